"""The driver in this process, without a daemon: devices as just after a boot, no mount.

``OfflineDriver`` builds the daemon's devices (``AccelDevice``, one VRAM memfd each, peers
of one another) with the firmware image loaded and the state operational, as
``kmod_emul.boot.boot`` leaves them, but starts no firmware process and mounts nothing.
Commands go through the same ``drv.execute``/``drv.read`` the FUSE layer calls
(``kmod_emul/fs.py``), on open files of this process, so the descriptors a command names
are this process's own, exactly as for a client of a real mount.

What the driver would send the firmware is dropped (``AccelDevice.fw_send`` with no
firmware), so a command is seen as far as the driver goes: nothing completes (a WAIT
answers ETIME, the default queue fills up), no memory comes back late. That is what makes
it useful for the handler unit tests (tests/unit/test_driver_handlers.py) and for timing
the driver's own cost (bench/profile_driver.py); everything past the driver needs a mount.

A ``DriverError`` comes back as the ``OSError`` the system call would raise; any other
exception is a driver bug and propagates with its traceback (the daemon answers EIO).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import trio

from abi import uapi
from kmod_emul import drv, limits
from kmod_emul.context import OpenFile
from kmod_emul.device import AccelDevice, MemoryConfig
from kmod_emul.errors import DriverError
from kmod_emul.fw import load_image
from kmod_emul.identity import Identity
from kmod_emul.memory import VramFile


def _oserror(exc: DriverError) -> OSError:
    return OSError(exc.errno, f"{os.strerror(exc.errno)} ({exc.message})")


class OfflineDriver:
    """``devices`` booted devices of ``memory`` bytes each, their image from
    ``firmware_dir`` (callers pass ``firmware.image.IMAGE_DIR``: the driver imports no
    firmware). ``fd_limit`` is the descriptor limit the tables are cut to (a small one
    makes the device-wide tables small: kmod_emul/limits.py)."""

    def __init__(self, firmware_dir: Path, devices: int = 1, memory: int = 256 << 20, *,
                 process_limit: int = 0, fd_limit: int = 1024,
                 info: drv.DriverInfo = drv.DriverInfo()) -> None:
        self.info = info
        self._vram = {i: VramFile(f"offline-accel{i}-vram", memory) for i in range(devices)}
        mem = MemoryConfig(self._vram, process_limit, "", devices, fd_limit)
        image = load_image(firmware_dir)
        self.devices = [
            AccelDevice(i, Identity(f"ACCEL-00000000-0000-4000-8000-{i:012x}", f"{i:013d}"),
                        memory, firmware_dir, 2.0, mem)
            for i in range(devices)
        ]
        for dev in self.devices:
            dev.all_devices = self.devices
            # what kmod_emul.boot.boot does once the firmware is up, minus the firmware
            dev.fw_image = image
            dev.static_info = None
            dev.limits = limits.Limits.for_device(image.config, devices, fd_limit)
            dev.state = uapi.DeviceState.OPERATIONAL
        self.files: list[OpenFile] = []

    # --- open(2), pwrite(2), pread(2), close(2) on a device node ----------------------------
    def open(self, index: int = 0) -> OpenFile:
        try:
            f = self.devices[index].tenants.open(os.getpid(), os.getuid(), os.getgid())
        except DriverError as exc:
            raise _oserror(exc) from None
        self.files.append(f)
        return f

    def write(self, f: OpenFile, raw: bytes) -> int:
        """``pwrite(fd, raw, 0)``: run one transaction (``drv.execute``)."""
        if not raw:
            return 0  # the VFS answers a zero-length write itself
        try:
            pending = drv.execute(self.info, f, bytes(raw))
            if pending is not None:  # a handler that waits (MODULE_LOAD)
                trio.run(lambda: pending)
        except DriverError as exc:
            raise _oserror(exc) from None
        return len(raw)

    def read(self, f: OpenFile, size: int, tag: int) -> bytes:
        """``pread(fd, size, tag)``: take the reply stored under ``tag``."""
        try:
            return drv.read(f, tag, size)
        except DriverError as exc:
            raise _oserror(exc) from None

    def release(self, f: OpenFile) -> None:
        if f in self.files:
            self.files.remove(f)
            f.device.tenants.release(f)

    # --- a handler alone, past the transaction's checks --------------------------------------
    def handler(self, f: OpenFile, cmd: uapi.Command, arg: Any) -> Any:
        """Run ``cmd``'s handler (``drv.TABLE``) on ``arg`` as decoded; its return value."""
        try:
            out = drv.TABLE[cmd.code](self.info, f, arg)
            return trio.run(lambda: out) if inspect.iscoroutine(out) else out
        except DriverError as exc:
            raise _oserror(exc) from None

    def close(self) -> None:
        for f in list(self.files):
            self.release(f)
        for vram in self._vram.values():
            vram.close()
        self._vram.clear()

    def __enter__(self) -> OfflineDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

