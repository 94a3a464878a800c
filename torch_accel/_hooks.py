"""What the C++ shim asks, answered with the runtime: devices, streams, events, storage.

Every function here is called from C++ (torch_accel/csrc/shim.cpp) with the GIL taken;
its name is the contract, so renaming one breaks the shim. Errors raise as themselves
(the shim lets Python exceptions through, but for the calls torch makes from destructors,
where it prints them), except where torch wants its own type: device out-of-memory is
``torch.OutOfMemoryError``, a device index out of range torch's RuntimeError, and a
device used in a child forked after initialisation is torch's "Cannot re-initialize"
RuntimeError. The runtime's device errors (DeviceLostError, ...) are RuntimeErrors too.

Streams follow torch.cuda: ``torch.Stream(device="accel")`` draws from a per-device pool
of ``POOL_SIZE`` streams per priority, round robin (so creating streams in a loop never
exhausts the device's queues); id 0 is the default stream. Events are runtime events
under small integer ids, which C++ keeps in its ``void*`` handle.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading

import numpy as np
import torch

import runtime
from runtime import discovery

#: streams per priority level in each device's pool (torch.cuda's kStreamsPerPool)
POOL_SIZE = 32
_PRIORITIES = (0, -1)  # runtime.Stream.priority_range(): low, high

_lock = threading.Lock()
_init_pid: int | None = None
#: this process's pid, refreshed in a forked child: the fork checks on the hot paths
#: (every allocation) compare it without a system call, as the runtime's do
_pid = os.getpid()
#: the visible devices, as initialisation counted them (0 before)
_count = 0


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ------------------------------------------------------------------------- devices
def fork_error() -> RuntimeError:
    return RuntimeError(
        "Cannot re-initialize accel in forked subprocess. To use accel with "
        "multiprocessing, you must use the 'spawn' start method")


def lazy_init() -> None:
    """Initialise the runtime once per process (torch.cuda's ``_lazy_init``)."""
    global _init_pid, _count
    if _init_pid == _pid:
        return
    if _init_pid is not None:
        raise fork_error()
    with _lock:
        if _init_pid is None:
            runtime.devices.init_state()  # as torch.cuda's: no device opened here
            _count = runtime.devices.visible_count()
            _init_pid = os.getpid()


def in_bad_fork() -> bool:
    return _init_pid is not None and _init_pid != _pid


def is_initialized() -> bool:
    return _init_pid == _pid


def is_available() -> bool:
    return discovery.device_count() > 0


def device_count() -> int:
    """Fork-safe: initialises nothing. Before initialisation (and in a forked child) it
    reads the device tree; once initialised, the count initialisation recorded, as
    torch.cuda caches its count: the autograd engine asks at every ``backward()``, and a
    tree read (a FUSE listdir and two file reads) was ~6 ms of an MLP training step."""
    if is_initialized():
        return runtime.devices.visible_count()
    return discovery.device_count()


def current_device() -> int:
    return runtime.current_device()


def checked(index: int) -> int:
    """``index``, if a device has it. One out of range is torch's RuntimeError (as
    torch.cuda's "invalid device ordinal"), not the runtime's ValueError, so
    ``torch.empty(1, device="accel:9")`` or ``torch.accelerator.memory_stats(9)`` fails as
    it would on CUDA. Initialises the runtime: the count is the one it recorded, so a
    device guard (every operator's) reads no device tree."""
    lazy_init()
    count = runtime.devices.visible_count()
    if not 0 <= index < count:
        raise RuntimeError(f"accel: invalid device index {index}: {count} device(s) visible "
                           "(the device index is out of range)")
    return index


def set_device(index: int) -> None:
    """torch's device guard and ``torch.accel.set_device``."""
    if index < 0:
        return  # torch's "no device": leave the current one
    runtime.set_device(checked(index))


def exchange_device(index: int) -> int:
    prev = runtime.current_device()
    if index >= 0 and index != prev:
        set_device(index)
    return prev


def has_primary_context(index: int) -> bool:
    return is_initialized() and index in runtime.devices.held()


def synchronize(index: int) -> None:
    lazy_init()
    runtime.synchronize(checked(index) if index >= 0 else None)


# ------------------------------------------------------------------------- streams
class _Pool:
    """One device's streams by id: 0 the default, pool streams made on first draw."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.by_id: dict[int, runtime.Stream] = {}
        self.ids: dict[runtime.Stream, int] = {}
        self.next = {p: itertools.cycle(range(POOL_SIZE)) for p in _PRIORITIES}
        self.foreign = itertools.count(1 + POOL_SIZE * len(_PRIORITIES))

    def stream(self, sid: int) -> runtime.Stream:
        if sid == 0:
            return runtime.default_stream(self.device)
        s = self.by_id.get(sid)
        if s is None:
            raise ValueError(f"accel:{self.device} has no stream with id {sid}")
        return s

    def id_of(self, s: runtime.Stream) -> int:
        if s is runtime.default_stream(self.device):
            return 0
        sid = self.ids.get(s)
        if sid is None:  # a runtime.Stream the program made itself: give it an id
            sid = next(self.foreign)
            self.by_id[sid], self.ids[s] = s, sid
        return sid

    def draw(self, priority: int) -> int:
        level = _PRIORITIES.index(-1 if priority < 0 else 0)
        sid = 1 + level * POOL_SIZE + next(self.next[_PRIORITIES[level]])
        if sid not in self.by_id:
            s = runtime.Stream(self.device, priority=_PRIORITIES[level])
            self.by_id[sid], self.ids[s] = s, sid
        return sid


_pools: dict[int, _Pool] = {}


def pool(device: int) -> _Pool:
    lazy_init()
    p = _pools.get(device)
    if p is None:
        with _lock:
            p = _pools.setdefault(device, _Pool(device))
    return p


def stream_of(device: int, sid: int) -> runtime.Stream:
    return pool(device).stream(sid)


def current_stream(device: int) -> int:
    device = device if device >= 0 else runtime.current_device()
    return pool(device).id_of(runtime.current_stream(device))


def new_stream(device: int, priority: int) -> int:
    device = device if device >= 0 else runtime.current_device()
    return pool(device).draw(priority)


def exchange_stream(device: int, sid: int) -> int:
    """torch's stream guards: the autograd engine's, twice per backward function, almost
    always with the stream already current (then nothing is set)."""
    prev = current_stream(device)
    if sid != prev:
        runtime.set_stream(stream_of(device, sid))
    return prev


def stream_query(device: int, sid: int) -> bool:
    return stream_of(device, sid).query()


def stream_synchronize(device: int, sid: int) -> None:
    stream_of(device, sid).synchronize()


# -------------------------------------------------------------------------- events
_events: dict[int, runtime.Event] = {}
_event_ids = itertools.count(1)


def event_record(eid: int, device: int, stream_device: int, sid: int, timing: bool) -> int:
    if eid == 0:
        eid = next(_event_ids)
        _events[eid] = runtime.Event(enable_timing=timing)
    _events[eid].record(stream_of(stream_device, sid))
    return eid


def event_block(eid: int, device: int, sid: int) -> None:
    stream_of(device, sid).wait_event(_events[eid])


def event_query(eid: int) -> bool:
    return _events[eid].query()


def event_synchronize(eid: int) -> None:
    _events[eid].synchronize()


def event_elapsed(start: int, end: int) -> float:
    """Milliseconds between two events: the shim's, after torch checked them, and
    ``torch.accel.Event.elapsed_time``'s, which torch never checked (so both checks are
    here too, with torch's messages and exception types)."""
    if not start or not end:
        raise RuntimeError("Both events must be recorded before calculating elapsed time.")
    if not (_events[start].enable_timing and _events[end].enable_timing):
        raise ValueError("Both events must be created with argument 'enable_timing=True'.")
    try:
        return _events[start].elapsed_time(_events[end])
    except runtime.InvalidValueError as exc:
        raise RuntimeError(str(exc)) from exc


def event_destroy(eid: int) -> None:
    _events.pop(eid, None)


def profiler_record() -> tuple[int, int]:
    """The profiler stubs' event at an operator's start or end: (current device, the id of
    a timing event recorded on its current stream)."""
    lazy_init()
    device = runtime.current_device()
    eid = next(_event_ids)
    _events[eid] = event = runtime.Event(enable_timing=True)
    event.record(runtime.current_stream(device))
    return device, eid


def profiler_elapsed_us(start: int, end: int) -> float:
    """Microseconds of device time between two profiler events, once both completed."""
    _events[end].synchronize()
    return _events[start].elapsed_time(_events[end]) * 1000.0


# ------------------------------------------------------------------ device storage
#: (device, block address) -> the runtime array a storage lives in; a storage's free takes
#: its entry out (the shim's ``free_block``, except in a child forked after the allocation)
blocks: dict[tuple[int, int], runtime.DeviceArray] = {}
_BYTES = np.dtype(np.uint8)


def alloc(nbytes: int, device: int) -> runtime.DeviceArray:
    """A block of ``nbytes`` on ``device`` (the shim's allocator, for a storage, which keeps
    the array and, freed, drops it and its entry in ``blocks``); an index out of range is torch's RuntimeError,
    as the device guard around the allocation said before the shim allocated on the named
    device directly."""
    if _init_pid != _pid or not 0 <= device < _count:
        checked(device)
    try:
        arr = runtime.DeviceArray(nbytes, _BYTES, device=device)
    except runtime.OutOfMemoryError as exc:
        raise torch.OutOfMemoryError(str(exc)) from None
    blocks[(device, arr.va)] = arr
    return arr


def block_holding(device: int, ptr: int) -> tuple[runtime.DeviceArray, int]:
    """The block of this process holding device address ``ptr``, and ``ptr``'s offset in
    it, for a storage torch built around memory the allocator did not hand it (a DLPack
    import). A scan of the live blocks: only such storages take this path."""
    for (dev, va), arr in list(blocks.items()):
        if dev == device and va <= ptr < va + arr.nbytes:
            return arr, ptr - va
    raise RuntimeError(f"accel:{device}: address {ptr:#x} is in no block this process "
                       "allocated")


def copy_data(device: int, dst: int, src: int, nbytes: int) -> None:
    to, frm = blocks[(device, dst)], blocks[(device, src)]
    to.view(np.uint8, nbytes).copy_(frm.view(np.uint8, nbytes))


def record_stream(device: int, va: int, sid: int) -> None:
    blocks[(device, va)].record_stream(stream_of(device, sid))


def memory_stats(device: int) -> dict[str, int]:
    lazy_init()
    return dict(runtime.memory_stats(checked(device)))


def empty_cache() -> None:
    if is_initialized():
        for device in runtime.devices.held():
            runtime.empty_cache(device)


def reset_peak_memory_stats(device: int) -> None:
    lazy_init()
    runtime.reset_peak_memory_stats(checked(device))


def reset_accumulated_memory_stats(device: int) -> None:
    lazy_init()
    runtime.memory._allocator(checked(device)).reset_accumulated_memory_stats()


def mem_get_info(device: int) -> tuple[int, int]:
    lazy_init()
    return runtime.mem_get_info(checked(device))


# ------------------------------------------------------------------- pinned memory
_pinned: dict[int, runtime.HostArray] = {}  # host address -> the pinned array there
_pinned_starts: list[int] = []


def pinned_alloc(nbytes: int) -> int:
    lazy_init()
    arr = runtime.pinned_empty(nbytes, np.uint8)
    ptr = arr.ctypes.data
    with _lock:
        _pinned[ptr] = arr
        bisect.insort(_pinned_starts, ptr)
    return ptr


def pinned_free(ptr: int) -> None:
    with _lock:
        if _pinned.pop(ptr, None) is not None:
            _pinned_starts.remove(ptr)


def pinned_at(ptr: int) -> runtime.HostArray | None:
    """The pinned array holding host address ``ptr``, viewed from there on (or None)."""
    with _lock:
        i = bisect.bisect_right(_pinned_starts, ptr) - 1
        arr = _pinned[_pinned_starts[i]] if i >= 0 else None
    if arr is None or ptr >= arr.ctypes.data + arr.nbytes:
        return None
    return arr[ptr - arr.ctypes.data:]


def is_pinned(ptr: int) -> bool:
    return pinned_at(ptr) is not None
