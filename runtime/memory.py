"""Memory classes from the host's side: device, pinned and managed arrays, IPC, copies.

* ``empty``/``to_device`` give a ``DeviceArray``: device-local memory from the caching
  allocator, never mapped into this process (as on real hardware); reached by copies.
* ``pinned_empty`` gives a numpy array in host memory the copy engines reach directly, so
  copies from and to it are asynchronous and run at memory bandwidth. The memory is this
  process's own (a sealed memfd, :mod:`runtime._shm`), pinned for the device by the driver.
* ``managed_empty`` gives a numpy array the device can also use: pages migrate to the
  device on device access and back on ``prefetch(to_device=False)``; the driver counts
  faults, bytes moved and evictions (``sys/class/accel/accelN/managed_*``).
* Pageable numpy arrays are staged through pinned buffers, as CUDA does: a copy from one
  returns once the data is staged (the source may be reused), a copy into one returns once
  the data has arrived.

Copies are ordered on a stream (the current one by default). A bad range, size or handle
is refused before anything is queued; the firmware checks again and faults the stream
rather than touch memory the context cannot reach.
"""

from __future__ import annotations

import bisect
import errno
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from abi import uapi, userq
from runtime import devices as _device
from runtime import _trace, discovery, errors
from runtime import sanitizer as _sanitizer
from runtime._shm import map_memfd, sealed_memfd
from runtime.allocator import CachingAllocator
from runtime.context import Context
from runtime import stream as _stream
from runtime.stream import Stream, current_stream, default_stream

STAGING_CHUNK = 8 << 20
#: How long an allocation that found the device full waits for memory this process freed
#: (the device gives it back once work queued before the free completed).
PENDING_FREE_WAIT_S = 5.0


@dataclass
class Segment:
    """One driver allocation of device-local memory (what the caching allocator carves)."""

    va: int
    size: int
    handle: int


class DriverBackend:
    """The caching allocator's raw backend: MEM_ALLOC/MEM_FREE/MEM_INFO on the primary context."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.ctx: Context = _device.primary_context(device)
        self._starts: list[int] = []
        self._segments: dict[int, Segment] = {}
        self._lock = threading.Lock()

    def raw_alloc(self, size: int) -> Segment:
        """MEM_ALLOC; when the device is full but memory this process freed is still on
        its way back (work queued before the free is finishing), wait for it and retry."""
        deadline = time.monotonic() + PENDING_FREE_WAIT_S
        while True:
            try:
                reply = self.ctx.channel.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
                    ctx_id=self.ctx.id, size=size, kind=uapi.MemKind.DEVICE, fd=-1))
                break
            except errors.OutOfMemoryError as exc:
                if exc.errno != errno.ENOMEM or time.monotonic() >= deadline:
                    raise
                pending = self.info().pending_free
                if not pending:
                    raise
                self.ctx.events.wait(lambda: self.info().pending_free < pending,
                                     deadline - time.monotonic(), "memory being freed")
        seg = Segment(reply.va, size, reply.handle)
        with self._lock:
            bisect.insort(self._starts, seg.va)
            self._segments[seg.va] = seg
        return seg

    def raw_free(self, segment: Segment) -> None:
        with self._lock:
            self._starts.remove(segment.va)
            del self._segments[segment.va]
        if os.getpid() == self.ctx.channel.pid and self.ctx.channel.fd >= 0:
            self.ctx.channel.call(uapi.ACCEL_CMD_MEM_FREE,
                                  uapi.accel_mem_free(ctx_id=self.ctx.id, handle=segment.handle))

    def mem_get_info(self) -> tuple[int, int]:
        info = self.info()
        return info.free, info.total

    def settle(self, timeout: float = PENDING_FREE_WAIT_S) -> None:
        """Wait (at most ``timeout``) until the memory this process freed is back in the
        device's pool, as a cudaFree that synchronises would: the driver answers MEM_FREE at
        once and gives the bytes back when work queued before the free has completed."""
        try:
            self.ctx.events.wait(lambda: self.info().pending_free == 0, timeout,
                                 "memory being freed")
        except errors.AccelTimeoutError:
            pass  # still in use by long work: it comes back when that work completes

    def info(self) -> uapi.accel_mem_info:
        return self.ctx.channel.call(uapi.ACCEL_CMD_MEM_INFO, uapi.accel_mem_info(ctx_id=self.ctx.id))

    def segment_of(self, va: int) -> Segment:
        with self._lock:
            i = bisect.bisect_right(self._starts, va) - 1
            seg = self._segments[self._starts[i]] if i >= 0 else None
        if seg is None or va >= seg.va + seg.size:
            raise errors.InvalidValueError(f"address {va:#x} is not in a live allocation")
        return seg


def _backend(device: _device.DeviceLike = None) -> DriverBackend:
    idx = device if type(device) is int else _device._index(device)
    return _device.get(idx).part("memory_backend", lambda: DriverBackend(idx))


def _allocator(device: _device.DeviceLike = None) -> CachingAllocator:
    idx = device if type(device) is int else _device._index(device)
    return _device.get(idx).part("allocator", lambda: CachingAllocator(_backend(idx)))


#: Per device index: (pid, its caching allocator, its default stream or None) as its
#: Device's parts were when last looked up. Every array's making needs the allocator and
#: a stream, and the two part lookups were a third of a small array's making and
#: dropping; an entry holds while its allocator is open (a lost or dropped device closes
#: it, and its parts are made anew) and in the process that made it (a forked child takes
#: the lookups, which refuse it). The default stream is a queue of the device: it is
#: looked up (made) only for an array that names no stream (``_hot_default``), never for
#: one that does -- a context whose queues are all in use still makes arrays on them.
_hot_parts: dict[int, tuple[int, CachingAllocator, Stream | None]] = {}


def _hot(idx: int) -> tuple[int, CachingAllocator, Stream | None]:
    """Device ``idx``'s entry in ``_hot_parts``, looked up anew (no default stream yet)."""
    entry = _hot_parts[idx] = (_device._pid, _allocator(idx), None)
    return entry


def _hot_default(idx: int) -> Stream:
    """Device ``idx``'s default stream, made if need be, kept in its fresh ``_hot`` entry."""
    s = default_stream(idx)
    pid, allocator, _ = _hot_parts[idx]
    _hot_parts[idx] = (pid, allocator, s)
    return s


def _refuse_in_capture(s: Stream, what: str) -> None:
    if s.capturing is not None:
        raise errors.InvalidValueError(f"{what} cannot be captured into a graph ({s!r} is capturing)")


def _refuse_allocation_in_capture(what: str) -> None:
    from runtime.graphs import capturing_graph

    if capturing_graph() is not None:
        raise errors.InvalidValueError(
            f"{what} during graph capture is outside the graph's pool; allocate it before "
            "capturing (device arrays made during capture come from the graph's pool)")


class DeviceArray:
    """An n-dimensional array in device-local memory (C order)."""

    # Slots: a cached allocate+free is a hot path (goal 5 us) and plain attributes cost.
    __slots__ = ("shape", "dtype", "nbytes", "device", "va", "_allocator", "_block",
                 "_launch_record", "__weakref__")
    #: _launch_record: this array's records as a kernel argument (runtime/launch.py), set
    #: on its first launch: they depend only on its address, dtype and shape, which are fixed

    def __init__(self, shape: tuple[int, ...] | int, dtype: Any, *, device: _device.DeviceLike = None,
                 stream: Stream | None = None) -> None:
        # The common call (a framework's storage: one length, a dtype object, a device
        # index) skips the general conversions: this is the hot path of every eager
        # operator's result (docs/torch.md, "Where an eager op's time goes").
        self.dtype = dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        if type(shape) is int and shape >= 0:
            self.shape = (shape,)
            self.nbytes = shape * dt.itemsize
        else:
            self.shape = (shape,) if type(shape) is int else tuple(shape)
            if self.shape and min(self.shape) < 0:
                raise errors.InvalidValueError(f"negative dimension in shape {self.shape}")
            self.nbytes = math.prod(self.shape) * dt.itemsize
        self.device = idx = device if type(device) is int else \
            _device.current_device() if device is None else _device._index(device)
        entry = _hot_parts.get(idx)
        if entry is None or entry[1].closed is not None or entry[0] != _device._pid:
            entry = _hot(idx)
        self._allocator = allocator = entry[1]
        s = stream or _stream._tls.streams.get(idx) or entry[2] or _hot_default(idx)
        if s.capturing is None:
            self._block = block = allocator.malloc(self.nbytes, s)
        else:  # the graph's own pool, for the graph's lifetime
            self._block = block = allocator.malloc(self.nbytes, s.capturing.pool)
            s.capturing.owned.append(self)
        self.va: int = block.va

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device=accel:{self.device})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Refused, as torch refuses ``np.asarray`` of a device tensor: the bytes are in
        device memory, which this process never maps (numpy would otherwise build an
        object array holding this array)."""
        raise TypeError(f"{self!r} lives in device memory; copy it to the host first with "
                        ".copy_to_host()")

    def __del__(self) -> None:
        block = getattr(self, "_block", None)
        if block is not None:
            self._block = None
            try:
                self._allocator.free(block)
            except errors.AccelError:
                pass  # device lost or process forked: nothing left to give back

    @property
    def size(self) -> int:
        return self.nbytes // self.dtype.itemsize if self.dtype.itemsize else 0

    def _host_check(self, host: np.ndarray, what: str) -> None:
        if host.nbytes != self.nbytes:
            raise errors.InvalidValueError(
                f"{what}: host array has {host.nbytes} bytes ({host.shape} {host.dtype}), "
                f"device array {self.nbytes} ({self.shape} {self.dtype})")
        if not host.flags.c_contiguous:
            raise errors.InvalidValueError(f"{what}: host array must be C-contiguous")

    def record_stream(self, stream: Stream) -> None:
        """Mark that ``stream`` uses this memory: its reuse then waits for that work too."""
        self._allocator.record_stream(self._block, stream)

    def dropped(self) -> errors.InvalidValueError | None:
        """The error for using this array once its memory went with its context: lost
        (a DeviceLostError naming why) or dropped to rebuild the device
        (``runtime.devices.drop``); None while the memory is there."""
        cause = self._allocator.closed
        if cause is None:
            return None
        if isinstance(cause, errors.DeviceLostError):
            return errors.DeviceLostError(f"{self!r}: its memory is gone: {cause}", cause.errno,
                                          cause.record)
        return errors.InvalidValueError(
            f"{self!r} was allocated before accel:{self.device} was rebuilt; its memory is "
            "gone, allocate it again")

    def copy_from_host(self, host: np.ndarray, stream: Stream | None = None) -> DeviceArray:
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("DeviceArray.copy_from_host", {}, self.copy_from_host, host, stream)
        if self._allocator.closed is not None:
            raise self.dropped()
        host = np.asanyarray(host)  # keeps a HostArray a HostArray (asarray would not)
        self._host_check(host, "copy_from_host")
        s = stream or current_stream(self.device)
        va = host_va(host)
        if va is not None:
            s.submit([userq.Copy(self.va, va, self.nbytes)], uses=(self, host))
        else:
            _refuse_in_capture(s, "a copy from pageable memory (it needs the host)")
            _staging(self.device).to_device(s, self.va, host.reshape(-1).view(np.uint8))
        return self

    def copy_to_host(self, out: np.ndarray | None = None, stream: Stream | None = None) -> np.ndarray:
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("DeviceArray.copy_to_host", {}, self.copy_to_host, out, stream)
        if self._allocator.closed is not None:
            raise self.dropped()
        out = np.empty(self.shape, self.dtype) if out is None else out
        self._host_check(out, "copy_to_host")
        s = stream or current_stream(self.device)
        va = host_va(out)
        if va is not None and stream is not None:  # asynchronous
            s.submit([userq.Copy(va, self.va, self.nbytes)], uses=(self, out))
        else:
            _refuse_in_capture(s, "a host read (it needs the host to wait)")
            if va is not None:
                s.wait_seqno(s.submit([userq.Copy(va, self.va, self.nbytes)]))
            else:
                _staging(self.device).to_host(s, out.reshape(-1).view(np.uint8), self.va)
        return out

    def copy_(self, src: DeviceArray, stream: Stream | None = None) -> DeviceArray:
        """Device-to-device copy (a peer copy when ``src`` lives on another device)."""
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("DeviceArray.copy_", {}, self.copy_, src, stream)
        if self._allocator.closed is not None or src._allocator.closed is not None:
            raise (self.dropped() or src.dropped())
        if src.nbytes != self.nbytes:
            raise errors.InvalidValueError(f"copy_: {src.nbytes} bytes into {self.nbytes}")
        s = stream or current_stream(self.device)
        s.submit([userq.Copy(self.va, src.va, self.nbytes)], uses=(self, src))
        return self

    def memset(self, value: int, stream: Stream | None = None) -> DeviceArray:
        """Set every byte to ``value`` (0..255)."""
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("DeviceArray.memset", {}, self.memset, value, stream)
        if self._allocator.closed is not None:
            raise self.dropped()
        if not 0 <= value <= 0xFF:
            raise errors.InvalidValueError(f"memset value {value} is not a byte")
        (stream or current_stream(self.device)).submit(
            [userq.Memset(self.va, self.nbytes, value)], uses=(self,))
        return self

    def view(self, dtype: Any, shape: tuple[int, ...] | int, offset: int = 0) -> DeviceView:
        """These bytes from ``offset`` seen as a C-order array of ``dtype`` and ``shape``,
        sharing this array's memory (as a torch storage backs many tensors): what a
        framework backend launches kernels on. The view keeps this array alive; a view
        reaching past its end is ``InvalidValueError``."""
        return DeviceView(self, dtype, shape, offset)

    def ipc_handle(self) -> IpcHandle:
        """A handle another process opens with ``open_ipc_handle`` (it maps the segment)."""
        _refuse_allocation_in_capture("exporting memory")
        backend = _backend(self.device)
        seg = backend.segment_of(self.va)
        reply = backend.ctx.channel.call(uapi.ACCEL_CMD_MEM_EXPORT, uapi.accel_mem_export(
            ctx_id=backend.ctx.id, handle=seg.handle))
        uuid = discovery.read_attr(backend.ctx.physical, "uuid")
        return IpcHandle(uuid, reply.export_id, reply.token, self.va - seg.va, self.shape,
                         self.dtype.str)


@dataclass(frozen=True)
class IpcHandle:
    """What crosses to another process (picklable): device, export, secret, where, what."""

    device_uuid: str
    export_handle: int
    token: int
    offset: int
    shape: tuple[int, ...]
    dtype: str


class DeviceView(DeviceArray):
    """Part of another array's memory under its own dtype and shape (``DeviceArray.view``);
    it frees nothing, its base does, once no view holds it."""

    __slots__ = ("base",)

    def __init__(self, base: DeviceArray, dtype: Any, shape: tuple[int, ...] | int,
                 offset: int = 0) -> None:  # noqa: D107 - see DeviceArray.view
        self.shape = (shape,) if type(shape) is int else tuple(shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        if (self.shape and min(self.shape) < 0) or offset < 0 or offset + self.nbytes > base.nbytes:
            raise errors.InvalidValueError(
                f"a view of {self.shape} {self.dtype} at byte {offset} does not fit in {base!r} "
                f"({base.nbytes} bytes)")
        self.base = base.base if isinstance(base, DeviceView) else base
        self.device, self._allocator = base.device, base._allocator
        self._block = None  # the base's to free; record_stream goes to the base
        self.va = base.va + offset

    def __del__(self) -> None:
        pass

    def record_stream(self, stream: Stream) -> None:
        self.base.record_stream(stream)


class ImportedArray(DeviceArray):
    """Another process's device memory mapped into this one; freed from here on GC."""

    __slots__ = ("ctx", "_import_handle")

    def __init__(self, handle: IpcHandle) -> None:  # noqa: D107 - see open_ipc_handle
        self.shape, self.dtype = tuple(handle.shape), np.dtype(handle.dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.device = _device_by_uuid(handle.device_uuid)
        self.ctx = _device.primary_context(self.device)
        reply = self.ctx.channel.call(uapi.ACCEL_CMD_MEM_IMPORT, uapi.accel_mem_import(
            ctx_id=self.ctx.id, export_handle=handle.export_handle, token=handle.token))
        if handle.offset + self.nbytes > reply.size:
            raise errors.InvalidValueError("IPC handle describes bytes past its allocation")
        self._import_handle = reply.handle
        self.va = reply.va + handle.offset
        self._block = None  # not the allocator's to free; it is there for dropped()
        self._allocator = _allocator(self.device)

    def __del__(self) -> None:
        ctx = getattr(self, "ctx", None)
        if hasattr(self, "_import_handle") and os.getpid() == ctx.channel.pid and ctx.channel.fd >= 0:
            try:
                ctx.channel.call(uapi.ACCEL_CMD_MEM_FREE,
                                 uapi.accel_mem_free(ctx_id=ctx.id, handle=self._import_handle))
            except errors.AccelError:
                pass

    def record_stream(self, stream: Stream) -> None:
        pass  # not from the caching allocator: freed explicitly, after a synchronize


def _device_by_uuid(uuid: str) -> int:
    for i, name in enumerate(discovery.visible_devices()):
        if discovery.read_attr(name, "uuid") == uuid:
            return i
    raise errors.InvalidValueError(f"IPC handle names device {uuid}, not visible here")


def _handle_fault(handle: object) -> str | None:
    """What makes ``handle`` no :class:`IpcHandle` one could import, or None. Checked
    before anything reaches the driver: a handle crosses processes (pickled, by hand), so
    what arrives may be the pickle's bytes, a cut-short copy or a field of the wrong
    type, and each would otherwise fail deep inside the import with an AttributeError."""
    if not isinstance(handle, IpcHandle):
        return f"got {type(handle).__name__}" + (
            " (bytes: unpickle them first, pickle.loads)" if isinstance(handle, bytes) else "")

    def count(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(handle.device_uuid, str):
        return f"its device_uuid is {handle.device_uuid!r}"
    for name in ("export_handle", "token", "offset"):
        if not count(getattr(handle, name)):
            return f"its {name} is {getattr(handle, name)!r}, not a count"
    if not isinstance(handle.shape, tuple) or not all(count(n) for n in handle.shape):
        return f"its shape is {handle.shape!r}"
    try:
        np.dtype(handle.dtype)
    except (TypeError, ValueError):
        return f"its dtype is {handle.dtype!r}"
    return None


def open_ipc_handle(handle: IpcHandle) -> DeviceArray:
    """Map another process's device memory, named by the :class:`IpcHandle` its
    ``DeviceArray.ipc_handle()`` returned; InvalidValueError for anything else."""
    fault = _handle_fault(handle)
    if fault is not None:
        raise errors.InvalidValueError(
            f"open_ipc_handle needs an IpcHandle, the result of DeviceArray.ipc_handle() in "
            f"the exporting process (picklable, sent as is): {fault}")
    _refuse_allocation_in_capture("importing memory")
    return ImportedArray(handle)


# --- host-visible memory -------------------------------------------------------------------
class _HostAllocation:
    """Host memory of this process (a sealed memfd) pinned for the device, mapped here;
    unpinned on GC."""

    def __init__(self, ctx: Context, nbytes: int, kind: uapi.MemKind) -> None:
        self.ctx = ctx
        self.handle: int | None = None  # until the driver pinned it: nothing to unpin
        fd = sealed_memfd(kind.name.lower(), max(nbytes, 1))
        try:
            self.mem = map_memfd(fd, nbytes)
            reply = ctx.channel.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
                ctx_id=ctx.id, size=max(nbytes, 1), kind=kind, fd=fd))
        finally:
            os.close(fd)  # the mapping and the driver keep the memory
        self.handle, self.va, self.kind = reply.handle, reply.va, kind
        self.base = np.frombuffer(self.mem, np.uint8).ctypes.data
        if (san := _sanitizer.active) is not None:
            san.host_memory(self.va, nbytes, kind.name.lower())

    def __del__(self) -> None:
        if self.handle is not None and os.getpid() == self.ctx.channel.pid \
                and self.ctx.channel.fd >= 0:
            try:
                self.ctx.channel.call(uapi.ACCEL_CMD_MEM_FREE,
                                      uapi.accel_mem_free(ctx_id=self.ctx.id, handle=self.handle))
            except errors.AccelError:
                pass


class HostArray(np.ndarray):
    """A numpy array in pinned or managed memory; views keep the allocation alive."""

    _accel: _HostAllocation | None

    def __array_finalize__(self, obj: Any) -> None:
        self._accel = getattr(obj, "_accel", None)

    @property
    def device_va(self) -> int:
        assert self._accel is not None
        return self._accel.va + (self.ctypes.data - self._accel.base)

    def prefetch(self, to_device: bool = True, stream: Stream | None = None) -> None:
        """Managed memory: migrate these pages to the device (or back to the host)."""
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("HostArray.prefetch", {}, self.prefetch, to_device, stream)
        if self._accel is None or self._accel.kind != uapi.MemKind.MANAGED:
            raise errors.InvalidValueError("prefetch is for managed memory")
        s = stream or current_stream(_runtime_index(self._accel.ctx))
        s.wait_seqno(s.submit([userq.Prefetch(self.device_va, self.nbytes,
                                       int(to_device))]))


def _runtime_index(ctx: Context) -> int:
    return discovery.visible_devices().index(ctx.physical)


def host_va(arr: np.ndarray) -> int | None:
    """The device address of a pinned/managed array's first byte (None: pageable)."""
    if isinstance(arr, HostArray) and arr._accel is not None:
        return arr.device_va
    return None


def _host_empty(shape: Any, dtype: Any, device: _device.DeviceLike, kind: uapi.MemKind) -> HostArray:
    _refuse_allocation_in_capture(f"allocating {kind.name.lower()} memory")
    return _map_host(shape, dtype, device, kind)


def _map_host(shape: Any, dtype: Any, device: _device.DeviceLike, kind: uapi.MemKind) -> HostArray:
    """A host-visible allocation as a numpy array (graphs use it for their own pool)."""
    dt = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    owner = _HostAllocation(_device.primary_context(_device._index(device)), nbytes, kind)
    arr = np.frombuffer(owner.mem, np.uint8, count=nbytes).view(dt).reshape(shape).view(HostArray)
    arr._accel = owner
    return arr


def pinned_empty(shape: Any, dtype: Any = np.float32, *,
                 device: _device.DeviceLike = None) -> HostArray:
    """Host memory the device's copy engines reach directly (torch's ``pin_memory``)."""
    return _host_empty(shape, dtype, device, uapi.MemKind.HOST_PINNED)


def managed_empty(shape: Any, dtype: Any = np.float32, *,
                  device: _device.DeviceLike = None) -> HostArray:
    """Host memory the device migrates pages of on access (CUDA's managed memory)."""
    return _host_empty(shape, dtype, device, uapi.MemKind.MANAGED)


# --- staging for pageable memory ---------------------------------------------------------------
class _Staging:
    """Two pinned buffers that pipeline pageable copies chunk by chunk."""

    def __init__(self, device: int) -> None:
        self.bufs = [pinned_empty(STAGING_CHUNK, np.uint8, device=device) for _ in range(2)]
        self.done: list[tuple[Stream, int] | None] = [None, None]
        self.lock = threading.Lock()

    def _ready(self, i: int) -> None:
        if self.done[i] is not None:
            s, seqno = self.done[i]  # type: ignore[misc]
            s.wait_seqno(seqno)
            self.done[i] = None

    def to_device(self, s: Stream, dst_va: int, src: np.ndarray) -> None:
        with self.lock:
            for n, off in enumerate(range(0, len(src), STAGING_CHUNK)):
                i = n % 2
                chunk = src[off : off + STAGING_CHUNK]
                self._ready(i)
                self.bufs[i][: len(chunk)] = chunk
                self.done[i] = (s, s.submit([userq.Copy(dst_va + off,
                                                      self.bufs[i].device_va, len(chunk))]))

    def to_host(self, s: Stream, dst: np.ndarray, src_va: int) -> None:
        with self.lock:
            chunks = list(enumerate(range(0, len(dst), STAGING_CHUNK)))
            pending: list[tuple[int, int, int, int]] = []  # (buf, off, len, seqno)
            for n, off in chunks:
                i = n % 2
                self._ready(i)
                length = min(STAGING_CHUNK, len(dst) - off)
                seqno = s.submit([userq.Copy(self.bufs[i].device_va, src_va + off, length)])
                pending.append((i, off, length, seqno))
                if len(pending) == 2:
                    self._drain(s, dst, pending.pop(0))
            for item in pending:
                self._drain(s, dst, item)

    def _drain(self, s: Stream, dst: np.ndarray, item: tuple[int, int, int, int]) -> None:
        i, off, length, seqno = item
        s.wait_seqno(seqno)
        dst[off : off + length] = self.bufs[i][:length]


def _staging(device: int) -> _Staging:
    return _device.get(device).part("staging", lambda: _Staging(device))


# --- the torch-style module functions ------------------------------------------------------------
def empty(shape: Any, dtype: Any = np.float32, *, device: _device.DeviceLike = None,
          stream: Stream | None = None) -> DeviceArray:
    """An uninitialised device array (``torch.empty``: ``device`` and ``stream`` are
    keyword-only, as torch's ``device`` is)."""
    return DeviceArray(shape, dtype, device=device, stream=stream)


def to_device(host: np.ndarray, *, device: _device.DeviceLike = None,
              stream: Stream | None = None) -> DeviceArray:
    """A copy of ``host`` in device memory, queued on ``stream`` (the current stream):
    ``x.to(device)`` in torch. ``device`` and ``stream`` are keyword-only: a positional
    ``to_device(x, 1)`` would otherwise silently make ``1`` the stream."""
    if not (isinstance(host, np.ndarray) and host.flags.c_contiguous):
        host = np.ascontiguousarray(host)
    return DeviceArray(host.shape, host.dtype, device=device, stream=stream).copy_from_host(host, stream)


def memory_stats(device: _device.DeviceLike = None) -> dict[str, int]:
    return _allocator(device).memory_stats()


def memory_allocated(device: _device.DeviceLike = None) -> int:
    return _allocator(device).memory_allocated()


def max_memory_allocated(device: _device.DeviceLike = None) -> int:
    return _allocator(device).max_memory_allocated()


def memory_reserved(device: _device.DeviceLike = None) -> int:
    return _allocator(device).memory_reserved()


def max_memory_reserved(device: _device.DeviceLike = None) -> int:
    return _allocator(device).max_memory_reserved()


def reset_peak_memory_stats(device: _device.DeviceLike = None) -> None:
    _allocator(device).reset_peak_memory_stats()


def memory_snapshot(device: _device.DeviceLike = None) -> list[dict[str, Any]]:
    """The device's segments and their blocks, as torch's ``memory_snapshot`` lists them
    (``CachingAllocator.snapshot``)."""
    return _allocator(device).snapshot()


def set_per_process_memory_fraction(fraction: float, device: _device.DeviceLike = None) -> None:
    """Let this process hold at most ``fraction`` of the device's memory; past it an
    allocation raises OutOfMemoryError (``CachingAllocator.set_memory_fraction``)."""
    _allocator(device).set_memory_fraction(fraction)


def empty_cache(device: _device.DeviceLike = None) -> None:
    """Give the cached, unused device memory back to the device (torch's ``empty_cache``),
    and wait until it is free there (so ``mem_get_info`` sees it)."""
    _allocator(device).empty_cache()
    _backend(device).settle()


def mem_get_info(device: _device.DeviceLike = None) -> tuple[int, int]:
    """(free, total) bytes of device memory, as the driver counts them (all processes)."""
    return _backend(device).mem_get_info()


def enable_peer_access(peer: int, device: _device.DeviceLike = None) -> None:
    """Let work on ``device`` (the current one) reach ``peer``'s memory of this process."""
    _device.primary_context(peer)
    ctx = _device.primary_context(_device._index(device))
    ctx.channel.call(uapi.ACCEL_CMD_PEER_ENABLE, uapi.accel_peer_enable(
        ctx_id=ctx.id, peer_index=_device_physical_index(peer)))


def _device_physical_index(index: int) -> int:
    return int(_device.primary_context(index).physical[5:])


__all__ = [
    "DeviceArray", "HostArray", "IpcHandle", "empty", "empty_cache", "enable_peer_access",
    "managed_empty", "max_memory_allocated", "max_memory_reserved", "mem_get_info",
    "memory_allocated", "memory_reserved", "memory_stats", "open_ipc_handle", "pinned_empty",
    "reset_peak_memory_stats", "to_device",
]
