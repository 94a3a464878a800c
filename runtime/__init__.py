"""accel-emu's user-space runtime: ``import runtime``.

Names follow ``torch.accelerator`` / ``torch.cuda`` (see CONTRACT.md). Discovery
(``is_available``, ``device_count``) reads sysfs only and is safe before ``fork``;
everything else initialises lazily. The runtime never imports the firmware or numba.
"""

from runtime.context import Context, Fence
from runtime.device import (
    DeviceProperties,
    current_device,
    device,
    get_device_name,
    get_device_properties,
    init,
    is_initialized,
    new_context,
    primary_context,
    set_device,
    synchronize,
)
from runtime.discovery import device_count, is_available
from runtime.errors import (
    AccelError,
    AccelTimeoutError,
    DeviceBusyError,
    DeviceInResetError,
    DeviceLostError,
    DriverVersionMismatchError,
    FirmwareBootError,
    FirmwareCorruptError,
    FirmwareError,
    FirmwareMissingError,
    InvalidValueError,
    KernelFaultError,
    NoDeviceError,
    OutOfMemoryError,
    UseAfterForkError,
)

__all__ = [
    "AccelError", "AccelTimeoutError", "Context", "DeviceBusyError", "DeviceInResetError",
    "DeviceLostError", "DeviceProperties", "DriverVersionMismatchError", "Fence",
    "FirmwareBootError", "FirmwareCorruptError", "FirmwareError", "FirmwareMissingError",
    "InvalidValueError", "KernelFaultError", "NoDeviceError", "OutOfMemoryError",
    "UseAfterForkError", "current_device", "device", "device_count", "get_device_name",
    "get_device_properties", "init", "is_available", "is_initialized", "new_context", "primary_context",
    "set_device", "synchronize",
]
