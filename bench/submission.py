"""Submission benchmarks (bring-up 3), each against a floor measured in the same run.

* no-op submit-to-completion round trip on a user-mode queue vs a shared-memory ping-pong
  between two Python processes (goal: at most 10 us median, absolute);
* back-to-back asynchronous launch rate vs writing the same packets into a bare shared
  ring (goal: at least 250,000 launches/s);
* round trip to a firmware that went to sleep vs waking a process blocked in select(2);
* firmware CPU while idle vs the echo filesystem's, over the same seconds;
* graph replay per node vs the same nodes launched eagerly.
"""

from __future__ import annotations

import os
import statistics
import time

from abi import userq
from bench.core import Env, Row, Samples, interleave, timed_row
from bench.floors import PingPong, PipeWake, bare_ring_rate


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alternate_with_pingpong(env: Env, noop: object) -> dict[str, Samples]:
    """Blocks of no-op round trips alternating with blocks of the ping-pong floor. The
    ping-pong child spins a CPU while it lives, so it lives only for its own blocks."""
    s = env.sizes
    out = {"pingpong": Samples("pingpong"), "noop": Samples("noop")}
    for _ in range(s.warmup):
        noop()  # type: ignore[operator]
    for r in range(s.rounds):
        for name in ("pingpong", "noop") if r % 2 == 0 else ("noop", "pingpong"):
            ping = PingPong() if name == "pingpong" else None
            fn = ping.round_trip if ping else noop
            try:
                for _ in range(50):
                    fn()  # type: ignore[operator]
                times = []
                for _ in range(s.block):
                    t0 = time.perf_counter_ns()
                    fn()  # type: ignore[operator]
                    times.append(time.perf_counter_ns() - t0)
            finally:
                if ping:
                    ping.close()
            out[name].ns.extend(times)
            out[name].block_medians.append(statistics.median(times))
    return out


def submission(env: Env) -> list[Row]:
    """Launch, submit-to-completion, event and priority costs of the doorbell path.

    Baselines: the driver round trip of a no-op (what a launch would cost without the
    user-mode ring) and the same work at idle or in order."""
    import numpy as np

    with env.accel_root_env():
        import runtime

        runtime.init()
        stream = runtime.Stream()
        nop = userq.Nop().encode()
        wake = PipeWake()
        try:
            def noop_round_trip() -> None:
                stream.wait_seqno(stream._write((nop,)))

            got = _alternate_with_pingpong(env, noop_round_trip)
            noop_us = got["noop"].median_us
            rows = [timed_row(
                "no-op submit-to-completion (user-mode queue)", got["noop"],
                "shared-memory ping-pong, 2 processes", got["pingpong"], goal=None,
                note=f"goal: at most 10 us median absolute; measured {noop_us:.2f} us "
                     f"({'met' if noop_us <= 10 else 'NOT met'}); Stream.submit + wait_seqno "
                     "(spins on the fence in shared memory)")]

            # idle wake-up: let the firmware fall asleep before each round trip
            idle = Samples("idle")
            floor = Samples("pipe")
            for i in range(10 if env.quick else 30):
                time.sleep(0.02)
                for name, fn, out in (("fw", noop_round_trip, idle), ("pipe", wake.round_trip, floor)):
                    t0 = time.perf_counter_ns()
                    fn()
                    out.ns.append(time.perf_counter_ns() - t0)
            idle.block_medians.append(statistics.median(idle.ns))
            floor.block_medians.append(statistics.median(floor.ns))
            rows.append(timed_row(
                "round trip to a sleeping firmware", idle, "wake a process blocked in select(2)",
                floor, goal=None,
                note="20 ms idle before each; includes the doorbell FIFO write and the "
                     "firmware leaving poll(2)"))
        finally:
            wake.close()

        n = 20_000 if env.quick else 100_000
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            stream._write((nop,))
        launch_s = (time.perf_counter() - t0) / n
        stream.synchronize()
        ring_s = bare_ring_rate(n)
        rate = 1 / launch_s
        rows.append(Row(
            "asynchronous launch, back to back", launch_s * 1e6, "bare shared ring, 64-byte packets",
            ring_s * 1e6, "us", None, None,
            note=f"{rate:,.0f} launches/s vs the bare ring's {1 / ring_s:,.0f} packets/s; goal: "
                 f"at least 250,000/s ({'met' if rate >= 250_000 else 'NOT met'})"))

        # graph replay vs eager, per node
        nodes = 100
        a = runtime.empty(4096, np.uint8)
        g = runtime.Graph()
        with runtime.graph(g, stream):
            for v in range(nodes):
                a.memset(v % 256, stream=stream)

        def eager() -> None:
            for v in range(nodes):
                a.memset(v % 256, stream=stream)
            stream.synchronize()

        def replay() -> None:
            g.replay()
            stream.synchronize()

        rounds = interleave({"eager": eager, "replay": replay}, block=10 if env.quick else 40,
                            rounds=4 if env.quick else 8, warmup=5)
        for smp in rounds.values():
            smp.ns = [t // nodes for t in smp.ns]
            smp.block_medians = [m / nodes for m in smp.block_medians]
        rows.append(timed_row(f"graph replay per node ({nodes} memsets)", rounds["replay"],
                              "eager launch per node, same work", rounds["eager"], goal=None,
                              note="each iteration ends with a synchronize"))
        del a, g
        rows.append(_preemption(env, runtime, np))
    return rows


def _preemption(env: Env, runtime: object, np: object) -> Row:
    """A high-priority 8 MiB copy's latency while both copy engines run 72 MiB low-priority
    copies (preempted between 4 MiB chunks) vs the same copy on idle engines."""
    rt, npy = runtime, np  # the caller's modules (the runtime was initialised there)
    low = [rt.Stream(priority=0) for _ in range(2)]  # type: ignore[attr-defined]
    high = rt.Stream(priority=-1)  # type: ignore[attr-defined]
    big = [rt.empty(72 << 20, npy.uint8) for _ in range(3)]  # type: ignore[attr-defined]
    small = [rt.empty(8 << 20, npy.uint8) for _ in range(2)]  # type: ignore[attr-defined]
    idle, busy = Samples("idle"), Samples("busy")

    def high_copy() -> int:
        t0 = time.perf_counter_ns()
        high.wait_seqno(high.submit([_copy(small[1].va, small[0].va, 8 << 20)]))
        return time.perf_counter_ns() - t0

    for _ in range(4 if env.quick else 12):
        idle.ns.append(high_copy())
        for i, s in enumerate(low):
            s.submit([_copy(big[1 + i].va, big[0].va, 72 << 20)])
        while any(_taken(s) < s.last_seqno for s in low):
            pass
        busy.ns.append(high_copy())
        for s in low:
            s.synchronize()
    idle.block_medians = [statistics.median(idle.ns)]
    busy.block_medians = [statistics.median(busy.ns)]
    worst = max(busy.ns) / 1e3
    return timed_row("high-priority 8 MiB copy, engines busy with low-priority work", busy,
                     "same copy, engines idle", idle, goal=None,
                     note=f"worst of {len(busy.ns)}: {worst:.0f} us; preemption between 4 MiB "
                          "chunks, so the extra delay is about one chunk copy per engine")


def _copy(dst: int, src: int, n: int) -> userq.Copy:
    return userq.Copy(dst, src, n)


def _taken(stream: object) -> int:
    return stream._ring.rptr  # type: ignore[attr-defined]


def idle_cpu(env: Env) -> list[Row]:
    """CPU the firmware processes burn while nothing is submitted, vs a process that only
    wakes every 50 ms (the firmware's heartbeat): the least an idle firmware can cost."""
    import subprocess
    import sys

    accel = env.accel
    fw_pids = [int(accel.root.joinpath(f"sys/kernel/debug/accel/accel{i}/fw_pid").read_text())
               for i in range(accel.devices)]
    ticker = subprocess.Popen([sys.executable, "-c",
                               "import select\nwhile True: select.select([], [], [], 0.05)"])
    try:
        window = 1.0 if env.quick else 4.0
        time.sleep(0.3)  # any spin after earlier work ends; the ticker starts
        fw0 = sum(_cpu_seconds(p) for p in fw_pids)
        tick0 = _cpu_seconds(ticker.pid)
        time.sleep(window)
        fw_pct = (sum(_cpu_seconds(p) for p in fw_pids) - fw0) / window / len(fw_pids) * 100
        tick_pct = (_cpu_seconds(ticker.pid) - tick0) / window * 100
    finally:
        ticker.kill()
        ticker.wait()
    tick = 100 / os.sysconf("SC_CLK_TCK") / window  # one clock tick, in percent
    return [Row("firmware CPU while idle (per device)", max(fw_pct, tick / 2), "a process waking "
                "every 50 ms", max(tick_pct, tick / 2), "%", None, None,
                note=f"utime+stime over {window:.0f} s of no work; one clock tick is {tick:.2f}% "
                     "(a figure of half a tick means none was counted); goal: near zero")]
