"""A device's failures, resets and recovery (ivpu's pm: ``ivpu_pm_trigger_recovery``).

Every way a device stops serving ends here: a failed boot (``fail``), a running firmware
that died or hung (``fail_running``), a shutdown the device did itself (``shut_down``), a
partition taken away (``unplug``) and a reset asked for (``request``). Each loses every
live context and records why; the supervisor (``AccelDevice.run``) waits on ``requested``
and the ``hold`` knob before it boots again.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from abi import faults, mailbox, uapi
from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice

log = logging.getLogger(__name__)


class Resets:
    """When a device fails or resets, and what happens to its contexts then."""

    def __init__(self, dev: AccelDevice) -> None:
        self.dev = dev
        #: debugfs ``reset_hold``: a requested reset waits while it is set
        self.hold = False
        self._hold_changed = trio.Event()
        self.requested = trio.Event()
        #: after a shutdown the device did itself: what must hold before the driver's
        #: recovery resets it (None: nothing to wait for)
        self._recover_when: Callable[[], bool] | None = None

    def request(self, reason: str = "reset requested", origin: str | None = None) -> None:
        """Begin a device reset; returns at once (state reads in_reset until it is done).
        A split device's reset is a package reset: each of its partitions resets too, as
        by a reset of its own (its contexts lost, its ``reset_count`` counted).
        ``origin``: the record's (``faults.ORIGIN_REQUESTED`` for a reset someone asked for)."""
        dev = self.dev
        log.info("%s: %s", dev.name, reason)
        dev.state = uapi.DeviceState.IN_RESET
        dev.failure = None  # a reset starts afresh; the next boot says how it went
        dev.reset_reason, dev.last_reset = reason, time.time()
        lost = dev.tenants.lose_contexts(f"{dev.name} was reset ({reason})")
        dev.report(faults.BY_NAME["DEVICE_RESET"].code, contexts=lost, message=reason,
                   origin=origin)
        self.requested.set()
        for part in dev.partitions:  # real parts tie the package's resets to its partitions
            part.resets.request(f"package reset of {dev.name}: {reason}", origin)

    async def next_reset(self) -> None:
        """Wait for a reset to be requested, then for ``hold`` to be released."""
        await self.requested.wait()
        self.requested = trio.Event()
        while self.hold:
            await self._hold_changed.wait()

    def set_hold(self, hold: bool) -> None:
        self.hold = hold
        self._hold_changed.set()
        self._hold_changed = trio.Event()

    def hang_firmware(self) -> None:
        """debugfs ``fw_hang``: the firmware stops heart-beating (the watcher notices)."""
        dev = self.dev
        if dev.fw is None:
            raise DriverError(errno.ENODEV, f"{dev.name} has no running firmware")
        dev.fw.send(0, mailbox.fw_hang())

    def fail(self, err: int, message: str) -> list[int]:
        """Fail the device: every context is lost; their ids."""
        dev = self.dev
        log.warning("%s failed: %s", dev.name, message)
        dev.state = uapi.DeviceState.FAILED
        dev.failure = (err, message)
        dev.last_failure = (err, message, time.time())
        return dev.tenants.lose_contexts(f"{dev.name} failed: {message}")

    def fail_running(self, err: int, message: str, code: int) -> None:
        """The running firmware died or hung (catalogue ``code``): fail (every context is
        told, the fault recorded), then, with ``recovery`` auto, reset at once -- the
        firmware restarts as in a reset, the contexts stay lost. (A failed boot is not
        retried: it would fail again.)"""
        self.dev.report(code, contexts=self.fail(err, message), message=message,
                        errno=errno.errorcode.get(err, str(err)))
        if self.dev.recovery == "auto":
            self.request(f"recovery from: {message}")

    def shut_down(self, err: int, message: str, code: int,
                  recover_when: Callable[[], bool] | None) -> None:
        """The device stopped itself (a thermal shutdown): fail it (every context is
        told, the fault recorded), stop its firmware, and with ``recovery`` auto reset it
        once ``recover_when()`` holds (None: something else resets it -- a partition's
        package does)."""
        dev = self.dev
        dev.report(code, contexts=self.fail(err, message), message=message,
                   errno=errno.errorcode.get(err, str(err)))
        self._recover_when = recover_when if dev.recovery == "auto" else None
        if dev.fw is not None:
            dev.fw.kill()  # powered off: the exit watcher ends serving

    async def recover_once(self) -> None:
        """Reset a device that shut itself down once it may serve again (cooled)."""
        ready, self._recover_when = self._recover_when, None
        while ready is not None and not self.requested.is_set():
            if ready():
                assert self.dev.failure is not None
                self.request(f"recovery from: {self.dev.failure[1]}")
                return
            await trio.sleep(0.1)

    def unplug(self, reason: str) -> None:
        """Remove the device for good (a partition that a mode change, or the rollback of
        one, takes away), as Linux's ``drm_dev_unplug``: from here every open and every
        command answers ENODEV, whoever holds it and whenever they opened it; the contexts
        it has, however recent, are lost (their processes' waiters see it at once) and
        recorded (DEVICE_REMOVED). The open files stay until their processes close them,
        and the VRAM with them: it closes once the last allocation in it is given back
        (``DeviceMemory.retire``). The caller halts the firmware."""
        dev = self.dev
        dev.removed = reason
        lost = dev.tenants.lose_contexts(f"{dev.name} was removed ({reason})")
        if lost:
            dev.report(faults.BY_NAME["DEVICE_REMOVED"].code, contexts=lost, message=reason)
        dev.memory.retire()
