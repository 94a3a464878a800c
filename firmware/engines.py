"""The queue scheduler and the engines: how the firmware runs user-mode rings.

Every queue is a ring in shared memory (layout in :mod:`abi.userq`, the shared ABI
header), memory of the process that owns it. The scheduler (the firmware's control thread)
takes packets in order, one queue at a time, high-priority queues first; cheap packets
(no-ops, satisfied waits, small copies, small launches of bounded kernels) run inline, so a
no-op round trip costs no thread hand-off. Heavy ones go to an engine pool (copy engines for
copies, memsets and migrations, compute engines for kernels); the queue is then busy until
the engine finishes, which keeps each queue in order while queues run side by side.

Nothing a process writes is trusted (docs/containment.md): ring words, packets, argument
blocks and modules are checked in Python integers before anything runs, and any exception
while decoding them faults the packet's own queue. The control thread does bounded work per
pass, whatever a process writes: it looks only at rings whose doorbell slot moved (or that
have work in flight), takes at most ``BATCH`` packets from a ring per pass, and faults a
ring whose write pointer jumps (so a +2**63 jump costs one step, not 2**63). Engines take
the highest-priority job first; a long copy moves in chunks and a long launch in time
slices (``QUANTUM_S``), between which an engine gives way to higher-priority work and to
any work waiting once its slice is up, so one giant grid cannot hold both compute engines.

A packet is validated against its context's address space when it runs; a bad one faults
*its own queue*: the ring records the first fault (seqno, errno, opcode, address), later
packets complete as cancelled without running, and nothing else is touched.
"""

from __future__ import annotations

import array
import errno
import heapq
import itertools
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from abi import kernel_lang, userq
from abi.userq import Op
from firmware import memory
from firmware.telemetry import Counters, log_unexpected

#: Copies and memsets up to this size run inline on the scheduler; larger on an engine.
INLINE_BYTES = 256 * 1024
#: Launches of at most this many threads of an already-compiled kernel whose work is
#: statically bounded (``CompiledKernel.inline_ok``: no loops) run inline on the scheduler.
INLINE_THREADS = 16 * 1024
#: An inline launch that still runs this long is stopped (it cannot happen for a bounded
#: kernel; the control thread must never be held long).
INLINE_WATCHDOG_S = 0.25
#: Engines move large copies in chunks of this size and check for higher-priority work
#: between chunks: the worst-case wait a high-priority packet sees on a busy copy engine.
COPY_CHUNK = 4 * 1024 * 1024
#: A launch runs in slices of about this long (a block is never cut): between slices its
#: engine takes waiting work first.
QUANTUM_S = 0.02
#: Packets the scheduler takes from one ring per pass, so a ring full of no-ops cannot
#: hold the control loop.
BATCH = 64
#: A context with at most this many rings has its doorbell slots compared one by one;
#: more are compared in one numpy operation.
_SCAN_IN_PYTHON = 16
#: The engine threads' nice value (see EnginePool._engine).
ENGINE_NICE = 10

class Ring(userq.RingView):
    """One queue's ring as the firmware, its consumer, sees it."""

    def __init__(self, ctx: FwContext, qid: int, priority: int, slot: int, fd: int,
                 fence_only: bool = False) -> None:
        super().__init__(fd)
        self.ctx, self.id, self.priority, self.slot = ctx, qid, priority, slot
        self.fence_only = fence_only  # another device's queue, imported to wait on
        self.taken = self.rptr
        self.published = self.taken  # what the scheduler may take (Scheduler.publish)
        self.busy = False  # an engine runs its current packet
        self.blocked: tuple[Ring, int] | None = None  # waiting for (ring, seqno)
        self.parked: tuple[int, tuple[int, ...]] | None = None  # a launch awaiting its module
        self.faulted = self.read_fault()[0] != 0
        self.closing = False
        self.last_irq = 0
        #: the fence as this firmware wrote it: the word in the ring is the process's
        #: memory, which it may overwrite (the ring's closing and unmaps go by this one)
        self.fence = self.taken

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

    def take(self) -> tuple[int, tuple[int, ...]]:
        seqno = self.taken + 1
        pkt = userq.PACKET.unpack_from(self.mem, userq.RING_PACKETS + ((seqno - 1) % userq.RING_SLOTS) * 64)
        self.taken = seqno
        self.set(userq.RING_RPTR, seqno)
        return seqno, pkt

    def complete(self, seqno: int, status: int, addr: int, opcode: int) -> None:
        """Publish a completion: timestamp, first fault, then the fence (in that order)."""
        self.stamp(seqno, time.monotonic_ns())
        if status and not self.faulted:
            self.write_fault(seqno, status, opcode, addr)
            self.faulted = True
        self.fence = seqno
        self.set(userq.RING_COMPLETED, seqno)

    def cancel_through(self, wptr: int) -> int:
        """A faulted ring's published packets complete as cancelled, all in one step;
        returns how many."""
        n = wptr - self.taken
        self.taken = self.fence = wptr
        self.set(userq.RING_RPTR, wptr)
        self.set(userq.RING_COMPLETED, wptr)
        return n

    def irq_due(self) -> bool:
        """Whether the fence passed the seqno a waiter armed (once per arming)."""
        armed = self.get(userq.RING_IRQ_SEQNO)
        done = self.completed
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

    def signal(self) -> None:
        """One byte on the process's event pipe (never blocks; a full pipe already says
        "look", a closed one has no reader)."""
        try:
            os.write(self.event, b"\1")
        except (BlockingIOError, BrokenPipeError):
            pass

    def moved_slots(self) -> list[int]:
        """Doorbell slots of known rings that hold news, if the page's sequence moved."""
        seq = self.db.get(userq.DB_SEQ)
        if seq == self.seen_seq:
            return []
        self.seen_seq = seq
        if len(self.slots) <= _SCAN_IN_PYTHON:  # a few rings: cheaper than numpy's calls
            words, base, consumed = self.db.words, userq.DB_SLOTS >> 3, self.consumed
            return [slot for slot in self.slots if words[base + slot] != consumed[slot]]
        now = np.frombuffer(self.db.mem, np.uint64, userq.ACCEL_DB_SLOT_COUNT, userq.DB_SLOTS)
        moved = np.flatnonzero(now != np.frombuffer(self.consumed, np.uint64))
        del now  # the page's mapping must not stay exported
        return [int(i) for i in moved if int(i) in self.slots]

    def went_idle(self, ring: Ring) -> None:
        self.consumed[ring.slot] = ring.taken

    def close(self) -> None:
        for fd in (self.doorbell, self.event):
            if fd >= 0:
                os.close(fd)
        self.doorbell = self.event = -1
        self.db.close()
        for ring in self.queues.values():
            ring.close()
        self.queues.clear()
        self.slots.clear()
        self.modules.clear()


# --- engines ---------------------------------------------------------------------------
class Job:
    """Engine work for one packet. ``run`` returns True when done, False when it gave
    way (it is queued again, behind the work it yields to). It must not raise; should it,
    the engine calls ``fail`` so the packet still completes (as a fault)."""

    def run(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class FnJob(Job):
    """A job from a function; a failure completes its packet with EIO (an engine error)."""

    def __init__(self, sched: Scheduler, ring: Ring, seqno: int, opcode: int,
                 fn: Callable[[], bool]) -> None:
        self.sched, self.ring, self.seqno, self.opcode, self.fn = sched, ring, seqno, opcode, fn

    def run(self) -> bool:
        try:
            return self.fn()
        except Exception as exc:  # noqa: BLE001 - an engine must outlive any packet
            self.fail(exc)
            return True

    def fail(self, exc: BaseException) -> None:
        log_unexpected(f"{Op(self.opcode).name} failed on an engine", exc)
        self.sched.count("faults")
        self.sched.finish(self.ring, self.seqno, errno.EIO, 0, self.opcode, from_engine=True)


@dataclass(order=True)
class _Queued:
    rank: tuple[int, int]  # (-priority, arrival): higher priority first, then FIFO
    job: Job = field(compare=False)


class EnginePool:
    """N engines of one kind, taking the highest-priority job first."""

    def __init__(self, name: str, count: int, sched: Scheduler) -> None:
        self._heap: list[_Queued] = []
        self._cond = threading.Condition()
        self._arrivals = itertools.count()
        self._sched = sched
        self._busy = 0
        for i in range(count):
            threading.Thread(target=self._engine, name=f"{name}{i}", daemon=True).start()

    def submit(self, priority: int, job: Job) -> None:
        with self._cond:
            heapq.heappush(self._heap, _Queued((-priority, next(self._arrivals)), job))
            self._cond.notify()

    def higher_waiting(self, priority: int) -> bool:
        """Is a job of higher priority than ``priority`` waiting? (checked between chunks)"""
        with self._cond:
            return bool(self._heap) and -self._heap[0].rank[0] > priority

    def waiting(self, priority: int) -> bool:
        """Is a job of at least ``priority`` waiting? (checked when a slice is up)"""
        with self._cond:
            return bool(self._heap) and -self._heap[0].rank[0] >= priority

    def _engine(self) -> None:
        # The engines are the device's own hardware; here they are threads sharing the
        # host's CPUs with the control loop and with every tenant's host code. A lower
        # priority keeps a busy engine from delaying the control loop (and a tenant's
        # submissions) by a scheduler time slice on every wake-up.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ENGINE_NICE)
        except OSError:
            pass
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                item = heapq.heappop(self._heap)
                self._busy += 1
                self._sched.peak("copy_engines_busy_peak", self._busy)
            try:
                done = item.job.run()
            except BaseException as exc:  # noqa: BLE001 - last resort: the engine lives on
                item.job.fail(exc)
                done = True
            with self._cond:
                self._busy -= 1
                if not done:  # gave way: back in line behind the work it yields to
                    self._sched.count("preemptions")
                    heapq.heappush(self._heap, _Queued((item.rank[0], next(self._arrivals)),
                                                       item.job))
                    self._cond.notify()
            # a finished job holds its packet's memory (a mapping and its descriptor):
            # let it go now, not when the next job comes
            del item


class Deadlines:
    """One timer thread for every running launch: the watchdog (stop a block that runs
    too long) and the time slice (ask the launch to stop at its next block boundary).
    ``preempt`` and ``watchdog`` are the abort word's values for the two (the generated
    code's ABI, firmware/kernel_lower.py)."""

    def __init__(self, preempt: int, watchdog: int) -> None:
        self.preempt, self.watchdog = preempt, watchdog
        self._cond = threading.Condition()
        self._entries: dict[int, tuple[np.ndarray, float, float]] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._run, name="deadlines", daemon=True).start()

    def add(self, abort: np.ndarray, watchdog_s: float, quantum_s: float | None) -> int:
        now = time.monotonic()
        token = next(self._ids)
        with self._cond:
            self._entries[token] = (abort, now + watchdog_s,
                                    now + quantum_s if quantum_s else float("inf"))
            self._cond.notify()
        return token

    def remove(self, token: int) -> None:
        with self._cond:
            self._entries.pop(token, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                nearest = float("inf")
                for abort, watchdog, quantum in self._entries.values():
                    if now >= watchdog:
                        abort[0] = self.watchdog
                    elif now >= quantum:
                        if abort[0] == 0:
                            abort[0] = self.preempt
                        nearest = min(nearest, watchdog)
                    else:
                        nearest = min(nearest, quantum, watchdog)
                self._cond.wait(None if nearest == float("inf") else max(0.0, nearest - now))


class Scheduler:
    """Owns the rings of every context and decides what runs where."""

    def __init__(self, config: dict, residency: memory.Residency, counters: Counters,
                 jit_cache_dir: str) -> None:
        self.counters = counters
        self.copy = EnginePool("copy", config["copy_engines"], self)
        self.compute = EnginePool("compute", config["compute_engines"], self)
        self.compute_engines = config["compute_engines"]
        self.max_threads = config["max_threads_per_block"]
        self.max_shared = config["max_shared_mem_per_block"]
        #: what this device has: a kernel whose source uses anything else (mma, atomics,
        #: block-shared memory) faults with EOPNOTSUPP, whatever its IR's flags claimed
        self.capabilities = frozenset(config.get("capabilities", ()))
        self.watchdog_s = config.get("watchdog_ms", 10_000) / 1000
        self.deadlines: Deadlines | None = None  # with the JIT (its thread, its constants)
        self._jit_cache_dir = jit_cache_dir
        self._jit: Any = None
        self._jit_lock = threading.Lock()
        self.residency = residency
        self.rings: list[Ring] = []  # every ring with a doorbell slot
        #: rings that may have work: their doorbell slot moved, or they have work in flight
        self.active: dict[Ring, None] = {}
        self.contexts: dict[int, FwContext] = {}
        self.hung = False
        self.held = False  # debugfs sched_hold: take no packets (tests of ordering use it)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()  # engines finishing vs the scheduler's bookkeeping
        self._modules: queue.SimpleQueue[FwModule] = queue.SimpleQueue()
        threading.Thread(target=self._module_loader, name="module-loader", daemon=True).start()

    # --- counters, updated from every thread ----------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    def peak(self, name: str, value: int) -> None:
        self.counters.peak(name, value)

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
        self.active[ring] = None

    def remove(self, ring: Ring) -> None:
        if ring in self.rings:
            self.rings.remove(ring)
        self.active.pop(ring, None)
        if ring.ctx.slots.get(ring.slot) is ring:
            del ring.ctx.slots[ring.slot]

    def pending(self) -> bool:
        """Work the scheduler can start now (a launch parked for its module is woken by
        the loader)."""
        return any(r.ready() for r in self.active)

    def doorbells_moved(self) -> bool:
        return any(c.db.get(userq.DB_SEQ) != c.seen_seq for c in self.contexts.values())

    # --- the scheduler's loop body -----------------------------------------------------
    def scan_doorbells(self) -> None:
        """Activate the rings whose doorbell slots moved: one word per context, and the
        slots only of contexts whose sequence word moved."""
        for ctx in self.contexts.values():
            for slot in ctx.moved_slots():
                self.active[ctx.slots[slot]] = None

    def publish(self) -> None:
        """Note each active ring's write pointer now, as what poll() may take. Called
        *before* the mailbox is drained: a packet may rely on control messages its producer
        sent before writing it (a pinned allocation's MAP before a launch whose arguments
        live there), and those are then processed before the packet starts. A write
        pointer that went back, or ran more than a ring ahead of what was taken, is a
        protocol violation: the ring faults (EINVAL) and is cancelled in one step."""
        for ring in self.active:
            if ring.busy:
                continue
            w = ring.wptr
            if not ring.faulted and (w < ring.taken or w - ring.taken > userq.RING_SLOTS):
                self.count("faults")
                with self._lock:
                    ring.write_fault(ring.taken + 1, errno.EINVAL, 0, 0)
                    ring.faulted = True
            if ring.faulted:
                ring.blocked = ring.parked = None
                if w > ring.taken:
                    with self._lock:
                        cancelled = ring.cancel_through(w)
                        irq = ring.irq_due()
                    self.count("packets", min(cancelled, userq.RING_SLOTS))
                    if irq:
                        ring.ctx.signal()
                w = ring.taken
            ring.published = w

    def poll(self) -> int:
        """Run or dispatch what can go now, up to the published write pointers and at most
        ``BATCH`` packets a ring; return how many packets were taken."""
        if self.hung or self.held:
            return 0
        done = 0
        for ring in sorted(self.active, key=lambda r: -r.priority):
            done += self._poll_ring(ring)
            if ring.idle() and not ring.closing:
                self.active.pop(ring, None)
                ring.ctx.went_idle(ring)
        return done

    def _poll_ring(self, ring: Ring) -> int:
        done = 0
        if ring.parked is not None and not ring.busy:
            if not self._module_ready(ring, ring.parked[1]):
                return 0
            seqno, pkt = ring.parked
            ring.parked = None
            done += 1
            if not self._start(ring, seqno, pkt):
                return done
        while done < BATCH and ring.ready():
            if ring.blocked is not None:
                other, target = ring.blocked
                if other.completed < target and not ring.closing:
                    break
                ring.blocked = None
                self.finish(ring, ring.taken, 0, 0, Op.WAIT_QUEUE)
                continue
            seqno, pkt = ring.take()
            done += 1
            if not self._start(ring, seqno, pkt):
                break  # busy on an engine, blocked or parked: next ring
        if ring.blocked is not None and not ring.busy:
            other, target = ring.blocked
            if other.completed >= target or ring.closing:  # a destroyed queue drains
                ring.blocked = None
                self.finish(ring, ring.taken, 0, 0, Op.WAIT_QUEUE)
                done += 1
        return done

    def _module_ready(self, ring: Ring, pkt: tuple[int, ...]) -> bool:
        mod = ring.ctx.modules.get(pkt[2] >> 16)
        return mod is None or mod.kernels is not None or mod.error != 0

    def _start(self, ring: Ring, seqno: int, pkt: tuple[int, ...]) -> bool:
        """Begin one packet. True if it finished inline (the ring may go on)."""
        opcode, flags, *a = pkt
        if ring.faulted:
            self.finish(ring, seqno, errno.ECANCELED, 0, opcode)
            return True
        try:
            if flags:
                raise memory.Fault(0, errno.EINVAL)
            job = self._prepare(ring, seqno, opcode, a)
        except memory.Fault as f:
            self.count("faults")
            self.finish(ring, seqno, f.code, f.addr, opcode)
            return True
        except Exception as exc:  # noqa: BLE001 - whatever a packet does, its queue pays
            log_unexpected(f"packet {opcode} of queue {ring.id}", exc)
            self.count("faults")
            self.finish(ring, seqno, errno.EINVAL, 0, opcode)
            return True
        if job is None:
            self.finish(ring, seqno, 0, 0, opcode)
            return True
        if job is _BLOCKED:
            return False
        if job is _PARKED:
            ring.parked = (seqno, tuple(pkt))
            return False
        ring.busy = True
        (self.compute if opcode == Op.LAUNCH else self.copy).submit(ring.priority, job)
        return False

    def _prepare(self, ring: Ring, seqno: int, opcode: int, a: list[int]) -> Any:
        """Validate a packet; run it now (return None) or return the engine job for it."""
        space = ring.ctx.space
        if opcode == Op.NOP:
            return None
        if opcode == Op.COPY:
            dst, src, n = a[0], a[1], a[2]
            (md, od), (ms, os_) = space.resolve(dst, n), space.resolve(src, n)
            return self._copy_job(ring, seqno, opcode, n, lambda lo, hi: np.copyto(
                md.data[od + lo : od + hi], ms.data[os_ + lo : os_ + hi]), (md, od), (ms, os_))
        if opcode == Op.MEMSET:
            dst, n, value = a[0], a[1], a[2]
            if value > 0xFF:
                raise memory.Fault(0, errno.EINVAL)
            m, off = space.resolve(dst, n)
            return self._copy_job(ring, seqno, opcode, n, lambda lo, hi: m.data[
                off + lo : off + hi].fill(value), (m, off))
        if opcode == Op.WAIT_QUEUE:
            other = ring.ctx.queues.get(a[0])
            if other is None or other is ring:
                raise memory.Fault(0, errno.EINVAL)
            if other.completed >= a[1]:
                return None
            ring.blocked = (other, a[1])
            return _BLOCKED
        if opcode == Op.PREFETCH:
            va, n, to_device = a[0], a[1], a[2]
            m, off = space.resolve(va, n)
            if m.resident is None or to_device > 1:
                raise memory.Fault(va, errno.EINVAL)
            move = self.residency.touch_device if to_device else self.residency.to_host

            def prefetch() -> bool:
                if n:
                    move(m, off, off + n)
                self.finish(ring, seqno, 0, 0, opcode, from_engine=True)
                return True
            return FnJob(self, ring, seqno, opcode, prefetch)
        if opcode == Op.LAUNCH:
            return self._launch(ring, seqno, a)
        raise memory.Fault(0, errno.EINVAL)

    # --- modules --------------------------------------------------------------------------
    def load_module(self, ctx: FwContext, module_id: int, raw: bytes) -> None:
        """Parse a module's image off the control thread (its launches wait for it)."""
        mod = ctx.modules[module_id] = FwModule(raw)
        self._modules.put(mod)
        self.warm_up()  # kernels are coming: load the JIT (numba) off the hot path

    def _module_loader(self) -> None:
        while True:
            mod = self._modules.get()
            try:
                kernels = json.loads(mod.raw)["kernels"]
                if not isinstance(kernels, dict):
                    raise ValueError("kernels is not an object")
                parsed = [(str(name), k) for name, k in kernels.items()]
                if not all(isinstance(k, dict) for _, k in parsed):
                    raise ValueError("a kernel is not an object")
                mod.kernels = parsed
            except Exception:  # noqa: BLE001 - a module that does not parse is the module's
                mod.error = errno.EINVAL
            mod.raw = b""
            self.wake()

    # --- kernels ------------------------------------------------------------------------
    def jit(self) -> Any:
        """The kernel cache, created on first use (numba loads only when kernels run, or
        at boot when the cache says kernels ran here before: see warm_up)."""
        with self._jit_lock:
            if self._jit is None:
                from firmware import jit

                jit.warm_up()
                self.deadlines = Deadlines(jit.ABORT_PREEMPT, jit.ABORT_WATCHDOG)
                self._jit = jit.KernelCache(Path(self._jit_cache_dir))
                self.counters.peak("jit_ready", 1)
            return self._jit

    def _launch(self, ring: Ring, seqno: int, a: list[int]) -> Any:
        """Check a LAUNCH (everything the process wrote, in Python integers), decode its
        arguments, and run it inline or return its first engine job."""
        handle, grid_w, block_w, dynamic, args_va, args_len = a[:6]
        mod = ring.ctx.modules.get(handle >> 16)
        if mod is None:
            raise memory.Fault(0, errno.EINVAL)
        if mod.kernels is None:
            if mod.error:
                raise memory.Fault(0, mod.error)
            return _PARKED
        if (handle & 0xFFFF) >= len(mod.kernels):
            raise memory.Fault(0, errno.EINVAL)
        name, kir = mod.kernels[handle & 0xFFFF]
        static = kir.get("shared_mem", 0)
        if type(static) is not int or not 0 <= static <= self.max_shared \
                or dynamic > self.max_shared - static:  # checked again against the source
            raise memory.Fault(0, errno.EINVAL)
        grid, block = userq.unpack_dims(grid_w), userq.unpack_dims(block_w)
        threads = block[0] * block[1] * block[2]
        if min(grid) < 1 or min(block) < 1 or threads > self.max_threads:
            raise memory.Fault(0, errno.EINVAL)
        if args_len > userq.ACCEL_ARGS_MAX:
            raise memory.Fault(args_va, errno.EINVAL)
        m, off = ring.ctx.space.resolve(args_va, args_len)
        values, types, buffers = decode_args(ring.ctx.space, bytes(m.data[off : off + args_len]),
                                             kir.get("params"))
        launch = Launch(ring, seqno, name, kir, types, values, buffers, grid, block, dynamic)
        nblocks = grid[0] * grid[1] * grid[2]
        if nblocks * threads <= INLINE_THREADS and self._jit is not None:
            kernel = self._jit.cached(kir, types, _options())
            # small, compiled and statically bounded: no engine hand-off (no GIL ping-pong)
            if kernel is not None and kernel.inline_ok:
                if not kernel.capabilities <= self.capabilities:
                    raise memory.Fault(0, errno.EOPNOTSUPP)
                self._run_inline(launch, kernel, nblocks)
                return None
        parts = max(1, min(self.compute_engines, nblocks))
        bounds = [nblocks * i // parts for i in range(parts + 1)]
        launch.remaining = parts
        jobs = [_BlockJob(self, launch, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        for job in jobs[1:]:
            self.compute.submit(ring.priority, job)
        return jobs[0]  # the scheduler submits the first, marking the ring busy

    def warm_up(self) -> None:
        """Create the JIT (importing numba and loading its CPU target take ~0.4 s) on a
        side thread."""
        if self._jit is None:
            threading.Thread(target=self.jit, name="jit-warm-up", daemon=True).start()

    def _run_inline(self, launch: Launch, kernel: Any, nblocks: int) -> None:
        """Run a small launch on the scheduler thread; faults raise as packet faults."""
        deadlines = self.deadlines
        assert deadlines is not None  # the JIT exists
        abort = np.zeros(1, np.int64)
        token = deadlines.add(abort, INLINE_WATCHDOG_S, None)
        try:
            kernel.run(0, nblocks, launch.grid, launch.block, launch.args, abort,
                       launch.dynamic_shared)
        except Exception as exc:  # noqa: BLE001 - a kernel's fault is the device's, not ours
            code, addr = fault_of(launch, exc)
            raise memory.Fault(addr, code) from None
        finally:
            deadlines.remove(token)
        if abort[0] > deadlines.preempt:
            raise memory.Fault(0, errno.ETIMEDOUT)
        self.count("launches")

    def launch_fault(self, launch: Launch, code: int, addr: int) -> None:
        with launch.lock:
            if launch.fault is None:
                launch.fault = (code, addr)
                self.count("faults")

    # --- copies ---------------------------------------------------------------------------
    def _copy_job(self, ring: Ring, seqno: int, opcode: int, n: int,
                  move: Callable[[int, int], object],
                  *touched: tuple[memory.Mapping, int]) -> Job | None:
        """Copy-engine work over ``n`` bytes in chunks; inline when small."""
        for m, off in touched:
            if m.resident is not None and n:
                self.residency.touch_device(m, off, off + n)
        if n <= INLINE_BYTES:
            move(0, n)
            self._count_copy(opcode, n)
            return None
        progress = [0]

        def run() -> bool:
            while progress[0] < n:
                hi = min(n, progress[0] + COPY_CHUNK)
                move(progress[0], hi)
                progress[0] = hi
                if progress[0] < n and self.copy.higher_waiting(ring.priority):
                    return False  # preempted between chunks
            self._count_copy(opcode, n)
            self.finish(ring, seqno, 0, 0, opcode, from_engine=True)
            return True
        return FnJob(self, ring, seqno, opcode, run)

    def _count_copy(self, opcode: int, n: int) -> None:
        if opcode == Op.COPY:
            self.counters.add("copies")
            self.counters.add("copy_bytes", n)

    def finish(self, ring: Ring, seqno: int, status: int, addr: int, opcode: int,
               from_engine: bool = False) -> None:
        with self._lock:
            ring.complete(seqno, status, addr, opcode)
            if from_engine:
                ring.busy = False
            userq.full_barrier()  # store the fence, then load what waiters armed (they mirror)
            irq = ring.irq_due()
        self.count("packets")
        if irq:
            ring.ctx.signal()
        if from_engine:
            self.wake()


_BLOCKED = object()
_PARKED = object()


def _options() -> Any:
    from firmware.jit import Options

    return Options()


def fault_of(launch: Launch, exc: Exception) -> tuple[int, int]:
    """(errno, device address) of a launch stopped by ``exc``. A bounds miss names the
    address it tried, saturated into the 64-bit space (``x[1 << 62]`` of a float32 buffer
    is past 2**64: the ring then reads U64_MAX)."""
    kind = getattr(exc, "kind", None)
    if kind == "watchdog":
        return errno.ETIMEDOUT, 0
    if kind == "bounds":
        index = getattr(exc, "index", None)
        for pname, va, itemsize in launch.buffers:
            if pname == getattr(exc, "param", None) and isinstance(index, int):
                return errno.EFAULT, min(max(0, va + index * itemsize), userq.U64_MAX)
        return errno.EFAULT, 0
    from firmware.kernel_check import KernelCompileError  # loaded: a kernel ran

    if kind is None and not isinstance(exc, KernelCompileError):
        log_unexpected(f"kernel {launch.name} failed", exc)  # a kernel that does not
    return errno.EINVAL, 0  # validate or compile is the kernel's fault, not news


class _Watchdog(Exception):
    pass


class _BlockJob(Job):
    """Engine work over blocks [lo, hi) of a launch: in time slices, giving way between
    slices to higher-priority work, and to any waiting work once a slice is up; a block
    running longer than the watchdog is stopped."""

    def __init__(self, sched: Scheduler, launch: Launch, lo: int, hi: int) -> None:
        self.sched, self.launch, self.next, self.hi = sched, launch, lo, hi

    def run(self) -> bool:
        sched, launch = self.sched, self.launch
        try:
            jit = sched.jit()
            kernel = jit.get(launch.kernel_ir, launch.arg_types, _options())
            sched.counters.peak("jit_compiles", jit.compiles)
            sched.counters.peak("jit_hits", jit.hits)
            if not kernel.capabilities <= sched.capabilities:
                sched.launch_fault(launch, errno.EOPNOTSUPP, 0)
                self._part_done()
                return True
            deadlines = sched.deadlines
            assert deadlines is not None  # made with the JIT
            abort = np.zeros(1, np.int64)
            while self.next < self.hi and launch.fault is None:
                if launch.ring.faulted:  # its context is being torn down: stop, unrun
                    sched.launch_fault(launch, errno.ECANCELED, 0)
                    break
                abort[0] = 0
                token = deadlines.add(abort, sched.watchdog_s, QUANTUM_S)
                try:
                    done_to = kernel.run(self.next, self.hi, launch.grid, launch.block,
                                         launch.args, abort, launch.dynamic_shared)
                finally:
                    deadlines.remove(token)
                if abort[0] > deadlines.preempt:  # the watchdog, between blocks
                    raise _Watchdog()
                self.next = done_to
                if self.next < self.hi and sched.compute.waiting(launch.ring.priority):
                    return False  # the slice is up and work waits: give way
        except _Watchdog:
            sched.launch_fault(launch, errno.ETIMEDOUT, 0)
        except Exception as exc:  # noqa: BLE001 - a kernel's fault is the device's, not ours
            sched.launch_fault(launch, *fault_of(launch, exc))
        self._part_done()
        return True

    def fail(self, exc: BaseException) -> None:
        log_unexpected(f"kernel {self.launch.name} failed on an engine", exc)
        self.sched.launch_fault(self.launch, errno.EIO, 0)
        self._part_done()

    def _part_done(self) -> None:
        launch = self.launch
        with launch.lock:
            launch.remaining -= 1
            last = launch.remaining == 0
        if last:
            status, addr = launch.fault or (0, 0)
            if not status:
                self.sched.count("launches")
            self.sched.finish(launch.ring, launch.seqno, status, addr, Op.LAUNCH,
                              from_engine=True)


# --- kernels --------------------------------------------------------------------------------
@dataclass
class Launch:
    """One LAUNCH packet in flight: its blocks are split across the compute engines."""

    ring: Ring
    seqno: int
    name: str
    kernel_ir: dict
    arg_types: tuple[str, ...]
    args: list
    buffers: list[tuple[str, int, int]]  # (param, va, itemsize) to turn a fault into an address
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_shared: int  # bytes per block for its dynamic_shared arrays
    remaining: int = 0  # engine jobs not finished
    fault: tuple[int, int] | None = None  # (errno, address)
    lock: threading.Lock = field(default_factory=threading.Lock)


def decode_args(space: memory.AddressSpace, raw: bytes, params: Any
                ) -> tuple[list, tuple[str, ...], list[tuple[str, int, int]]]:
    """The argument block of a launch -> (values, types for the JIT, buffer addresses).
    Everything is the process's: a record that does not fit its kernel's parameters, a
    shape whose product is not the buffer's element count (checked in Python integers,
    so it cannot overflow) or a buffer outside the context's memory faults the launch."""
    if not isinstance(params, list) or len(raw) % userq.ARG_RECORD.size:
        raise memory.Fault(0, errno.EINVAL)
    recs = [userq.ARG_RECORD.unpack_from(raw, off) for off in range(0, len(raw), userq.ARG_RECORD.size)]
    values: list = []
    types: list[str] = []
    buffers: list[tuple[str, int, int]] = []
    i = 0
    for p in params:
        if i >= len(recs) or not isinstance(p, dict):
            raise memory.Fault(0, errno.EINVAL)
        kind, code, value, nbytes = recs[i]
        i += 1
        dtype_name = kernel_lang.DTYPE_NAMES.get(code)
        want = p.get("dtype")
        if dtype_name is None or not (want is None or want == dtype_name):
            raise memory.Fault(0, errno.EINVAL)
        dtype = np.dtype(dtype_name)
        if kind == userq.ARG_SCALAR and p.get("kind") == "scalar":
            values.append(np.frombuffer(value.to_bytes(8, "little")[: dtype.itemsize], dtype)[0])
            types.append(dtype_name)
        elif kind == userq.ARG_BUFFER and p.get("kind") == "buffer":
            shape: list[int] = []
            while i < len(recs) and recs[i][0] == userq.ARG_SHAPE:
                count = recs[i][1]
                if count not in (1, 2):
                    raise memory.Fault(0, errno.EINVAL)
                shape += [int(recs[i][2]), int(recs[i][3])][:count]
                i += 1
            if nbytes % dtype.itemsize or len(shape) > 8:
                raise memory.Fault(value, errno.EINVAL)
            m, off = space.resolve(value, nbytes)
            elements = nbytes // dtype.itemsize
            shape = shape or [elements]
            product = 1
            for d in shape:
                product *= d
            if product != elements:
                raise memory.Fault(value, errno.EINVAL)
            values.append(m.data[off : off + nbytes].view(dtype).reshape(shape))
            types.append(f"{dtype_name}[{len(shape)}d]")
            buffers.append((str(p.get("name")), value, dtype.itemsize))
        else:
            raise memory.Fault(0, errno.EINVAL)
    if i != len(recs):
        raise memory.Fault(0, errno.EINVAL)
    return values, tuple(types), buffers
