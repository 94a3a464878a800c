"""What a compute engine does: LAUNCH packets, and the modules and JIT they need.

A module's image is parsed on a loader thread (a launch that names it waits, parked,
until it is); the JIT -- numba -- is created on first use, or at boot when the kernel cache
says kernels ran here before, so a device that never runs kernels never pays for it.

A launch is checked in Python integers before anything runs: its kernel, its dimensions
against the device's limits, its argument block (:func:`plan_args`, :func:`bind_args`: every buffer
resolved against the context, every shape against its buffer). A small launch of a
compiled, statically bounded kernel (no loops) runs inline on the control loop, under a
watchdog; any other goes to one :class:`BlockJob` per compute engine, each claiming
chunks of its blocks as it gets to them and running them in time slices (``QUANTUM_S``, a
block is never cut) between which it gives way to waiting work of at least its priority,
so one giant grid cannot hold both engines. A
block that runs past the image's ``watchdog_ms`` is stopped (ETIMEDOUT). A fault names the
address it tried, saturated into the 64-bit space.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from abi import hazard, kernel_lang, userq
from abi.userq import Op
from firmware import managed, memory
from firmware.engines import Deadlines, Job
from firmware.rings import FwContext, FwModule, Ring
from firmware.telemetry import Counters, log_unexpected

if TYPE_CHECKING:
    from firmware.jit import CompiledKernel
    from firmware.scheduler import Scheduler

#: A launch of an already-compiled kernel whose work per thread is statically bounded
#: (``CompiledKernel.work_per_thread``: no loops, at most 256 syntax-tree nodes) runs
#: inline on the scheduler when its threads times that work is at most this: a 1 Mi-thread
#: elementwise kernel (~25 nodes) takes ~0.3-0.6 ms here, less than handing it to the
#: engines costs (an engine starts ~0.25 ms after dispatch on this 2-CPU machine, and
#: two engines over one memory-bound loop were no faster than one: docs/kernels.md)...
INLINE_WORK = 1 << 25
#: A looping kernel's node counts weigh this much more: they are upper bounds of nodes
#: run one after another in a loop, not of a straight body's mostly untaken branches
#: (calibrated in docs/launch.md, "Looping kernels inline").
LOOP_WORK_WEIGHT = 10
#: ...and at most this many threads (a launch of many near-empty threads still costs per
#: thread).
INLINE_THREADS = 1 << 20
#: An inline launch that still runs this long is stopped (it cannot happen for a bounded
#: kernel; the control thread must never be held long).
INLINE_WATCHDOG_S = 0.25
#: A launch runs in slices of about this long (a block is never cut): between slices its
#: engine takes waiting work first.
QUANTUM_S = 0.02
#: An engine claims at least 1/(this x engines) of a grid's blocks at a time
#: (:meth:`Launch.claim`). Each claim costs a call into the kernel (~4 us, its checks),
#: and the last chunk is the imbalance between the engines at the end: with a 16th of the
#: grid as the floor, a 64-block sum reduction read 5-11% slower than with halves; with a
#: 64th, 7% faster (docs/kernels.md, "Sixth round").
CHUNKS_PER_ENGINE = 32

#: What :meth:`Kernels.launch` returns for a launch whose module is not parsed yet.
PARKED = object()


class Kernels:
    """One device's kernel side: its limits, the module loader, the JIT and the timer of
    running launches (made with the JIT: its thread, its constants)."""

    def __init__(self, config: dict, jit_cache_dir: str, counters: Counters,
                 wake: Callable[[], None]) -> None:
        self.compute_engines = config["compute_engines"]
        self.max_threads = config["max_threads_per_block"]
        self.max_shared = config["max_shared_mem_per_block"]
        #: what this device has: a kernel whose source uses anything else (mma, atomics,
        #: block-shared memory) faults with EOPNOTSUPP, whatever its IR's flags claimed
        self.capabilities = frozenset(config.get("capabilities", ()))
        self.watchdog_s = config.get("watchdog_ms", 10_000) / 1000
        #: ...and in ns: a WAIT_VALUE that names no timeout of its own ends at it
        self.watchdog_ns = int(config.get("watchdog_ms", 10_000)) * 1_000_000
        self.deadlines: Deadlines | None = None
        #: the abort word of the inline launches (one runs at a time, on the control loop)
        self._inline_abort = np.zeros(1, np.int64)
        #: whether a ring turn's inline launches are watched (end_turn disarms it)
        self._inline_watched = False
        #: work run inline (INLINE_WORK's units) since the scheduler last zeroed it: a
        #: ring's turn of a pass ends once it reaches INLINE_WORK, so that one ring of
        #: large inline launches holds the others (and higher priorities) one launch long
        self.inline_work = 0
        #: inline launches run in the current ring's turn: counted once per turn
        #: (the scheduler's ``_charge_turn``), not per launch
        self.inline_launches = 0
        self._counters = counters
        self._wake = wake  # the scheduler's: a parked launch's module is ready
        self._jit_cache_dir = jit_cache_dir
        self._jit: Any = None
        self._jit_lock = threading.Lock()
        #: the module loader's work: modules to parse, and kernels whose inline launch
        #: asked for MKL (``_run_inline``: loading it is ~0.3 s of CPU, not the control
        #: loop's to spend)
        self._modules: queue.SimpleQueue[FwModule | CompiledKernel] = queue.SimpleQueue()
        self._mkl_queued = False  # one request queued is enough (matrix.serve_request)
        threading.Thread(target=self._module_loader, name="module-loader", daemon=True).start()

    # --- modules --------------------------------------------------------------------------
    def load_module(self, ctx: FwContext, module_id: int, raw: bytes) -> None:
        """Parse a module's image off the control thread (its launches wait for it)."""
        mod = ctx.modules[module_id] = FwModule(raw)
        self._modules.put(mod)
        self.warm_up()  # kernels are coming: load the JIT (numba) off the hot path

    def module_ready(self, ring: Ring, words: tuple[int, ...]) -> bool:
        """Whether a parked launch (its packet's words) can start again (its module
        parsed, failed or gone)."""
        mod = ring.ctx.modules.get(userq.decode(words).handle >> 16)
        return mod is None or mod.kernels is not None or mod.error != 0

    def _module_loader(self) -> None:
        # the module is the call's argument, not a local of this loop: a local would hold
        # the last module parsed (and whatever it comes to hold) while the loader waits
        while True:
            self._side_work(self._modules.get())

    def _side_work(self, item: FwModule | CompiledKernel) -> None:
        """Parse a module (and wake its parked launches), or load MKL for a kernel whose
        inline launch asked for it (``CompiledKernel.ended``)."""
        if isinstance(item, FwModule):
            _parse(item)
            self._wake()
        else:
            item.ended()

    # --- the JIT --------------------------------------------------------------------------
    def jit(self) -> Any:
        """The kernel cache, created on first use (numba loads only when kernels run, or
        at boot when the cache says kernels ran here before: see warm_up)."""
        with self._jit_lock:
            if self._jit is None:
                from firmware import jit

                jit.warm_up()
                self.deadlines = Deadlines(jit.ABORT_PREEMPT, jit.ABORT_WATCHDOG)
                library = Path(os.environ.get("AEMU_KERNEL_LIBRARY", jit.LIBRARY_DIR))
                self._jit = jit.KernelCache(Path(self._jit_cache_dir),
                                            library=library if library.is_dir() else None)
                self._counters.peak("jit_ready", 1)
            return self._jit

    def warm_up(self) -> None:
        """Create the JIT (importing numba and loading its CPU target take ~0.4 s) on a
        side thread."""
        if self._jit is None:
            threading.Thread(target=self.jit, name="jit-warm-up", daemon=True).start()

    def turn_spent(self) -> bool:
        """Whether a ring's turn of the scheduler's pass ran its inline work's worth."""
        return self.inline_work >= INLINE_WORK

    def end_turn(self) -> None:
        """A ring's turn ended: its inline launches' watchdog is disarmed. One arming
        covers a whole turn: the turn's inline work is bounded (``turn_spent``, plus the
        one launch that crossed it), and adding and removing an entry per launch was a
        sixth of a small launch's time."""
        if self._inline_watched:
            assert self.deadlines is not None
            self.deadlines.disarm_inline()
            self._inline_watched = False

    # --- launches -------------------------------------------------------------------------
    def launch(self, sched: Scheduler, ring: Ring, seqno: int, pkt: userq.Launch,
               start_ns: int) -> Any:
        """Check a LAUNCH (everything the process wrote, in Python integers), decode its
        arguments, and run it inline (None), park it (``PARKED``) or return its first
        engine job (the others are submitted already)."""
        handle, grid_w, block_w, dynamic, args_va, args_len = pkt
        mod = ring.ctx.modules.get(handle >> 16)
        if mod is None:
            raise memory.Fault(0, errno.EINVAL)
        if mod.kernels is None:
            if mod.error:
                raise memory.Fault(0, mod.error)
            return PARKED
        index = handle & 0xFFFF
        if index >= len(mod.kernels):
            raise memory.Fault(0, errno.EINVAL)
        space = ring.ctx.space
        if not args_va and args_len <= userq.RING_ARGS_SLOT_BYTES:
            args_va = ring.args_slot(seqno)  # the queue's own arena (abi/userq.py), or 0
        try:
            raw: bytes | None = _argument_block(space, args_va, args_len)
        except memory.Fault:
            raw = None  # raised below, after the checks that come first
        bound = None if raw is None else mod.bound.get((index, raw, grid_w, block_w, dynamic))
        if bound is not None and bound.generation == space.generation:
            if type(bound) is EngineBound:
                return self._to_engines(sched, ring, seqno, bound, None, start_ns)
            self._run_inline(bound)
            return None
        name, kir = mod.kernels[index]
        static = kir.get("shared_mem", 0)
        if type(static) is not int or not 0 <= static <= self.max_shared \
                or dynamic > self.max_shared - static:  # checked again against the source
            raise memory.Fault(0, errno.EINVAL)
        grid, block = userq.unpack_dims(grid_w), userq.unpack_dims(block_w)
        threads = block[0] * block[1] * block[2]
        if min(grid) < 1 or min(block) < 1 or threads > self.max_threads:
            raise memory.Fault(0, errno.EINVAL)
        if raw is None:
            raw = _argument_block(space, args_va, args_len)
        generation = space.generation  # before binding: a change meanwhile binds again
        steps = self._plan(mod, index, kir, raw)
        options = _options(bool(steps) and steps[-1][0] == "hazard")  # ACCEL_SANITIZE's
        values, types, buffers, pages = bind_args(space, steps)
        kernel = self._compiled(mod, index, kir, types, options)
        nblocks = grid[0] * grid[1] * grid[2]
        total = nblocks * threads
        work = None if kernel is None or total > INLINE_THREADS \
            else _inline_work(kernel, grid, block, values, total)
        if work is not None and work <= INLINE_WORK \
                and (pages is None or managed.inline_ok(pages)):
            # small, compiled and statically bounded: no engine hand-off (no GIL ping-pong)
            if not kernel.capabilities <= self.capabilities:
                raise memory.Fault(0, errno.EOPNOTSUPP)
            bound = Bound(generation, name,
                          kernel.bind(grid, block, values, self._inline_abort, dynamic),
                          buffers, values, work, kernel if kernel.uses_mma else None)
            try:
                self._run_inline(bound)
            finally:
                if pages is not None:  # what it touched, up to where it stopped
                    managed.migrate(sched.residency, pages)
            if pages is None:  # managed pages migrate per launch: those bind every time
                self._remember(mod, (index, raw, grid_w, block_w, dynamic), bound)
            return None
        engine = EngineBound(generation, name, kir, types, values, buffers, grid, block,
                             dynamic, kernel, options, nblocks)
        if pages is None and kernel is not None:  # compiled: it goes to the engines again
            self._remember(mod, (index, raw, grid_w, block_w, dynamic), engine)
        return self._to_engines(sched, ring, seqno, engine, pages, start_ns)

    @staticmethod
    def _remember(mod: FwModule, key: tuple[int, bytes, int, int, int],
                  bound: Bound | EngineBound) -> None:
        """Keep a launch checked and bound for its next time (PLAN_CACHE per module)."""
        if len(mod.bound) >= PLAN_CACHE:
            mod.bound.clear()
        mod.bound[key] = bound

    def _to_engines(self, sched: Scheduler, ring: Ring, seqno: int, b: EngineBound,
                    pages: list[managed.PageMap] | None, start_ns: int) -> BlockJob:
        """A launch's engine jobs, one per engine its blocks can keep busy: the first is
        returned (the scheduler submits it, marking the ring busy), the others submitted."""
        parts = max(1, min(self.compute_engines, b.nblocks))
        launch = Launch(ring, seqno, b.name, b.kernel_ir, b.arg_types, b.values, b.buffers,
                        b.grid, b.block, b.dynamic_shared, b.compiled, pages=pages,
                        nblocks=b.nblocks, engines=parts, remaining=parts, options=b.options)
        jobs = [BlockJob(sched, launch, start_ns) for _ in range(parts)]
        for job in jobs[1:]:
            sched.compute.submit(ring.priority, job)
        return jobs[0]

    def _plan(self, mod: FwModule, index: int, kir: dict, raw: bytes) -> list[Step]:
        """The argument block's plan (:func:`plan_args`), kept by its module: a framework
        launches the same kernel with the same arguments over and over, and parsing the
        records costs more than resolving the buffers again, which happens every launch."""
        key = (index, raw)
        steps = mod.plans.get(key)
        if steps is None:
            if len(mod.plans) >= PLAN_CACHE:
                mod.plans.clear()
            steps = mod.plans[key] = plan_args(raw, kir.get("params"))
        return steps

    def _compiled(self, mod: FwModule, index: int, kir: dict, types: tuple[str, ...],
                  options: Any) -> Any:
        """The kernel's compiled form if the JIT has it (None otherwise), remembered on its
        module: the JIT cache's lookup compares the whole IR with its own copy (~10 us for
        a small kernel), which a module's parsed, unchanging IR need pass only once. The
        checked variant (``options.sanitize``) is remembered apart."""
        key = (index, types, True) if options.sanitize else (index, types)
        kernel = mod.compiled.get(key)
        if kernel is None and self._jit is not None:
            kernel = self._jit.cached(kir, types, options)
            if kernel is not None:
                mod.compiled[key] = kernel
                self.publish_jit_counts(self._jit)
        return kernel

    def publish_jit_counts(self, jit: Any) -> None:
        """The JIT's own hit and compile counts, as the device's counters (once per
        lookup in the JIT, not per launch: a module remembers what it found)."""
        self._counters.peak("jit_compiles", jit.compiles)
        self._counters.peak("jit_hits", jit.hits)

    def _run_inline(self, b: Bound) -> None:
        """Run a small launch on the scheduler thread; faults raise as packet faults. No
        :class:`Launch` record: nothing but this call sees it. Inline launches run one at
        a time, so they share one abort word, cleared when a ring's turn arms the watchdog
        (``end_turn``): a launch the watchdog stopped faults its ring, which cancels
        the rest of that turn."""
        deadlines = self.deadlines
        assert deadlines is not None  # the JIT exists
        abort = self._inline_abort
        if not self._inline_watched:  # the turn's first inline launch (end_turn)
            deadlines.arm_inline(abort, INLINE_WATCHDOG_S)
            self._inline_watched = True
        self.inline_work += b.work
        try:
            b.run()
        except Exception as exc:  # noqa: BLE001 - a kernel's fault is the device's, not ours
            code, addr = fault_of(b.name, b.buffers, exc)
            raise memory.Fault(addr, code) from None
        if abort[0] > deadlines.preempt:  # the ring faults: the rest of its turn cancels
            raise memory.Fault(0, errno.ETIMEDOUT)
        self.inline_launches += 1
        if b.mma is not None and not self._mkl_queued and b.mma.mkl_asked():
            self._mkl_queued = True  # loaded on the module loader, off the control loop
            self._modules.put(b.mma)


class Bound(NamedTuple):
    """An inline launch checked and bound against its context's memory: the same
    kernel, argument block and shape run again without decoding or resolving anything,
    while the context's mappings stay as they were (``generation``)."""

    generation: int
    name: str
    #: the whole grid over ``values`` (``CompiledKernel.bind``: checked once, with the
    #: inline launches' abort word)
    run: Callable[[], int]
    buffers: list[tuple[str, int, int]]
    values: list
    work: int  # threads x work per thread (INLINE_WORK)
    #: the kernel when it calls the matrix unit, whose BLAS calls may ask for MKL
    mma: CompiledKernel | None = None


class EngineBound(NamedTuple):
    """A launch for the engines checked and bound against its context's memory, as
    :class:`Bound` is for an inline one: the same kernel, argument block and shape go to
    the engines again without planning, binding or looking the kernel up (~13 us of the
    control loop per launch before; an MLP step's every product is one)."""

    generation: int
    name: str
    kernel_ir: dict
    arg_types: tuple[str, ...]
    values: list
    buffers: list[tuple[str, int, int]]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_shared: int
    compiled: Any  # the compiled kernel (None: the engine asks the JIT; then not kept)
    options: Any
    nblocks: int


def _inline_work(kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int],
                 values: list, threads: int) -> int | None:
    """A launch's work in ``INLINE_WORK``'s units, or None when it is not bounded: a
    loop-free kernel's threads times its static work per thread; a looping kernel's as its
    launch's values bound it (firmware/launch_work.py), weighted ``LOOP_WORK_WEIGHT``."""
    if kernel.work_per_thread is not None:
        return threads * kernel.work_per_thread
    if kernel.loop_work is None:
        return None
    per_thread = kernel.loop_work.per_thread(grid, block, values)
    return None if per_thread is None else threads * per_thread * LOOP_WORK_WEIGHT


def _parse(mod: FwModule) -> None:
    """Parse a module's image into its kernels, or mark it failed (EINVAL)."""
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


def _argument_block(space: memory.AddressSpace, va: int, length: int) -> bytes:
    """The launch's argument block as it is now (the process may rewrite a slot between
    launches); Fault where it is too long or outside the context's memory."""
    if length > userq.ACCEL_ARGS_MAX:
        raise memory.Fault(va, errno.EINVAL)
    m, off = space.resolve(va, length)
    return m.data[off : off + length].tobytes()  # bytes(view) took 3x as long


@functools.cache
def _options(sanitize: bool = False) -> Any:
    """The JIT options of a launch (one instance each: built per launch it cost ~2 us):
    the checked variant when its argument block names a hazard record (abi/hazard.py)."""
    from firmware.jit import Options

    return Options(sanitize=sanitize)


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
    #: the compiled kernel when the module had it at dispatch, else None (the engine asks
    #: the JIT: a lookup there compares the whole IR, ~17 us of an engine's turn)
    compiled: Any = None
    nblocks: int = 0
    engines: int = 1  # the engine jobs sharing its blocks
    remaining: int = 0  # engine jobs not finished
    claimed: int = 0  # blocks [0, claimed) are some engine's (Launch.claim)
    fault: tuple[int, int] | None = None  # (errno, address)
    pages: list[managed.PageMap] | None = None  # its managed buffers' page maps, if any
    options: Any = None  # the JIT options it compiles with (None: the default ones)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self) -> tuple[int, int] | None:
        """The next chunk of blocks for an engine, or None when every block is claimed or
        the launch faulted. A chunk is a share of what is left -- a quarter of it for two
        engines, at least a 64th of the grid -- not a fixed half of the grid: each
        engine takes the next chunk as it gets to it, so an engine that starts late (a
        wake-up costs ~0.25 ms here) or whose CPU is taken by something else leaves the
        rest to the other instead of the packet waiting for its half."""
        with self.lock:
            lo, left = self.claimed, self.nblocks - self.claimed
            if left <= 0 or self.fault is not None:
                return None
            floor = -(-self.nblocks // (CHUNKS_PER_ENGINE * self.engines))
            hi = lo + min(left, max(floor, -(-left // (2 * self.engines))))
            self.claimed = hi
            return lo, hi

    def record_fault(self, code: int, addr: int) -> None:
        """The launch's first fault is its packet's (the other engines' stop there)."""
        with self.lock:
            if self.fault is None:
                self.fault = (code, addr)

    def share_done(self) -> bool:
        """One engine's share finished: True for the last (which completes the packet)."""
        with self.lock:
            self.remaining -= 1
            return self.remaining == 0

def fault_of(name: str, buffers: list[tuple[str, int, int]], exc: Exception
             ) -> tuple[int, int]:
    """(errno, device address) of a launch stopped by ``exc``. A bounds miss names the
    address it tried, saturated into the 64-bit space (``x[1 << 62]`` of a float32 buffer
    is past 2**64: the ring then reads U64_MAX)."""
    kind = getattr(exc, "kind", None)
    if kind == "watchdog":
        return errno.ETIMEDOUT, 0
    if kind == "bounds":
        index = getattr(exc, "index", None)
        for pname, va, itemsize in buffers:
            if pname == getattr(exc, "param", None) and isinstance(index, int):
                return errno.EFAULT, min(max(0, va + index * itemsize), userq.U64_MAX)
        return errno.EFAULT, 0
    from firmware.kernel_check import KernelCompileError  # loaded: a kernel ran

    if kind is None and not isinstance(exc, KernelCompileError):
        log_unexpected(f"kernel {name} failed", exc)  # a kernel that does not
    return errno.EINVAL, 0  # validate or compile is the kernel's fault, not news


class _Watchdog(Exception):
    pass


class BlockJob(Job):
    """One engine's part of a launch: chunks of its blocks claimed one after another
    (:meth:`Launch.claim`), run in time slices between which it gives way to waiting work
    of at least its priority; a block running longer than the watchdog is stopped. The
    last job to find nothing left to claim completes the packet, with the launch's first
    fault if any."""

    __slots__ = ("hi", "launch", "next")

    def __init__(self, sched: Scheduler, launch: Launch, start_ns: int) -> None:
        super().__init__(sched, launch.ring, launch.seqno, Op.LAUNCH, start_ns)
        self.launch, self.next, self.hi = launch, 0, 0  # its chunk: blocks [next, hi)

    def run(self) -> bool:
        sched, launch, kernels = self.sched, self.launch, self.sched.kernels
        kernel = None
        try:
            kernel = launch.compiled
            if kernel is None:
                jit = kernels.jit()
                began = time.monotonic_ns()
                kernel = jit.get(launch.kernel_ir, launch.arg_types,
                                 launch.options or _options())
                with launch.lock:  # the engines sharing it may each have waited
                    launch.ring.record_compile(launch.seqno, time.monotonic_ns() - began)
                kernels.publish_jit_counts(jit)
            if not kernel.capabilities <= kernels.capabilities:
                launch.record_fault(errno.EOPNOTSUPP, 0)
            elif not self._slices(kernel):
                return False  # the slice is up and work waits: give way
        except _Watchdog:
            launch.record_fault(errno.ETIMEDOUT, 0)
        except Exception as exc:  # noqa: BLE001 - a kernel's fault is the device's, not ours
            launch.record_fault(*fault_of(launch.name, launch.buffers, exc))
        self._share_done()
        if kernel is not None:
            kernel.ended()
        return True

    def _slices(self, kernel: Any) -> bool:
        """Run time slices until no block is left or the launch stopped (True), or until
        a slice is up with work waiting (False: the rest is this job's next turn). Raises
        what the kernel raised, or :class:`_Watchdog`. One deadline entry covers a slice
        and all its chunks, as it covered a slice of a half before chunks (an entry per
        chunk would wake the timer thread per chunk)."""
        sched, launch, deadlines = self.sched, self.launch, self.sched.kernels.deadlines
        assert deadlines is not None  # made with the JIT
        abort = np.zeros(1, np.int64)
        while True:
            abort[0] = 0
            token = deadlines.add(abort, sched.kernels.watchdog_s, QUANTUM_S)
            try:
                left = self._chunks(kernel, abort)
            finally:
                deadlines.remove(token)
            if abort[0] > deadlines.preempt:  # the watchdog, between blocks
                raise _Watchdog()
            if not left:
                return True
            if sched.compute.waiting(launch.ring.priority):
                return False

    def _chunks(self, kernel: Any, abort: np.ndarray) -> bool:
        """Claim and run chunks until the abort word stops the slice (True: blocks are
        left) or none is left or the launch stopped (False)."""
        sched, launch = self.sched, self.launch
        while launch.fault is None:
            if self.next >= self.hi:
                chunk = launch.claim()
                if chunk is None:
                    return False
                self.next, self.hi = chunk
            if launch.ring.faulted:  # its context is being torn down: stop, unrun
                launch.record_fault(errno.ECANCELED, 0)
                return False
            began = time.perf_counter_ns()
            try:
                self.next = kernel.run(self.next, self.hi, launch.grid, launch.block,
                                       launch.args, abort, launch.dynamic_shared)
            finally:
                if launch.pages is not None:  # what the chunk touched (firmware/managed.py)
                    managed.migrate(sched.residency, launch.pages)
                sched.compute.charge(self, time.perf_counter_ns() - began)  # as it runs
            if abort[0]:
                return self.next < self.hi or launch.claimed < launch.nblocks
        return False

    def fail(self, exc: BaseException) -> None:
        log_unexpected(f"kernel {self.launch.name} failed on an engine", exc)
        self.launch.record_fault(errno.EIO, 0)
        self._share_done()

    def _share_done(self) -> None:
        launch = self.launch
        if launch.share_done():
            status, addr = launch.fault or (0, 0)
            if not status:
                self.sched.counters.add("launches")
            self.finish(status, addr)


#: launch-ABI dtype code -> numpy dtype (np.dtype(name) per argument cost ~1 us)
_DTYPES = {code: np.dtype(name) for code, name in kernel_lang.DTYPE_NAMES.items()}


#: a step of an argument plan: ("scalar", value, type), ("buffer", va, nbytes, dtype,
#: shape, type, param name, shape ok), ("hazard", va): the checked mode's hazard record
#: (abi/hazard.py), last, or ("fault", addr, errno)
Step = tuple
#: plans a module keeps (per kernel and argument block bytes) before it starts over
PLAN_CACHE = 64


def plan_args(raw: bytes, params: Any) -> list[Step]:
    """What the block says, checked against the parameters: a pure function of the bytes
    and the IR, so a module may keep it (:meth:`Kernels.launch`). It never raises: a bad
    record becomes a fault step where decoding would have stopped, so that faults keep the
    order of a straight decode (a buffer outside memory before a later bad record)."""
    if not isinstance(params, list) or len(raw) % userq.ARG_RECORD.size:
        return [("fault", 0, errno.EINVAL)]
    recs = [userq.ARG_RECORD.unpack_from(raw, off) for off in range(0, len(raw), userq.ARG_RECORD.size)]
    steps: list[Step] = []
    i = 0
    for p in params:
        if i >= len(recs) or not isinstance(p, dict):
            return [*steps, ("fault", 0, errno.EINVAL)]
        kind, code, value, nbytes = recs[i]
        i += 1
        dtype_name = kernel_lang.DTYPE_NAMES.get(code)
        want = p.get("dtype")
        if dtype_name is None or not (want is None or want == dtype_name):
            return [*steps, ("fault", 0, errno.EINVAL)]
        dtype = _DTYPES[code]
        if kind == userq.ARG_SCALAR and p.get("kind") == "scalar":
            scalar = np.frombuffer(value.to_bytes(8, "little")[: dtype.itemsize], dtype)[0]
            steps.append(("scalar", scalar, dtype_name))
        elif kind == userq.ARG_BUFFER and p.get("kind") == "buffer":
            shape: list[int] = []
            while i < len(recs) and recs[i][0] == userq.ARG_SHAPE:
                count = recs[i][1]
                if count not in (1, 2):
                    return [*steps, ("fault", 0, errno.EINVAL)]
                shape += [int(recs[i][2]), int(recs[i][3])][:count]
                i += 1
            if nbytes % dtype.itemsize or len(shape) > 8:
                return [*steps, ("fault", value, errno.EINVAL)]
            elements = nbytes // dtype.itemsize
            shape = shape or [elements]
            product = 1
            for d in shape:
                product *= d
            steps.append(("buffer", value, nbytes, dtype, tuple(shape),
                          f"{dtype_name}[{len(shape)}d]", str(p.get("name")),
                          product == elements))
        else:
            return [*steps, ("fault", 0, errno.EINVAL)]
    if i < len(recs) and recs[i][0] == hazard.ARG_HAZARD:  # the checked mode's record
        _, _, va, nbytes = recs[i]
        i += 1
        if nbytes < hazard.RECORD_BYTES or va % 8:
            return [*steps, ("fault", va, errno.EINVAL)]
        steps.append(("hazard", va))
    if i != len(recs):
        steps.append(("fault", 0, errno.EINVAL))
    return steps


def bind_args(space: memory.AddressSpace, steps: list[Step]
              ) -> tuple[list, tuple[str, ...], list[tuple[str, int, int]],
                         list[managed.PageMap] | None]:
    """A plan against the context's memory now: every buffer resolved (and faulted when
    outside it) and viewed, on every launch, in the plan's order; a managed buffer adds a
    page map (returned, None when there is none; its arguments follow the values)."""
    values: list = []
    types: list[str] = []
    buffers: list[tuple[str, int, int]] = []
    pages: list[managed.PageMap] | None = None
    record: list[np.ndarray] = []
    for step in steps:
        if step[0] == "scalar":
            values.append(step[1])
            types.append(step[2])
        elif step[0] == "buffer":
            _, va, nbytes, dtype, shape, type_name, pname, shape_ok = step
            m, off = space.resolve(va, nbytes)
            if not shape_ok:
                raise memory.Fault(va, errno.EINVAL)
            values.append(m.data[off : off + nbytes].view(dtype).reshape(shape))
            if m.resident is not None:
                pages, type_name = managed.bind(pages, m, off, nbytes, type_name)
            types.append(type_name)
            buffers.append((pname, va, dtype.itemsize))
        elif step[0] == "hazard":
            m, off = space.resolve(step[1], hazard.RECORD_BYTES)
            record.append(m.data[off : off + hazard.RECORD_BYTES].view(np.int64))
        else:
            raise memory.Fault(step[1], step[2])
    if pages is not None:
        values += managed.arguments(pages)
    return values + record, tuple(types), buffers, pages
