"""accel-emu's user-space runtime: ``import runtime``.

Names follow ``torch.accelerator`` / ``torch.cuda`` (docs/contract.md). Discovery
(``is_available``, ``device_count``) reads sysfs only and is safe before ``fork``;
everything else initialises lazily. The runtime never imports the firmware or numba.
"""

from runtime.context import Context, Fence
from runtime.devices import (
    DeviceProperties,
    current_device,
    device,
    fault_records,
    get_device_name,
    get_device_properties,
    init,
    is_initialized,
    new_context,
    primary_context,
    recover,
    reset_device,
    set_device,
    synchronize,
)
from runtime.discovery import device_count, is_available
from runtime.memory import (
    DeviceArray,
    DeviceView,
    HostArray,
    IpcHandle,
    empty,
    empty_cache,
    enable_peer_access,
    managed_empty,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    open_ipc_handle,
    pinned_empty,
    reset_peak_memory_stats,
    to_device,
)
from runtime.graphs import Graph, GraphPool, graph
from runtime.profiler import Profile, profile
from runtime.launch import Kernel, LaunchPlan, Module, compile, kernel
from runtime.stream import Event, Stream, current_stream, default_stream, set_stream, stream
from runtime.errors import (
    AccelError,
    AccelTimeoutError,
    DeviceBusyError,
    DeviceFaultError,
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
    RaceError,
    ResourceLimitError,
    UseAfterForkError,
)

__all__ = [
    "AccelError", "AccelTimeoutError", "Context", "DeviceArray", "DeviceBusyError", "DeviceView",
    "DeviceFaultError", "DeviceInResetError", "DeviceLostError", "DeviceProperties",
    "DriverVersionMismatchError", "Event", "Fence", "FirmwareBootError",
    "FirmwareCorruptError", "FirmwareError", "FirmwareMissingError", "Graph", "GraphPool",
    "HostArray", "InvalidValueError", "IpcHandle", "Kernel", "KernelCompileError",
    "KernelFaultError", "LaunchPlan", "Module",
    "NoDeviceError", "OutOfMemoryError", "Profile", "RaceError", "ResourceLimitError", "Stream", "UseAfterForkError", "compile",
    "current_device", "current_stream", "default_stream", "device", "device_count", "empty",
    "empty_cache", "enable_peer_access", "fault_records", "get_device_name", "get_device_properties",
    "graph", "init", "is_available", "is_initialized", "kernel", "managed_empty",
    "max_memory_allocated", "max_memory_reserved", "mem_get_info", "memory_allocated",
    "memory_reserved", "memory_stats", "new_context", "open_ipc_handle", "pinned_empty",
    "primary_context", "profile", "recover", "reset_device", "reset_peak_memory_stats", "set_device",
    "set_stream", "stream", "synchronize", "to_device",
]


def __getattr__(name: str) -> object:
    """``runtime.KernelCompileError`` without importing the kernel front end (an import
    ``import runtime`` should not pay for) until it is used."""
    if name == "KernelCompileError":
        from runtime.kernels import KernelCompileError

        return KernelCompileError
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
