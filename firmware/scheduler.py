"""The queue scheduler: how the firmware's control loop runs user-mode rings.

It takes packets in order, one queue at a time, high-priority queues first. Cheap packets
(no-ops, satisfied waits, small copies, small launches of bounded kernels) run inline, so a
no-op round trip costs no thread hand-off; heavy ones become jobs for the engines
(:mod:`firmware.engines`: copy engines for copies, memsets and migrations, compute engines
for kernels), and the queue is busy until its job completes. What each packet does is
:mod:`firmware.copies` and :mod:`firmware.launches`; the waits (``WAIT_QUEUE``,
``WAIT_VALUE``) and ``WRITE_VALUE`` are the scheduler's own, with :mod:`firmware.waits`.

Nothing a process writes is trusted (docs/containment.md): ring words, packets, argument
blocks and modules are checked in Python integers before anything runs, and any exception
while decoding them faults the packet's own queue. The control thread does bounded work per
pass, whatever a process writes: it looks only at rings whose doorbell slot moved (or that
have packets it can take: a ring whose packet runs on an engine is set aside until the job
ends, so sixty-four rings waiting on copies cost a pass nothing), takes at most ``BATCH``
packets from a ring per pass, and faults a ring whose write pointer jumps (so a +2**63
jump costs one step, not 2**63).

A packet is validated against its context's address space when it runs; a bad one faults
*its own queue*: the ring records the first fault (seqno, errno, opcode, address), later
packets complete as cancelled without running, and nothing else is touched. However a
packet ends -- inline, on an engine, cancelled -- it ends through :meth:`Scheduler.complete`
with a :class:`~firmware.rings.Completion`, which writes it back, counts it and raises the
waiter's interrupt. A turn's run of packets that end inline (launches, no-ops, small
copies) ends through one such call: each is timestamped as it ends (``Ring.stamp``), and
the fence passes the run at the turn's end or before anything else of the ring shows
(``_publish_ended``).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from time import monotonic_ns
from typing import Any

from abi import userq
from abi.userq import Op
from firmware import copies, memory, waits
from firmware.engines import EnginePool
from firmware.launches import PARKED, Kernels
from firmware.rings import Completion, FwContext, Ring
from firmware.telemetry import Counters, Tally, log_unexpected

#: Packets the scheduler takes from one ring per pass, so a ring full of no-ops cannot
#: hold the control loop.
BATCH = 64
#: A ring's turn ends once the control loop has spent this long on it (ns), and the next
#: turn goes to the context that has had the least of the loop's time: the quantum is the
#: longest a bystander's packet waits behind another tenant's inline work (plus the packet
#: being run, which is bounded by ``launches.INLINE_WORK``). A ring alone on the loop
#: keeps its turn while nothing new comes (``_turn_goes_on``).
TURN_NS = 20_000

#: What a packet's start returns when its ring now waits for another queue's fence.
_BLOCKED = object()
#: A LAUNCH's typed layout made from its ring words without a call: ``userq.decode``'s
#: work, inlined on the path every operator of a framework takes (the slice holds exactly
#: the layout's fields, as there)
_LAUNCH_WORDS = slice(2, 2 + len(userq.Launch._fields))
_new_packet = tuple.__new__

#: The engine kind whose time a packet run inline is charged to (utilization, fdinfo): the
#: control loop stands in for an engine of that kind.
_INLINE_KIND = {Op.LAUNCH: "compute", Op.COPY: "copy", Op.MEMSET: "copy", Op.PREFETCH: "copy"}
#: each kind's busy counter
_BUSY_COUNTER = {kind: f"{kind}_busy_ns" for kind in set(_INLINE_KIND.values())}
#: Packets whose inline end the fence may publish with the rest of their turn's run
#: (``_publish_ended``): what they do is memory a process reads once the fence says they
#: ended, never a word it waits on instead of the fence (a WRITE_VALUE's) or a state of
#: the ring (a wait's). A context under an adversarial schedule completes each packet as
#: it ends (its record of where a fault would hit follows each completion).
_DEFERRED = frozenset((Op.LAUNCH, Op.NOP, Op.COPY, Op.MEMSET))


def _no_news() -> bool:
    """A pass's ``interrupted`` when nothing can interrupt it (a test's, a bench's)."""
    return False


class Scheduler:
    """Owns the rings of every context and decides what runs where."""

    def __init__(self, config: dict, residency: memory.Residency, counters: Counters,
                 jit_cache_dir: str) -> None:
        self.counters = counters
        #: what this thread (the control loop) counts, merged into ``counters`` per pass
        self.tally = Tally()
        #: the engine time (ns, by kind) the control loop spent on the packets of the
        #: current ring's turn, charged when the turn ends (``_charge_turn``), not per packet
        self._turn_busy = dict.fromkeys(_BUSY_COUNTER, 0)
        self.copy = EnginePool("copy", config["copy_engines"], counters)
        self.compute = EnginePool("compute", config["compute_engines"], counters)
        self.kernels = Kernels(config, jit_cache_dir, counters, self.wake)
        self.residency = residency
        self.rings: list[Ring] = []  # every ring with a doorbell slot
        #: rings that may have work: their doorbell slot moved, or their engine job ended,
        #: or they have packets left
        self.active: dict[Ring, None] = {}
        #: rings whose engine job ended since the loop last looked: back on ``active`` at
        #: its next pass (``_readmit``); the engines append, holding ``_lock``
        self._off_engine: list[Ring] = []
        #: the virtual time of the last turn begun (start-time fair queueing between
        #: contexts): a context or ring that becomes active starts no earlier, so time
        #: spent idle is not banked
        self.vclock = 0
        self.contexts: dict[int, FwContext] = {}
        self.hung = False
        self.held = False  # debugfs sched_hold: take no packets (tests of ordering use it)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()  # engines finishing vs the scheduler's bookkeeping
        #: told of each ring's first fault, (seqno, errno, opcode, address), once its ring
        #: holds it (the firmware reports it to the driver for the fault log)
        self.on_fault: Callable[[Ring, tuple[int, int, int, int]], None] | None = None
        #: devices whose memory is out of reach over the link (Op.LINK): copies touching
        #: it fail with ENOLINK
        self.links_down: set[int] = set()
        #: packets the last pass took from the processes' own rings, not the driver's
        #: default queues (SUBMIT_NOOP): what can saturate the control loop
        #: (host_cpu.Boost)
        self.user_taken = 0
        #: the running pass's ``interrupted`` (``poll``): what ends a turn that would
        #: otherwise go on (``_turn_goes_on``)
        self._interrupted: Callable[[], bool] = _no_news

    # --- wake-ups --------------------------------------------------------------------------
    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\1")  # the scheduler may have work now
        except BlockingIOError:
            pass

    def drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # --- rings -------------------------------------------------------------------------------
    def add(self, ring: Ring) -> None:
        """A new ring: it may hold work already (its producer did not wait for us)."""
        self.rings.append(ring)
        ring.ctx.slots[ring.slot] = ring
        ring.ctx.went_idle(ring)  # what it had taken: anything else in its slot is news
        self._activate(ring)

    def _activate(self, ring: Ring) -> None:
        """``ring`` may have work: its turns, and its context's, start at the clock."""
        if ring not in self.active:
            self.active[ring] = None
            ring.vtime = max(ring.vtime, self.vclock)
            ring.ctx.vtime = max(ring.ctx.vtime, self.vclock)

    def remove(self, ring: Ring) -> None:
        if ring in self.rings:
            self.rings.remove(ring)
        self.active.pop(ring, None)
        if ring.ctx.slots.get(ring.slot) is ring:
            del ring.ctx.slots[ring.slot]

    def pending(self) -> bool:
        """Work the scheduler can start now. Not a ring waiting on a queue's fence or
        parked for its module, even with packets behind: what it waits for wakes the loop
        (a completion on an engine, the module loader). Counted as runnable, such a ring
        kept the loop polling with no timeout, holding the GIL from the thread importing
        numba that the awaited launch needed: a launch on a cold JIT followed by a
        wait_event on another stream never completed on a loaded machine."""
        now = monotonic_ns()
        return any(r.ready() and r.blocked is None and r.parked is None
                   and r.held_until <= now for r in self.active)

    def held_for_s(self) -> float:
        """How long until a packet an adversarial schedule delays may start (seconds; inf:
        none is delayed): the longest the loop may sleep with nothing else to do."""
        until = min((r.held_until for r in self.active if r.held_until), default=0)
        return max(0.0, (until - monotonic_ns()) / 1e9) if until else float("inf")

    def doorbells_moved(self) -> bool:
        return any(c.db.get(userq.DB_SEQ) != c.seen_seq for c in self.contexts.values())

    # --- the scheduler's loop body -----------------------------------------------------
    def scan_doorbells(self) -> None:
        """Activate the rings whose doorbell slots moved (one word per context, and the
        slots only of contexts whose sequence word moved) and those whose engine job
        ended."""
        if self._off_engine:  # read unlocked: one appended meanwhile is seen next pass
            self._readmit()
        for ctx in self.contexts.values():
            for slot in ctx.moved_slots():
                self._activate(ctx.slots[slot])

    def _readmit(self) -> None:
        """The rings whose engine job ended rejoin the scan, unless removed meanwhile (a
        queue destroyed once its job ended)."""
        with self._lock:
            back, self._off_engine = self._off_engine, []
        for ring in back:
            if ring.ctx.slots.get(ring.slot) is ring:
                self._activate(ring)

    def publish(self) -> None:
        """Note each active ring's write pointer now, as what poll() may take. Called
        *before* the mailbox is drained: a packet may rely on control messages its producer
        sent before writing it (a pinned allocation's MAP before a launch whose arguments
        live there), and those are then processed before the packet starts. A write
        pointer that went back, or ran more than a ring ahead of what was taken, is a
        protocol violation: the ring faults (EINVAL) and is cancelled in one step. What lies
        more than the queue's depth past what was taken waits in the ring, unpublished,
        until the ring has room: a producer that ignores the depth gains nothing by it."""
        for ring in self.active:
            if ring.busy:
                continue
            w = ring.wptr
            lie = not ring.faulted and (w < ring.taken or w - ring.taken > userq.RING_SLOTS)
            if ring.faulted or lie:
                ring.blocked = ring.parked = None
                if lie:  # its next packet faults, what was published is cancelled
                    fault = (ring.taken + 1, errno.EINVAL, 0, 0)
                    self._cancel(ring, w, Completion(errno.EINVAL, 0, 0, fault))
                elif w > ring.taken:
                    self._cancel(ring, w, _CANCELLED)
                w = ring.taken
            ring.published = min(w, ring.taken + ring.depth)

    def _cancel(self, ring: Ring, wptr: int, c: Completion) -> None:
        """A faulted ring's published packets complete as cancelled, all in one step,
        unread and without timestamps (a write pointer behind the fence completes
        nothing)."""
        ring.take_through(wptr)
        self.complete(ring, max(wptr, ring.fence), c)

    def poll(self, interrupted: Callable[[], bool] = _no_news) -> int:
        """Run or dispatch what can go now, up to the published write pointers; return how
        many packets were taken. Ends the pass: what it (and publish) counted is merged
        into the counters.

        A pass gives each ring at most ``BATCH`` packets and ``launches.INLINE_WORK`` of
        inline work, as one turn did before, but in turns of about ``TURN_NS``: the next
        turn goes by strict priority, then to the context that has had the least of the
        control loop's time, then to its ring that has had the least (start-time fair
        queueing). So a tenant with many queues gets no more turns than one with one, and a
        bystander's packet waits about one turn behind a flood, not a pass of every ring's
        batch. The pass ends early once ``interrupted()`` says a doorbell or the mailbox has
        news (a new packet may rely on control messages sent before it: ``publish``).

        A lost context's rings leave the active set untaken, checked before each turn: the
        driver clears the context's live-table entry before the process can learn of the
        loss (the doorbell page's "lost" word, ENODEV), so packets rung after it never
        start, even while the loss's message waits behind others on the mailbox."""
        done = self.user_taken = 0
        self._interrupted = interrupted
        if self.active and not (self.hung or self.held):
            for ring in list(self.active):
                if ring.ctx.dropped():
                    self.active.pop(ring, None)
                elif self._nothing_to_take(ring):
                    self._set_aside(ring)  # not looked at this pass
            #: what each ring that had a turn may still take this pass: packets, work done
            budget: dict[Ring, tuple[int, int]] = {}
            while (ring := self._next_turn(budget)) is not None:
                if ring.ctx.dropped():  # lost since the pass began (the live table)
                    self.active.pop(ring, None)
                    continue
                self.vclock = max(self.vclock, ring.ctx.vtime)
                left, work = budget.get(ring, (BATCH, 0))
                t0 = monotonic_ns()
                took = self._poll_ring(ring, left, work)
                spent_ns = monotonic_ns() - t0
                ring.vtime += spent_ns
                ring.ctx.vtime += spent_ns
                done += took
                if ring.slot != userq.ACCEL_DB_DEFAULT_SLOT:
                    self.user_taken += took
                # a turn that took nothing, or ran out of the pass's budget, was the last
                budget[ring] = (left - took if took and not self.kernels.turn_spent() else 0,
                                self.kernels.inline_work)
                if self._nothing_to_take(ring):
                    self._set_aside(ring)
                if interrupted():
                    break
        self.tally.flush(self.counters)
        return done

    @staticmethod
    def _nothing_to_take(ring: Ring) -> bool:
        """Idle (and not draining to close), or waiting for its engine job."""
        return ring.busy or (ring.idle() and not ring.closing)

    def _set_aside(self, ring: Ring) -> None:
        """Out of the scan until there is news: an idle ring until its doorbell slot
        moves, a ring on an engine until its job ends (``complete``, ``_readmit``). Left
        on ``active``, every ring waiting for a copy cost every pass of the loop a look,
        so another tenant's 64 waiting threads took a bystander's no-op from 10 us to
        24 us (docs/containment.md, "Figures")."""
        self.active.pop(ring, None)
        if ring.busy:
            ring.ctx.in_flight(ring)
        else:
            ring.ctx.went_idle(ring)

    def _next_turn(self, budget: dict[Ring, tuple[int, int]]) -> Ring | None:
        """The ring whose turn is next: of those that may take a packet and have budget
        left this pass, the highest priority, then the context that has had the least
        time, then its ring that has."""
        best: Ring | None = None
        now = 0
        for ring in self.active:
            if ring.busy or budget.get(ring, (BATCH,))[0] <= 0:
                continue
            if not (ring.ready() or ring.blocked is not None or ring.parked is not None):
                continue
            if ring.held_until:  # an adversarial schedule delays its next packet
                now = now or monotonic_ns()
                if ring.held_until > now:
                    continue
            if best is None or (-ring.priority, ring.ctx.vtime, ring.adv_rank, ring.vtime) < \
                    (-best.priority, best.ctx.vtime, best.adv_rank, best.vtime):
                best = ring
        return best

    def _poll_ring(self, ring: Ring, left: int, work: int) -> int:
        """One turn of a ring: its packets, up to ``left`` of them, ``TURN_NS`` and the
        pass's inline budget (``work`` of it already spent)."""
        try:
            return self._take_turn(ring, left, work)
        finally:
            self._publish_ended(ring)
            self.kernels.end_turn()
            self._charge_turn(ring)

    def _publish_ended(self, ring: Ring) -> None:
        """The fence passes the turn's run of packets that ended inline (``Ring.stamp``):
        one completion -- its lock, barrier, interrupt check and count -- for the run, not
        one per packet. Called at the turn's end and before anything else of the ring a
        waiter can see (a fault, a hand-off to an engine, a wait, a written value), so
        every state of the ring's words a waiter can read was one it could read before:
        only the fence lags, by at most the turn (``TURN_NS``)."""
        if ring.ended > ring.fence:
            self.complete(ring, ring.ended, _ENDED)

    def _charge_turn(self, ring: Ring) -> None:
        """The turn's inline launches and engine time, to the counters and to the ring's
        context."""
        kernels = self.kernels
        if kernels.inline_launches:
            self.tally.add("launches", kernels.inline_launches)
            kernels.inline_launches = 0
        busy = self._turn_busy
        for kind, ns in busy.items():
            if ns:
                self.tally.add(_BUSY_COUNTER[kind], ns)
                ring.ctx.engine_time.add(kind, ns)
                busy[kind] = 0

    def _take_turn(self, ring: Ring, left: int, work: int) -> int:
        done = 0
        kernels = self.kernels
        kernels.inline_work = work  # what the ring ran inline this pass (turn_spent)
        deadline = monotonic_ns() + TURN_NS
        if ring.parked is not None and not ring.busy:
            if not kernels.module_ready(ring, ring.parked[1]):
                return 0
            seqno, pkt = ring.parked
            ring.parked = None
            done += 1
            if not self._start(ring, seqno, pkt):
                return done
        # ``ring.ready()`` spelled out without its ``fence_only`` test (such rings are
        # never on the scheduler): one call less per packet on the hot path
        while done < left and ring.taken < ring.published and not ring.busy \
                and not kernels.turn_spent():
            if done and monotonic_ns() >= deadline:
                if not self._turn_goes_on(ring):
                    break
                deadline = monotonic_ns() + TURN_NS
            if ring.blocked is not None:
                if not self._unblocked(ring):
                    break
                continue
            if ring.ctx.adversary is not None and ring.ctx.adversary.holds(ring):
                break  # its next packet is delayed: the loop wakes for it (held_for_s)
            seqno, pkt = ring.take()
            done += 1
            if not self._start(ring, seqno, pkt):
                break  # busy on an engine, blocked or parked: next ring
        if ring.blocked is not None and not ring.busy and self._unblocked(ring):
            done += 1
        return done

    def _turn_goes_on(self, ring: Ring) -> bool:
        """The turn's ``TURN_NS`` is up: it goes on for another while its ring is the
        only one on ``active`` (the next turn would be its own) and the pass has no news
        (``poll``'s ``interrupted``: a doorbell or a message ends the turn, as it ends the
        pass), with its run of ended packets published now, so the fence still lags by
        at most ``TURN_NS``. Another turn of the same ring cost ~3 us (the completion, the
        watchdog's disarming and arming, the charge, the turn's choice) and came every two
        or three small launches of a flood."""
        if len(self.active) != 1 or self._interrupted():
            return False
        self._publish_ended(ring)
        return True

    def _unblocked(self, ring: Ring) -> bool:
        """Complete the ring's wait (firmware/waits.py) if it is over, or failed (a value
        wait past its deadline faults the ring), or the ring is being destroyed (it
        drains)."""
        wait = ring.blocked
        assert wait is not None
        now = monotonic_ns()
        try:
            if not wait.ready(now) and not ring.closing:
                return False
            c = Completion(0, wait.start_ns, monotonic_ns())
        except memory.Fault as f:
            c = Completion.failed(ring.taken, wait.opcode, f.code, f.addr, wait.start_ns, now)
        ring.blocked = None
        self.complete(ring, ring.taken, c)
        return True

    def poll_in_s(self) -> float:
        """How long the loop may sleep before a blocked ring needs a look (seconds; inf:
        whatever it waits for wakes the loop): another device's fence and a host-written
        value move without telling us (firmware/waits.py)."""
        now = monotonic_ns()
        at = min((t for r in self.active if r.blocked is not None
                  and (t := r.blocked.poll_at_ns(now)) is not None), default=None)
        return float("inf") if at is None else max(0.0, (at - now) / 1e9)

    def _start(self, ring: Ring, seqno: int, words: tuple[int, ...]) -> bool:
        """Begin one packet, ``words`` as the ring holds it (``userq.RAW_PACKET``). True if
        it finished inline (the ring may go on)."""
        opcode = words[0]
        deferred = opcode in _DEFERRED and ring.ctx.adversary is None
        if not deferred:  # what it does may be seen: the packets before it first
            self._publish_ended(ring)
        start_ns = monotonic_ns()  # the clock of perf_counter too, so also the busy time's
        if ring.faulted:
            self.complete(ring, seqno, Completion(errno.ECANCELED, start_ns, start_ns))
            return True
        try:
            if words[1]:  # flags: none is defined
                raise memory.Fault(0, errno.EINVAL)
            job = self._prepare(ring, seqno, words, start_ns)
        except memory.Fault as f:
            code, addr = f.code, f.addr
        except Exception as exc:  # noqa: BLE001 - whatever a packet does, its queue pays
            log_unexpected(f"packet {opcode} of queue {ring.id}", exc)
            code, addr = errno.EINVAL, 0
        else:
            if job is None:
                end_ns = monotonic_ns()
                if deferred:
                    ring.stamp(seqno, end_ns)
                else:
                    self.complete(ring, seqno, Completion(0, start_ns, end_ns))
                kind = _INLINE_KIND.get(opcode)
                if kind is not None:
                    self._turn_busy[kind] += end_ns - start_ns
                return True
            self._publish_ended(ring)
            if job is _BLOCKED:
                return False
            if job is PARKED:
                ring.parked = (seqno, words)
                return False
            ring.on_engine(True)
            (self.compute if opcode == Op.LAUNCH else self.copy).submit(ring.priority, job)
            return False
        self._publish_ended(ring)
        self.complete(ring, seqno, Completion.failed(seqno, opcode, code, addr, start_ns,
                                                     monotonic_ns()))
        return True

    def _prepare(self, ring: Ring, seqno: int, words: tuple[int, ...], start_ns: int) -> Any:
        """Decode a packet into its opcode's layout (``abi.userq``), validate it, and run
        it now (return None), return the engine job for it, or say that it waits
        (``_BLOCKED``, ``PARKED``). A NOP has no words to decode."""
        opcode = words[0]
        if opcode == Op.LAUNCH:  # a framework's every operator: first
            return self.kernels.launch(self, ring, seqno,
                                       _new_packet(userq.Launch, words[_LAUNCH_WORDS]), start_ns)
        if opcode == Op.NOP:
            return None
        if opcode == Op.COPY:
            return copies.copy(self, ring, seqno, userq.decode(words), start_ns)
        if opcode == Op.MEMSET:
            return copies.memset(self, ring, seqno, userq.decode(words), start_ns)
        if opcode == Op.WAIT_QUEUE:
            pkt = userq.decode(words)
            other = ring.ctx.queues.get(pkt.queue)
            if other is None or other is ring:
                raise memory.Fault(0, errno.EINVAL)
            if other.completed >= pkt.seqno:
                return None
            ring.blocked = waits.QueueWait(other, pkt.seqno, start_ns)
            return _BLOCKED
        if opcode == Op.WAIT_VALUE:
            value_wait = waits.wait_value(ring, userq.decode(words), start_ns,
                                          self.kernels.watchdog_ns)
            if value_wait is None:
                return None
            ring.blocked = value_wait
            return _BLOCKED
        if opcode == Op.WRITE_VALUE:
            waits.write_value(ring, userq.decode(words))
            return None
        if opcode == Op.PREFETCH:
            return copies.prefetch(self, ring, seqno, userq.decode(words), start_ns)
        raise memory.Fault(0, errno.EINVAL)

    # --- completions ----------------------------------------------------------------------
    def complete(self, ring: Ring, seqno: int, c: Completion,
                 from_engine: bool = False) -> None:
        """The one way packets end: write ``c`` back for the packets up to ``seqno``,
        free the ring of its engine, count them, and signal a waiter whose armed seqno the
        fence passed (and the scheduler, for the ring's next packet). Called on an engine
        (``from_engine``) or else on the control loop, which counts into its tally."""
        lock = self._lock
        lock.acquire()  # not ``with``: twice the cost, on every packet's path
        try:
            first_fault = c.fault is not None and not ring.faulted
            passed = ring.complete(seqno, c)
            if from_engine:
                ring.on_engine(False)
                self._off_engine.append(ring)
            userq.full_barrier()  # store the fence, then load what waiters armed (they mirror)
            irq = ring.irq_due()
        finally:
            lock.release()
        adversary = ring.ctx.adversary
        if adversary is not None and adversary.record:  # where a fault now would hit
            adversary.completed(ring, seqno)
        count = self.counters if from_engine else self.tally
        if passed > 0:  # a jump of 2**63 counts as a ring's worth
            count.add("packets", passed if passed <= userq.RING_SLOTS else userq.RING_SLOTS)
        if c.fault is not None:
            count.add("faults")
            if first_fault and self.on_fault is not None:
                self.on_fault(ring, c.fault)
        if irq:
            ring.ctx.signal()
        if from_engine:
            self.wake()


#: Published packets of a ring that had faulted: they never run.
_CANCELLED = Completion(errno.ECANCELED, 0, 0)
#: A turn's run of packets that ended inline, each timestamped already (``Ring.stamp``).
_ENDED = Completion(0, 0, 0)
