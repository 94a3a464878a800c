"""Firmware loading and boot: the driver's side of the mailbox.

``load_image`` is ``request_firmware`` plus verification: it tells a missing image
(ENOPKG) from a corrupt or incompatible one (ENOEXEC). ``FirmwareProcess.boot`` copies the
verified image into a fresh mailbox (a memfd), starts the device's firmware process with
only the mailbox, doorbell, interrupt and descriptor-channel fds (and every device's VRAM),
and waits for the READY handshake; a firmware that exits or reports failure during boot is
a boot failure (EIO).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import signal
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from abi import fwimage, mailbox
from abi._struct import Struct
from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.device import MemoryConfig

log = logging.getLogger(__name__)

BOOT_TIMEOUT_S = 30.0
STOP_GRACE_S = 1.0


def load_image(firmware_dir: Path, name: str = fwimage.IMAGE_NAME) -> fwimage.FirmwareImage:
    """Read and verify ``firmware_dir/name`` or raise DriverError with a distinct errno."""
    path = firmware_dir / name
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DriverError(
            errno.ENOPKG,
            f"firmware image {name} not found in {firmware_dir}; install it (the package ships "
            f"firmware/images/{name}) or point accel-emud --firmware-dir at it, then reset the device",
        ) from None
    except OSError as exc:
        raise DriverError(errno.ENOPKG, f"firmware image {path} unreadable: {exc.strerror}") from None
    try:
        img = fwimage.parse(raw)
    except fwimage.ImageError as exc:
        raise DriverError(
            errno.ENOEXEC,
            f"firmware image {path} is corrupt: {exc}; reinstall the image, then reset the device",
        ) from None
    lo, hi = img.manifest["abi_min"], img.manifest["abi_max"]
    if not lo <= mailbox.MAILBOX_ABI <= hi:
        raise DriverError(
            errno.ENOEXEC,
            f"firmware image {path} speaks mailbox ABI {lo}..{hi} but this driver speaks "
            f"{mailbox.MAILBOX_ABI}; install a matching firmware, then reset the device",
        )
    return img


@dataclass(eq=False)
class _Message:
    """A message on its way to the firmware, with the descriptors it carries (owned here
    until sent: the channel closes them once they are in flight)."""

    op: mailbox.Op
    ctx_id: int
    payload: Struct
    fds: list[int] = field(default_factory=list)
    fds_sent: bool = False


class FirmwareProcess:
    """A running firmware: its process, mailbox, descriptor channel and wake-up pipes."""

    def __init__(self, proc: trio.Process, mbx: mailbox.Mailbox, mem: mmap.mmap,
                 doorbell_w: int, irq_r: int, fdchan: mailbox.FdChannel) -> None:
        self.proc = proc
        self.mbx = mbx
        self._mem = mem
        self._doorbell_w = doorbell_w
        self.irq_r = irq_r
        self._fdchan = fdchan
        self._cookies = iter(range(1, 1 << 63))
        #: messages that found the command ring (or the channel) full, sent in order
        self._backlog: deque[_Message] = deque()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def boot(cls, img: fwimage.FirmwareImage, boot_flags: int, label: str,
                   vram_size: int, memcfg: MemoryConfig) -> FirmwareProcess:
        """Start a firmware process on ``img``; return once it reports READY.

        It gets every device's VRAM memfd (so peer access needs no fd passing later), the
        descriptor channel for what clients bring, and nothing else of the daemon's.
        """
        memfd = os.memfd_create(f"accel-emu-{label}-mailbox", os.MFD_CLOEXEC)
        os.ftruncate(memfd, mailbox.MAILBOX_SIZE)
        mem = mmap.mmap(memfd, mailbox.MAILBOX_SIZE)
        mbx = mailbox.Mailbox(memoryview(mem))
        mbx.host_init(img.raw, boot_flags)
        doorbell_r, doorbell_w = os.pipe()
        irq_r, irq_w = os.pipe()
        os.set_blocking(irq_r, False)
        os.set_blocking(doorbell_w, False)  # a full pipe means "already rung", never a stall
        fdchan, theirs = mailbox.FdChannel.pair()
        vram = ",".join(f"{dev}:{fd}" for dev, fd in memcfg.vram_fds.items())
        try:
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "firmware", "--mailbox-fd", str(memfd),
                 "--doorbell-fd", str(doorbell_r), "--irq-fd", str(irq_w), "--vram-fds", vram,
                 "--vram-size", str(vram_size), "--fd-channel", str(theirs.fileno()),
                 "--jit-cache", memcfg.jit_cache],
                pass_fds=(memfd, doorbell_r, irq_w, theirs.fileno(), *memcfg.vram_fds.values()),
                start_new_session=True,  # a Ctrl-C on the daemon's terminal is not a device crash
            )
        except BaseException:
            fdchan.close()
            raise
        finally:
            for fd in (memfd, doorbell_r, irq_w):
                os.close(fd)
            theirs.close()
        fw = cls(proc, mbx, mem, doorbell_w, irq_r, fdchan)
        try:
            await fw._handshake()
        except BaseException:
            await fw.stop()
            raise
        return fw

    async def _handshake(self) -> None:
        with trio.move_on_after(BOOT_TIMEOUT_S):
            while True:
                state = self.mbx.fw_state
                if state == mailbox.FwState.READY:
                    return
                if state == mailbox.FwState.BOOT_FAILED:
                    raise DriverError(errno.EIO, f"firmware failed to boot: {self.mbx.boot_message}")
                if self.proc.poll() is not None:
                    raise DriverError(
                        errno.EIO,
                        f"firmware process exited during boot with status {self.proc.returncode}",
                    )
                await self.wait_irq(0.05)
        raise DriverError(errno.EIO, f"firmware did not finish booting in {BOOT_TIMEOUT_S:.0f} s")

    async def wait_irq(self, timeout: float | None = None) -> bool:
        """Sleep until the firmware raises an interrupt; consume it. False on timeout."""
        with trio.move_on_after(timeout if timeout is not None else float("inf")):
            await trio.lowlevel.wait_readable(self.irq_r)
            try:
                os.read(self.irq_r, 4096)
            except BlockingIOError:
                pass
            return True
        return False

    def send(self, ctx_id: int, payload: Struct, fds: list[int] | None = None) -> None:
        """Queue the message whose payload is ``payload`` (its op is the struct's, from
        ``mailbox.OP_OF``) and ring the doorbell. Never drops one: a message that finds the
        ring full waits in the backlog, which drains (in order) on the next interrupt.
        ``fds`` (owned by the call from here on) travel on the descriptor channel under
        the cookie this sets in the payload."""
        if fds:
            payload.cookie = next(self._cookies)
        self._backlog.append(_Message(mailbox.OP_OF[type(payload)], ctx_id, payload,
                                      list(fds or ())))
        self.flush()

    def flush(self) -> None:
        sent = False
        while self._backlog:
            msg = self._backlog[0]
            if msg.fds and not msg.fds_sent:
                if not self._fdchan.send(msg.payload.cookie, msg.fds):
                    break  # the channel is full: the firmware drains it as it goes
                msg.fds_sent = True
            if not self.mbx.cmd.push(msg.op, msg.ctx_id, msg.payload):
                break
            self._backlog.popleft()
            sent = True
        if sent:
            self.ring_doorbell()

    def ring_doorbell(self) -> None:
        if self._doorbell_w >= 0:
            try:
                os.write(self._doorbell_w, b"\1")
            except (BlockingIOError, BrokenPipeError):
                pass  # already rung / firmware gone (the watchdog reports the latter)

    async def stop(self) -> None:
        """Halt the firmware: close its doorbell, then SIGKILL if it lingers; reap it."""
        if self.irq_r >= 0:
            trio.lowlevel.notify_closing(self.irq_r)
        for fd in (self._doorbell_w, self.irq_r):
            if fd >= 0:
                os.close(fd)
        self._doorbell_w = self.irq_r = -1
        for msg in self._backlog:  # never sent: their descriptors are still ours
            if not msg.fds_sent:
                for fd in msg.fds:
                    os.close(fd)
        self._backlog.clear()
        self._fdchan.close()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(STOP_GRACE_S):
                await self.proc.wait()
            if self.proc.returncode is None:
                try:
                    os.kill(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await self.proc.wait()
        log.debug("firmware pid %d stopped (status %s)", self.proc.pid, self.proc.returncode)
