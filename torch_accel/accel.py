"""``torch.accel``: torch.cuda's names for the ``accel`` device (docs/torch.md).

Discovery (``is_available``, ``device_count``) reads the device tree and initialises
nothing, so it is safe before ``fork``; everything else initialises lazily. Devices,
streams, events, memory and random numbers are the runtime's, reached through the same
functions the C++ shim calls (torch_accel/_hooks.py), so ``torch.accel``,
``torch.accelerator`` and ``torch.Stream``/``torch.Event`` agree on every answer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import warnings

import torch

import runtime
from runtime import discovery
from torch_accel import _hooks, memory_summary as _summary, telemetry
from torch_accel._hooks import device_count, is_available, is_initialized
from torch_accel.graphs import (AccelGraph, graph, graph_pool_handle,
                                is_current_stream_capturing, make_graphed_callables)

__all__ = [
    "AccelGraph", "DeviceProperties", "Event", "Stream", "current_device",
    "current_stream", "default_stream", "device", "device_count", "device_of",
    "empty_cache", "get_amp_supported_dtype", "get_arch_list", "get_device_capability",
    "get_device_name", "get_device_properties", "get_rng_state", "get_rng_state_all",
    "graph", "graph_pool_handle", "init", "initial_seed", "ipc_collect", "is_available",
    "is_bf16_supported", "is_current_stream_capturing", "is_initialized",
    "list_gpu_processes", "make_graphed_callables", "manual_seed", "manual_seed_all",
    "max_memory_allocated", "max_memory_reserved", "mem_get_info", "memory_allocated",
    "memory_reserved", "memory_snapshot", "memory_stats", "memory_summary",
    "reset_max_memory_allocated", "reset_max_memory_cached", "reset_peak_memory_stats",
    "seed", "seed_all", "set_device", "set_per_process_memory_fraction",
    "set_rng_state", "set_rng_state_all", "set_stream", "stream", "synchronize",
    "temperature", "utilization",
]

#: c10::DeviceType::PrivateUse1, the number torch.Stream's (id, index, type) form wants
DEVICE_TYPE = 20


def _index(dev: Any = None) -> int:
    """torch's device argument (None, an int, ``"accel:1"``, a torch.device) as an index."""
    if dev is None:
        return current_device()
    if isinstance(dev, str):
        dev = torch.device(dev)
    if isinstance(dev, torch.device):
        if dev.type != "accel":
            raise ValueError(f"Expected an accel device, but got: {dev}")
        return current_device() if dev.index is None else dev.index
    return int(dev)


def init() -> None:
    _hooks.lazy_init()


def _lazy_init() -> None:
    _hooks.lazy_init()


def _is_in_bad_fork() -> bool:
    return _hooks.in_bad_fork()


def current_device() -> int:
    return runtime.current_device()


def set_device(device: Any) -> None:
    _hooks.set_device(_index(device))


class device:
    """Context manager that makes ``dev`` current (torch.cuda.device)."""

    def __init__(self, dev: Any) -> None:
        self.idx = -1 if dev is None else _index(dev)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = _hooks.exchange_device(self.idx)

    def __exit__(self, *exc: object) -> None:
        if self.idx >= 0:
            _hooks.set_device(self.prev)


#: ``device`` under a name a parameter called ``device`` does not hide
_device_guard = device


class device_of(device):
    """The device of tensor ``obj`` current for the body (torch.cuda.device_of)."""

    def __init__(self, obj: torch.Tensor) -> None:
        super().__init__(obj.get_device() if obj.device.type == "accel" else -1)


def synchronize(device: Any = None) -> None:
    """Wait for every stream of this process on the device; raises its first fault."""
    _hooks.synchronize(_index(device))


class DeviceProperties(runtime.DeviceProperties):
    """The runtime's device properties under torch.cuda's names as well, so code written
    for ``torch.cuda.get_device_properties`` reads them: ``major``/``minor`` (the ISA
    version, torch.cuda's compute capability), ``multi_processor_count`` (the compute
    engines, each running one block at a time as an SM does), ``shared_memory_per_block``."""

    @property
    def major(self) -> int:
        return int(self.isa_version.split(".")[0])

    @property
    def minor(self) -> int:
        return int(self.isa_version.split(".")[1])

    @property
    def multi_processor_count(self) -> int:
        return self.compute_engines

    @property
    def shared_memory_per_block(self) -> int:
        return self.max_shared_mem_per_block


def get_device_properties(device: Any = None) -> DeviceProperties:
    _hooks.lazy_init()
    return DeviceProperties(**vars(runtime.get_device_properties(_index(device))))


def get_device_name(device: Any = None) -> str:
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """The ISA version as (major, minor), as torch.cuda's compute capability."""
    props = get_device_properties(device)
    return props.major, props.minor


def get_arch_list() -> list[str]:
    """The ISAs kernels are built for, ``isa_<major><minor>`` as torch.cuda's ``sm_80``:
    the firmware compiles each kernel for its own device on first launch, so these are
    the visible devices' ISA versions (read from the device tree, initialising nothing);
    empty when no device is visible, as torch.cuda's."""
    isas = {discovery.read_attr(name, "isa_version") for name in discovery.visible_devices()}
    return sorted("isa_" + "".join(isa.split(".")[:2]) for isa in isas)


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """torch.cuda's answer: native bfloat16 if the device's capabilities name it (none of
    this device's kernel types is a 16-bit float, so they do not), else, when
    ``including_emulation``, whether a bfloat16 tensor can be made on the device (it moves
    as 16-bit integers and computes through the host, docs/torch.md)."""
    if not is_available():
        return False
    if "bfloat16" in get_device_properties().capabilities:
        return True
    if not including_emulation:
        return False
    try:
        return bool(torch.tensor([1.0], dtype=torch.bfloat16, device="accel").item() == 1.0)
    except Exception:  # noqa: BLE001 - torch.cuda's probe: any failure means "no"
        return False


def utilization(device: Any = None) -> int:
    """Percent of the last second the device's compute engines were busy, all processes'
    work (torch.cuda.utilization): the driver's reading, initialising nothing."""
    return telemetry.utilization(_index(device))


def temperature(device: Any = None) -> int:
    """The device's temperature in degrees Celsius (torch.cuda.temperature)."""
    return telemetry.temperature(_index(device))


def list_gpu_processes(device: Any = None) -> str:
    """The processes holding memory on the device and how much (torch.cuda's text)."""
    return telemetry.list_processes(_index(device))


# ---------------------------------------------------------------- streams and events
class Stream(torch.Stream):
    """A stream of the accel device (torch.cuda.Stream): from the device's stream pool."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        if kwargs:  # torch's rebuild from (stream_id, device_index, device_type)
            return super().__new__(cls, **kwargs)
        with _device_guard(device):
            return super().__new__(cls, device=torch.device("accel", _index(device)),
                                   priority=priority)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return runtime.Stream.priority_range()

    @property
    def priority(self) -> int:
        """The stream's priority (torch.cuda.Stream.priority): 0, or -1 for high."""
        return self.runtime_stream.priority

    @property
    def runtime_stream(self) -> runtime.Stream:
        """The runtime stream behind this one (for runtime kernels and copies)."""
        return _hooks.stream_of(self.device_index, self.stream_id)


class Event(torch.Event):
    """An event of the accel device (torch.cuda.Event)."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False) -> Event:
        return super().__new__(cls, device="accel", enable_timing=enable_timing,
                               blocking=blocking, interprocess=interprocess)

    def elapsed_time(self, end_event: torch.Event) -> float:
        """Milliseconds from this event to ``end_event`` (both recorded, both timing).
        torch's binding accepts only an exact torch.Event as ``end_event``, so a subclass
        would be refused there: the two are measured by the ids torch keeps for them."""
        return _hooks.event_elapsed(self.event_id, end_event.event_id)


def current_stream(device: Any = None) -> Stream:
    idx = _index(device)
    return Stream(stream_id=_hooks.current_stream(idx), device_index=idx,
                  device_type=DEVICE_TYPE)


def default_stream(device: Any = None) -> Stream:
    idx = _index(device)
    _hooks.lazy_init()
    return Stream(stream_id=0, device_index=idx, device_type=DEVICE_TYPE)


def set_stream(stream: torch.Stream) -> None:
    if stream is not None:
        _hooks.exchange_stream(stream.device_index, stream.stream_id)


class stream:
    """Context manager making ``s`` current, and its device (torch.cuda.stream)."""

    def __init__(self, s: torch.Stream | None) -> None:
        self.s = s
        self.prev_device = -1
        self.prev: int | None = None

    def __enter__(self) -> torch.Stream | None:
        if self.s is None:
            return None
        self.prev_device = _hooks.exchange_device(self.s.device_index)
        self.prev = _hooks.exchange_stream(self.s.device_index, self.s.stream_id)
        return self.s

    def __exit__(self, *exc: object) -> None:
        if self.s is not None:
            _hooks.exchange_stream(self.s.device_index, self.prev)
            _hooks.set_device(self.prev_device)


def _sleep(cycles: int) -> None:
    """Keep the current stream busy for about ``cycles`` loop turns (torch.cuda._sleep)."""
    from torch_accel.kernels import sleep

    _hooks.lazy_init()
    sleep(cycles)


# ------------------------------------------------------------------------------ memory
def memory_stats(device: Any = None) -> OrderedDict[str, Any]:
    """torch.accelerator's answer, so both name the same keys (torch adds the oversize
    counters the runtime's allocator has no pool for) with the same values; empty, and
    initialising nothing, before the device is initialised (as torch.cuda's)."""
    return torch.accelerator.memory_stats(_index(device))


def memory_allocated(device: Any = None) -> int:
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: Any = None) -> int:
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: Any = None) -> int:
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: Any = None) -> int:
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: Any = None) -> None:
    _hooks.reset_peak_memory_stats(_index(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    """torch.cuda's older name: resets every peak, and warns that it does, as torch.cuda's."""
    warnings.warn("torch.accel.reset_max_memory_allocated now calls "
                  "torch.accel.reset_peak_memory_stats, which resets /all/ peak memory stats.",
                  FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device: Any = None) -> None:
    """torch.cuda's older name: resets every peak, and warns that it does, as torch.cuda's."""
    warnings.warn("torch.accel.reset_max_memory_cached now calls "
                  "torch.accel.reset_peak_memory_stats, which resets /all/ peak memory stats.",
                  FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """torch.cuda's text table of the allocator's statistics for the device."""
    idx = _index(device)
    return _summary.memory_summary(memory_stats(idx), idx, abbreviated)


def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list[dict[str, Any]]:
    """torch.cuda's list of segments of every device this process uses, each with its
    blocks (``address``, ``size``, ``requested_size``, ``state``). ``stream`` is the
    torch stream id the segment was made for (``None`` for a graph capture's); no stack
    frames are recorded. There is one memory pool per device, so ``mempool_id`` must be
    None."""
    if mempool_id is not None:
        raise ValueError("accel has one memory pool per device: mempool_id must be None")
    if not _hooks.is_initialized():
        return []
    segments = []
    for idx in runtime.devices.held():
        pool = _hooks.pool(idx)
        for seg in runtime.memory.memory_snapshot(idx):
            s = seg["stream"]
            segments.append({**seg, "stream": pool.id_of(s) if isinstance(s, runtime.Stream)
                             else None, "segment_pool_id": (0, 0), "is_expandable": False,
                             "frames": [],
                             "blocks": [{**b, "frames": []} for b in seg["blocks"]]})
    return segments


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Let this process hold at most ``fraction`` of the device's memory (torch.cuda's
    checks and messages); an allocation past it raises torch.OutOfMemoryError, after the
    allocator has given back its cached segments, as when the device is full."""
    _hooks.lazy_init()
    idx = _index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    runtime.memory.set_per_process_memory_fraction(fraction, idx)


def ipc_collect() -> None:
    """torch.cuda.ipc_collect frees memory that other processes received through
    torch.multiprocessing and released, which CUDA's producer keeps behind reference
    counters. An accel tensor received that way (torch_accel/ipc.py) maps the producer's
    memory until its storage is freed, and the driver keeps the memory while any process
    maps it, so nothing is held for this to free: it initialises, as torch.cuda's does."""
    _hooks.lazy_init()


def empty_cache() -> None:
    _hooks.empty_cache()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    return _hooks.mem_get_info(_index(device))


# ---------------------------------------------------------------------------- autocast
def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes ``torch.autocast(device_type="accel", dtype=...)`` accepts (torch asks the
    device module): the matrix unit's 16-bit inputs. float16 is the default."""
    return [torch.float16, torch.bfloat16]


# ---------------------------------------------------------------------- random numbers
def default_generator(dev: Any = None) -> torch.Generator:
    """The device's default generator: what ``manual_seed`` seeds and random ops draw from
    when given none."""
    from torch_accel import _C

    return _C._default_generator(_index(dev))


def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator().seed()


def seed_all() -> None:
    s = default_generator(0).seed()
    for i in range(1, device_count()):
        default_generator(i).manual_seed(s)


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device: Any = "accel") -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "accel") -> None:
    default_generator(device).set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)
