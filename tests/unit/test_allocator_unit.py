"""Unit tests of the caching allocator's logic (runtime/allocator.py), without a device.

The backend is an in-memory first-fit VA range with a capacity that counts its calls; streams
and events are fakes whose completion each test decides. What is checked is torch's
contract: rounding and pools, best fit, split and merge, per-stream reuse, record_stream,
empty_cache, the out-of-memory path and message, and memory_stats.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.allocator import (
    LARGE_BUFFER,
    METRIC_NAMES,
    POOL_NAMES,
    SMALL_BUFFER,
    STAT_NAMES,
    Block,
    CachingAllocator,
    format_size,
)
from runtime.errors import InvalidValueError, OutOfMemoryError

KiB = 1 << 10
MiB = 1 << 20
BASE_VA = 0x7F00_0000_0000


@dataclass(eq=False)
class FakeSegment:
    va: int
    size: int


class FakeBackend:
    """A device of ``capacity`` bytes: first fit over one VA range; ``foreign`` bytes of it
    are held by other processes (counted as used, not mapped anywhere)."""

    device = 0

    def __init__(self, capacity: int = 256 * MiB, foreign: int = 0) -> None:
        self.capacity = capacity
        self.foreign = foreign
        self.live: dict[int, FakeSegment] = {}
        self.allocs = self.frees = self.failures = 0

    def used(self) -> int:
        return self.foreign + sum(s.size for s in self.live.values())

    def raw_alloc(self, size: int) -> FakeSegment:
        if self.used() + size <= self.capacity:
            va = BASE_VA
            for seg in sorted(self.live.values(), key=lambda s: s.va):
                if seg.va - va >= size:
                    break
                va = seg.va + seg.size
            if va + size <= BASE_VA + self.capacity - self.foreign:
                self.allocs += 1
                seg = self.live[va] = FakeSegment(va, size)
                return seg
        self.failures += 1
        raise OutOfMemoryError("out of device memory [ENOMEM]", 12)

    def raw_free(self, segment: FakeSegment) -> None:
        assert self.live.pop(segment.va) is segment
        self.frees += 1

    def mem_get_info(self) -> tuple[int, int]:
        return self.capacity - self.used(), self.capacity


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.syncs = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.events: list[FakeEvent] = []

    def record_event(self) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]

    def finish(self) -> None:
        """The device catches up with everything queued on the stream."""
        for event in self.events:
            event.done = True

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def alloc(backend: FakeBackend) -> CachingAllocator:
    return CachingAllocator(backend)


s1, s2, s3 = FakeStream("s1"), FakeStream("s2"), FakeStream("s3")


def stat(alloc: CachingAllocator, key: str) -> int:
    return alloc.memory_stats()[key]


# -- rounding and pools ------------------------------------------------------------------------

@pytest.mark.parametrize("request_size, block_size, pool, segment", [
    (1, 512, "small_pool", SMALL_BUFFER),
    (512, 512, "small_pool", SMALL_BUFFER),
    (513, 1024, "small_pool", SMALL_BUFFER),
    (1 * MiB, 1 * MiB, "small_pool", SMALL_BUFFER),
    (1 * MiB + 1, 1 * MiB + 512, "large_pool", LARGE_BUFFER),
    (10 * MiB - 512, 10 * MiB - 512, "large_pool", LARGE_BUFFER),
    (10 * MiB, 10 * MiB, "large_pool", 10 * MiB),
    (11 * MiB + 1, 12 * MiB, "large_pool", 12 * MiB),      # a rest of < 1 MiB stays on
    (12 * MiB, 12 * MiB, "large_pool", 12 * MiB),
    (40 * MiB, 40 * MiB, "large_pool", 40 * MiB),
])
def test_rounding_and_pool(alloc: CachingAllocator, backend: FakeBackend, request_size: int,
                           block_size: int, pool: str, segment: int) -> None:
    block = alloc.malloc(request_size, s1)
    assert (block.size, block.requested_size, block.stream) == (block_size, request_size, s1)
    assert [s.size for s in backend.live.values()] == [segment]
    assert block.va == BASE_VA
    stats = alloc.memory_stats()
    other = "large_pool" if pool == "small_pool" else "small_pool"
    assert stats[f"allocation.{pool}.current"] == 1
    assert stats[f"allocation.{other}.current"] == 0
    assert stats[f"allocated_bytes.{pool}.current"] == block_size
    assert stats[f"requested_bytes.{pool}.current"] == request_size
    assert stats[f"reserved_bytes.{pool}.current"] == segment


def test_zero_bytes_get_a_null_block(alloc: CachingAllocator, backend: FakeBackend) -> None:
    block = alloc.malloc(0, s1)
    assert (block.va, block.size, block.requested_size) == (0, 0, 0)
    alloc.record_stream(block, s2)
    alloc.free(block)
    alloc.free(block)
    assert backend.allocs == 0 and stat(alloc, "allocation.all.allocated") == 0


def test_bad_calls_are_refused(alloc: CachingAllocator) -> None:
    with pytest.raises(InvalidValueError):
        alloc.malloc(-1, s1)
    block = alloc.malloc(100, s1)
    alloc.free(block)
    with pytest.raises(InvalidValueError, match="freed twice"):
        alloc.free(block)
    with pytest.raises(InvalidValueError):
        alloc.record_stream(block, s2)


# -- best fit, split and merge -----------------------------------------------------------------

@pytest.mark.parametrize("order", list(itertools.permutations("ABC")))
def test_split_then_merge_in_any_order(alloc: CachingAllocator, backend: FakeBackend,
                                       order: tuple[str, ...]) -> None:
    blocks = {name: alloc.malloc(4 * KiB, s1) for name in "ABC"}
    assert [b.va for b in blocks.values()] == [BASE_VA, BASE_VA + 4 * KiB, BASE_VA + 8 * KiB]
    assert backend.allocs == 1
    assert stat(alloc, "inactive_split.small_pool.current") == 1     # the segment's rest
    for name in order:
        alloc.free(blocks[name])
    stats = alloc.memory_stats()
    assert stats["inactive_split.all.current"] == 0                  # one whole free block
    assert stats["inactive_split_bytes.all.current"] == 0
    assert stats["reserved_bytes.all.current"] == SMALL_BUFFER
    assert stats["segment.all.current"] == 1
    alloc.empty_cache()                                               # only a whole one goes
    assert backend.frees == 1 and backend.live == {}
    assert alloc.memory_reserved() == 0


def test_a_hole_is_reused_by_best_fit(alloc: CachingAllocator) -> None:
    a, b, c = (alloc.malloc(4 * KiB, s1) for _ in range(3))
    alloc.free(b)
    stats = alloc.memory_stats()
    assert stats["inactive_split.small_pool.current"] == 2            # the hole and the rest
    assert stats["inactive_split_bytes.small_pool.current"] == SMALL_BUFFER - 8 * KiB
    d = alloc.malloc(3 * KiB, s1)                                     # fits the hole
    assert d.va == b.va and d.size == 3 * KiB
    e = alloc.malloc(1 * KiB, s1)                                     # the hole's last KiB
    assert e.va == b.va + 3 * KiB
    assert stat(alloc, "inactive_split.small_pool.current") == 1


def test_large_pool_keeps_remainders_only_above_1_mib(alloc: CachingAllocator) -> None:
    a = alloc.malloc(19 * MiB, s1)           # 20 MiB segment, 1 MiB rest: not split off
    assert (a.size, a.requested_size) == (20 * MiB, 19 * MiB)
    assert stat(alloc, "allocated_bytes.large_pool.current") == 20 * MiB
    assert stat(alloc, "inactive_split.large_pool.current") == 0
    alloc.free(a)
    b = alloc.malloc(2 * MiB, s1)            # 18 MiB rest: split
    assert stat(alloc, "inactive_split.large_pool.current") == 1
    assert b.va == a.va


def test_small_pool_splits_off_512_bytes(alloc: CachingAllocator) -> None:
    blocks = [alloc.malloc(1 * MiB, s1), alloc.malloc(1 * MiB - 512, s1)]
    assert stat(alloc, "inactive_split_bytes.small_pool.current") == 512
    last = alloc.malloc(512, s1)
    assert last.va == blocks[1].va + blocks[1].size
    assert stat(alloc, "inactive_split.small_pool.current") == 0


# -- streams -----------------------------------------------------------------------------------

def test_an_eager_results_cycle_keeps_torchs_figures(alloc: CachingAllocator,
                                                     backend: FakeBackend) -> None:
    """An eager loop's result: freed, it merges with the rest of its segment; allocated
    again, that rest is split off again (from the Block object the merge let go, reused).
    Address, layout and every figure are torch's, cycle after cycle, and a free that
    merges both ways (prev and next) hands out a consistent layout too."""
    a, b = alloc.malloc(4 * KiB, s1), alloc.malloc(4 * KiB, s1)
    rest_size = SMALL_BUFFER - 12 * KiB
    c = alloc.malloc(4 * KiB, s1)
    va = c.va
    alloc.reset_peak_memory_stats()
    for _ in range(5):
        alloc.free(c)
        c = alloc.malloc(3 * KiB, s1)        # rounds to 3 KiB: the rest moves by 1 KiB
        assert c.va == va
        alloc.free(c)
        c = alloc.malloc(4 * KiB, s1)
        assert c.va == va
    stats = alloc.memory_stats()
    assert stats["allocation.all.allocated"] == 3 + 10 and stats["allocation.all.freed"] == 10
    assert stats["allocated_bytes.all.current"] == 12 * KiB
    assert stats["inactive_split.all.current"] == 1
    assert stats["inactive_split_bytes.all.current"] == rest_size
    assert stats["inactive_split_bytes.all.peak"] == rest_size + 4 * KiB   # merged, between
    assert stats["segment.all.current"] == 1 and backend.allocs == 1
    [segment] = alloc.snapshot()
    assert [(blk["address"] - BASE_VA, blk["size"], blk["state"]) for blk in segment["blocks"]] \
        == [(0, 4 * KiB, "active_allocated"), (4 * KiB, 4 * KiB, "active_allocated"),
            (8 * KiB, 4 * KiB, "active_allocated"), (12 * KiB, rest_size, "inactive")]
    alloc.free(a)                            # a hole before b
    alloc.free(c)                            # c merges with the rest
    alloc.free(b)                            # b merges both ways: the segment is whole
    d = alloc.malloc(8 * KiB, s1)
    assert d.va == BASE_VA and d.prev is None and d.next is not None and d.next.prev is d
    assert (d.next.va, d.next.size, d.next.next) == (BASE_VA + 8 * KiB, SMALL_BUFFER - 8 * KiB,
                                                      None)
    [segment] = alloc.snapshot()
    assert [(blk["size"], blk["state"]) for blk in segment["blocks"]] == [
        (8 * KiB, "active_allocated"), (SMALL_BUFFER - 8 * KiB, "inactive")]
    assert stat(alloc, "inactive_split.all.current") == 1


@pytest.mark.parametrize("size", [4 * KiB, 5 * MiB, 30 * MiB])
def test_same_stream_reuses_at_once(alloc: CachingAllocator, backend: FakeBackend,
                                    size: int) -> None:
    a = alloc.malloc(size, s1)
    va = a.va
    alloc.free(a)
    b = alloc.malloc(size, s1)
    assert b.va == va and backend.allocs == 1


def test_other_stream_does_not_reuse(alloc: CachingAllocator, backend: FakeBackend) -> None:
    a = alloc.malloc(4 * KiB, s1)
    alloc.free(a)
    b = alloc.malloc(4 * KiB, s2)
    assert b.va != a.va and backend.allocs == 2
    assert b.stream is s2


def test_record_stream_delays_reuse_until_the_event(alloc: CachingAllocator) -> None:
    own, a_stream, b_stream = FakeStream("own"), FakeStream("a"), FakeStream("b")
    a = alloc.malloc(4 * KiB, own)
    va = a.va
    alloc.record_stream(a, own)                  # its own stream: nothing to wait for
    alloc.record_stream(a, a_stream)
    alloc.record_stream(a, b_stream)
    alloc.free(a)
    assert len(a_stream.events) == len(b_stream.events) == 1 and own.events == []
    stats = alloc.memory_stats()
    assert stats["allocation.all.current"] == 0
    assert stats["active.all.current"] == 1 and stats["active_bytes.all.current"] == 4 * KiB
    assert stats["requested_bytes.all.current"] == 4 * KiB

    b = alloc.malloc(4 * KiB, own)                # a is still in use on the other streams
    assert b.va != va
    a_stream.finish()
    c = alloc.malloc(4 * KiB, own)                # one of two done: still waiting
    assert c.va not in (va, b.va)
    b_stream.finish()
    d = alloc.malloc(4 * KiB, own)                # both done: back in the pool, best fit
    assert d.va == va
    assert stat(alloc, "active.all.current") == 3
    assert a_stream.events[0].syncs == 0         # found by query, never waited for


def test_a_freed_block_waiting_for_events_is_not_reused_at_once(alloc: CachingAllocator) -> None:
    """The fast path that hands the one just-freed block out again (``_reuse_freed``) must
    not skip record_stream: the other stream's event must complete first."""
    own, other = FakeStream("own"), FakeStream("other")
    a = alloc.malloc(4 * KiB, own)
    va = a.va
    alloc.record_stream(a, other)
    alloc.free(a)                                 # nothing between the free and the malloc
    b = alloc.malloc(4 * KiB, own)
    assert b.va != va and len(other.events) == 1
    other.finish()
    assert alloc.malloc(4 * KiB, own).va == va
    assert other.events[0].syncs == 0


class CountingAllocator(CachingAllocator):
    """Counts the mallocs the fast path served (to prove the comparison below covers it)."""

    reused = 0

    def _reuse_freed(self, size: int, requested: int, stream: FakeStream) -> Block | None:
        block = super()._reuse_freed(size, requested, stream)
        self.reused += block is not None
        return block


def _replay(seed: int, settle: bool) -> tuple[CountingAllocator, list[int]]:
    """A random sequence weighted like eager code (results of a few sizes freed and made
    again, two streams, some record_stream, peaks reset now and then); ``settle`` reads the
    statistics after every free, which puts the freed block back at once and so never lets
    ``malloc`` take the fast path. Returns the allocator and every address handed out."""
    import random
    rng = random.Random(seed)
    streams = [FakeStream("x"), FakeStream("y")]
    alloc = CountingAllocator(FakeBackend(capacity=64 * MiB))
    live: list[Block] = []
    vas = []
    last: tuple[int, FakeStream] | None = None   # the last free's size and stream
    for _ in range(600):
        r = rng.random()
        if r < 0.45 or not live:
            if last is not None and rng.random() < 0.5:
                size, stream = last              # the next result like the one freed
            else:
                size = rng.choice([4 * KiB, 16 * KiB, 3 * KiB + 1, 512, 1 * MiB,
                                   2 * MiB, 5 * MiB, 19 * MiB + 1])
                stream = rng.choice(streams)
            try:
                live.append(alloc.malloc(size, stream))
            except OutOfMemoryError:
                continue
            vas.append(live[-1].va)
        elif r < 0.85:
            block = live.pop(-rng.choice([1, 2, 2, 3]) if len(live) >= 3 else 0)
            last = block.requested_size, block.stream
            alloc.free(block)
            if settle:
                alloc.memory_stats()
        elif r < 0.9:
            alloc.record_stream(rng.choice(live), rng.choice(streams))
        elif r < 0.95:
            rng.choice(streams).finish()
        elif r < 0.97:
            alloc.reset_peak_memory_stats()
        else:
            alloc.empty_cache()
    return alloc, vas


@pytest.mark.parametrize("bump_large", [False, True])
def test_a_peak_the_free_would_raise_takes_the_slow_path(backend: FakeBackend,
                                                         bump_large: bool) -> None:
    """Freeing a result merges it with the rest of its segment, which raises the free split
    bytes for a moment; at their peak the fast path must leave the malloc to the slow path,
    which raises the peak as torch's does (the pool's alone, when the sum over both pools
    had a higher peak from the large pool), and take over from the next cycle on."""
    alloc = CountingAllocator(backend)
    a, b, c = (alloc.malloc(4 * KiB, s1) for _ in range(3))
    rest = SMALL_BUFFER - 12 * KiB
    alloc.reset_peak_memory_stats()
    alloc.reset_accumulated_memory_stats()
    if bump_large:                           # the sum's peak: 15 MiB of free large split
        alloc.free(alloc.malloc(5 * MiB, s1))
        alloc.memory_stats()                 # puts it back: the next free is the one queued
    va = c.va
    for _ in range(4):
        alloc.free(c)
        c = alloc.malloc(4 * KiB, s1)
        assert c.va == va
    assert alloc.reused == 3                 # all but the first cycle
    stats = alloc.memory_stats()
    assert stats["inactive_split_bytes.small_pool.peak"] == rest + 4 * KiB
    assert stats["inactive_split_bytes.all.peak"] == (
        rest + 15 * MiB if bump_large else rest + 4 * KiB)
    assert stats["inactive_split_bytes.small_pool.allocated"] == 4 * 4 * KiB
    assert stats["allocation.small_pool.allocated"] == 4
    assert stats["allocation.small_pool.current"] == 3


@pytest.mark.parametrize("seed", range(12))
def test_reusing_the_freed_block_at_once_is_the_slow_paths_result(seed: int) -> None:
    """The fast path is taken only where it hands out what the slow path (the block put
    back, merged, then best fit and split) would: the same addresses, the same statistics
    (peaks included), the same segments and blocks."""
    fast, fast_vas = _replay(seed, settle=False)
    slow, slow_vas = _replay(seed, settle=True)
    assert fast.reused > 0 and slow.reused == 0
    assert fast_vas == slow_vas
    assert fast.memory_stats() == slow.memory_stats()

    def layout(alloc: CachingAllocator) -> list[tuple]:
        return [(g["address"], g["stream"].name, [tuple(b.values()) for b in g["blocks"]])
                for g in alloc.snapshot()]
    assert layout(fast) == layout(slow)


# -- empty_cache -------------------------------------------------------------------------------

def test_empty_cache_releases_only_wholly_free_segments(alloc: CachingAllocator,
                                                        backend: FakeBackend) -> None:
    side = FakeStream("side")
    free_one = alloc.malloc(4 * KiB, s1)
    live = alloc.malloc(4 * KiB, s2)
    pending = alloc.malloc(4 * KiB, s3)
    alloc.record_stream(pending, side)
    alloc.free(free_one)
    alloc.free(pending)
    assert len(backend.live) == 3

    alloc.empty_cache()
    assert backend.frees == 1 and len(backend.live) == 2
    assert side.events[0].syncs == 0             # empty_cache does not wait for the device
    assert alloc.memory_reserved() == 2 * SMALL_BUFFER
    assert live.va in backend.live

    side.finish()
    alloc.empty_cache()
    assert backend.frees == 2 and list(backend.live) == [live.va]
    alloc.free(live)
    alloc.empty_cache()
    assert backend.live == {} and alloc.memory_reserved() == 0
    assert stat(alloc, "num_device_free") == 3


def test_empty_cache_keeps_split_segments(alloc: CachingAllocator,
                                          backend: FakeBackend) -> None:
    a, b = alloc.malloc(4 * KiB, s1), alloc.malloc(4 * KiB, s1)
    alloc.free(a)
    alloc.empty_cache()
    assert backend.frees == 0
    alloc.free(b)
    alloc.empty_cache()
    assert backend.frees == 1


# -- out of memory -----------------------------------------------------------------------------

def test_oom_frees_the_cache_and_retries(alloc: CachingAllocator, backend: FakeBackend) -> None:
    backend.capacity = 50 * MiB
    side = FakeStream("side")
    cached = alloc.malloc(20 * MiB, s1)
    pending = alloc.malloc(20 * MiB, s2)
    alloc.record_stream(pending, side)
    alloc.free(cached)
    alloc.free(pending)                          # its event is not done yet
    block = alloc.malloc(30 * MiB, s3)           # fits only once both are given back
    assert block.size == 30 * MiB
    assert side.events[0].syncs == 1             # the OOM path waited for it
    stats = alloc.memory_stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_ooms"] == 0
    assert stats["num_sync_all_streams"] == 1
    assert stats["num_device_alloc"] == 3 and stats["num_device_free"] == 2
    assert stats["reserved_bytes.all.current"] == 30 * MiB
    assert stats["active.all.current"] == 1


def test_memory_fraction_refuses_segments_past_it(backend: FakeBackend) -> None:
    """A segment past the fraction is refused as when the device is full: the cache goes
    back first, then OutOfMemoryError names the limit; cached blocks are still reused."""
    alloc = CachingAllocator(backend)
    kept = alloc.malloc(30 * MiB, s1)              # a 30 MiB segment of its own
    cached = alloc.malloc(12 * MiB, s1)
    alloc.free(cached)
    alloc.set_memory_fraction(0.25)                # 64 MiB of 256
    again = alloc.malloc(12 * MiB, s1)             # the cached segment: no new one
    alloc.free(again)
    with pytest.raises(OutOfMemoryError, match="This process may hold 64.00 MiB"):
        alloc.malloc(40 * MiB, s1)                 # 30 + 40 > 64, even with the cache freed
    assert alloc.memory_reserved() == 30 * MiB     # the cache was given back first
    assert stat(alloc, "num_ooms") == 1 and stat(alloc, "num_alloc_retries") == 1
    alloc.set_memory_fraction(1.0)
    alloc.free(alloc.malloc(40 * MiB, s1))
    alloc.free(kept)
    with pytest.raises(InvalidValueError):
        alloc.set_memory_fraction(1.5)


def test_oom_message_and_counts() -> None:
    backend = FakeBackend(capacity=256 * MiB, foreign=13 * MiB)
    alloc = CachingAllocator(backend)
    kept = [alloc.malloc(20 * MiB, s1) for _ in range(8)]                # 160 MiB, whole
    for i in range(4):                           # 4 segments of 20 MiB, 10 MiB used in each
        stream = FakeStream(f"half{i}")
        kept += [alloc.malloc(5 * MiB, stream), alloc.malloc(5 * MiB, stream)]
    assert alloc.memory_allocated() == 200 * MiB and alloc.memory_reserved() == 240 * MiB
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(3 * MiB, FakeStream("new"))
    assert str(info.value) == (  # the request, not the 20 MiB segment it needed
        "accel out of memory. Tried to allocate 3.00 MiB. Device 0 has a total capacity of "
        "256.00 MiB of which 3.00 MiB is free. Of the allocated memory 200.00 MiB is "
        "allocated by the runtime, and 40.00 MiB is reserved by the runtime but unallocated.")
    assert info.value.errno == 12
    assert isinstance(info.value, MemoryError)
    stats = alloc.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1
    assert backend.failures == 2
    assert alloc.memory_reserved() == 240 * MiB  # nothing was whole, so nothing was released
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(3 * MiB, FakeStream("new"))
    assert stat(alloc, "num_ooms") == 2 and stat(alloc, "num_alloc_retries") == 2


@pytest.mark.parametrize("size, text", [
    (0, "0 bytes"), (512, "512 bytes"), (1024, "1024 bytes"), (1536, "1.50 KiB"),
    (MiB, "1024.00 KiB"), (3 * MiB, "3.00 MiB"), (1 << 30, "1024.00 MiB"),
    (5 << 29, "2.50 GiB"),
])
def test_format_size_as_torch(size: int, text: str) -> None:
    assert format_size(size) == text


# -- statistics --------------------------------------------------------------------------------

def test_memory_stats_keys_are_torchs(alloc: CachingAllocator) -> None:
    stats = alloc.memory_stats()
    expected = {f"{s}.{p}.{m}" for s in STAT_NAMES for p in POOL_NAMES for m in METRIC_NAMES}
    expected |= {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free", "max_split_size"}
    assert set(stats) == expected
    assert list(stats) == sorted(stats)
    assert stats["max_split_size"] == -1
    assert all(v == 0 for k, v in stats.items() if k != "max_split_size")


def test_memory_stats_through_a_sequence(alloc: CachingAllocator) -> None:
    a = alloc.malloc(1000, s1)                   # small: 1024 bytes of a 2 MiB segment
    b = alloc.malloc(5 * MiB, s1)                # large: 5 MiB of a 20 MiB segment
    s = alloc.memory_stats()
    assert (s["allocation.all.current"], s["allocation.all.peak"]) == (2, 2)
    assert (s["allocation.small_pool.allocated"], s["allocation.large_pool.allocated"]) == (1, 1)
    assert s["allocated_bytes.all.current"] == 1024 + 5 * MiB
    assert s["requested_bytes.all.current"] == 1000 + 5 * MiB
    assert s["reserved_bytes.all.current"] == SMALL_BUFFER + LARGE_BUFFER
    assert (s["segment.small_pool.current"], s["segment.large_pool.current"]) == (1, 1)
    assert s["inactive_split.all.current"] == 2
    assert s["inactive_split_bytes.all.current"] == SMALL_BUFFER - 1024 + 15 * MiB
    assert s["active_bytes.all.current"] == s["allocated_bytes.all.current"]
    assert s["num_device_alloc"] == 2

    alloc.free(b)
    s = alloc.memory_stats()
    assert (s["allocation.all.current"], s["allocation.all.peak"]) == (1, 2)
    assert (s["allocation.all.allocated"], s["allocation.all.freed"]) == (2, 1)
    assert s["allocated_bytes.large_pool.freed"] == 5 * MiB
    assert s["requested_bytes.large_pool.freed"] == 5 * MiB
    assert s["inactive_split.large_pool.current"] == 0            # merged back whole
    assert s["inactive_split.large_pool.freed"] == 1
    assert s["allocated_bytes.all.peak"] == 1024 + 5 * MiB
    assert alloc.memory_allocated() == 1024
    assert alloc.max_memory_allocated() == 1024 + 5 * MiB
    assert alloc.memory_reserved() == alloc.max_memory_reserved() == 22 * MiB

    alloc.reset_peak_memory_stats()
    assert alloc.max_memory_allocated() == 1024
    s = alloc.memory_stats()
    assert all(s[f"{st_}.{p}.peak"] == s[f"{st_}.{p}.current"]
               for st_ in STAT_NAMES for p in POOL_NAMES)

    alloc.reset_accumulated_memory_stats()
    s = alloc.memory_stats()
    assert all(s[f"{st_}.{p}.{m}"] == 0 for st_ in STAT_NAMES for p in POOL_NAMES
               for m in ("allocated", "freed"))
    assert s["num_device_alloc"] == 0 and s["allocation.all.current"] == 1
    alloc.free(a)
    c = alloc.malloc(2000, s1)
    s = alloc.memory_stats()
    assert (s["allocation.all.allocated"], s["allocation.all.freed"]) == (1, 1)
    assert s["allocated_bytes.small_pool.allocated"] == c.size == 2048
    assert s["allocated_bytes.small_pool.freed"] == 1024
    assert s["allocated_bytes.all.peak"] == 2048
    alloc.empty_cache()
    assert stat(alloc, "num_device_free") == 1   # the large segment; the small one is in use


def run_script(alloc: CachingAllocator, script: str, streams: dict[str, FakeStream],
               blocks: dict[str, Block]) -> None:
    """Run ``name = size stream`` (sizes like ``19M+1``, ``512K``) and ``free name`` steps."""
    for step in script.split(";"):
        words = step.split()
        if words[0] == "free":
            alloc.free(blocks.pop(words[1]))
            continue
        name, _, size, stream = words
        n = sum(int(term[:-1]) * {"K": KiB, "M": MiB}[term[-1]] if term[-1] in "KM"
                else int(term) for term in size.split("+"))
        blocks[name] = alloc.malloc(n, streams.setdefault(stream, FakeStream(stream)))


# In each script the last malloc reuses a cached block and passes one peak, the one named
# (with its ``active`` twin): the others were raised before, so each comparison that decides
# whether peaks move must catch its own.
@pytest.mark.parametrize("key, value, script", [
    ("allocation.small_pool.peak", 2,
     "a = 20M s; b = 20M s; free a; free b; x = 1M s; free x; x = 512 s; y = 512 s"),
    ("allocated_bytes.small_pool.peak", 2560,
     "a = 20M s; b = 20M s; free a; free b; a = 1024 s; b = 1024 s; free a; free b;"
     "a = 1024 s; free a; a = 513 s; b = 1025 s"),
    ("requested_bytes.small_pool.peak", 2100,
     "a = 20M s; b = 20M s; free a; free b; a = 1024 s; b = 1024 s; free a; free b;"
     "a = 513 s; b = 1025 s; free a; free b; a = 1100 s; b = 1000 s"),
    ("allocation.all.peak", 3,
     "a = 512 s; b = 512 s; free a; free b; y = 20M s; z = 1M s; free y; free z;"
     "y = 19M+1 s; a = 512 s; b = 512 s"),
    ("allocated_bytes.all.peak", 20 * MiB + 512 * KiB,
     "a = 512 s; b = 5M s; free a; free b; x = 1M s; free x; y = 20M s; free y;"
     "x = 512K s; y = 19M+1 s"),
    ("requested_bytes.all.peak", 19 * MiB + 512 * KiB,
     "a = 512 s; b = 5M s; free a; free b; x = 1M s; free x; y = 19M+1 s; free y;"
     "y = 18M+512K s; x = 1M s"),
    ("inactive_split.large_pool.peak", 2,
     "x = 512 s; x2 = 512 t; free x; free x2; big = 40M s; free big; t = 2M s; free t;"
     "big = 40M s; u = 19M+1 s; v = 19M+1 s; free u; free v; free big;"
     "u = 5M s; v = 16M s"),
    ("inactive_split_bytes.large_pool.peak", 18 * MiB,
     "; ".join(f"x{i} = 512 s{i}" for i in range(10)) + "; "
     + "; ".join(f"free x{i}" for i in range(10)) + "; y = 5M s; free y; y = 2M s"),
    ("inactive_split.all.peak", 2,
     "a = 20M s; b = 20M s; free a; free b; x = 512 s; free x; y = 2M s; free y;"
     "x = 512 s; y = 5M s"),
    ("inactive_split_bytes.all.peak", 20 * MiB - 512,
     "x = 512 s; y = 18M+512K s; free x; free y; y = 2M s; free y; x = 512 s; free x;"
     "y = 2M s; x = 512 s"),
])
def test_each_peak_is_caught_on_its_own(alloc: CachingAllocator, key: str, value: int,
                                        script: str) -> None:
    setup, last = script.rsplit(";", 1)
    streams: dict[str, FakeStream] = {}
    blocks: dict[str, Block] = {}
    run_script(alloc, setup, streams, blocks)
    before = alloc.memory_stats()
    run_script(alloc, last, streams, blocks)
    after = alloc.memory_stats()
    assert after["num_device_alloc"] == before["num_device_alloc"], "the last step must reuse"
    passed = {k for k in after if k.endswith(".peak") and after[k] != before[k]}
    twin = key.replace("allocation.", "active.").replace("allocated_bytes.", "active_bytes.")
    assert passed == {key, twin} and after[key] == value


# -- robustness --------------------------------------------------------------------------------

def test_free_from_inside_an_allocator_call(backend: FakeBackend) -> None:
    """A finalizer run by the garbage collector may free an array in the middle of a malloc
    on the same thread: the free must neither deadlock nor break the state."""
    alloc = CachingAllocator(backend)
    victim = alloc.malloc(4 * KiB, s1)
    raw_alloc = backend.raw_alloc

    def raw_alloc_running_a_finalizer(size: int) -> FakeSegment:
        alloc.free(victim)
        return raw_alloc(size)

    backend.raw_alloc = raw_alloc_running_a_finalizer  # type: ignore[method-assign]
    result: list[Block] = []
    worker = threading.Thread(target=lambda: result.append(alloc.malloc(4 * KiB, s2)),
                              daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "free deadlocked inside malloc"
    assert alloc.memory_allocated() == result[0].size
    assert alloc.malloc(4 * KiB, s1).va == victim.va


def test_threads(backend: FakeBackend) -> None:
    alloc = CachingAllocator(backend)
    shared = FakeStream("shared")
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        own = FakeStream(f"t{seed}")
        held: list[Block] = []
        try:
            for i in range(1500):
                stream = own if i % 3 else shared
                held.append(alloc.malloc(512 * (1 + (i * seed) % 40), stream))
                if i % 7 == 0:
                    held.append(alloc.malloc(2 * MiB + i, stream))
                if len(held) > 6:
                    alloc.free(held.pop(i % len(held)))
                if i % 200 == 0:
                    alloc.memory_stats()
                    alloc.empty_cache()
            for block in held:
                alloc.free(block)
        except BaseException as exc:     # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert alloc.memory_allocated() == 0
    assert stat(alloc, "allocation.all.allocated") == stat(alloc, "allocation.all.freed")
    alloc.empty_cache()
    assert backend.live == {} and alloc.memory_reserved() == 0


# -- random sequences --------------------------------------------------------------------------

STREAMS = [FakeStream(f"r{i}") for i in range(3)]
SIZES = st.one_of(st.integers(1, 4 * KiB), st.integers(1, 2 * MiB),
                  st.sampled_from([512, 1 * MiB, 1 * MiB + 1, 10 * MiB - 1, 10 * MiB]),
                  st.integers(1, 24 * MiB))


class AllocatorMachine(RuleBasedStateMachine):
    """Random malloc / free / record_stream / event completion / empty_cache sequences on a
    small device, checking after every step what must always hold."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = FakeBackend(capacity=64 * MiB)
        self.alloc = CachingAllocator(self.backend)
        self.live: list[Block] = []
        self.peaks = {"allocated_bytes": 0, "reserved_bytes": 0, "allocation": 0}
        self.base = dict.fromkeys(itertools.product(STAT_NAMES, POOL_NAMES), 0)

    @rule(size=SIZES, stream=st.sampled_from(STREAMS))
    def malloc(self, size: int, stream: FakeStream) -> None:
        try:
            block = self.alloc.malloc(size, stream)
        except OutOfMemoryError:
            return
        assert block.size >= size and block.size % 512 == 0 and block.stream is stream
        self.live.append(block)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        block = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.alloc.free(block)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=st.sampled_from(STREAMS))
    def record_stream(self, data: st.DataObject, stream: FakeStream) -> None:
        block = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        self.alloc.record_stream(block, stream)

    @rule(stream=st.sampled_from(STREAMS))
    def finish(self, stream: FakeStream) -> None:
        stream.finish()

    @rule()
    def empty_cache(self) -> None:
        self.alloc.empty_cache()

    @rule()
    def reset_peaks(self) -> None:
        self.alloc.reset_peak_memory_stats()
        stats = self.alloc.memory_stats()
        self.peaks = {name: stats[f"{name}.all.current"] for name in self.peaks}

    @rule()
    def reset_accumulated(self) -> None:
        self.alloc.reset_accumulated_memory_stats()
        stats = self.alloc.memory_stats()
        self.base = {(s, p): stats[f"{s}.{p}.current"] for s, p in self.base}

    @invariant()
    def consistent(self) -> None:
        live = sorted(self.live, key=lambda b: b.va)
        for a, b in zip(live, live[1:]):
            assert a.va + a.size <= b.va, "live blocks overlap"
        segments = sorted(self.backend.live.values(), key=lambda s: s.va)
        for block in live:
            assert any(s.va <= block.va and block.va + block.size <= s.va + s.size
                       for s in segments), "a live block lies outside every segment"
        stats = self.alloc.memory_stats()
        allocated = sum(b.size for b in live)
        reserved = sum(s.size for s in segments)
        assert self.alloc.memory_allocated() == allocated == stats["allocated_bytes.all.current"]
        assert self.alloc.memory_reserved() == reserved == stats["reserved_bytes.all.current"]
        assert reserved >= allocated
        snapshot = self.alloc.snapshot()
        assert [(g["address"], g["total_size"]) for g in snapshot] == \
            [(s.va, s.size) for s in segments], "the snapshot's segments are not the held ones"
        for g in snapshot:  # its blocks tile the segment, in address order
            ends = [g["address"]] + [b["address"] + b["size"] for b in g["blocks"]]
            assert [b["address"] for b in g["blocks"]] == ends[:-1], g
            assert ends[-1] == g["address"] + g["total_size"], g
        assert sorted((b["address"], b["size"]) for g in snapshot for b in g["blocks"]
                      if b["state"] == "active_allocated") == [(b.va, b.size) for b in live]
        assert sum(g["allocated_size"] for g in snapshot) == allocated
        assert stats["allocation.all.current"] == len(live)
        assert stats["segment.all.current"] == len(segments)
        assert stats["active.all.current"] >= len(live)
        assert stats["requested_bytes.all.current"] <= stats["active_bytes.all.current"]
        for s in STAT_NAMES:
            for p in POOL_NAMES:
                cur, peak, added, freed = (stats[f"{s}.{p}.{m}"] for m in METRIC_NAMES)
                assert 0 <= cur <= peak and added - freed == cur - self.base[s, p], (s, p)
                assert added >= 0 and freed >= 0, (s, p)
            assert sum(stats[f"{s}.{p}.current"] for p in POOL_NAMES[1:]) == \
                stats[f"{s}.all.current"]
        # Within a step these move one way, or fall and then rise (the OOM path): their
        # peaks are the largest values seen between steps.
        for name, now in [("allocated_bytes", allocated), ("reserved_bytes", reserved),
                          ("allocation", len(live))]:
            self.peaks[name] = max(self.peaks[name], now)
            assert stats[f"{name}.all.peak"] == self.peaks[name], name

    def teardown(self) -> None:
        for block in self.live:
            self.alloc.free(block)
        for stream in STREAMS:
            stream.finish()
        self.alloc.empty_cache()
        assert self.backend.live == {}


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_random_sequences = AllocatorMachine.TestCase
