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

import torch

import runtime
from torch_accel import _hooks
from torch_accel._hooks import device_count, is_available, is_initialized

__all__ = [
    "Event", "Stream", "current_device", "current_stream", "default_stream", "device",
    "device_count", "device_of", "empty_cache", "get_amp_supported_dtype",
    "get_device_capability", "get_device_name", "get_device_properties", "get_rng_state",
    "get_rng_state_all", "init", "initial_seed",
    "is_available", "is_initialized", "manual_seed", "manual_seed_all", "max_memory_allocated",
    "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_reserved",
    "memory_stats", "reset_peak_memory_stats", "seed", "seed_all", "set_device",
    "set_rng_state", "set_rng_state_all", "set_stream", "stream", "synchronize",
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


def set_device(dev: Any) -> None:
    _hooks.set_device(_index(dev))


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


class device_of(device):
    """The device of tensor ``obj`` current for the body (torch.cuda.device_of)."""

    def __init__(self, obj: torch.Tensor) -> None:
        super().__init__(obj.get_device() if obj.device.type == "accel" else -1)


def synchronize(dev: Any = None) -> None:
    """Wait for every stream of this process on the device; raises its first fault."""
    _hooks.synchronize(_index(dev))


def get_device_properties(dev: Any = None) -> runtime.DeviceProperties:
    _hooks.lazy_init()
    return runtime.get_device_properties(_index(dev))


def get_device_name(dev: Any = None) -> str:
    return get_device_properties(dev).name


def get_device_capability(dev: Any = None) -> tuple[int, int]:
    """The ISA version as (major, minor), as torch.cuda's compute capability."""
    props = get_device_properties(dev)
    major, minor = (int(p) for p in str(props.isa_version).split(".")[:2])
    return major, minor


# ---------------------------------------------------------------- streams and events
class Stream(torch.Stream):
    """A stream of the accel device (torch.cuda.Stream): from the device's stream pool."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        if kwargs:  # torch's rebuild from (stream_id, device_index, device_type)
            return super().__new__(cls, **kwargs)
        with globals()["device"](device):
            return super().__new__(cls, device=torch.device("accel", _index(device)),
                                   priority=priority)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return runtime.Stream.priority_range()

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


def current_stream(dev: Any = None) -> Stream:
    idx = _index(dev)
    return Stream(stream_id=_hooks.current_stream(idx), device_index=idx,
                  device_type=DEVICE_TYPE)


def default_stream(dev: Any = None) -> Stream:
    idx = _index(dev)
    _hooks.lazy_init()
    return Stream(stream_id=0, device_index=idx, device_type=DEVICE_TYPE)


def set_stream(s: torch.Stream) -> None:
    if s is not None:
        _hooks.exchange_stream(s.device_index, s.stream_id)


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
def memory_stats(dev: Any = None) -> OrderedDict[str, Any]:
    """torch.accelerator's answer, so both name the same keys (torch adds the oversize
    counters the runtime's allocator has no pool for) with the same values; empty, and
    initialising nothing, before the device is initialised (as torch.cuda's)."""
    return torch.accelerator.memory_stats(_index(dev))


def memory_allocated(dev: Any = None) -> int:
    return memory_stats(dev).get("allocated_bytes.all.current", 0)


def max_memory_allocated(dev: Any = None) -> int:
    return memory_stats(dev).get("allocated_bytes.all.peak", 0)


def memory_reserved(dev: Any = None) -> int:
    return memory_stats(dev).get("reserved_bytes.all.current", 0)


def max_memory_reserved(dev: Any = None) -> int:
    return memory_stats(dev).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(dev: Any = None) -> None:
    _hooks.reset_peak_memory_stats(_index(dev))


def empty_cache() -> None:
    _hooks.empty_cache()


def mem_get_info(dev: Any = None) -> tuple[int, int]:
    return _hooks.mem_get_info(_index(dev))


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


def get_rng_state(dev: Any = "accel") -> torch.Tensor:
    return default_generator(dev).get_state()


def set_rng_state(state: torch.Tensor, dev: Any = "accel") -> None:
    default_generator(dev).set_state(state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states: list[torch.Tensor]) -> None:
    for i, state in enumerate(states):
        set_rng_state(state, i)
