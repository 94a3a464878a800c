"""The adversarial schedule of one context (``ACCEL_SCHEDULE=adversarial:SEED``,
docs/schedule.md): delays and queue ranks, seeded, within the contract.

The contract (docs/submission.md) orders a queue's packets and nothing else: packets of
different queues are ordered only by ``WAIT_QUEUE``, and a fence or an event says only
that what came before it completed. So the firmware may start any packet later than it
could have, and may run ready queues in any order; a correct program cannot tell, and a
program that leaves two accesses of different queues unordered sees them in either order.

The decisions are a pure function of the seed and the packet (the queue's index in its
context, the seqno), not of time: the same seed makes the same decisions in every run
(what a run does with them still depends on when the host submits). A replayed schedule
makes exactly the decisions its table lists and no others. Either way, with
``SCHED_RECORD`` each decision applied is appended to the table (abi/schedule.py), and
``SCHED_AT`` names the packet a fault injected now would hit (the driver records such
faults: kmod_emul/ras.py); under the default schedule that position is all it keeps.

A replay's ``FAULT`` entries are injected again: before the context starts a packet once
the entry's queue has started the packets before the entry's seqno, the firmware asks the
driver to inject the fault (``fire``) and starts nothing of the context's until the
driver answered (``fault_answered``), which it does once the fault has done what it does
(a lost context starts nothing more) or was refused. So the fault comes at the same packet
in every replay.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from time import monotonic_ns
from typing import TYPE_CHECKING

from abi import schedule as sched
from abi import userq
from abi.schedule import Decision, Entry

if TYPE_CHECKING:
    from firmware.rings import Ring

#: The delays a packet may get (us), each as likely, and no delay as likely as all of
#: them: most are longer than a host takes to queue the next few operations, so
#: independent work queued later runs first (a race of a packet A and a later B of
#: another queue shows when A is delayed longer than B: in about a quarter of the seeds).
DELAYS_US = (1_000, 5_000, 20_000)
#: The chance that a queue's rank changes at a packet (PCT's priority change points,
#: spread over the run instead of chosen from a known length).
CHANGE_CHANCE = 1 / 16
#: The longest delay a replay applies, whatever its table says (an edited one could
#: otherwise stall its own queue, and the unmaps behind it, for an hour).
MAX_REPLAY_DELAY_US = 1_000_000
#: Ranks are drawn from this many values (lower runs first).
RANKS = 1 << 16
#: How long a replayed packet waits for the packets listed before it to start before the
#: replay gives up on them (the program took another path than the recorded run).
ORDER_PATIENCE_NS = 2_000_000_000
#: ... and how often it looks whether they did (the loop sleeps meanwhile)
ORDER_RECHECK_NS = 100_000
#: How long the context waits for the driver's answer to a replayed fault before it goes
#: on (a driver that never answers: the device is going down, or the message was lost),
#: and how often the loop looks meanwhile (the answer also wakes it).
FAULT_PATIENCE_NS = 2_000_000_000
FAULT_RECHECK_NS = 10_000_000


class Adversary:
    """One context's decisions: which packet waits how long, which queue goes first."""

    def __init__(self, schedule: int, seed: int, table_fd: int | None,
                 fire: Callable[[Entry], None] | None = None) -> None:
        self.mode = sched.Mode(schedule & sched.SCHED_MODE_MASK)
        self.seed = seed
        self.table = (userq.SharedWords(table_fd, sched.SCHED_FILE_SIZE)
                      if table_fd is not None else None)
        #: asks the driver to inject a replayed fault (firmware/main.py)
        self.fire = fire
        #: a replay's faults not injected yet, in table order; the one awaiting the
        #: driver's answer, and since when
        self.faults: list[Entry] = []
        self.awaiting: Entry | None = None
        self.awaiting_since = 0
        #: the context's queues by index (a fault's queue is named by its index)
        self.rings: dict[int, Ring] = {}
        #: SCHED_AT as last written, and its writers' lock (the control loop starts
        #: packets, the engines complete them)
        self.at = (0, 1)
        self._at_lock = threading.Lock()
        #: a replay's decisions, by (queue, seqno)
        self.delays: dict[tuple[int, int], int] = {}
        self.ranks: dict[tuple[int, int], int] = {}
        #: a replay's start order: each listed packet's place among the listed, and the
        #: place whose packet starts next (``frontier``), since when it is awaited
        self.order: dict[tuple[int, int], int] = {}
        self.frontier = 0
        self.awaited_since = 0
        self.started = 0  # packets started: the next one's ORDER value
        if self.mode == sched.Mode.REPLAY and self.table is not None:
            self._load()
        self.record = bool(schedule & sched.SCHED_RECORD) and self.table is not None
        if self.record:
            assert self.table is not None
            self.table.set(sched.SCHED_COUNT, 0)
            self.table.set(sched.SCHED_DROPPED, 0)
            self.table.set(sched.SCHED_AT, sched.at_word(*self.at))
        self.queues = 0  # queues the context had: the next one's index

    def _load(self) -> None:
        """A replay's table, as the process wrote it; an entry that is not a decision
        (the process's memory: anything may be there) is skipped."""
        assert self.table is not None
        words = self.table.words
        count = min(self.table.get(sched.SCHED_COUNT), sched.SCHED_CAPACITY)
        base = sched.SCHED_ENTRIES >> 3
        starts: list[tuple[int, int, int]] = []
        for i in range(count):
            w = words[base + 4 * i: base + 4 * i + 4].tolist()
            try:
                e = sched.entry_of(w)
            except ValueError:
                continue
            if e.kind == Decision.ORDER:
                starts.append((e.value, e.queue, e.seqno))
            elif e.kind == Decision.FAULT:
                if len(self.faults) < sched.SCHED_FAULT_CAPACITY:  # what a recording holds:
                    self.faults.append(e)  # each packet start looks at every one pending
            else:
                table = self.delays if e.kind == Decision.DELAY else self.ranks
                table[e.queue, e.seqno] = e.value
        # places by value, renumbered from 0: a shrunk recording keeps only some
        self.order = {(q, s): place for place, (_, q, s) in enumerate(sorted(starts))}

    def close(self) -> None:
        if self.table is not None:
            self.table.close()
            self.table = None

    def _rng(self, *key: int) -> random.Random:
        return random.Random("/".join(map(str, (self.seed, *key))))

    def _note(self, e: Entry) -> None:
        """Append a decision applied to the table (a full table counts it as dropped)."""
        t = self.table
        if not self.record or t is None:
            return
        n = t.get(sched.SCHED_COUNT)
        if n >= sched.SCHED_CAPACITY:
            t.set(sched.SCHED_DROPPED, t.get(sched.SCHED_DROPPED) + 1)
            return
        base = (sched.SCHED_ENTRIES >> 3) + 4 * n
        for i, w in enumerate(sched.entry_words(e)):
            t.words[base + i] = w
        t.set(sched.SCHED_COUNT, n + 1)  # the entry first, then the count that shows it

    # --- the scheduler's questions ------------------------------------------------------
    def queue_added(self, ring: Ring) -> None:
        """A new queue of the context: its index and its first rank."""
        index = self.queues
        self.queues += 1
        ring.adv_index = index
        self.rings[index] = ring
        ring.adv_rank = max(0, self._rank(index, 0))

    def _rank(self, queue: int, seqno: int) -> int:
        """The queue's rank from ``seqno`` on, or its rank so far (-1: unchanged)."""
        if self.mode == sched.Mode.DEFAULT:  # recording faults only: no decisions
            return -1
        if self.mode == sched.Mode.REPLAY:
            rank = self.ranks.get((queue, seqno), -1)
        elif seqno == 0:
            rank = self._rng(queue).randrange(RANKS)
        else:
            rng = self._rng(queue, seqno, 1)
            rank = rng.randrange(RANKS) if rng.random() < CHANGE_CHANCE else -1
        if rank >= 0:
            self._note(Entry(queue, seqno, Decision.RANK, rank))
        return rank

    def _delay_us(self, queue: int, seqno: int) -> int:
        if self.mode == sched.Mode.DEFAULT:
            return 0
        if self.mode == sched.Mode.REPLAY:  # the table is the process's: bounded here
            return min(self.delays.get((queue, seqno), 0), MAX_REPLAY_DELAY_US)
        rng = self._rng(queue, seqno)
        pick = rng.randrange(2 * len(DELAYS_US))
        return DELAYS_US[pick] if pick < len(DELAYS_US) else 0

    def holds(self, ring: Ring) -> bool:
        """Must the ring's next packet wait? Decided the first time the scheduler could
        start it: its delay, and the queue's rank change there."""
        seqno = ring.taken + 1
        if ring.held_seqno != seqno:
            index = ring.adv_index
            ring.held_seqno = seqno
            rank = self._rank(index, seqno)
            if rank >= 0:
                ring.adv_rank = rank
            us = self._delay_us(index, seqno)
            ring.held_until = monotonic_ns() + us * 1000 if us else 0
            if us:
                self._note(Entry(index, seqno, Decision.DELAY, us))
        if ring.held_until:
            if monotonic_ns() < ring.held_until:
                return True
            ring.held_until = 0
        if self.order and self._out_of_order(ring.adv_index, seqno):
            ring.held_until = monotonic_ns() + ORDER_RECHECK_NS
            return True
        if (self.faults or self.awaiting) and self._fault_holds(ring):
            return True
        if self.mode != sched.Mode.DEFAULT:
            self._note(Entry(ring.adv_index, seqno, Decision.ORDER, self.started))
            self.started += 1
        if self.record:
            self._set_at(ring.adv_index, seqno)
        return False

    # --- injected faults ----------------------------------------------------------------
    def _set_at(self, queue: int, seqno: int) -> None:
        """``SCHED_AT``: a fault coming now hits packet ``seqno`` of ``queue``."""
        with self._at_lock:
            self.at = (queue, seqno)
            if self.table is not None:
                self.table.set(sched.SCHED_AT, sched.at_word(queue, seqno))

    def completed(self, ring: Ring, seqno: int) -> None:
        """The ring's packets up to ``seqno`` completed (any thread): if the last one
        started is among them, a fault now hits the queue's next packet."""
        if not self.record:
            return
        with self._at_lock:
            queue, at = self.at
            if ring.adv_index == queue and seqno >= at:
                self.at = (queue, at + 1)
                if self.table is not None:
                    self.table.set(sched.SCHED_AT, sched.at_word(queue, at + 1))

    def _fault_holds(self, ring: Ring) -> bool:
        """Must the ring's next packet wait for a replayed fault? It does while the
        driver has not answered one (at most ``FAULT_PATIENCE_NS``), and when a fault is
        due: the first whose queue has started the packets before its seqno is sent to
        the driver (``fire``) and awaited."""
        now = monotonic_ns()
        if self.awaiting is not None:
            if now - self.awaiting_since < FAULT_PATIENCE_NS:
                ring.held_until = now + FAULT_RECHECK_NS
                return True
            self.awaiting = None  # no answer: go on
        for i, f in enumerate(self.faults):
            started = self.rings[f.queue].taken if f.queue in self.rings else 0
            if started >= f.seqno - 1:
                del self.faults[i]
                if self.fire is None:
                    return False
                self.awaiting, self.awaiting_since = f, now
                ring.held_until = now + FAULT_RECHECK_NS
                self.fire(f)
                return True
        return False

    def fault_answered(self) -> None:
        """The driver injected (or refused) the awaited fault: the context's packets may
        start again (the ones it held wake now, not at their recheck)."""
        self.awaiting = None
        for ring in self.rings.values():
            ring.held_until = 0

    def _out_of_order(self, queue: int, seqno: int) -> bool:
        """Must a replay's packet wait for one listed before it to start? A packet the
        order does not list never waits; one awaited for ``ORDER_PATIENCE_NS`` (the run
        went another way: it never comes) is given up on."""
        place = self.order.get((queue, seqno))
        if place is None:
            return False
        now = monotonic_ns()
        if place > self.frontier:
            if not self.awaited_since:
                self.awaited_since = now
            if now - self.awaited_since < ORDER_PATIENCE_NS:
                return True
            self.frontier = place  # what it waited for is not coming
        self.frontier = max(self.frontier, place + 1)
        self.awaited_since = 0
        return False
