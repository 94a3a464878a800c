"""Where the firmware's CPU goes per launch: the control loop's pass around a kernel.

``python -m bench.profile_launch`` drives the firmware's scheduler in this process (no
daemon, no mount: the scheduler, its engines and its JIT over rings and memory laid out
as abi/userq.py says, as tests/unit/test_scheduler.py drives them), with the torch
backend's own elementwise module and its ``a + b`` launch over 4 Ki float32: the same
kernel, argument block (288 bytes: three buffers with their shape records, six scalars)
and dimensions as ``da + db``. Every figure is this thread's CPU time
(``time.thread_time_ns``), so time spent waiting for a CPU on a shared machine is not
counted.

It prints:

* the whole per launch, two ways: a queue of ``--launches`` packets drained (several a
  pass), and one packet per pass (a host issuing an op every ~20 us: each pass finds one
  packet);
* each stage of a one-packet pass alone, in a loop of its own (best of ``--repeat``
  loops), on the very objects the pass uses. The stages add up to less than the whole: a
  call in a loop of its own finds the interpreter's and the CPU's caches warm.

``--engine`` also times a launch the engines run (a kernel with a ``while`` loop, never
run inline, doing almost nothing), one at a time and each waited for: the hand-off's cost
per launch, on the control thread and in the whole process (the engine threads, the
watchdog's timer).
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import select
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from abi import kernel_lang, mailbox, uapi, userq
from abi.userq import Op

MiB = 1 << 20
VA = 0x1000_0000
SIZE = 32 * MiB
N = 4096
#: the control loop's nap while an engine runs, at most (firmware/main.py: the rest of
#: ``SPIN_AFTER_ACTIVITY_S``; the engine's completion ends it, through the wake-up pipe)
ENGINES_BUSY_NAP_S = 500e-6
#: a kernel the engines run whatever its size (a ``while`` is never bounded), doing
#: almost nothing: what a launch pays for the hand-off alone
ENGINE_SOURCE = """
def spin(x, n: 'int64'):
    i = global_id(0)
    k = 0
    while k < n:
        k += 1
    x[i] = k
"""


def _packet(op: int, *a: int) -> bytes:
    return userq.RAW_PACKET.pack(op, 0, *a, *[0] * (7 - len(a)))


def _buffer(va: int, n: int) -> bytes:
    f32 = kernel_lang.DTYPE_CODES["float32"]
    return (userq.ARG_RECORD.pack(userq.ARG_BUFFER, f32, va, 4 * n)
            + userq.ARG_RECORD.pack(userq.ARG_SHAPE, 1, n, 0))


def _scalar(dtype: str, value: int | float) -> bytes:
    bits = int.from_bytes(np.array(value, dtype).tobytes().ljust(8, b"\0"), "little")
    return userq.ARG_RECORD.pack(userq.ARG_SCALAR, kernel_lang.DTYPE_CODES[dtype], bits, 0)


class Bench:
    """One scheduler (this thread its control loop), one context, one queue."""

    def __init__(self, jit_dir: str) -> None:
        from firmware import image, memory
        from firmware.rings import FwContext, Ring
        from firmware.scheduler import Scheduler
        from firmware.telemetry import Counters

        self.counters = Counters(mailbox.STAT_NAMES)
        self.sched = Scheduler(dict(image.DEFAULT_PAYLOAD),
                               memory.Residency(self.counters, 64 * MiB), self.counters,
                               jit_dir)
        fd = os.memfd_create("bench-doorbell")
        os.ftruncate(fd, userq.ACCEL_DB_PAGE_SIZE)
        self.db = userq.SharedWords(fd, userq.ACCEL_DB_PAGE_SIZE)
        os.close(fd)
        self.event_r, event_w = os.pipe()  # the waiters' interrupts (none armed here)
        os.set_blocking(event_w, False)
        self.ctx = FwContext(1, -1, event_w, self.db)
        self.ctx.seen_seq = self.db.get(userq.DB_SEQ)
        self.mem = np.frombuffer(mmap.mmap(-1, SIZE), np.uint8)
        self.ctx.space.add(memory.Mapping(VA, SIZE, uapi.MemKind.HOST_PINNED, 0, self.mem))
        self.sched.contexts[1] = self.ctx
        fd = os.memfd_create("bench-ring")
        os.ftruncate(fd, userq.RING_FILE_SIZE)
        self.ring = Ring(self.ctx, 1, 0, 1, fd)
        self.prod = userq.RingView(fd)
        os.close(fd)
        self.ctx.queues[1] = self.ring
        self.sched.add(self.ring)

    def load(self, module_id: int, source: str) -> dict[str, int]:
        """Load a module; its kernels' handles by name."""
        from runtime.kernels import canonical_json, compile_module

        image = canonical_json(compile_module(source))
        self.sched.kernels.load_module(self.ctx, module_id, image)
        # a kernel's index is its place in the image as the firmware parses it
        return {name: module_id << 16 | i
                for i, name in enumerate(json.loads(image)["kernels"])}

    def write(self, pkt: bytes, count: int = 1) -> int:
        """Write ``count`` copies of a packet and ring the doorbell; the last seqno."""
        w = self.prod.wptr
        for _ in range(count):
            self.prod.write_packet(w, pkt)
            w += 1
        self.prod.set(userq.RING_WPTR, w)
        self.db.set(userq.DB_SLOTS + 8 * self.ring.slot, w)
        self.db.set(userq.DB_SEQ, self.db.get(userq.DB_SEQ) + 1)
        return w

    def step(self) -> int:
        """One pass of the control loop's scheduler part (firmware/main.py ``run``)."""
        self.sched.scan_doorbells()
        self.sched.publish()
        return self.sched.poll()

    def until(self, seqno: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while self.ring.fence < seqno:
            self.step()
            if time.monotonic() > deadline:
                raise TimeoutError(f"seqno {seqno} not done (fence {self.ring.fence})")
            if self.ring.busy:  # the control loop's nap while an engine runs (main.py)
                select.select([self.sched.wake_fd], [], [], ENGINES_BUSY_NAP_S)
                self.sched.drain_wakeups()
        fault = self.prod.read_fault()
        if fault[0]:
            raise RuntimeError(f"the launch faulted: {fault}")


def _clock_us() -> float:
    """What reading the thread's CPU clock adds to an interval it measures (us): a
    system call, ~0.7 us on this machine, as much as a dozen Python calls."""
    t0 = time.thread_time_ns()
    for _ in range(1000):
        time.thread_time_ns()
    return (time.thread_time_ns() - t0) / 1001 / 1e3


def _per_call(fn: Callable[[], object], number: int, repeat: int) -> float:
    """Best of ``repeat`` loops of ``number`` calls, CPU us per call."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.thread_time_ns()
        for _ in range(number):
            fn()
        best = min(best, (time.thread_time_ns() - t0) / number / 1e3)
    return best


def add_launch(b: Bench) -> bytes:
    """The ``da + db`` launch's packet, its argument block written at ``VA``."""
    from torch_accel.kernels import elementwise

    handles = b.load(2, elementwise.SOURCE)
    a, x, y = VA + MiB, VA + 2 * MiB, VA + 3 * MiB
    b.mem[MiB + 0 : MiB + 4 * N].view(np.float32)[:] = 1.0
    b.mem[2 * MiB : 2 * MiB + 4 * N].view(np.float32)[:] = np.arange(N)
    b.mem[3 * MiB : 3 * MiB + 4 * N].view(np.float32)[:] = 2.0
    block = (_buffer(a, N) + _buffer(x, N) + _buffer(y, N) + _scalar("float32", 0)
             + _scalar("int64", int(elementwise.Binary.add)) + _scalar("float32", 1)
             + _scalar("int64", N) + _scalar("int64", 1) + _scalar("int64", 1))
    b.mem[: len(block)] = np.frombuffer(block, np.uint8)
    return _packet(Op.LAUNCH, handles["arith_f"], userq.pack_dims((N // 256, 1, 1)),
                   userq.pack_dims((256, 1, 1)), 0, VA, len(block))


def whole(b: Bench, pkt: bytes, launches: int, rounds: int) -> tuple[list[float], list[float]]:
    """CPU us per launch: a queue of ``launches`` drained, and one launch per pass
    (the producer's writes not counted), ``rounds`` times each."""
    drained, single = [], []
    for _ in range(rounds):
        w = b.write(pkt, launches)
        t0 = time.thread_time_ns()
        b.until(w)
        drained.append((time.thread_time_ns() - t0) / launches / 1e3)
        spent = 0
        for _ in range(launches):
            w = b.write(pkt)
            t0 = time.thread_time_ns()
            b.step()
            spent += time.thread_time_ns() - t0
            assert b.ring.fence == w
        single.append(spent / launches / 1e3 - _clock_us())
    return drained, single


def _pass_cpu(b: Bench, pkt: bytes, launches: int) -> float:
    """CPU us of a one-packet pass (the producer's write not counted), median of ten
    runs of ``launches // 10``."""
    runs = []
    per_run = max(1, launches // 10)
    for _ in range(10):
        spent = 0
        for _ in range(per_run):
            b.write(pkt)
            t0 = time.thread_time_ns()
            b.step()
            spent += time.thread_time_ns() - t0
        runs.append(spent / per_run / 1e3 - _clock_us())
    b.sched.kernels.end_turn()
    b.ring.fence = b.ring.taken  # what a stub took, as ended (no waiter is armed)
    return statistics.median(runs)


def stages(b: Bench, pkt: bytes, launches: int) -> list[tuple[str, float]]:
    """Each stage of a one-packet pass, exclusive, in CPU us per launch: the pass's CPU
    time with one callee replaced by a stub (one at a time), outermost first; a stage is
    the difference between its own stub's pass and the next one out's."""
    sched, kernels = b.sched, b.sched.kernels
    bound = next(iter(b.ctx.modules[2].bound.values()))

    def took(*_: object) -> int:  # a turn that only takes the packet
        b.ring.take()
        return 1

    stubs: list[tuple[str, object, str, Callable[..., object]]] = [
        ("doorbell scan, publish, the pass's frame (turn choice, counters' merge)",
         sched, "_poll_ring", took),
        ("the ring's turn: take, its deadline, the watchdog's disarming, busy time",
         sched, "_start", lambda *_: True),
        ("packet start and decode, the completion (timestamp, fence, waiter, counters)",
         kernels, "launch", lambda *_: None),
        ("argument block read, bound lookup, launch count", kernels, "_run_inline",
         lambda *_: None),
    ]
    passes = []
    for _, obj, attr, stub in stubs:
        setattr(obj, attr, stub)
        try:
            passes.append(_pass_cpu(b, pkt, launches))
        finally:
            delattr(obj, attr)
    whole_us = _pass_cpu(b, pkt, launches)
    passes.append(whole_us)
    rows = [(stubs[0][0], passes[0])]
    rows += [(stubs[i][0], passes[i] - passes[i - 1]) for i in range(1, len(stubs))]
    kernel_us = _per_call(bound.run, 2000, 5)
    rows.append(("the inline run's frame: the watchdog's arming, call, fault check",
                 whole_us - passes[-2] - kernel_us))
    rows.append(("the kernel: the bound compiled grid, 4 Ki threads (alone, best loop)",
                 kernel_us))
    rows.append(("= the whole one-packet pass", whole_us))
    return rows


def engine(b: Bench, launches: int, rounds: int) -> list[tuple[float, float, float]]:
    """A launch the engines run (64 threads of ``ENGINE_SOURCE``), one at a time, each
    waited for as a synchronize would: (control thread CPU, whole process CPU, wall), us
    per launch, per round."""
    handle = b.load(3, ENGINE_SOURCE)["spin"]
    block = _buffer(VA + 4 * MiB, 64) + _scalar("int64", 1)
    b.mem[8192 : 8192 + len(block)] = np.frombuffer(block, np.uint8)
    pkt = _packet(Op.LAUNCH, handle, userq.pack_dims((1, 1, 1)), userq.pack_dims((64, 1, 1)),
                  0, VA + 8192, len(block))
    b.until(b.write(pkt), timeout=600)  # compiled
    out = []
    for _ in range(rounds):
        t0, p0, w0 = time.thread_time_ns(), time.process_time_ns(), time.perf_counter_ns()
        for _ in range(launches):
            b.until(b.write(pkt))
        out.append(((time.thread_time_ns() - t0) / launches / 1e3,
                    (time.process_time_ns() - p0) / launches / 1e3,
                    (time.perf_counter_ns() - w0) / launches / 1e3))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launches", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--engine", action="store_true",
                   help="also the hand-off of a launch the engines run")
    args = p.parse_args(argv)
    sys.setswitchinterval(0.0002)  # as the firmware's process runs (firmware/main.py)
    with tempfile.TemporaryDirectory(prefix="profile-launch-") as jit_dir:
        b = Bench(jit_dir)
        pkt = add_launch(b)
        b.until(b.write(pkt), timeout=600)  # the module parsed, the kernel compiled
        b.until(b.write(pkt))  # bound inline
        out = b.mem[MiB : MiB + 4 * N].view(np.float32)
        assert (out == np.arange(N) + 2).all(), "the launch computed something else"
        drained, single = whole(b, pkt, args.launches, args.rounds)
        print(f"load average {os.getloadavg()[0]:.1f}; 4 Ki float32 a + b (arith_f), "
              f"firmware CPU per launch, this thread")
        print(f"  queue of {args.launches} drained: median {statistics.median(drained):.2f} us"
              f" (rounds {', '.join(f'{x:.2f}' for x in drained)})")
        print(f"  one packet per pass:   median {statistics.median(single):.2f} us"
              f" (rounds {', '.join(f'{x:.2f}' for x in single)})")
        print("stages of a one-packet pass, exclusive (CPU us per launch):")
        for name, us in stages(b, pkt, args.launches):
            print(f"  {us:7.2f}  {name}")
        if args.engine:
            rounds = engine(b, max(1, args.launches // 5), args.rounds)
            print("a launch on an engine (64 threads, a while loop of one trip), waited for:"
                  " us per launch, control thread CPU / process CPU / wall")
            for thread_us, process_us, wall_us in rounds:
                print(f"  {thread_us:8.1f} {process_us:8.1f} {wall_us:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
