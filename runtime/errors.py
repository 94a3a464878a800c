"""The runtime's exceptions: one base, one class per cause a user must tell apart.

"No accelerator available" is only one of them. Missing firmware, a corrupt image, a
driver of another ABI, a device held by another tenant and a device in reset are different
conditions for different teams, so each has its own class and a message that names the
cause and the fix. Driver-level errors carry the driver's ``errno``.

The errors a framework's user meets mid-program (the device lost, out of memory, work that
faulted) are also ``RuntimeError``s, as torch.cuda's are (``torch.OutOfMemoryError``,
``torch.AcceleratorError``): code written against torch catches them with ``except
RuntimeError`` without knowing this runtime, which never imports torch.
"""

from __future__ import annotations

import errno as _errno
from typing import Any


class AccelError(Exception):
    """Base of every runtime error. ``errno`` is the driver's, when the driver said no."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class NoDeviceError(AccelError):
    """No device is visible: no daemon serves the root, or ACCEL_VISIBLE_DEVICES hides them."""


class FirmwareError(AccelError):
    """The device's firmware is unusable; see the subclass."""


class FirmwareMissingError(FirmwareError):
    """The firmware image the device boots from is not installed (ENOPKG)."""


class FirmwareCorruptError(FirmwareError):
    """The firmware image failed verification or speaks another mailbox ABI (ENOEXEC)."""


class FirmwareBootError(FirmwareError):
    """The firmware was loaded but failed to boot (EIO)."""


class DriverVersionMismatchError(AccelError):
    """The driver does not speak this runtime's uAPI version (EPROTO)."""


class DeviceBusyError(AccelError):
    """Another process holds the device exclusively, like a partition of another tenant (EBUSY)."""


class DeviceInResetError(AccelError):
    """The device is resetting or booting; retry once it is operational (EAGAIN)."""


class OutOfMemoryError(AccelError, MemoryError, RuntimeError):
    """The device cannot satisfy an allocation."""


class ResourceLimitError(OutOfMemoryError):
    """A limit the driver enforces was reached: a device-wide table is full (ENOSPC) or
    this process or context is over its share (EDQUOT) of contexts, queues, pinned
    memory, host allocations or modules (``sys/class/accel/accelN/limits`` lists them)."""


class _Recorded(AccelError):
    """An error that carries the fault record (``abi.faults``: code, device, device_uuid,
    engine, queue, context, pid, address, bank, link, severity, corrected, scope, action,
    time, ...) of what caused it. A fault has one record, the driver's: the runtime reads
    it from the device's ``fault_log`` (runtime/faults.py) and never builds its own, but
    for DRIVER_GONE (130: the daemon died, no driver is left to record it). ``{}`` where
    the cause has no record, or none could be read (docs/faults.md, "Life of a fault")."""

    def __init__(self, message: str, errno: int | None = None,
                 record: dict[str, Any] | None = None) -> None:
        super().__init__(message, errno)
        self.record = record or {}


class DeviceFaultError(_Recorded, RuntimeError):
    """Queued work faulted on the device (scope ``queue``: the stream is done). Raised at
    the synchronisation point that covers it; ``record`` is the driver's record of the
    fault, the one ``fault_log`` and the event node show."""


class KernelFaultError(DeviceFaultError):
    """A kernel faulted on the device; ``record`` is the driver's record of the fault,
    plus ``kernel``: the kernel's name, which only this process knows."""


class DeviceLostError(_Recorded, RuntimeError):
    """The device failed or was reset under this context, or a fault lost the context
    alone; its state is gone (ENODEV). ``record`` is the driver's record of the fault that
    lost it (the first that lists the context), or the runtime's DRIVER_GONE."""


class UseAfterForkError(AccelError):
    """Device state initialised in a parent process was used in a forked child."""


class InvalidValueError(AccelError, ValueError):
    """An argument the runtime or the driver rejects (EINVAL and friends)."""


class AccelTimeoutError(AccelError, TimeoutError):
    """A host wait ran out of time before the device finished (ETIME)."""


class RaceError(AccelError, RuntimeError):
    """The sanitizer (``ACCEL_SANITIZE=1``, runtime/sanitizer.py) found device accesses to
    overlapping bytes, at least one a write, that nothing orders. Raised at the next host
    wait after the second was queued; ``report`` is the first race (a
    ``runtime.sanitizer.RaceReport``: both accesses with stream, queue, seqno, op, mode and
    call site, the overlapping range and its memory kind), ``reports`` every race found
    since the last such raise."""

    def __init__(self, reports: list[Any]) -> None:
        more = f"\n(and {len(reports) - 1} more: see .reports)" if len(reports) > 1 else ""
        super().__init__(f"{reports[0]}{more}")
        self.reports = list(reports)
        self.report = reports[0]


#: How the runtime reads a driver errno. Open-time codes carry the device's failure text.
ERRNO_CLASSES: dict[int, type[AccelError]] = {
    _errno.ENOENT: InvalidValueError,
    _errno.ENOPKG: FirmwareMissingError,
    _errno.ENOEXEC: FirmwareCorruptError,
    _errno.EIO: FirmwareBootError,
    _errno.EPROTO: DriverVersionMismatchError,
    _errno.EBUSY: DeviceBusyError,
    _errno.EAGAIN: DeviceInResetError,
    _errno.ENODEV: DeviceLostError,
    _errno.ETIME: AccelTimeoutError,
    _errno.EINVAL: InvalidValueError,
    _errno.ENOTTY: InvalidValueError,
    _errno.EBADFD: InvalidValueError,
    _errno.ENOMEM: OutOfMemoryError,
    _errno.ENOSPC: ResourceLimitError,
    _errno.EDQUOT: ResourceLimitError,
    _errno.EPERM: InvalidValueError,
    _errno.EACCES: InvalidValueError,
    _errno.EBADF: InvalidValueError,
    _errno.EMEDIUMTYPE: InvalidValueError,
}


def from_errno(err: int, message: str) -> AccelError:
    cls = ERRNO_CLASSES.get(err, AccelError)
    name = _errno.errorcode.get(err, str(err))
    return cls(f"{message} [{name}]", err)
