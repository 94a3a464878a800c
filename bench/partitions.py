"""One partition's kernel launches while the other partition of the same device is saturated
(docs/partitions.md).

A private one-device daemon is split into 2 partitions. A tenant on the second partition
runs a giant grid on its compute engine, switched on and off through its stdin; the
bystander, another process on the first partition, times launch-to-completion of a small
kernel (``fill`` of 256 floats) in blocks that alternate with blocks of the same while the
other partition is quiet. Then the device is made whole again and the same is timed for
two tenants of it, who share its engines. Partitions have engines and a firmware of their
own; on this emulator both partitions' engines are host threads, so on a host with few
CPUs the flood still takes CPU time from the bystander's partition.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.core import Env, Row, Samples, timed_row
from bench.floods import GIANT_GRID, Flood
from bench.procs import REPO

#: The bystander: on "measure", times N launches of a small kernel and prints them (ns).
_BYSTANDER = """
import json, sys, time, numpy as np, runtime
from runtime import kernel_lib
lib = runtime.compile(kernel_lib.SOURCE)
x = runtime.empty(256, np.float32)
s = runtime.Stream()
lib.fill[1, 256](x, np.float32(1), stream=s); s.synchronize()   # compiled before timing
print("ready", flush=True)
for line in sys.stdin:
    times = []
    for _ in range(int(line)):
        t0 = time.perf_counter_ns()
        lib.fill[1, 256](x, np.float32(2), stream=s)
        s.synchronize()
        times.append(time.perf_counter_ns() - t0)
    print(json.dumps(times), flush=True)
"""


def _launches(root: Path, flood_on: str, bystander_on: str, samples: int,
              rounds: int) -> tuple[Samples, Samples]:
    """(flooded, quiet) launch round trips of a bystander on device ``bystander_on`` while
    a tenant on ``flood_on`` runs a giant grid, in alternating blocks."""
    flood = Flood(root, GIANT_GRID, visible=flood_on)
    bystander = subprocess.Popen(
        [sys.executable, "-c", _BYSTANDER], cwd=REPO, text=True, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "ACCEL_EMU_ROOT": str(root), "ACCEL_VISIBLE_DEVICES": bystander_on,
             "PYTHONPATH": str(REPO)})
    assert bystander.stdin is not None and bystander.stdout is not None
    got = {k: Samples(k) for k in ("quiet", "flood")}
    try:
        if bystander.stdout.readline().strip() != "ready":
            raise RuntimeError("the bystander did not start")
        for r in range(rounds):
            for state in ("off", "on") if r % 2 == 0 else ("on", "off"):
                flood.switch(state)
                bystander.stdin.write(f"{samples}\n")
                bystander.stdin.flush()
                times = json.loads(bystander.stdout.readline())
                key = "flood" if state == "on" else "quiet"
                got[key].ns.extend(times)
                got[key].block_medians.append(statistics.median(times))
        flood.switch("off")
    finally:
        flood.close()
        bystander.stdin.close()
        bystander.wait(timeout=60)
    return got["flood"], got["quiet"]


def partition_isolation(env: Env) -> list[Row]:
    """A kernel launch round trip with a giant grid on the other partition of the same
    device vs quiet, and the same for two tenants of the whole device."""
    d = env.new_accel(1)
    d.start()
    mode = d.root / "sys/class/accel/accel0/partition_mode"
    samples = 30 if env.quick else 100
    rounds = 2 if env.quick else 4
    rows = []
    # split in 2, the partitions are accel1 and accel2 (docs/partitions.md); then whole
    for split, flood_on, bystander_on, what in (
            ("2", "2", "1", "partition 0's kernel launch round trip, partition 1 running a "
                            "giant grid"),
            ("1", "0", "0", "a tenant's kernel launch round trip, another tenant of the "
                            "whole device running a giant grid")):
        mode.write_text(split)
        flooded, quiet = _launches(d.root, flood_on, bystander_on, samples, rounds)
        rows.append(timed_row(
            what, flooded, "same, the other quiet", quiet, goal=None,
            note=f"worst flooded {flooded.percentile_us(100):,.0f} us vs quiet "
                 f"{quiet.percentile_us(100):,.0f} us; {rounds} rounds of {samples}"))
    return rows
