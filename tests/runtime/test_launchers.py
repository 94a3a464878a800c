"""The launchers people start device code with: a spawn ``multiprocessing.Pool``, PyTorch
``DataLoader`` workers and ``torchrun`` ranks (docs/distributed.md).

Each test runs a real script in a fresh interpreter (spawn re-imports ``__main__``, so it
must be a file), checks values computed on the device in the processes the launcher
started, and then that the driver's books show both devices idle again: every context,
queue and byte those processes held was given back when they exited.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testkit import REPO
from testkit.daemon import Daemon

IDLE = {"contexts": "0", "memory_used": "0", "queues": "0"}

#: What every worker computes: saxpy from the kernel library on its current device.
WORK = """
import os
import sys

import numpy as np

import runtime
from runtime import kernel_lib

N = 4096


def expected(a: float) -> np.ndarray:
    return a * np.arange(N, dtype=np.float32) + 1


def on_device(a: float) -> np.ndarray:
    # a * arange(N) + 1 on this process's current device, copied back to the host
    mod = runtime.compile(kernel_lib.SOURCE)
    out = runtime.empty(N, np.float32)
    mod.saxpy[(N + 255) // 256, 256](np.float32(a), runtime.to_device(np.arange(N, dtype=np.float32)),
                                      runtime.to_device(np.ones(N, np.float32)), out)
    return out.copy_to_host()
"""

POOL = """
import multiprocessing as mp

_barrier = None


def start_worker(barrier, counter) -> None:
    # each worker takes the next device, its first device call
    global _barrier
    _barrier = barrier
    with counter.get_lock():
        n, counter.value = counter.value, counter.value + 1
    runtime.set_device(n % runtime.device_count())


def task(a: float):
    _barrier.wait(30)  # both tasks at once: each worker takes one
    return os.getpid(), runtime.get_device_properties().physical_index, on_device(a)


if __name__ == "__main__":
    runtime.init()  # an initialised parent: spawn children start clean anyway
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(2, initializer=start_worker, initargs=(ctx.Barrier(2), ctx.Value("i", 0)))
    results = pool.map(task, [2.0, 3.0], chunksize=1)
    pool.close()
    pool.join()  # the workers exit, not terminated: their device state is torn down on exit
    assert len({pid for pid, _, _ in results}) == 2, results
    assert sorted(dev for _, dev, _ in results) == [0, 1], results
    for a, (_, _, got) in zip([2.0, 3.0], results):
        assert np.array_equal(got, expected(a)), (a, got[:4])
    print("pool ok")
"""

LOADER = """
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

ITEMS = 6


class OnDevice(Dataset):
    # item i is on_device(i), computed by the worker that loads it, on that worker's device
    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int):
        dev = runtime.get_device_properties().physical_index
        return i, get_worker_info().id, dev, torch.from_numpy(on_device(float(i)))


def bind_worker(worker_id: int) -> None:
    # worker_init_fn: the worker's first device call, so its runtime state is its own
    runtime.set_device(worker_id % runtime.device_count())


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "fork-before":
        assert runtime.device_count() == 2 and not runtime.is_initialized()  # discovery only
    else:
        assert np.array_equal(on_device(1.0), expected(1.0))  # the parent uses the device
    loader = DataLoader(OnDevice(), batch_size=None, num_workers=2, worker_init_fn=bind_worker,
                        multiprocessing_context="spawn" if mode == "spawn" else None)
    try:
        items = list(loader)
    except runtime.UseAfterForkError as exc:
        print(f"UseAfterForkError parent={os.getpid()}: {exc}")
        sys.exit(0)
    assert sorted(i for i, *_ in items) == list(range(ITEMS)), items
    for i, worker, dev, got in items:
        assert dev == worker % 2, (i, worker, dev)
        assert np.array_equal(got.numpy(), expected(float(i))), (i, got[:4])
    print(f"loader ok {len(items)} items from workers {sorted({w for _, w, _, _ in items})}")
"""


def write_script(tmp_path: Path, body: str) -> Path:
    """``WORK`` and ``body`` as one script file (spawn children re-import it by path)."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(WORK) + textwrap.dedent(body))
    return script


def run_settled(daemon: Daemon, script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` against the daemon, then wait for the books to show every device idle
    (the firmware confirms teardown a moment after the processes are gone)."""
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                         env=daemon.env(), timeout=120, cwd=REPO)
    for dev in range(daemon.devices):
        daemon.wait_attrs(dev, IDLE)
    return out


def test_spawn_pool_workers_compute_on_their_devices(daemon, tmp_path):
    out = run_settled(daemon, write_script(tmp_path, POOL))
    assert out.returncode == 0 and out.stdout.strip() == "pool ok", out.stderr + out.stdout


@pytest.mark.parametrize("mode", ["spawn", "fork-before"])
def test_dataloader_workers_compute_every_item(daemon, tmp_path, mode):
    """spawn works whatever the parent did; the default fork works while the parent has
    only done discovery, and ``worker_init_fn`` gives each worker its own device."""
    out = run_settled(daemon, write_script(tmp_path, LOADER), mode)
    assert out.returncode == 0, out.stderr + out.stdout
    assert out.stdout.strip() == "loader ok 6 items from workers [0, 1]", out.stdout


def test_dataloader_fork_after_parent_init_raises_use_after_fork(daemon, tmp_path):
    """The parent's device state cannot be shared with forked workers: the worker's first
    device call fails, and the DataLoader re-raises that error in the parent as the same
    class, naming the worker, the initialising parent and the fix."""
    out = run_settled(daemon, write_script(tmp_path, LOADER), "fork-after")
    assert out.returncode == 0, out.stderr + out.stdout
    line = out.stdout.strip()
    parent = re.match(r"UseAfterForkError parent=(\d+): ", line)
    assert parent, line
    assert "in DataLoader worker process" in line
    assert f"initialised in process {parent[1]} before this process" in line
    assert "'spawn'" in line and "initialise the runtime in the child" in line


RANK_LINE = re.compile(r"rank (\d) local_rank (\d) bind (\S+) device (\d) uuid (\S+) fabric (\S+)")


@pytest.mark.parametrize("bind", ["visible", "set_device"])
def test_torchrun_ranks_on_their_own_devices_all_reduce(daemon, bind):
    """examples/torchrun_allreduce.py, launched through torchrun (it checks the all-reduce
    itself); here, that each rank bound the device of its LOCAL_RANK and no two shared one."""
    out = run_settled(daemon, REPO / "examples" / "torchrun_allreduce.py", bind)
    assert out.returncode == 0, out.stderr + out.stdout
    ranks = sorted(m.groups() for m in RANK_LINE.finditer(out.stdout))
    assert [r[:4] for r in ranks] == [("0", "0", bind, "0"), ("1", "1", bind, "1")], out.stdout
    assert [r[4] for r in ranks] == [daemon.attr(0, "uuid"), daemon.attr(1, "uuid")]
    assert len({r[5] for r in ranks}) == 2, ranks
