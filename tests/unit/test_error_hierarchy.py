"""runtime/errors.py's classes: the errors a framework's user meets mid-program are
``RuntimeError``s (torch.cuda's are), and every one keeps its place under AccelError, its
other built-in base and its errno, so neither runtime code nor torch code has to change
what it catches. No device: the classes alone."""

from __future__ import annotations

import errno

import pytest

from runtime import errors

pytestmark = pytest.mark.timeout(30)

#: class -> the bases it must keep besides AccelError and RuntimeError
USER_FACING = {
    errors.DeviceLostError: (),
    errors.DeviceFaultError: (),
    errors.KernelFaultError: (errors.DeviceFaultError,),
    errors.OutOfMemoryError: (MemoryError,),
    errors.ResourceLimitError: (errors.OutOfMemoryError, MemoryError),
}


@pytest.mark.parametrize("cls", USER_FACING, ids=lambda c: c.__name__)
def test_the_errors_a_user_meets_are_runtime_errors_under_accel_error(cls):
    assert issubclass(cls, errors.AccelError) and issubclass(cls, RuntimeError)
    assert all(issubclass(cls, base) for base in USER_FACING[cls])
    exc = cls("lost", errno.ENODEV)
    assert exc.errno == errno.ENODEV and str(exc) == "lost"
    with pytest.raises(RuntimeError):
        raise exc


def test_recorded_errors_keep_their_record():
    exc = errors.DeviceLostError("lost", errno.ENODEV, {"code": 130})
    assert exc.record == {"code": 130} and isinstance(exc, RuntimeError)
    assert errors.KernelFaultError("fault").record == {}


def test_the_driver_errnos_of_a_lost_device_and_of_memory_read_as_runtime_errors():
    for err in (errno.ENODEV, errno.ENOMEM, errno.ENOSPC, errno.EDQUOT):
        assert isinstance(errors.from_errno(err, "MEM_ALLOC"), RuntimeError), err


@pytest.mark.parametrize("cls", [errors.InvalidValueError, errors.NoDeviceError,
                                 errors.FirmwareMissingError, errors.DeviceBusyError,
                                 errors.DeviceInResetError, errors.AccelTimeoutError,
                                 errors.UseAfterForkError], ids=lambda c: c.__name__)
def test_the_other_errors_are_not_runtime_errors(cls):
    """Argument and setup errors keep their own kinds (ValueError, TimeoutError, ...):
    ``except RuntimeError`` around device work must not swallow a caller's mistake."""
    assert issubclass(cls, errors.AccelError) and not issubclass(cls, RuntimeError)
