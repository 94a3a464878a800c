"""accl's all_reduce on accel tensors against gloo's on CPU tensors of the same bytes.

Two ranks under ``torchrun --standalone`` on a 2-device daemon of their own, one per device,
run this file: each round times a block of accl all_reduces (accel tensors, then a
synchronize, so the results are on the device) and a block of gloo all_reduces on a
separate gloo group (CPU tensors), in alternating order, after a barrier so both ranks
time the same block. Rank 0 writes the per-call times; the parent turns them into rows
(issue 33's goals: at most 1.5x gloo for 64 MiB, 2x for 4 KiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.core import Env, Row, Samples, timed_row

#: (bytes, calls per block, rounds; quick rounds)
SIZES = [(4096, 20, 8, 4), (64 << 20, 2, 6, 3)]


def distributed(env: Env) -> list[Row]:
    """accl all_reduce of 4 KiB and 64 MiB on accel tensors (2 ranks) vs gloo on CPU tensors."""
    out = env.workdir / "distributed.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", __file__, str(out), "quick" if env.quick else "full"]
    # a daemon of its own: the shared one's devices hold what earlier groups' processes
    # keep (the bench process's torch caching allocator reserves device memory), and two
    # 64 MiB tensors plus their staging did not fit beside it (OutOfMemoryError)
    d = env.new_accel(2)
    d.start()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, ACCEL_EMU_ROOT=str(d.root),
                                   PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    if proc.returncode != 0:
        raise RuntimeError("distributed ranks failed:\n" + _rank_tails(proc.stderr))
    rows = []
    for size, cases in json.loads(out.read_text()).items():
        accl, gloo = (_samples(name, cases[name]) for name in ("accl", "gloo"))
        label = "4 KiB" if int(size) < 1 << 20 else f"{int(size) >> 20} MiB"
        rows.append(timed_row(f"all_reduce {label} float32, accl on accel tensors (2 ranks)",
                              accl, f"gloo all_reduce {label}, CPU tensors", gloo,
                              goal=2.0 if int(size) < 1 << 20 else 1.5))
    return rows


def _rank_tails(stderr: str, chars: int = 2500) -> str:
    """The end of each rank's own lines (torchrun prefixes them ``[rankN]:``): the rank
    that failed first is seldom the one whose traceback comes last."""
    tails = []
    for rank in (0, 1):
        mine = "\n".join(line for line in stderr.splitlines() if line.startswith(f"[rank{rank}]"))
        tails.append(mine[-chars:] or f"[rank{rank}]: (no output)")
    return "\n".join(tails) + "\n" + stderr[-1500:]


def _samples(name: str, blocks: list[list[int]]) -> Samples:
    s = Samples(name)
    for block in blocks:
        s.ns.extend(block)
        s.block_medians.append(sorted(block)[len(block) // 2])
    return s


def _rank_main(out: str, quick: bool) -> None:
    """One rank: alternating blocks of accl and gloo all_reduces; rank 0 writes the times."""
    import torch
    import torch.distributed as dist

    torch.accel.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("accl")
    gloo = dist.new_group(backend="gloo")
    result: dict[int, dict[str, list[list[int]]]] = {}
    for nbytes, calls, rounds, quick_rounds in SIZES:
        dev_t = torch.ones(nbytes // 4, device="accel")
        cpu_t = torch.ones(nbytes // 4)

        def accl() -> None:
            dist.all_reduce(dev_t)
            torch.accel.synchronize()

        def host() -> None:
            dist.all_reduce(cpu_t, group=gloo)

        cases = {"accl": accl, "gloo": host}
        times: dict[str, list[list[int]]] = {name: [] for name in cases}
        for fn in cases.values():
            fn()  # warm: the kernels, the pinned buffers, gloo's pairs
        for rnd in range(quick_rounds if quick else rounds):
            for name in (list(cases) if rnd % 2 == 0 else list(cases)[::-1]):
                dist.barrier(group=gloo)
                block = []
                for _ in range(calls):
                    t0 = time.perf_counter_ns()
                    cases[name]()
                    block.append(time.perf_counter_ns() - t0)
                times[name].append(block)
        result[nbytes] = times
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2] == "quick")
