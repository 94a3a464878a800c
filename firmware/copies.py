"""What a copy engine does: COPY, MEMSET and PREFETCH packets.

A copy or memset up to ``INLINE_BYTES`` runs inline on the control loop (a hand-off to an
engine thread costs more than moving the bytes); a larger one is a :class:`CopyJob` that
moves ``COPY_CHUNK`` bytes per turn and gives way between chunks to higher-priority work:
the worst-case wait a high-priority packet sees on a busy copy engine. Addresses are
resolved against the packet's context before anything moves (a miss faults the packet
with the first bad address), and managed pages the copy touches migrate to the device
first. A PREFETCH migrates managed pages on an engine, in one turn.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from abi.uapi import MemKind
from abi.userq import Copy, Memset, Op, Prefetch
from firmware import memory
from firmware.engines import Job
from firmware.rings import Ring
from firmware.telemetry import Counters, Tally

if TYPE_CHECKING:
    from firmware.scheduler import Scheduler

#: Copies and memsets up to this size run inline on the scheduler; larger on an engine.
INLINE_BYTES = 256 * 1024
#: Engines move large copies in chunks of this size and check for higher-priority work
#: between chunks: the worst-case wait a high-priority packet sees on a busy copy engine.
COPY_CHUNK = 4 * 1024 * 1024


def copy(sched: Scheduler, ring: Ring, seqno: int, pkt: Copy, start_ns: int) -> Job | None:
    dst, src, n = pkt
    space = ring.ctx.space
    (md, od), (ms, os_) = space.resolve(dst, n), space.resolve(src, n)
    _check_link(sched, md, dst)
    _check_link(sched, ms, src)
    return _bytes(sched, ring, seqno, Op.COPY, start_ns, n, lambda lo, hi: np.copyto(
        md.data[od + lo : od + hi], ms.data[os_ + lo : os_ + hi]), (md, od), (ms, os_))


def memset(sched: Scheduler, ring: Ring, seqno: int, pkt: Memset,
           start_ns: int) -> Job | None:
    dst, n, value = pkt
    if value > 0xFF:
        raise memory.Fault(0, errno.EINVAL)
    m, off = ring.ctx.space.resolve(dst, n)
    _check_link(sched, m, dst)
    return _bytes(sched, ring, seqno, Op.MEMSET, start_ns, n, lambda lo, hi: m.data[
        off + lo : off + hi].fill(value), (m, off))


def _check_link(sched: Scheduler, m: memory.Mapping, va: int) -> None:
    """Another device's memory is reached over the link: not while it is down."""
    if m.kind == MemKind.DEVICE and m.owner in sched.links_down:
        raise memory.Fault(va, errno.ENOLINK)


def prefetch(sched: Scheduler, ring: Ring, seqno: int, pkt: Prefetch, start_ns: int) -> Job:
    va, n, to_device = pkt
    m, off = ring.ctx.space.resolve(va, n)
    if m.resident is None or to_device > 1:
        raise memory.Fault(va, errno.EINVAL)
    residency = sched.residency
    move = residency.touch_device if to_device else residency.to_host
    return PrefetchJob(sched, ring, seqno, Op.PREFETCH, start_ns, move, m, off, n)


def _bytes(sched: Scheduler, ring: Ring, seqno: int, opcode: int, start_ns: int, n: int,
           move: Callable[[int, int], object],
           *touched: tuple[memory.Mapping, int]) -> Job | None:
    """Copy-engine work over ``n`` bytes, ``move(lo, hi)`` moving bytes [lo, hi): inline
    (returns None, done) when small, else the job that moves them in chunks."""
    for m, off in touched:
        if m.resident is not None and n:
            sched.residency.touch_device(m, off, off + n)
    if n <= INLINE_BYTES:
        move(0, n)
        count(sched.tally, opcode, n)
        return None
    return CopyJob(sched, ring, seqno, opcode, start_ns, n, move)


def count(counters: Counters | Tally, opcode: int, n: int) -> None:
    if opcode == Op.COPY:  # memsets are not copies
        counters.add("copies")
        counters.add("copy_bytes", n)


class CopyJob(Job):
    """A large copy or memset: ``COPY_CHUNK`` bytes a turn, preempted between chunks."""

    __slots__ = ("move", "moved", "n")

    def __init__(self, sched: Scheduler, ring: Ring, seqno: int, opcode: int, start_ns: int,
                 n: int, move: Callable[[int, int], object]) -> None:
        super().__init__(sched, ring, seqno, opcode, start_ns)
        self.n, self.move, self.moved = n, move, 0

    def run(self) -> bool:
        n, engines = self.n, self.sched.copy
        while self.moved < n:
            hi = min(n, self.moved + COPY_CHUNK)
            self.move(self.moved, hi)
            self.moved = hi
            if hi < n and engines.higher_waiting(self.ring.priority):
                return False  # preempted between chunks
        count(self.sched.counters, self.opcode, n)
        self.finish()
        return True


class PrefetchJob(Job):
    """A PREFETCH: migrate the managed pages of bytes [off, off + n) of ``m``."""

    __slots__ = ("m", "move", "n", "off")

    def __init__(self, sched: Scheduler, ring: Ring, seqno: int, opcode: int, start_ns: int,
                 move: Callable[[memory.Mapping, int, int], None], m: memory.Mapping,
                 off: int, n: int) -> None:
        super().__init__(sched, ring, seqno, opcode, start_ns)
        self.move, self.m, self.off, self.n = move, m, off, n

    def run(self) -> bool:
        if self.n:
            self.move(self.m, self.off, self.off + self.n)
        self.finish()
        return True
