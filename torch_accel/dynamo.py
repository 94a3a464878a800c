"""Dynamo's view of the accel device: ``torch._dynamo``'s device interface for ``accel``.

Imported only once something imports ``torch._dynamo.device_interface`` (the first
``torch.compile``; torch_accel/_dynamo_hook.py): Dynamo costs seconds to import, which
``import torch`` must not pay.

Dynamo traces code that names a device's streams, events and device guards through a
``DeviceInterface`` registered for the device type (torch registers cuda's, xpu's, mtia's
...). Without one, ``torch.compile`` of a function that makes an ``torch.accel.Stream``,
records an event or enters ``torch.accel.device`` breaks the graph or fails. This one maps
every name onto ``torch.accel`` (torch_accel/accel.py), which keeps torch.cuda's names.

Triton is not the device's kernel language (``is_triton_capable`` is False), so Inductor's
Triton path does not take accel graphs: torch_accel/inductor/ generates their kernels in
the device's own language (docs/torch.md, "torch.compile").
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo import trace_rules
from torch._dynamo.device_interface import (
    DeviceInterface,
    caching_worker_current_devices,
    caching_worker_device_properties,
    register_interface_for_device,
)

from torch_accel import _hooks, accel

DEVICE_TYPE = "accel"


class AccelInterface(DeviceInterface):
    """``torch.accel`` as Dynamo asks for a device's runtime."""

    device = accel.device  # type: ignore[assignment]
    Event = accel.Event  # type: ignore[assignment]
    Stream = accel.Stream  # type: ignore[assignment]

    class Worker:
        """What Inductor's compile workers ask without initialising the device (they are
        other processes: the parent's answers are cached for them)."""

        @staticmethod
        def set_device(device: int) -> None:
            caching_worker_current_devices[DEVICE_TYPE] = device

        @staticmethod
        def current_device() -> int:
            if DEVICE_TYPE in caching_worker_current_devices:
                return caching_worker_current_devices[DEVICE_TYPE]
            return accel.current_device()

        @staticmethod
        def get_device_properties(device: torch.types.Device = None) -> Any:
            index = accel._index(device) if device is not None else \
                AccelInterface.Worker.current_device()
            if DEVICE_TYPE not in caching_worker_device_properties:
                caching_worker_device_properties[DEVICE_TYPE] = [
                    accel.get_device_properties(i) for i in range(accel.device_count())]
            return caching_worker_device_properties[DEVICE_TYPE][index]

    current_device = staticmethod(accel.current_device)
    set_device = staticmethod(accel.set_device)
    device_count = staticmethod(accel.device_count)
    stream = staticmethod(accel.stream)  # type: ignore[assignment]
    current_stream = staticmethod(accel.current_stream)
    set_stream = staticmethod(accel.set_stream)  # type: ignore[assignment]
    synchronize = staticmethod(accel.synchronize)
    get_device_properties = staticmethod(accel.get_device_properties)  # type: ignore[assignment]
    memory_allocated = staticmethod(accel.memory_allocated)
    is_bf16_supported = staticmethod(accel.is_bf16_supported)  # type: ignore[arg-type]

    @staticmethod
    def is_available() -> bool:
        return accel.is_available()

    #: make a device current, return the one that was (Dynamo's ``DeviceGuard``); setting
    #: a device opens no context here (runtime.set_device), so "maybe" is the same call
    exchange_device = staticmethod(_hooks.exchange_device)
    maybe_exchange_device = staticmethod(_hooks.exchange_device)

    @staticmethod
    def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        accel.set_stream(accel.Stream(stream_id=stream_id, device_index=device_index,
                                      device_type=device_type))

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        """The current stream's id on ``device_idx`` (cuda's is its ``cudaStream_t``)."""
        return accel.current_stream(device_idx).stream_id

    @staticmethod
    def get_compute_capability(device: torch.types.Device = None) -> int:
        major, minor = accel.get_device_capability(device)
        return major * 10 + minor

    @staticmethod
    def is_triton_capable(device: torch.types.Device = None) -> bool:
        return False


def register() -> None:
    """Register the interface for ``accel`` and ``accel:N`` (as torch does for cuda),
    keep Dynamo out of the backend's own modules, and let Dynamo put ``torch.accel``'s stream calls in the graph as calls, as its trace
    rules do for ``torch.cuda``'s (tracing into them would reach the runtime's process
    checks, which Dynamo cannot trace: a graph break); ``accel.stream`` so reaches
    Dynamo's handler of a device interface's stream context."""
    torch.compiler.allow_in_graph([accel.current_stream, accel.default_stream,
                                   accel.synchronize, accel.set_stream, accel.stream])
    # the backend's own Python (operators, kernels, the runtime) is the device's driver
    # stack, as torch's C++ is cuda's: frames Dynamo meets running after a graph break (an
    # eager ``loss.backward()`` inside a compiled function) are run, not traced, as it
    # does for torch's own files (tracing the runtime's launch fails)
    for package in ("torch_accel", "runtime", "abi"):
        trace_rules.add(package)
    register_interface_for_device(DEVICE_TYPE, AccelInterface)
    for i in range(accel.device_count()):
        register_interface_for_device(f"{DEVICE_TYPE}:{i}", AccelInterface)
