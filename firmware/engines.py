"""The device's engines: pools of copy and compute engines that run jobs, and the timer
that watches the launches running on them.

A packet too heavy for the control loop (a large copy, a launch that is not small and
bounded) becomes a :class:`Job` the scheduler hands to an engine pool; its queue is busy
until the job completes, which keeps each queue in order while queues run side by side.
Engines take the highest-priority job first. A job does bounded work per turn and gives
way between turns -- a long copy moves in chunks, a long launch in time slices -- so a
higher-priority packet waits at most one turn, and one giant job cannot hold an engine.

Between contexts of one priority the pools are fair, not first come first served: a job's
place is its context's next turn (start-time fair queueing, one turn per job), so a
context with a job on each of sixteen queues gets one turn in each round, not sixteen
before another context's one. A bystander's kernel therefore waits for at most one turn
of each other context per engine, however many queues they flood (docs/submission.md).

An engine must outlive anything a packet does: a job that raises anyway completes its
packet as a fault (EIO), and the engine takes the next one.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from abi.userq import Op
from firmware import host_cpu
from firmware.rings import Completion, Ring
from firmware.telemetry import Counters, log_unexpected

if TYPE_CHECKING:
    from firmware.scheduler import Scheduler

class Job:
    """Engine work for one packet: which packet it is (ring, seqno, opcode), when the
    scheduler started it, and the work. ``run`` does one turn: True when the work is done,
    False when it gave way (it is queued again, behind the work it yields to). A job ends
    its packet through :meth:`finish`; should ``run`` raise, the engine calls ``fail``."""

    __slots__ = ("charged_ns", "opcode", "ring", "sched", "seqno", "start_ns")

    def __init__(self, sched: Scheduler, ring: Ring, seqno: int, opcode: int,
                 start_ns: int) -> None:
        self.sched, self.ring, self.seqno, self.opcode = sched, ring, seqno, opcode
        self.start_ns = start_ns
        #: engine time of the current turn already counted (EnginePool.charge)
        self.charged_ns = 0

    def run(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        """An engine error: the packet completes with EIO."""
        log_unexpected(f"{Op(self.opcode).name} failed on an engine", exc)
        self.finish(errno.EIO, 0)

    def finish(self, status: int = 0, addr: int = 0) -> None:
        """Complete the packet, faulted with ``status`` at ``addr`` unless it is 0."""
        end_ns = time.monotonic_ns()
        c = (Completion.failed(self.seqno, self.opcode, status, addr, self.start_ns, end_ns)
             if status else Completion(0, self.start_ns, end_ns))
        self.sched.complete(self.ring, self.seqno, c, from_engine=True)


@dataclass(order=True)
class _Queued:
    #: (-priority, turn, arrival): higher priority first, then the context's turn (fair
    #: between contexts), then first come first served
    rank: tuple[int, int, int]
    job: Job = field(compare=False)


class _Turns:
    """Start-time fair queueing between contexts: each context's next turn. A job takes
    the later of its context's next turn and the turn being served, so a context that was
    idle does not bank turns, and one with many jobs queued takes one turn per round."""

    #: past this many contexts remembered, those whose turns are all served are forgotten
    PRUNE = 1024

    def __init__(self) -> None:
        self.serving = 0
        self._next: dict[int, int] = {}

    def take(self, ctx_id: int) -> int:
        turn = max(self.serving, self._next.get(ctx_id, 0))
        self._next[ctx_id] = turn + 1
        if len(self._next) > self.PRUNE:
            self._next = {c: t for c, t in self._next.items() if t > self.serving}
        return turn


class EnginePool:
    """N engines of one kind, taking the highest-priority job first."""

    def __init__(self, name: str, count: int, counters: Counters) -> None:
        self._heap: list[_Queued] = []
        self._turns = _Turns()
        #: the heap's and the parked list's lock
        self._lock = threading.Lock()
        #: the wake-up locks of the engines parked for want of a job, held while they
        #: sleep (:meth:`_next`)
        self._parked: list[threading.Lock] = []
        self._arrivals = itertools.count()
        self._counters = counters
        self.name = name  # an engine kind, abi.mailbox.ENGINE_KINDS
        self._busy_stat = f"{name}_busy_ns"
        self._busy = 0
        # the busy peak shows whether streams' copies overlapped: a copy-engine figure
        self._peak_stat = "copy_engines_busy_peak" if name == "copy" else None
        for i in range(count):
            threading.Thread(target=self._engine, name=f"{name}{i}", daemon=True).start()

    def submit(self, priority: int, job: Job) -> None:
        lock = self._lock
        lock.acquire()  # not ``with``: twice the cost, on every engine launch's path
        try:
            self._queue(-priority, job)
            self._unpark()
        finally:
            lock.release()

    def _unpark(self) -> None:
        """Wake one parked engine, if any (the caller holds the lock)."""
        if self._parked:
            self._parked.pop().release()

    def _queue(self, rank: int, job: Job) -> None:
        """In line at its context's next turn (the caller holds the lock)."""
        turn = self._turns.take(job.ring.ctx.id)
        heapq.heappush(self._heap, _Queued((rank, turn, next(self._arrivals)), job))

    def charge(self, job: Job, ns: int) -> None:
        """Count ``ns`` of engine time of a turn still running: a launch of seconds on an
        idle engine gives way to nobody, and counted only when its turn ended, the device
        would read 0% busy (and stay cool) for all of it."""
        self._counters.add(self._busy_stat, ns)
        job.ring.ctx.engine_time.add(self.name, ns)
        job.charged_ns += ns

    def busy(self) -> bool:
        """Is an engine running a job, or a job waiting for one? (read without the lock:
        a stale answer only costs the control loop one spin or one wake-up)"""
        return self._busy > 0 or bool(self._heap)

    def higher_waiting(self, priority: int) -> bool:
        """Is a job of higher priority than ``priority`` waiting? (checked between chunks)"""
        with self._lock:
            return bool(self._heap) and -self._heap[0].rank[0] > priority

    def waiting(self, priority: int) -> bool:
        """Is a job of at least ``priority`` waiting? (checked when a slice is up)"""
        with self._lock:
            return bool(self._heap) and -self._heap[0].rank[0] >= priority

    def _next(self, wake: threading.Lock) -> _Queued:
        """The next job, parking this engine until there is one. An engine with nothing
        to do sleeps on its own wake-up lock, held, which :meth:`submit` releases: one
        futex wake per hand-off, where a ``Condition`` made a lock and queued it per wait
        and took its own lock again on waking (Python code, on the GIL, both sides)."""
        lock = self._lock
        lock.acquire()
        while not self._heap:
            self._parked.append(wake)
            lock.release()
            wake.acquire()  # sleeps, taking no CPU, until submit releases it
            lock.acquire()
        try:
            item = heapq.heappop(self._heap)
            self._turns.serving = max(self._turns.serving, item.rank[1])
            self._busy += 1
            if self._peak_stat:
                self._counters.peak(self._peak_stat, self._busy)
        finally:
            lock.release()
        return item

    def _engine(self) -> None:
        host_cpu.lower_engine_priority()
        wake = threading.Lock()
        wake.acquire()  # held: the engine's acquire sleeps until submit releases it
        while True:
            item = self._next(wake)
            start = time.perf_counter_ns()
            item.job.charged_ns = 0
            try:
                done = item.job.run()
            except BaseException as exc:  # noqa: BLE001 - last resort: the engine lives on
                item.job.fail(exc)
                done = True
            busy = time.perf_counter_ns() - start - item.job.charged_ns
            self._counters.add(self._busy_stat, busy)
            item.job.ring.ctx.engine_time.add(self.name, busy)
            with self._lock:
                self._busy -= 1
                if not done:  # gave way: back in line behind the work it yields to
                    self._counters.add("preemptions")
                    self._queue(item.rank[0], item.job)
                    self._unpark()
            # a finished job holds its packet's memory (a mapping and its descriptor):
            # let it go now, not when the next job comes
            del item


class Deadlines:
    """One timer thread for every running launch: the watchdog (stop a block that runs
    too long) and the time slice (ask the launch to stop at its next block boundary).
    ``preempt`` and ``watchdog`` are the abort word's values for the two (the generated
    code's ABI, firmware/lower/abi.py)."""

    def __init__(self, preempt: int, watchdog: int) -> None:
        self.preempt, self.watchdog = preempt, watchdog
        #: the condition's lock, taken directly by add/remove (``with`` on the Condition
        #: runs two Python-level calls per launch)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._entries: dict[int, tuple[np.ndarray, float, float]] = {}
        #: the control loop's inline launches' standing entry, (abort word, watchdog
        #: time), re-armed per ring turn (arm_inline); None between turns
        self._inline: tuple[np.ndarray, float] | None = None
        self._ids = itertools.count()
        #: when the timer thread wakes next (monotonic seconds; inf: only when told)
        self._wakes_at = float("inf")
        threading.Thread(target=self._run, name="deadlines", daemon=True).start()

    def add(self, abort: np.ndarray, watchdog_s: float, quantum_s: float | None) -> int:
        """Watch ``abort``'s launch. The timer thread is woken only when this deadline
        comes before its next wake-up: back-to-back inline launches (a 0.25 s watchdog
        each) then wake it about once per watchdog period, not once per launch (a thread
        hand-off per launch, on the control loop's GIL)."""
        now = time.monotonic()
        token = next(self._ids)
        watchdog = now + watchdog_s
        quantum = now + quantum_s if quantum_s else float("inf")
        with self._lock:
            self._entries[token] = (abort, watchdog, quantum)
            if min(watchdog, quantum) < self._wakes_at:
                self._cond.notify()
        return token

    def remove(self, token: int) -> None:
        with self._lock:
            self._entries.pop(token, None)

    def arm_inline(self, abort: np.ndarray, watchdog_s: float) -> None:
        """Watch the control loop's inline launches from now (one ring's turn of them),
        their abort word cleared. A standing entry, not :meth:`add`'s per turn: with one
        packet per pass (a host issuing an op every ~20 us) every launch is a turn of its
        own, and an entry added and removed per turn cost ~1.5 us of a ~18 us launch.
        Under the lock, as the timer's scan is: a scan sees the turn's deadline with its
        cleared word, or neither (never an old deadline firing into a new turn)."""
        watchdog = time.monotonic() + watchdog_s
        lock = self._lock
        lock.acquire()  # not ``with``: twice the cost, per turn
        try:
            abort[0] = 0
            self._inline = (abort, watchdog)
            if watchdog < self._wakes_at:
                self._cond.notify()
        finally:
            lock.release()

    def disarm_inline(self) -> None:
        """The turn ended. Without the lock: a scan that still read the old entry can
        only fire into a word no launch runs under, which the next arming clears."""
        self._inline = None

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                nearest = float("inf")
                inline = self._inline
                if inline is not None:
                    if now >= inline[1]:
                        inline[0][0] = self.watchdog
                    else:
                        nearest = inline[1]
                for abort, watchdog, quantum in self._entries.values():
                    if now >= watchdog:
                        abort[0] = self.watchdog
                    elif now >= quantum:
                        if abort[0] == 0:
                            abort[0] = self.preempt
                        nearest = min(nearest, watchdog)
                    else:
                        nearest = min(nearest, quantum, watchdog)
                self._wakes_at = nearest
                self._cond.wait(None if nearest == float("inf") else max(0.0, nearest - now))
