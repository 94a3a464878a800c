"""The queue scheduler and the engines: how the firmware runs user-mode rings.

Every queue is a ring in shared memory (layout in :mod:`kmod_emul.uapi`, the shared ABI
header). The scheduler (the firmware's control thread) takes packets in order, one queue at
a time, high-priority queues first; cheap packets (no-ops, satisfied waits, small copies)
run inline, so a no-op round trip costs no thread hand-off. Heavy ones go to an engine
pool (copy engines for copies, memsets and migrations); the queue is then busy until the
engine finishes, which keeps each queue in order while queues run side by side.

Engines take the highest-priority job first, and a long copy is done in chunks: between
chunks an engine that sees higher-priority work waiting puts the rest of its copy back and
takes that work (preemption at chunk granularity, see docs/submission.md).

A packet is validated against its context's address space when it runs; a bad one faults
*its own queue*: the ring records the first fault (seqno, errno, opcode, address), later
packets complete as cancelled without running, and nothing else is touched.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from firmware import memory
from kmod_emul import uapi
from kmod_emul.uapi import Op

_PKT = struct.Struct("<II7Q")
#: Copies and memsets up to this size run inline on the scheduler; larger on an engine.
INLINE_BYTES = 256 * 1024
#: Launches of at most this many threads, already compiled, run inline on the scheduler.
INLINE_THREADS = 16 * 1024
#: Engines move large copies in chunks of this size and check for higher-priority work
#: between chunks: the worst-case wait a high-priority packet sees on a busy copy engine.
COPY_CHUNK = 4 * 1024 * 1024


class Ring(uapi.RingView):
    """One queue's ring as the firmware, its consumer, sees it."""

    def __init__(self, ctx: FwContext, qid: int, priority: int, path: str,
                 fence_only: bool = False) -> None:
        super().__init__(path)
        self.ctx, self.id, self.priority = ctx, qid, priority
        self.fence_only = fence_only  # another device's queue, imported to wait on
        self.taken = self.rptr
        self.published = self.taken  # what the scheduler may take (Scheduler.publish)
        self.busy = False  # an engine runs its current packet
        self.blocked: tuple[Ring, int] | None = None  # waiting for (ring, seqno)
        self.faulted = self.read_fault()[0] != 0
        self.closing = False
        self.last_irq = 0

    def ready(self) -> bool:
        """Has a packet the scheduler could take now."""
        return not self.busy and not self.fence_only and self.taken < self.wptr

    def take(self) -> tuple[int, tuple[int, ...]]:
        seqno = self.taken + 1
        pkt = _PKT.unpack_from(self.mem, uapi.RING_PACKETS + ((seqno - 1) % uapi.RING_SLOTS) * 64)
        self.taken = seqno
        self.set(uapi.RING_RPTR, seqno)
        return seqno, pkt

    def complete(self, seqno: int, status: int, addr: int, opcode: int) -> None:
        """Publish a completion: timestamp, first fault, then the fence (in that order)."""
        self.stamp(seqno, time.monotonic_ns())
        if status and not self.faulted:
            self.write_fault(seqno, status, opcode, addr)
            self.faulted = True
        self.set(uapi.RING_COMPLETED, seqno)

    def irq_due(self) -> int:
        """The fence value to interrupt the driver with, or 0."""
        armed = self.get(uapi.RING_IRQ_SEQNO)
        done = self.completed
        if armed and done >= armed and armed > self.last_irq:
            self.last_irq = done
            return done
        return 0

    def set_sleeping(self, value: int) -> None:
        self.set(uapi.RING_SLEEPING, value)


@dataclass(eq=False)
class FwContext:
    id: int
    space: memory.AddressSpace = field(default_factory=memory.AddressSpace)
    queues: dict[int, Ring] = field(default_factory=dict)
    doorbell: int = -1  # the FIFO's read end (-1 before it is opened)
    #: loaded modules: module id -> [(kernel name, kernel IR)] in the module's order
    modules: dict[int, list[tuple[str, dict]]] = field(default_factory=dict)
    _doorbell_keepalive: int = -1  # a write end of our own, so the FIFO never reads EOF


@dataclass(order=True)
class _Job:
    rank: tuple[int, int]  # (-priority, arrival): higher priority first, then FIFO
    run: Callable[[], bool] = field(compare=False)  # True: done; False: preempted, re-queue


class EnginePool:
    """N engines of one kind, taking the highest-priority job first."""

    def __init__(self, name: str, count: int, stats: dict[str, int]) -> None:
        self._heap: list[_Job] = []
        self._cond = threading.Condition()
        self._arrivals = itertools.count()
        self._stats = stats
        self._busy = 0
        for i in range(count):
            threading.Thread(target=self._engine, name=f"{name}{i}", daemon=True).start()

    def submit(self, priority: int, run: Callable[[], bool]) -> None:
        with self._cond:
            heapq.heappush(self._heap, _Job((-priority, next(self._arrivals)), run))
            self._cond.notify()

    def higher_waiting(self, priority: int) -> bool:
        """Is a job of higher priority than ``priority`` waiting? (checked between chunks)"""
        with self._cond:
            return bool(self._heap) and -self._heap[0].rank[0] > priority

    def _engine(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                job = heapq.heappop(self._heap)
                self._busy += 1
                peak = self._stats.get("copy_engines_busy_peak", 0)
                self._stats["copy_engines_busy_peak"] = max(peak, self._busy)
            done = job.run()
            with self._cond:
                self._busy -= 1
                if not done:  # preempted: back in line behind the higher-priority work
                    self._stats["preemptions"] += 1
                    heapq.heappush(self._heap, _Job((job.rank[0], next(self._arrivals)), job.run))
                    self._cond.notify()


class Scheduler:
    """Owns the rings of every context and decides what runs where."""

    def __init__(self, config: dict, residency: memory.Residency, stats: dict[str, int],
                 on_irq: Callable[[Ring, int], None], jit_cache_dir: str) -> None:
        self.copy = EnginePool("copy", config["copy_engines"], stats)
        self.compute = EnginePool("compute", config["compute_engines"], stats)
        self.compute_engines = config["compute_engines"]
        self.max_threads = config["max_threads_per_block"]
        self.max_shared = config["max_shared_mem_per_block"]
        self.watchdog_s = config.get("watchdog_ms", 10_000) / 1000
        self._jit_cache_dir = jit_cache_dir
        self._jit: Any = None
        self._jit_lock = threading.Lock()
        self._running: dict[int, tuple[np.ndarray, float]] = {}  # id(abort) -> (abort, deadline)
        threading.Thread(target=self._watchdog, name="watchdog", daemon=True).start()
        self.residency = residency
        self.stats = stats
        self.on_irq = on_irq
        self.rings: list[Ring] = []  # high priority first
        self.hung = False
        self.held = False  # debugfs sched_hold: take no packets (tests of ordering use it)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()  # engines finishing vs the scheduler's bookkeeping

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def add(self, ring: Ring) -> None:
        self.rings.append(ring)
        self.rings.sort(key=lambda r: -r.priority)

    def remove(self, ring: Ring) -> None:
        if ring in self.rings:
            self.rings.remove(ring)

    def pending(self) -> bool:
        return any(r.ready() for r in self.rings)

    # --- the scheduler's loop body -----------------------------------------------------
    def publish(self) -> None:
        """Note each ring's write pointer now, as what poll() may take. Called *before* the
        mailbox is drained: a packet may rely on control messages its producer sent before
        writing it (a pinned allocation's MAP before a launch whose arguments live there),
        and those are then processed before the packet starts."""
        for ring in self.rings:
            ring.published = ring.wptr

    def poll(self) -> int:
        """Run or dispatch what can go now, up to the published write pointers; return how
        many packets were taken."""
        if self.hung or self.held:
            return 0
        done = 0
        for ring in list(self.rings):
            while ring.ready() and ring.taken < ring.published:
                if ring.blocked is not None:
                    other, target = ring.blocked
                    if other.completed < target and not ring.closing:
                        break
                    ring.blocked = None
                    self._finish(ring, ring.taken, 0, 0, Op.WAIT_QUEUE)
                    continue
                seqno, pkt = ring.take()
                done += 1
                if not self._start(ring, seqno, pkt):
                    break  # busy on an engine or blocked: next ring
            if ring.blocked is not None and not ring.busy:
                other, target = ring.blocked
                if other.completed >= target:
                    ring.blocked = None
                    self._finish(ring, ring.taken, 0, 0, Op.WAIT_QUEUE)
                    done += 1
        return done

    def _start(self, ring: Ring, seqno: int, pkt: tuple[int, ...]) -> bool:
        """Begin one packet. True if it finished inline (the ring may go on)."""
        opcode, flags, *a = pkt
        if ring.faulted:
            self._finish(ring, seqno, errno.ECANCELED, 0, opcode)
            return True
        try:
            if flags:
                raise memory.Fault(0, errno.EINVAL)
            job = self._prepare(ring, seqno, opcode, a)
        except memory.Fault as f:
            self.stats["faults"] += 1
            self._finish(ring, seqno, f.code, f.addr, opcode)
            return True
        if job is None:
            self._finish(ring, seqno, 0, 0, opcode)
            return True
        if job is _BLOCKED:
            return False
        ring.busy = True
        (self.compute if opcode == Op.LAUNCH else self.copy).submit(ring.priority, job)
        return False

    def _prepare(self, ring: Ring, seqno: int, opcode: int,
                 a: list[int]) -> Callable[[], bool] | object | None:
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
                self._finish(ring, seqno, 0, 0, opcode, from_engine=True)
                return True
            return prefetch
        if opcode == Op.LAUNCH:
            return self._launch(ring, seqno, a)
        raise memory.Fault(0, errno.EINVAL)

    # --- kernels ------------------------------------------------------------------------
    def jit(self) -> Any:
        """The kernel cache, created on first use (numba loads only when kernels run, or
        at boot when the cache says kernels ran here before: see warm_up)."""
        with self._jit_lock:
            if self._jit is None:
                from firmware import jit

                jit.warm_up()
                self._jit = jit.KernelCache(Path(self._jit_cache_dir))
                self.stats["jit_ready"] = 1
            return self._jit

    def _launch(self, ring: Ring, seqno: int, a: list[int]) -> Callable[[], bool] | None:
        handle, grid_w, block_w, dynamic, args_va, args_len = a[:6]
        kernels = ring.ctx.modules.get(handle >> 16)
        if kernels is None or (handle & 0xFFFF) >= len(kernels):
            raise memory.Fault(0, errno.EINVAL)
        name, kir = kernels[handle & 0xFFFF]
        if kir.get("shared_mem", 0) + dynamic > self.max_shared:  # the IR's figure: checked
            raise memory.Fault(0, errno.EINVAL)  # against its source when it compiles
        grid, block = uapi.unpack_dims(grid_w), uapi.unpack_dims(block_w)
        threads = block[0] * block[1] * block[2]
        if min(grid) < 1 or min(block) < 1 or threads > self.max_threads:
            raise memory.Fault(0, errno.EINVAL)
        m, off = ring.ctx.space.resolve(args_va, args_len)
        values, types, buffers = decode_args(ring.ctx.space, bytes(m.data[off : off + args_len]),
                                             kir["params"])
        launch = Launch(ring, seqno, name, kir, types, values, buffers, grid, block, dynamic)
        nblocks = grid[0] * grid[1] * grid[2]
        if nblocks * threads <= INLINE_THREADS and self._jit is not None:
            kernel = self._jit.cached(kir, types, _options())
            # small and compiled: no engine hand-off (no GIL ping-pong). Not with mma: its
            # work grows with the tiles, not with the thread count.
            if kernel is not None and not kernel.uses_mma:
                self._run_inline(launch, kernel, nblocks)
                return None  # type: ignore[return-value]
        parts = max(1, min(self.compute_engines, nblocks))
        bounds = [nblocks * i // parts for i in range(parts + 1)]
        launch.remaining = parts
        jobs = [self._block_job(launch, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
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
        abort = np.zeros(1, np.int64)
        self._running[id(abort)] = (abort, time.monotonic() + self.watchdog_s)
        try:
            kernel.run(0, nblocks, launch.grid, launch.block, launch.args, abort,
                       launch.dynamic_shared)
        except Exception as exc:  # noqa: BLE001 - a kernel's fault is the device's, not ours
            code, addr = self._fault_of(launch, exc)
            raise memory.Fault(addr, code) from None
        finally:
            self._running.pop(id(abort), None)
        if abort[0] == 2:
            raise memory.Fault(0, errno.ETIMEDOUT)
        self.stats["launches"] += 1

    def _block_job(self, launch: Launch, lo: int, hi: int) -> Callable[[], bool]:
        """Engine work over blocks [lo, hi): in slices, yielding to higher-priority work
        between slices (preemption between blocks), stopped by the watchdog."""
        nblocks = hi - lo
        slice_size = max(1, nblocks // 16)
        state = {"next": lo}

        def run() -> bool:
            try:
                jit = self.jit()
                kernel = jit.get(launch.kernel_ir, launch.arg_types, _options())
                self.stats["jit_compiles"], self.stats["jit_hits"] = jit.compiles, jit.hits
                abort = np.zeros(1, np.int64)
                while state["next"] < hi and launch.fault is None:
                    end = min(hi, state["next"] + slice_size)
                    self._running[id(abort)] = (abort, time.monotonic() + self.watchdog_s)
                    try:
                        done_to = kernel.run(state["next"], end, launch.grid, launch.block,
                                             launch.args, abort, launch.dynamic_shared)
                    finally:
                        self._running.pop(id(abort), None)
                    if abort[0] == 2:
                        raise _Watchdog()
                    state["next"] = done_to
                    if state["next"] < hi and self.compute.higher_waiting(launch.ring.priority):
                        return False  # preempted between blocks
            except _Watchdog:
                self._launch_fault(launch, errno.ETIMEDOUT, 0)
            except Exception as exc:  # noqa: BLE001 - a kernel's fault is the device's, not ours
                if getattr(exc, "kind", None) is None:  # not a bounds/watchdog fault: say why
                    print(f"firmware: kernel {launch.name} failed: {exc!r}", file=sys.stderr,
                          flush=True)
                self._launch_fault(launch, *self._fault_of(launch, exc))
            with launch.lock:
                launch.remaining -= 1
                last = launch.remaining == 0
            if last:
                status, addr = launch.fault or (0, 0)
                if not status:
                    self.stats["launches"] += 1
                self._finish(launch.ring, launch.seqno, status, addr, Op.LAUNCH, from_engine=True)
            return True
        return run

    def _fault_of(self, launch: Launch, exc: Exception) -> tuple[int, int]:
        kind = getattr(exc, "kind", None)
        if kind == "watchdog":
            return errno.ETIMEDOUT, 0
        if kind == "bounds":
            for pname, va, itemsize in launch.buffers:
                if pname == exc.param:  # type: ignore[attr-defined]
                    return errno.EFAULT, va + exc.index * itemsize  # type: ignore[attr-defined]
            return errno.EFAULT, 0
        return errno.EINVAL, 0  # the kernel did not validate or compile

    def _launch_fault(self, launch: Launch, code: int, addr: int) -> None:
        with launch.lock:
            if launch.fault is None:
                launch.fault = (code, addr)
                self.stats["faults"] += 1

    def _watchdog(self) -> None:
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            for abort, deadline in list(self._running.values()):
                if now > deadline:
                    abort[0] = 2  # the kernel checks it in every loop and at every block

    def _copy_job(self, ring: Ring, seqno: int, opcode: int, n: int,
                  move: Callable[[int, int], object],
                  *touched: tuple[memory.Mapping, int]) -> Callable[[], bool] | None:
        """Copy-engine work over ``n`` bytes in chunks; inline when small."""
        for m, off in touched:
            if m.resident is not None and n:
                self.residency.touch_device(m, off, off + n)
        if n <= INLINE_BYTES:
            move(0, n)
            self._count(opcode, n)
            return None
        progress = [0]

        def run() -> bool:
            while progress[0] < n:
                hi = min(n, progress[0] + COPY_CHUNK)
                move(progress[0], hi)
                progress[0] = hi
                if progress[0] < n and self.copy.higher_waiting(ring.priority):
                    return False  # preempted between chunks
            self._count(opcode, n)
            self._finish(ring, seqno, 0, 0, opcode, from_engine=True)
            return True
        return run

    def _count(self, opcode: int, n: int) -> None:
        if opcode == Op.COPY:
            self.stats["copies"] += 1
            self.stats["copy_bytes"] += n

    def _finish(self, ring: Ring, seqno: int, status: int, addr: int, opcode: int,
                from_engine: bool = False) -> None:
        with self._lock:
            ring.complete(seqno, status, addr, opcode)
            self.stats["packets"] += 1
            if from_engine:
                ring.busy = False
            irq = ring.irq_due()
        if irq:
            self.on_irq(ring, irq)
        if from_engine:
            try:
                os.write(self._wake_w, b"\1")  # the scheduler may have work for this ring
            except BlockingIOError:
                pass


_BLOCKED = object()


class _Watchdog(Exception):
    pass


def _options() -> Any:
    from firmware.jit import Options

    return Options()


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


def decode_args(space: memory.AddressSpace, raw: bytes, params: list[dict]
                ) -> tuple[list, tuple[str, ...], list[tuple[str, int, int]]]:
    """The argument block of a launch -> (values, types for the JIT, buffer addresses)."""
    recs = [uapi.ARG_RECORD.unpack_from(raw, off)
            for off in range(0, len(raw) - len(raw) % uapi.ARG_RECORD.size, uapi.ARG_RECORD.size)]
    values: list = []
    types: list[str] = []
    buffers: list[tuple[str, int, int]] = []
    i = 0
    for p in params:
        if i >= len(recs):
            raise memory.Fault(0, errno.EINVAL)
        kind, code, value, nbytes = recs[i]
        i += 1
        dtype_name = uapi.DTYPE_NAMES.get(code)
        if dtype_name is None or (p.get("dtype") not in (None, dtype_name)):
            raise memory.Fault(0, errno.EINVAL)
        dtype = np.dtype(dtype_name)
        if kind == uapi.ARG_SCALAR and p["kind"] == "scalar":
            values.append(np.frombuffer(value.to_bytes(8, "little")[: dtype.itemsize], dtype)[0])
            types.append(dtype_name)
        elif kind == uapi.ARG_BUFFER and p["kind"] == "buffer":
            shape: list[int] = []
            while i < len(recs) and recs[i][0] == uapi.ARG_SHAPE:
                shape += [int(recs[i][2]), int(recs[i][3])][: max(0, recs[i][1])]
                i += 1
            m, off = space.resolve(value, nbytes)
            view = m.data[off : off + nbytes].view(dtype)
            shape = shape or [len(view)]
            if int(np.prod(shape)) * dtype.itemsize != nbytes:
                raise memory.Fault(value, errno.EINVAL)
            values.append(view.reshape(shape))
            types.append(f"{dtype_name}[{len(shape)}d]")
            buffers.append((p["name"], value, dtype.itemsize))
        else:
            raise memory.Fault(0, errno.EINVAL)
    if i != len(recs):
        raise memory.Fault(0, errno.EINVAL)
    return values, tuple(types), buffers
