"""A bystander tenant under another tenant's floods (docs/containment.md, "Figures").

For each flood -- 64 threads waiting on long copies, 1,000 idle queues, a giant grid on
both compute engines -- the bench process is the bystander: it times no-op round trips on a
user-mode queue of its own and driver round trips (DEVICE_QUERY), in blocks that alternate
with blocks of the same with the flooding process quiet. Goal: the flooded figure at most
2x the quiet one. The flood is another process (another context: another tenant), told
"on"/"off" through its stdin and answering once the flood is (or is no longer) running.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from bench.core import Env, Row, Samples, timed_row
from bench.procs import REPO

#: A giant grid on the compute engines (bench/partitions.py floods a partition with it).
GIANT_GRID = """
    mod = runtime.compile("def churn(x, n):\\n    acc = 0.0\\n    for j in range(n):\\n"
                          "        acc = acc + 1.0\\n    x[global_id(0) % 1024] = acc\\n")
    x = runtime.empty(1024, np.float32); s = runtime.Stream()
    mod.churn[1, 32](x, np.int64(1), stream=s); s.synchronize()
    def on(): mod.churn[1 << 16, 256](x, np.int64(2000), stream=s); time.sleep(0.2)
    def off(): s.synchronize()
"""

#: The flooding tenant: "on"/"off" lines switch its flood; it answers each.
_FLOODS = {
    "64 threads waiting on long copies": """
        src = runtime.empty(32 << 20, np.uint8); dst = runtime.empty(32 << 20, np.uint8)
        go = threading.Event()
        def waiter():
            s = runtime.Stream()
            while True:
                go.wait()
                dst.copy_(src, stream=s)
                s.synchronize()
        for _ in range(64):
            threading.Thread(target=waiter, daemon=True).start()
        def on(): go.set(); time.sleep(0.2)
        def off(): go.clear(); runtime.synchronize(); time.sleep(0.2)
    """,
    "1,000 idle queues": """
        queues = []
        def on(): queues.extend(runtime.Stream() for _ in range(1000))
        def off(): queues.clear(); time.sleep(0.1)
    """,
    "a giant grid on both compute engines": GIANT_GRID,
}

_DRIVER = """
import sys, threading, time, numpy as np, runtime
{body}
print("ready", flush=True)
state = "off"
for line in sys.stdin:
    if line.strip() != state:
        state = line.strip()
        (on if state == "on" else off)()
    print(state, flush=True)
"""


class Flood:
    """A flooding tenant on the mount at ``root`` (``visible``: its ACCEL_VISIBLE_DEVICES)."""

    def __init__(self, root: Path, body: str, visible: str | None = None) -> None:
        extra = {} if visible is None else {"ACCEL_VISIBLE_DEVICES": visible}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DRIVER.format(body=textwrap.dedent(body))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
            env=dict(os.environ, ACCEL_EMU_ROOT=str(root), PYTHONPATH=str(REPO), **extra))
        if self.proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError("the flooding tenant did not start")

    def switch(self, state: str) -> None:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(state + "\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != state:
            raise RuntimeError(f"the flooding tenant did not turn {state}")

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bystander_under_floods(env: Env) -> list[Row]:
    """A bystander's no-op and driver round trips with another tenant quiet vs flooding
    (64 waiting threads, 1,000 queues, a giant grid); goal: at most 2x quiet."""
    with env.accel_root_env():
        import runtime
        from runtime.context import Context

        runtime.init()
        # the flooding tenant needs device memory: what earlier benchmarks of this process
        # left in its caching allocator goes back first (a full run filled the device)
        runtime.empty_cache(0)
        stream = runtime.Stream()
        ctx = Context("accel0")
        nop_samples = 50 if env.quick else 200
        rounds = 2 if env.quick else 4

        def nop() -> None:
            stream.wait_seqno(stream.submit_nop())

        rows = []
        for name, body in _FLOODS.items():
            flood = Flood(env.accel.root, body)
            got = {k: Samples(k) for k in ("nop quiet", "nop flood", "drv quiet", "drv flood")}
            try:
                for r in range(rounds):
                    for state in ("off", "on") if r % 2 == 0 else ("on", "off"):
                        flood.switch(state)
                        label = "flood" if state == "on" else "quiet"
                        for key, fn in ((f"nop {label}", nop),
                                        (f"drv {label}", ctx.query_device)):
                            times = []
                            for _ in range(nop_samples):
                                t0 = time.perf_counter_ns()
                                fn()
                                times.append(time.perf_counter_ns() - t0)
                            got[key].ns.extend(times)
                            got[key].block_medians.append(statistics.median(times))
                flood.switch("off")
            finally:
                flood.close()
            for kind, what in (("nop", "no-op round trip on its own queue"),
                               ("drv", "driver round trip (DEVICE_QUERY)")):
                flooded, quiet = got[f"{kind} flood"], got[f"{kind} quiet"]
                rows.append(timed_row(
                    f"bystander {what}, another tenant: {name}", flooded,
                    "same, that tenant quiet", quiet, goal=2.0,
                    note=f"worst flooded {flooded.percentile_us(100):,.0f} us vs quiet "
                         f"{quiet.percentile_us(100):,.0f} us; {rounds} rounds of "
                         f"{nop_samples} per case"))
        ctx.close()
    return rows
