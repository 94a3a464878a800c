"""Memory under stress: random allocate/free/copy over several streams, every byte checked.

A shadow copy of every live device array is kept on the host; each operation is applied to
both, and every array is read back and compared at checkpoints and at the end. Several
processes run the same at once on the shared device, and the driver's books must return
to idle when they exit.
"""

from __future__ import annotations

import subprocess
import sys

STRESS = r"""
import sys, time, numpy as np, runtime
from abi import userq
seed, ops = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(seed)
streams = [runtime.Stream() for _ in range(3)]
live = {}          # id -> (device array, host shadow, stream it was last used on)
pin = runtime.pinned_empty(1 << 20, np.uint8)
next_id = 0
ooms = 0

def join(s, arr_stream):
    if arr_stream is not s:
        s.wait_stream(arr_stream)           # the contract: cross-stream needs an event

for step in range(ops):
    op = rng.choice(["alloc", "alloc", "free", "h2d", "d2d", "memset", "check"])
    if op == "alloc" or not live:
        n = int(rng.choice([1, 100, 4096, 65536, 1 << 20, 3 << 20]))
        s = streams[rng.integers(3)]
        for attempt in range(200):            # other processes hold the rest: recover
            try:
                d = runtime.empty(n, np.uint8, stream=s)
                break
            except runtime.OutOfMemoryError:
                ooms += 1
                if live:                      # give back half of ours, then retry
                    for k in list(live)[: len(live) // 2 + 1]:
                        del live[k]
                else:                         # ours is all given back: wait for theirs
                    time.sleep(0.01)
        else:
            raise AssertionError(f"step {step}: out of memory with nothing of ours held")
        shadow = rng.integers(0, 255, n, dtype=np.uint8)
        d.copy_from_host(shadow, stream=s)
        live[next_id] = (d, shadow, s); next_id += 1
        continue
    key = list(live)[rng.integers(len(live))]
    d, shadow, s_old = live[key]
    s = streams[rng.integers(3)]
    if op == "free":
        if s_old is not streams[0] and rng.random() < 0.5:
            d.record_stream(s_old)
        del live[key], d
    elif op == "h2d":
        join(s, s_old)
        if rng.random() < 0.5:               # pinned: asynchronous, into a prefix
            k = min(len(shadow), 1 << 20)
            pin[:k] = rng.integers(0, 255, k, dtype=np.uint8)
            s.submit([userq.Copy(d.va, pin.device_va, k)])
            s.synchronize()                  # before the pinned buffer is written again
            shadow[:k] = pin[:k]
        else:                                # pageable: staged, the whole array
            shadow[:] = rng.integers(0, 255, len(shadow), dtype=np.uint8)
            d.copy_from_host(shadow, stream=s)
        live[key] = (d, shadow, s)
    elif op == "d2d":
        other = list(live)[rng.integers(len(live))]
        d2, shadow2, s2 = live[other]
        if len(shadow2) == len(shadow) and other != key:
            join(s, s_old); join(s, s2)
            d2.copy_(d, stream=s)
            shadow2[:] = shadow
            live[other] = (d2, shadow2, s); live[key] = (d, shadow, s)
    elif op == "memset":
        v = int(rng.integers(256))
        join(s, s_old)
        d.memset(v, stream=s)
        shadow[:] = v
        live[key] = (d, shadow, s)
    elif op == "check":
        join(s, s_old)
        got = d.copy_to_host(stream=s)
        assert np.array_equal(got, shadow), f"step {step}: array {key} differs"
        live[key] = (d, shadow, s)
for key, (d, shadow, s) in live.items():
    assert np.array_equal(d.copy_to_host(stream=s), shadow), f"final: array {key} differs"
st = runtime.memory_stats()
assert st["allocated_bytes.all.current"] == sum(
    ((len(sh) + 511) // 512) * 512 for _, sh, _ in live.values())
print("ok", len(live), ooms, st["num_ooms"], st["segment.all.current"])
"""


def test_random_sequences_every_byte_checked(daemon):
    out = subprocess.run([sys.executable, "-c", STRESS, "1", "1500"], env=daemon.env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_several_processes_at_once_then_idle(daemon):
    procs = [daemon.popen_py(STRESS, str(seed), "600") for seed in (2, 3, 4)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert out.startswith("ok")
    daemon.wait_attrs(0, {"memory_used": "0", "contexts": "0", "processes": "pid device_bytes"})
