"""The runtime's caching device-memory allocator, after PyTorch's CUDA caching allocator.

A raw driver allocation is a round trip through the driver, far too slow to make for every
array, and freeing one would have to wait for the device. So, as
``c10/cuda/CUDACachingAllocator.cpp`` does, the runtime keeps the memory it frees and hands
it out again, and gives segments back to the driver only on ``empty_cache()`` or when the
driver runs out. The rules, each as torch has them:

* Sizes round up to a multiple of 512 bytes. Requests of at most 1 MiB come from the small
  pool, carved out of 2 MiB segments; larger ones from the large pool, out of 20 MiB
  segments below 10 MiB and otherwise out of a segment of their own rounded up to 2 MiB.
  The two pools keep small arrays from fragmenting the segments large ones need.
* A freed block goes back to its pool under the stream it was allocated on, and only that
  stream reuses it: work queued on one stream runs in order, so the next owner's work cannot
  overtake the last owner's and nobody has to wait. Reuse is immediate.
* ``record_stream(block, s)`` says another stream used the block. Freeing it then records an
  event on each such stream, and the block returns to its pool only once all have completed,
  as found at the next ``malloc`` or ``empty_cache`` (torch's ``process_events``).
* Lookup is best fit (smallest block, then lowest address) among the stream's free blocks of
  the pool. A block larger than needed is split when the rest is worth keeping (at least
  512 bytes in the small pool, more than 1 MiB in the large one); a freed block merges with
  free neighbours of its segment, so a segment whose blocks are all free is one block again.
* When the driver is out of memory, the allocator waits for all pending events, returns every
  wholly free segment and retries once; if that fails too it raises ``OutOfMemoryError`` with
  torch's message: what it tried to allocate (like torch, the segment it asked the driver
  for, so 20.00 MiB for a 3 MiB request), what the device has, what this process holds.
* ``memory_stats()`` has torch's keys and meanings.

A zero-byte request gets a null block (``va == 0``, ``size == 0``) that holds no memory, is
not counted, and that ``free`` and ``record_stream`` ignore, as torch hands out a null pointer.

Threads: one lock guards the allocator's state. ``free`` does not take it: it marks the block
freed and queues it, and the next call that takes the lock puts the queued blocks back first,
so every result is as if each free had been done at once. This halves the lock traffic of a
malloc/free pair, and it lets a finalizer free an array at any moment, even when the garbage
collector runs it inside an allocator call on the same thread (any Python allocation can),
without deadlocking or seeing the state mid-update. (A finalizer must not ``malloc``.)
"""

from __future__ import annotations

import copy
import errno
import threading
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Protocol

from runtime import _trace
from runtime.errors import InvalidValueError, OutOfMemoryError

MIN_BLOCK_SIZE = 512                 #: every size rounds up to a multiple of this
SMALL_SIZE = 1 << 20                 #: the largest request the small pool serves
SMALL_BUFFER = 2 << 20               #: the size of a small-pool segment
MIN_LARGE_ALLOC = 10 << 20           #: smaller large requests share a LARGE_BUFFER segment
LARGE_BUFFER = 20 << 20              #: the size of a shared large-pool segment
ROUND_LARGE = 2 << 20                #: larger requests get a segment rounded up to this

#: Torch's statistics, each for all pools together and for each pool (``memory_stats``).
STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
              "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOL_NAMES = ("all", "small_pool", "large_pool")
METRIC_NAMES = ("current", "peak", "allocated", "freed")
#: Torch's event counters: driver calls that failed and were retried after freeing the
#: cache, out-of-memory errors raised, waits for all pending events, raw allocs and frees.
COUNTER_NAMES = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free")
(ALLOCATION, SEGMENT, ACTIVE, INACTIVE_SPLIT, ALLOCATED_BYTES, RESERVED_BYTES, ACTIVE_BYTES,
 INACTIVE_SPLIT_BYTES, REQUESTED_BYTES) = range(len(STAT_NAMES))

# Block.state
_ALLOCATED = 0      # handed out
_FREED = 1          # freed and queued or waiting for events; or a new segment's, unused
_CACHED = 2         # in its pool's free list
_NULL = 3           # the null block of a zero-byte request


class Segment(Protocol):
    """One raw driver allocation."""

    va: int      #: device virtual address of its first byte
    size: int    #: at least the size asked of ``raw_alloc``


class EventLike(Protocol):
    """A point on a stream (``runtime.stream.Event``)."""

    def query(self) -> bool:
        """True once the device finished the work recorded before the event."""

    def synchronize(self) -> None:
        """Wait until ``query()`` would be true."""


class StreamLike(Hashable, Protocol):
    """An in-order queue of device work (``runtime.stream.Stream``).

    Free blocks are kept per stream in a dict, so equal streams must be the same queue.
    """

    def record_event(self) -> EventLike:
        """An event after the work queued on the stream so far."""


class RawBackend(Protocol):
    """What the allocator needs from the driver."""

    device: int  #: the runtime's index of the device, for messages

    def raw_alloc(self, size: int) -> Segment:
        """A new segment of ``size`` bytes; ``OutOfMemoryError`` when the device is full."""

    def raw_free(self, segment: Segment) -> None:
        """Give a segment back to the driver."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as the driver counts them."""


class Block:
    """A range of a segment: what ``malloc`` returns and a device array holds.

    ``va``, ``size``, ``requested_size`` and ``stream`` are the public part; the rest is the
    allocator's. ``size`` is the request rounded up, or more where the rest of the free block
    was too small to split off (as in torch, the block then counts whole). Free a block once,
    to the allocator that made it: that allocator then reuses the object for other
    allocations.
    """

    __slots__ = ("va", "size", "requested_size", "stream", "free_list", "prev", "next",
                 "state", "stream_uses", "events", "event_count")

    def __init__(self, va: int, size: int, stream: StreamLike, free_list: _FreeList | None,
                 prev: Block | None, next: Block | None, state: int) -> None:
        self.va = va
        self.size = size
        self.requested_size = 0
        self.stream = stream
        self.free_list = free_list       # where it goes when free: its pool's, its stream's
        self.prev = prev                 # neighbours in the segment, None at its ends
        self.next = next
        self.state = state
        self.stream_uses: set[StreamLike] | None = None    # from record_stream
        self.events: list[tuple[StreamLike, EventLike]] | None = None  # recorded by free
        self.event_count = 0             # of those, how many the allocator still waits for

    def __repr__(self) -> str:
        state = ("allocated", "freed", "cached", "null")[self.state]
        return f"<Block va={self.va:#x} size={self.size} {state}>"


class _FreeList:
    """A pool's free blocks of one stream, sorted by (size, va) for a best-fit ``bisect``.

    A key packs the pair into one int, ``size << 64 | va``: ints compare in C, and a key is
    unique since an address is.
    """

    __slots__ = ("pool", "stream", "keys", "blocks")

    def __init__(self, pool: _Pool, stream: StreamLike) -> None:
        self.pool = pool
        self.stream = stream
        self.keys: list[int] = []
        self.blocks: list[Block] = []

    def index(self, block: Block) -> int:
        return bisect_left(self.keys, block.size << 64 | block.va)

    def insert(self, block: Block) -> None:
        key = block.size << 64 | block.va
        i = bisect_left(self.keys, key)
        self.keys.insert(i, key)
        self.blocks.insert(i, block)

    def remove(self, block: Block) -> None:
        i = self.index(block)
        del self.keys[i]
        del self.blocks[i]

    def replace(self, i: int, block: Block) -> None:
        """Put ``block`` in the place of entry ``i``.

        A split or a merge swaps one free block for another of nearly the same key, which
        usually belongs in the same place: then it takes it, and nothing moves.
        """
        keys = self.keys
        key = block.size << 64 | block.va
        if (i == 0 or keys[i - 1] < key) and (i + 1 == len(keys) or key < keys[i + 1]):
            keys[i] = key
            self.blocks[i] = block
        else:
            del keys[i]
            del self.blocks[i]
            self.insert(block)


class _Pool:
    """The small or the large pool: its free blocks by stream, and its statistics.

    The statistics are torch's, kept in the form that costs the hot path fewest updates:
    ``active`` is ``allocation`` plus the freed blocks still waiting for events
    (``pending``); ``<stat>_added`` is torch's ``allocated`` metric (the total increase), and
    torch's ``freed`` is ``added - (current - base)``, ``base`` being the current value when
    the totals were last zeroed.
    """

    __slots__ = ("free_lists", "min_split",
                 "allocation", "allocated_bytes", "requested_bytes", "inactive_split",
                 "inactive_split_bytes", "segment", "reserved_bytes", "pending", "pending_bytes",
                 "allocation_added", "allocated_bytes_added", "requested_bytes_added",
                 "inactive_split_added", "inactive_split_bytes_added", "segment_added",
                 "reserved_bytes_added", "peak", "base")

    def __init__(self, min_split: int) -> None:
        self.free_lists: dict[StreamLike, _FreeList] = {}
        self.min_split = min_split       # the least remainder worth splitting off
        self.allocation = self.allocated_bytes = self.requested_bytes = 0
        self.inactive_split = self.inactive_split_bytes = 0
        self.segment = self.reserved_bytes = self.pending = self.pending_bytes = 0
        self.peak = [0] * len(STAT_NAMES)
        self.reset_added()

    def free_list(self, stream: StreamLike) -> _FreeList:
        """The stream's free list; it stays, as blocks handed out point to it."""
        free = self.free_lists.get(stream)
        if free is None:
            free = self.free_lists[stream] = _FreeList(self, stream)
        return free

    def current(self) -> list[int]:
        """Torch's ``current`` of each statistic, in ``STAT_NAMES`` order."""
        return [self.allocation, self.segment, self.allocation + self.pending,
                self.inactive_split, self.allocated_bytes, self.reserved_bytes,
                self.allocated_bytes + self.pending_bytes, self.inactive_split_bytes,
                self.requested_bytes]

    def added(self) -> list[int]:
        """Torch's ``allocated`` (total increase since the last reset) of each statistic."""
        return [self.allocation_added, self.segment_added, self.allocation_added,
                self.inactive_split_added, self.allocated_bytes_added, self.reserved_bytes_added,
                self.allocated_bytes_added, self.inactive_split_bytes_added,
                self.requested_bytes_added]

    def reset_added(self) -> None:
        self.allocation_added = self.allocated_bytes_added = self.requested_bytes_added = 0
        self.inactive_split_added = self.inactive_split_bytes_added = 0
        self.segment_added = self.reserved_bytes_added = 0
        self.base = self.current()       # the current values when the totals were zeroed

    def change_inactive_split(self, blocks: int, size: int) -> None:
        """Add to the free split blocks' count and bytes (either may be negative)."""
        self.inactive_split += blocks
        self.inactive_split_bytes += size
        if blocks > 0:
            self.inactive_split_added += blocks
        if size > 0:
            self.inactive_split_bytes_added += size


class CachingAllocator:
    """The caching allocator of one device in this process, on top of its raw backend."""

    def __init__(self, backend: RawBackend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._freed: deque[Block] = deque()          # freed, not yet back in a pool
        self._small = _Pool(MIN_BLOCK_SIZE)
        self._large = _Pool(SMALL_SIZE + 1)
        self._peak = [0] * len(STAT_NAMES)           # peaks of the sums over both pools
        self._segments: dict[int, Segment] = {}      # by va of the segment's first byte
        self._heads: dict[int, Block] = {}           # each segment's first block, by its va
        #: the most this process may hold of the device (``set_memory_fraction``), or None
        self._limit: int | None = None
        self._events: dict[StreamLike, deque[tuple[EventLike, Block]]] = {}
        self._pending = 0                            # blocks waiting for events
        self._spare: Block | None = None             # one a merge let go, for a split to reuse
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        #: set by :meth:`close`: why the context under the backend, and its memory, are gone
        #: (None while they are not)
        self.closed: Exception | None = None

    @property
    def device(self) -> int:
        return self._backend.device

    def close(self, cause: Exception | None = None) -> None:
        """The context this allocator's memory belongs to is gone -- lost (``cause``, a
        DeviceLostError) or dropped to rebuild the device: the driver has freed every
        segment, so nothing is given back from here; blocks still held are forgotten when
        freed, and any further ``malloc`` is refused.

        Takes no lock: the loss is noticed inside a driver call, which may be this
        allocator's own (``malloc`` holds its lock around MEM_ALLOC); one store publishes
        it, and the pools are left as they are: nothing reads them again."""
        self.closed = cause or InvalidValueError(
            f"the allocator of device {self.device} is closed (the device was dropped to be "
            "rebuilt)")

    # -- the public operations ---------------------------------------------------------------

    def malloc(self, size: int, stream: StreamLike) -> Block:
        """A block of at least ``size`` bytes for use on ``stream``."""
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("alloc", {"bytes": size, "device": self.device}, self.malloc, size, stream)
        if size <= 0:
            if size == 0:
                return Block(0, 0, stream, None, None, None, _NULL)
            raise InvalidValueError(f"cannot allocate {size} bytes")
        if self.closed is not None:
            raise copy.copy(self.closed).with_traceback(None)
        rounded = (size + MIN_BLOCK_SIZE - 1) & -MIN_BLOCK_SIZE
        pool = self._small if rounded <= SMALL_SIZE else self._large
        lock = self._lock
        lock.acquire()
        try:
            if self._freed:
                if len(self._freed) == 1 and not self._events:
                    block = self._reuse_freed(rounded, size, stream)
                    if block is not None:
                        return block
                self._put_back_freed()
            if self._events:
                self._process_events()
            free = pool.free_lists.get(stream)
            if free is None:
                free = pool.free_list(stream)
            i = bisect_left(free.keys, rounded << 64)
            if i < len(free.keys):
                block = free.blocks[i]
            else:
                block = self._new_segment(free, rounded)
                i = -1
            self._hand_out(block, free, i, rounded, size)
        finally:
            lock.release()
        return block

    def free(self, block: Block) -> None:
        """Give a block back; its stream may reuse it at once (see ``record_stream``)."""
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("free", {"bytes": block.size, "device": self.device}, self.free, block)
        if block.state != _ALLOCATED:
            if block.state == _NULL:
                return
            raise InvalidValueError(f"{block!r} is not allocated (freed twice?)")
        if self.closed is not None:  # its memory went with the context
            block.state = _FREED
            return
        if block.stream_uses:
            block.events = [(s, s.record_event()) for s in block.stream_uses]
            block.stream_uses = None
        block.state = _FREED
        self._freed.append(block)

    def record_stream(self, block: Block, stream: StreamLike) -> None:
        """Note that ``stream`` uses the block: once freed, it waits for that stream's work.

        Only the block's owner touches it until it is freed, so this needs no lock.
        """
        if block.state != _ALLOCATED:
            if block.state == _NULL:
                return
            raise InvalidValueError(f"{block!r} is not allocated")
        if stream == block.stream:
            return
        if block.stream_uses is None:
            block.stream_uses = set()
        block.stream_uses.add(stream)

    def empty_cache(self) -> None:
        """Return every wholly free segment to the driver; never waits for the device.

        Blocks still waiting for their events stay (torch's ``emptyCache`` synchronises on
        them first): their segments go at a later call once the events have completed.
        """
        with self._lock:
            if self._freed:
                self._put_back_freed()
            if self._events:
                self._process_events()
            self._release_free_segments()

    # -- statistics ----------------------------------------------------------------------------

    def memory_stats(self) -> OrderedDict[str, int]:
        """Torch's ``memory_stats``: ``stat.pool.metric`` keys and the counters, sorted."""
        with self._lock:
            if self._freed:
                self._put_back_freed()
            out = {**self._counters, "max_split_size": -1}   # -1: any block may be split
            per_pool = [[(c, p.peak[s], a, a - (c - p.base[s]))
                         for s, (c, a) in enumerate(zip(p.current(), p.added()))]
                        for p in (self._small, self._large)]
            summed = [(small[0] + large[0], self._peak[s], small[2] + large[2],
                       small[3] + large[3])
                      for s, (small, large) in enumerate(zip(*per_pool))]
            for pool_name, stats in zip(POOL_NAMES, [summed, *per_pool]):
                for stat_name, metrics in zip(STAT_NAMES, stats):
                    for metric_name, value in zip(METRIC_NAMES, metrics):
                        out[f"{stat_name}.{pool_name}.{metric_name}"] = value
        return OrderedDict(sorted(out.items()))

    def memory_allocated(self) -> int:
        """Bytes in blocks handed out and not freed (``allocated_bytes.all.current``)."""
        with self._lock:
            if self._freed:
                self._put_back_freed()
            return self._small.allocated_bytes + self._large.allocated_bytes

    def max_memory_allocated(self) -> int:
        return self._peak[ALLOCATED_BYTES]

    def memory_reserved(self) -> int:
        """Bytes of the segments held from the driver (``reserved_bytes.all.current``)."""
        with self._lock:
            return self._small.reserved_bytes + self._large.reserved_bytes

    def max_memory_reserved(self) -> int:
        return self._peak[RESERVED_BYTES]

    def reset_peak_memory_stats(self) -> None:
        """Make every peak the current value."""
        with self._lock:
            if self._freed:
                self._put_back_freed()
            self._small.peak = self._small.current()
            self._large.peak = self._large.current()
            self._peak = [s + l for s, l in zip(self._small.peak, self._large.peak)]

    def reset_accumulated_memory_stats(self) -> None:
        """Zero the ``allocated`` and ``freed`` metrics and the event counters."""
        with self._lock:
            if self._freed:
                self._put_back_freed()
            self._small.reset_added()
            self._large.reset_added()
            self._counters = dict.fromkeys(COUNTER_NAMES, 0)

    def set_memory_fraction(self, fraction: float) -> None:
        """Hold at most ``fraction`` of the device's memory (torch's
        ``set_per_process_memory_fraction``): a segment that would take the reserved bytes
        past it is refused as if the device were full, after freeing the cache; 1.0 is the
        whole device. Segments held already stay."""
        if not 0.0 <= fraction <= 1.0:
            raise InvalidValueError(f"memory fraction {fraction} is outside 0 to 1")
        limit = int(fraction * self._backend.mem_get_info()[1])
        with self._lock:
            self._limit = limit

    def snapshot(self) -> list[dict]:
        """Torch's ``memory_snapshot()`` segments: each held segment, lowest address first,
        with its blocks in address order and their states (``active_allocated``,
        ``active_pending_free`` for a freed block waiting for streams, ``inactive``); a
        segment's ``stream`` is the stream object it serves, for the caller to name."""
        with self._lock:
            if self._freed:
                self._put_back_freed()
            out = []
            for va in sorted(self._heads):
                head = self._heads[va]
                blocks, block = [], head
                while block is not None:
                    state = ("active_allocated" if block.state == _ALLOCATED else
                             "inactive" if block.state == _CACHED else "active_pending_free")
                    blocks.append({"address": block.va, "size": block.size, "state": state,
                                   "requested_size": block.requested_size
                                   if state != "inactive" else 0})
                    block = block.next
                active = [b for b in blocks if b["state"] != "inactive"]
                out.append({
                    "device": self.device, "address": va,
                    "total_size": self._segments[va].size, "stream": head.stream,
                    "segment_type": "small" if head.free_list.pool is self._small else "large",
                    "allocated_size": sum(b["size"] for b in active
                                          if b["state"] == "active_allocated"),
                    "active_size": sum(b["size"] for b in active),
                    "requested_size": sum(b["requested_size"] for b in active),
                    "blocks": blocks})
            return out

    # -- internals (the lock is held) ----------------------------------------------------------

    def _hand_out(self, block: Block, free: _FreeList, i: int, size: int,
                  requested: int) -> None:
        """Hand out ``block`` (entry ``i`` of ``free``, or -1 if new), split to ``size``.

        Every statistic that grows here is compared with its peak, both pools' sums included;
        ``active`` is ``allocation`` plus the pending blocks, so it can pass its peak (never
        below ``allocation``'s) only when blocks are pending or ``allocation`` passes its own.
        """
        pool = free.pool
        already_split = block.prev is not None or block.next is not None
        remaining = block.size - size
        split_grew = False
        if remaining >= pool.min_split:
            # the block a merge let go, if any: an eager loop's result is freed and
            # allocated again, which merges it with the rest of its segment and splits that
            # off again, and making a Block was ~0.5 us of the pair
            rest, self._spare = self._spare or Block.__new__(Block), None
            rest.__init__(block.va + size, remaining, block.stream, free, block, block.next,
                          _CACHED)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            if i < 0:
                free.insert(rest)
            else:
                free.replace(i, rest)
            if already_split:                # a free split block shrank
                pool.change_inactive_split(0, -size)
            else:                            # a whole free segment was split
                pool.change_inactive_split(1, remaining)
                split_grew = True
        else:
            if i >= 0:
                del free.keys[i]
                del free.blocks[i]
            if already_split:                # a free split block is used whole
                pool.change_inactive_split(-1, -block.size)
        block.state = _ALLOCATED
        block.requested_size = requested
        size = block.size
        pool.allocation += 1
        pool.allocated_bytes += size
        pool.requested_bytes += requested
        pool.allocation_added += 1
        pool.allocated_bytes_added += size
        pool.requested_bytes_added += requested
        small, large, peak, total = self._small, self._large, pool.peak, self._peak
        if (self._pending or split_grew and self._inactive_split_passed_peak(pool)
                or pool.allocation > peak[ALLOCATION]
                or pool.allocated_bytes > peak[ALLOCATED_BYTES]
                or pool.requested_bytes > peak[REQUESTED_BYTES]
                or small.allocation + large.allocation > total[ALLOCATION]
                or small.allocated_bytes + large.allocated_bytes > total[ALLOCATED_BYTES]
                or small.requested_bytes + large.requested_bytes > total[REQUESTED_BYTES]):
            self._update_peaks(pool)

    def _reuse_freed(self, size: int, requested: int, stream: StreamLike) -> Block | None:
        """The one block queued as freed, handed out again as it is, if that is exactly what
        putting it back (merged) and a best-fit ``malloc`` of ``size`` (rounded) bytes on
        ``stream`` would hand out, with the same figures; else None, for that slow path.

        An eager loop frees a result and allocates the next one of the same size: the slow
        path merges the block with the free rest of its segment, if any, and splits the same
        bytes off again (~1 us of the pair). It is the same block when: it has ``size``
        bytes and ``stream``'s free list (so the same pool), no events to wait for, no free
        block before it (the merge would move its address), a free block after it, if any,
        worth splitting off again, and no free block of the list a better fit than it merged.
        Its figures: ``allocation`` and ``allocated_bytes`` are back where they were, the
        totals count one more of each; the free split blocks' are where they were too, but
        the slow path raised them for a moment (the free, or the split of a segment merged
        whole), which their totals count, and where that would pass their peaks, the slow
        path is taken to raise them. Only without pending events (``_events`` empty): an event that
        completes would free blocks the merge and the best fit must see first.
        """
        block = self._freed[0]
        free = block.free_list
        if block.size != size or free.stream is not stream or block.events is not None:
            return None
        prev, next = block.prev, block.next
        if prev is not None and prev.state == _CACHED:
            return None
        pool = free.pool
        keys = free.keys
        i = bisect_left(keys, size << 64)
        merged = size
        if next is not None and next.state == _CACHED:
            if next.size < pool.min_split:  # the split would leave it joined to the block
                return None
            merged += next.size
            if i < len(keys) and free.blocks[i] is next:
                i += 1
            split_blocks, after = 0, next.next
        else:
            split_blocks, after = 1, next
        if i < len(keys) and keys[i] < (merged << 64 | block.va):
            return None                      # best fit is another block
        small, large, total = self._small, self._large, self._peak
        if prev is not None or after is not None:  # merged, it would be a free split block
            peak = pool.peak
            if (pool.inactive_split + split_blocks > peak[INACTIVE_SPLIT]
                    or pool.inactive_split_bytes + size > peak[INACTIVE_SPLIT_BYTES]
                    or small.inactive_split + large.inactive_split + split_blocks
                    > total[INACTIVE_SPLIT]
                    or small.inactive_split_bytes + large.inactive_split_bytes + size
                    > total[INACTIVE_SPLIT_BYTES]):
                return None
            pool.inactive_split_added += split_blocks    # the totals count what rose
            pool.inactive_split_bytes_added += size
        elif split_blocks == 0:  # merged whole, the split splits a whole segment again
            pool.inactive_split_added += 1
            pool.inactive_split_bytes_added += next.size
        self._freed.popleft()
        pool.requested_bytes += requested - block.requested_size
        block.requested_size = requested
        block.state = _ALLOCATED
        pool.allocation_added += 1
        pool.allocated_bytes_added += size
        pool.requested_bytes_added += requested
        if (pool.requested_bytes > pool.peak[REQUESTED_BYTES]
                or small.requested_bytes + large.requested_bytes > total[REQUESTED_BYTES]):
            self._update_peaks(pool)
        return block

    def _inactive_split_passed_peak(self, pool: _Pool) -> bool:
        small, large, peak, total = self._small, self._large, pool.peak, self._peak
        return (pool.inactive_split > peak[INACTIVE_SPLIT]
                or pool.inactive_split_bytes > peak[INACTIVE_SPLIT_BYTES]
                or small.inactive_split + large.inactive_split > total[INACTIVE_SPLIT]
                or small.inactive_split_bytes + large.inactive_split_bytes
                > total[INACTIVE_SPLIT_BYTES])

    def _update_peaks(self, pool: _Pool) -> None:
        """Raise the pool's peaks, and those of the sums, to their current values."""
        peak = pool.peak
        for i, value in enumerate(pool.current()):
            if value > peak[i]:
                peak[i] = value
        total = self._peak
        for i, (s, l) in enumerate(zip(self._small.current(), self._large.current())):
            if s + l > total[i]:
                total[i] = s + l

    def _put_back_freed(self) -> None:
        """Do the work of the frees queued since the last call."""
        freed = self._freed
        while freed:
            block = freed.popleft()
            pool = block.free_list.pool
            pool.allocation -= 1
            pool.allocated_bytes -= block.size
            if block.events is None:
                self._free_block(block)
            else:
                self._wait_for_events(block)

    def _free_block(self, block: Block) -> None:
        """Put a block nobody uses any more in its free list, merged with free neighbours."""
        free = block.free_list
        pool = free.pool
        pool.requested_bytes -= block.requested_size
        prev, next = block.prev, block.next
        prev_free = prev is not None and prev.state == _CACHED
        next_free = next is not None and next.state == _CACHED
        if prev_free and next_free:
            free.remove(next)                # block takes prev's place in the list
        i = free.index(prev) if prev_free else free.index(next) if next_free else -1
        split_blocks = split_bytes = 0       # net change of the pool's free split blocks
        if prev_free:
            block.va = prev.va
            block.size += prev.size
            block.prev = prev.prev
            if prev.prev is not None:
                prev.prev.next = block
            else:
                self._heads[block.va] = block
            split_blocks -= 1
            split_bytes -= prev.size
        if next_free:
            block.size += next.size
            block.next = next.next
            if next.next is not None:
                next.next.prev = block
            split_blocks -= 1
            split_bytes -= next.size
        if block.prev is not None or block.next is not None:
            split_blocks += 1
            split_bytes += block.size
        if next_free or prev_free:  # nothing refers to it any more: the next split's
            self._spare = next if next_free else prev
        block.state = _CACHED
        if i < 0:
            free.insert(block)
        else:
            free.replace(i, block)
        if split_blocks or split_bytes:
            pool.change_inactive_split(split_blocks, split_bytes)
            if (split_blocks > 0 or split_bytes > 0) and self._inactive_split_passed_peak(pool):
                self._update_peaks(pool)

    def _wait_for_events(self, block: Block) -> None:
        """Keep a freed block out of its pool until the events its free recorded complete."""
        events, block.events = block.events, None
        block.event_count = len(events)
        block.free_list.pool.pending += 1
        block.free_list.pool.pending_bytes += block.size
        self._pending += 1
        for stream, event in events:
            self._events.setdefault(stream, deque()).append((event, block))

    def _event_done(self, block: Block) -> None:
        block.event_count -= 1
        if block.event_count == 0:
            block.free_list.pool.pending -= 1
            block.free_list.pool.pending_bytes -= block.size
            self._pending -= 1
            self._free_block(block)

    def _process_events(self) -> None:
        """Free the blocks whose events have all completed, without waiting.

        A stream's events complete in order, so its queue is read up to the first one still
        pending.
        """
        for stream in list(self._events):
            queue = self._events[stream]
            while queue:
                event, block = queue[0]
                if not event.query():
                    break
                queue.popleft()
                self._event_done(block)
            if not queue:
                del self._events[stream]

    def _synchronize_and_free_events(self) -> None:
        """Wait for every pending event and free the blocks that waited on them."""
        self._counters["num_sync_all_streams"] += 1
        while self._events:
            stream, queue = next(iter(self._events.items()))
            while queue:
                event, block = queue[0]
                event.synchronize()
                queue.popleft()
                self._event_done(block)
            del self._events[stream]

    def _new_segment(self, free: _FreeList, size: int) -> Block:
        """A new segment for a request of ``size`` (rounded) bytes, as one free block.

        If the driver is out of memory, wait for the pending events, return all cached
        segments and retry once.
        """
        if size <= SMALL_SIZE:
            alloc_size = SMALL_BUFFER
        elif size < MIN_LARGE_ALLOC:
            alloc_size = LARGE_BUFFER
        else:
            alloc_size = -(-size // ROUND_LARGE) * ROUND_LARGE
        try:
            segment = self._raw_alloc(alloc_size)
        except OutOfMemoryError:
            self._synchronize_and_free_events()
            self._release_free_segments()
            self._counters["num_alloc_retries"] += 1
            try:
                segment = self._raw_alloc(alloc_size)
            except OutOfMemoryError as exc:
                self._counters["num_ooms"] += 1
                raise OutOfMemoryError(self._oom_message(size), exc.errno) from None
        self._segments[segment.va] = segment
        self._counters["num_device_alloc"] += 1
        pool = free.pool
        pool.segment += 1
        pool.reserved_bytes += segment.size
        pool.segment_added += 1
        pool.reserved_bytes_added += segment.size
        self._update_peaks(pool)
        head = self._heads[segment.va] = Block(segment.va, segment.size, free.stream, free,
                                                None, None, _FREED)
        return head

    def _raw_alloc(self, size: int) -> Segment:
        """The driver's segment, unless it would take this process past its limit: torch's
        ``set_per_process_memory_fraction`` refuses there as the device would when full, so
        the caller frees the cache and retries the same way."""
        if self._limit is not None:
            reserved = self._small.reserved_bytes + self._large.reserved_bytes
            if reserved + size > self._limit:
                raise OutOfMemoryError(
                    f"{format_size(size)} more would pass this process's limit", errno.ENOMEM)
        return self._backend.raw_alloc(size)

    def _release_free_segments(self) -> None:
        """Give back every segment that is one free block (not split, not waiting)."""
        for pool in (self._small, self._large):
            for free in pool.free_lists.values():
                for block in [b for b in free.blocks if b.prev is None and b.next is None]:
                    self._backend.raw_free(self._segments[block.va])
                    del self._segments[block.va]
                    del self._heads[block.va]
                    free.remove(block)
                    self._counters["num_device_free"] += 1
                    pool.segment -= 1
                    pool.reserved_bytes -= block.size

    def _oom_message(self, requested: int) -> str:
        """Torch names the segment size it asked for; this names the (512-rounded) request,
        which is what the caller can act on."""
        free, total = self._backend.mem_get_info()
        allocated = self._small.allocated_bytes + self._large.allocated_bytes
        reserved = self._small.reserved_bytes + self._large.reserved_bytes
        return (f"accel out of memory. Tried to allocate {format_size(requested)}. "
                f"Device {self.device} has a total capacity of {format_size(total)} of which "
                f"{format_size(free)} is free. Of the allocated memory "
                f"{format_size(allocated)} is allocated by the runtime, and "
                f"{format_size(reserved - allocated)} is reserved by the runtime but "
                f"unallocated." + ("" if self._limit is None else
                                   f" This process may hold {format_size(self._limit)} "
                                   f"(set_per_process_memory_fraction)."))


def format_size(size: int) -> str:
    """A byte count as torch's ``format_size`` prints it (``20.00 MiB``, ``512 bytes``)."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"
