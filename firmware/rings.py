"""What the firmware keeps per context: its rings, its modules, how a packet's end is
written back.

Every queue is a ring in shared memory (layout in :mod:`abi.userq`, the shared ABI
header), memory of the process that owns it: nothing in it is trusted
(docs/containment.md). The firmware keeps its own copy of what it must rely on -- what it
took, its fence -- and writes back only its own words: the read pointer, completion
timestamps, the first fault and the fence, in that order, so a waiter that sees the fence
sees the rest. A packet's end is one :class:`Completion`, and :meth:`Ring.complete` is
the only writer of those words.

A context's doorbell page says which rings have news: each queue's slot holds its write
pointer, and a sequence word moves on every ring of the page, so an idle context costs one
word per pass (:meth:`FwContext.moved_slots`).
"""

from __future__ import annotations

import array
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from abi import userq
from firmware import memory
from firmware.telemetry import EngineTime

if TYPE_CHECKING:
    from firmware.adversary import Adversary
    from firmware.waits import Wait

#: A context with at most this many rings has its doorbell slots compared one by one;
#: more are compared in one numpy operation.
_SCAN_IN_PYTHON = 16
#: ring words of the queue's argument arena (Ring.args_slot)
_ARGS_VA, _ARGS_SLOTS = userq.RING_ARGS_VA >> 3, userq.RING_ARGS_SLOTS >> 3
#: ring words every packet's path writes or reads (Ring.take, complete, irq_due: word
#: stores of their own, not RingView's calls, on the path of every packet)
_RPTR, _COMPLETED = userq.RING_RPTR >> 3, userq.RING_COMPLETED >> 3
_TIMESTAMPS, _IRQ_SEQNO = userq.RING_TIMESTAMPS >> 3, userq.RING_IRQ_SEQNO >> 3


@dataclass(slots=True)
class Completion:
    """How packets of a ring ended: what :meth:`Ring.complete` writes back.

    ``status`` is 0, the errno a packet faulted with, or ECANCELED for one that never ran
    (its ring had faulted). ``start_ns``/``end_ns`` are device time (``time.monotonic_ns``)
    from when the scheduler started the packet to its end; ``end_ns`` is the ring's
    completion timestamp (0 for packets cancelled in bulk, which get none). ``fault`` is
    the ring's fault record, ``(seqno, errno, opcode, address)`` as
    :meth:`abi.userq.RingView.read_fault` reads it, when a packet faulted (it is written
    if it is the ring's first), else None."""

    status: int
    start_ns: int
    end_ns: int
    fault: tuple[int, int, int, int] | None = None

    @classmethod
    def failed(cls, seqno: int, opcode: int, code: int, addr: int, start_ns: int,
               end_ns: int) -> Completion:
        return cls(code, start_ns, end_ns, (seqno, code, opcode, addr))


class Ring(userq.RingView):
    """One queue's ring as the firmware, its consumer, sees it."""

    def __init__(self, ctx: FwContext, qid: int, priority: int, slot: int, fd: int,
                 fence_only: bool = False, depth: int = userq.RING_SLOTS) -> None:
        super().__init__(fd)
        self.ctx, self.id, self.priority, self.slot = ctx, qid, priority, slot
        #: packets admitted past what was taken (the queue's depth, Scheduler.publish)
        self.depth = depth
        self.fence_only = fence_only  # another device's queue, imported to wait on
        self.taken = self.rptr
        self.published = self.taken  # what the scheduler may take (Scheduler.publish)
        self.busy = False  # an engine runs its current packet (on_engine)
        #: the control loop's time its turns took (ns), from the scheduler's clock when it
        #: last became active (firmware/scheduler.py: fair turns)
        self.vtime = 0
        self.blocked: Wait | None = None  # what its current packet waits for (firmware/waits.py)
        self.parked: tuple[int, tuple[int, ...]] | None = None  # a launch awaiting its module
        #: its context's adversarial schedule (firmware/adversary.py): the queue's index
        #: in the context and rank (lower goes first), and the packet it last decided on
        #: and when that one may start (monotonic ns; 0: now)
        self.adv_index = self.adv_rank = 0
        self.held_seqno = self.held_until = 0
        self.faulted = self.read_fault()[0] != 0
        self.closing = False
        self.last_irq = 0
        #: the fence as this firmware wrote it: the word in the ring is the process's
        #: memory, which it may overwrite (the ring's closing and unmaps go by this one)
        self.fence = self.taken
        #: the last packet that ended inline in the current turn, timestamped but behind
        #: the fence until the scheduler publishes the turn's run of them (``stamp``)
        self.ended = self.taken

    @property
    def completed(self) -> int:
        """The fence: our own for a ring we run; for another device's ring (imported to
        wait on) the word in it, and once closed the last value seen there (rings
        blocked on it still read it)."""
        if not self.fence_only:
            return self.fence
        if self.mem.closed:
            return self.final_fence
        return self.words[userq.RING_COMPLETED >> 3]

    def close(self) -> None:
        if not self.mem.closed:
            self.final_fence = self.words[userq.RING_COMPLETED >> 3]
            super().close()

    def ready(self) -> bool:
        """Has a packet the scheduler could take now."""
        return not self.busy and not self.fence_only and self.taken < self.published

    def idle(self) -> bool:
        # a write pointer behind what was taken is a lie publish() must fault first (a
        # new ring may come with one): such a ring is not idle until it faulted
        w = self.wptr
        return (not self.busy and self.blocked is None and self.parked is None
                and (self.taken == w or (self.faulted and self.taken > w)))

    def on_engine(self, busy: bool) -> None:
        """An engine took (True) or ended (False) the ring's current packet: kept here
        for the scheduler and published for the ring's waiters (``RING_ON_ENGINE``)."""
        self.busy = busy
        self.set(userq.RING_ON_ENGINE, busy)

    def args_slot(self, seqno: int) -> int:
        """The device address of ``seqno``'s slot in the queue's own argument arena (the
        producer's ``RING_ARGS_VA``/``RING_ARGS_SLOTS``), 0 where it named none. Both are
        the process's words: whatever they say is only an address in its own memory,
        resolved like any other."""
        va, slots = self.words[_ARGS_VA], self.words[_ARGS_SLOTS]
        if not va or not slots:
            return 0
        return va + seqno % slots * userq.RING_ARGS_SLOT_BYTES

    def take(self) -> tuple[int, tuple[int, ...]]:
        """The next packet: its seqno and raw words (the scheduler decodes them)."""
        seqno = self.taken + 1
        words = self.read_packet(seqno)
        self.taken = seqno
        self.words[_RPTR] = seqno
        return seqno, words

    def take_through(self, wptr: int) -> None:
        """Take every published packet up to ``wptr`` unread (a faulted ring's, to cancel)."""
        if wptr > self.taken:
            self.taken = wptr
            self.set(userq.RING_RPTR, wptr)

    def stamp(self, seqno: int, end_ns: int) -> None:
        """``seqno`` ended well at ``end_ns``: its timestamp now, the fence later (the
        scheduler's ``_publish_ended``, once for a turn's run of such packets)."""
        self.words[_TIMESTAMPS + (seqno - 1) % userq.RING_SLOTS] = end_ns
        self.ended = seqno

    def complete(self, seqno: int, c: Completion) -> int:
        """Publish that the packets up to ``seqno`` ended as ``c`` says: timestamp, first
        fault, then the fence (in that order); returns how many packets the fence passed."""
        words = self.words
        if c.end_ns:
            words[_TIMESTAMPS + (seqno - 1) % userq.RING_SLOTS] = c.end_ns
        if c.fault is not None and not self.faulted:
            self.write_fault(*c.fault)
            self.faulted = True
        passed = seqno - self.fence
        if passed > 0:
            self.fence = seqno
            words[_COMPLETED] = seqno
        return passed

    def irq_due(self) -> bool:
        """Whether the fence passed the seqno a waiter armed (once per arming)."""
        armed = self.words[_IRQ_SEQNO]
        done = self.fence if not self.fence_only else self.completed
        if armed and done >= armed and armed > self.last_irq:
            self.last_irq = done
            return True
        return False


@dataclass(eq=False)
class FwModule:
    """A loaded module: the image's bytes until the loader thread parsed them."""

    raw: bytes
    kernels: list[tuple[str, dict]] | None = None  # (name, IR) in the module's order
    error: int = 0  # errno when the image did not parse
    #: (kernel index, argument types) -> its CompiledKernel, once the JIT had it: the
    #: module's IR never changes once parsed, so a launch need not compare it with the
    #: JIT cache's copy again (firmware/launches.py)
    compiled: dict[tuple[int, tuple[str, ...]], Any] = field(default_factory=dict)
    #: (kernel index, argument block bytes) -> its argument plan (firmware/launches.py)
    plans: dict[tuple[int, bytes], list] = field(default_factory=dict)
    #: (kernel index, argument block bytes, grid, block, dynamic shared) -> the launch
    #: it checked and bound, inline or for the engines, while the context's mappings did
    #: not change (firmware/launches.py ``Bound``, ``EngineBound``)
    bound: dict[tuple[int, bytes, int, int, int], Any] = field(default_factory=dict)


@dataclass(eq=False)
class FwContext:
    id: int
    doorbell: int  # read end of the process's doorbell pipe
    event: int  # write end of its event pipe
    db: userq.SharedWords  # its doorbell page
    space: memory.AddressSpace = field(default_factory=memory.AddressSpace)
    queues: dict[int, Ring] = field(default_factory=dict)
    modules: dict[int, FwModule] = field(default_factory=dict)
    #: doorbell slot -> ring, and for each slot what its ring had taken when it last went
    #: idle: a slot that holds anything else has news (the comparison cannot be fooled by
    #: a slot's previous queue having stopped at the value a new one reaches first)
    slots: dict[int, Ring] = field(default_factory=dict)
    consumed: array.array = field(
        default_factory=lambda: array.array("Q", bytes(8 * userq.ACCEL_DB_SLOT_COUNT)))
    seen_seq: int = 0
    #: the control loop's time its rings' turns took (ns), from the scheduler's clock when
    #: it last became active (firmware/scheduler.py: fair turns between contexts)
    vtime: int = 0
    #: the engine time its packets took (DRM fdinfo), and its entry in the mailbox's
    #: context table (-1: none; the table is full)
    engine_time: EngineTime = field(default_factory=EngineTime)
    stats_slot: int = -1
    #: the driver lost or destroyed it (CTX_LOST, CTX_DESTROY): nothing more starts from
    #: its rings. The driver's word on the mailbox, never the doorbell page's "lost" word,
    #: which the process can write (one that did stalled its context's work for good)
    lost: bool = False
    #: the mailbox's live table (abi/mailbox.py ``LIVE_OFF``, the driver's) and this
    #: context's entry in it: the driver clears the entry the moment it loses the
    #: context, before its message (``lost``) may arrive
    live_table: memoryview | None = None
    live_slot: int = 0
    #: its schedule's decisions when the process asked for other than the default
    #: (firmware/adversary.py)
    adversary: Adversary | None = None

    def dropped(self) -> bool:
        """Whether nothing more may start from this context's rings: the driver lost or
        destroyed it, said on the mailbox or, sooner, in the live table."""
        if not self.lost and self.live_table is not None \
                and self.live_table[self.live_slot] != self.id:
            self.lost = True
        return self.lost

    def signal(self) -> None:
        """One byte on the process's event pipe (never blocks; a full pipe already says
        "look", a closed one has no reader)."""
        try:
            os.write(self.event, b"\1")
        except (BlockingIOError, BrokenPipeError):
            pass

    def moved_slots(self) -> list[int]:
        """Doorbell slots of known rings that hold news, if the page's sequence moved;
        none once the context is lost."""
        seq = self.db.get(userq.DB_SEQ)
        if seq == self.seen_seq:
            return []
        self.seen_seq = seq  # seen, lost or not: a moved sequence keeps the loop awake
        if self.dropped():
            return []
        if len(self.slots) <= _SCAN_IN_PYTHON:  # a few rings: cheaper than numpy's calls
            words, base, consumed = self.db.words, userq.DB_SLOTS >> 3, self.consumed
            return [slot for slot in self.slots if words[base + slot] != consumed[slot]]
        now = np.frombuffer(self.db.mem, np.uint64, userq.ACCEL_DB_SLOT_COUNT, userq.DB_SLOTS)
        moved = np.flatnonzero(now != np.frombuffer(self.consumed, np.uint64))
        del now  # the page's mapping must not stay exported
        return [int(i) for i in moved if int(i) in self.slots]

    def went_idle(self, ring: Ring) -> None:
        self.consumed[ring.slot] = ring.taken

    def in_flight(self, ring: Ring) -> None:
        """``ring``'s packet went to an engine and the ring out of the scan: what its slot
        holds now is no news (the job's end brings the ring back, which then reads its
        write pointer afresh), so other rings' knocks do not bring it back before."""
        self.consumed[ring.slot] = self.db.words[(userq.DB_SLOTS >> 3) + ring.slot]

    def drop_bindings(self) -> None:
        """Forget every module's bound launches (a mapping went away): their views would
        keep its memory, and a host mapping's descriptor, alive until the kernel's next
        launch (their generation already keeps them from running)."""
        for mod in self.modules.values():
            mod.bound.clear()

    def unload(self, module_id: int) -> None:
        """MODULE_UNLOAD: the module goes with its bound launches. Only the context's
        modules are reached by ``drop_bindings``; an unloaded one's bindings, with their
        views of the context's memory, would outlive every unmap and the context itself
        wherever the module is still referenced (the loader thread held the one it parsed
        last: a pinned mapping's descriptor leaked until the device's next module load)."""
        mod = self.modules.pop(module_id, None)
        if mod is not None:
            mod.bound.clear()

    def close(self) -> None:
        for fd in (self.doorbell, self.event):
            if fd >= 0:
                os.close(fd)
        self.doorbell = self.event = -1
        self.db.close()
        if self.adversary is not None:
            self.adversary.close()
        for ring in self.queues.values():
            ring.close()
        self.queues.clear()
        self.slots.clear()
        self.modules.clear()
