"""Launchers with the torch backend (issue item 8): DataLoader workers that build batches on
the host feeding a training loop on accel through pinned memory, and torchrun ranks, each
on its own accel device, all-reducing over gloo.

gloo takes CPU tensors only: a device tensor is refused ("No backend type associated with
device type accel" with the plain "gloo" backend; "ProcessGroupGloo::allreduce: unsupported
device type accel" when accel is mapped to gloo explicitly), so ranks round-trip through
the host: copy to CPU, all-reduce, copy back. The rank test checks that refusal too, so a
torch that starts accepting device tensors is noticed.
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

pytestmark = pytest.mark.timeout(180)

LOADER = """
import torch
from torch.utils.data import DataLoader, Dataset


class Line(Dataset):
    # points of y = 3x - 1, made on the host by whichever worker loads them
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        x = torch.tensor([i / 64.0])
        return x, 3 * x - 1, torch.tensor(torch.accel.is_initialized())


if __name__ == "__main__":
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1).to("accel")  # the parent initialises before workers fork
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(Line(), batch_size=16, shuffle=True, num_workers=2, pin_memory=True,
                        persistent_workers=True)
    batches = pinned = initialised = 0
    losses = []
    for epoch in range(8):
        for x, y, worker_init in loader:
            batches += 1
            pinned += x.is_pinned() and y.is_pinned()
            initialised += int(worker_init.sum())
            x, y = x.to("accel", non_blocking=True), y.to("accel", non_blocking=True)
            loss = ((model(x) - y) ** 2).mean()  # not F.mse_loss: it fails on accel (see report)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    print(f"batches {batches} pinned {pinned} initialised workers {initialised} "
          f"device {model.weight.device} loss {losses[0]} -> {losses[-1]}")
"""

RANK = """
import os

import torch
import torch.distributed as dist

rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
torch.accel.set_device(local_rank)
dist.init_process_group("gloo")
x = torch.arange(4.0, device="accel") * (rank + 1)  # computed on this rank's device
try:
    dist.all_reduce(x.clone())
    refused = "accepted"
except RuntimeError as e:
    refused = str(e).splitlines()[0]
host = x.cpu()
dist.all_reduce(host)
x.copy_(host)  # the sum back on the device
# one write of the whole line: the ranks share the launcher's stdout, and print's separate
# writes of text and newline interleaved between them once
os.write(1, f"rank {rank} on {x.device}: {x.cpu().tolist()} device tensors: {refused}\\n".encode())
dist.destroy_process_group()
"""


def run_script(daemon: Daemon, tmp_path: Path, body: str, *launcher: str) -> list[str]:
    """``body`` as a file (workers and ranks re-import it), run against the daemon."""
    script = tmp_path / "launched.py"
    script.write_text(textwrap.dedent(body))
    out = subprocess.run([sys.executable, *launcher, str(script)], capture_output=True, text=True,
                         env=daemon.env(), timeout=170, cwd=REPO)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout.split("\n")[:-1]


def test_dataloader_workers_feed_pinned_batches_to_training_on_accel(daemon, tmp_path):
    """Forked workers (the default) after the parent initialised: fine, since they build
    host tensors only; the pin thread pins every batch; the model learns the line."""
    lines = run_script(daemon, tmp_path, LOADER)
    assert len(lines) == 1, lines
    said, losses = lines[0].split(" loss ")
    first, last = map(float, losses.split(" -> "))
    assert said == "batches 32 pinned 32 initialised workers 0 device accel:0", lines
    assert last < first / 10, lines  # the model learnt the line



def test_torchrun_ranks_compute_on_their_devices_and_all_reduce_through_the_host(daemon, tmp_path):
    lines = run_script(daemon, tmp_path, RANK, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node=2")
    ranks = sorted(re.findall(r"rank \d on [^\n]*?device type accel", "\n".join(lines)))
    refusal = "No backend type associated with device type accel"
    assert ranks == [f"rank {r} on accel:{r}: [0.0, 3.0, 6.0, 9.0] device tensors: {refusal}"
                     for r in (0, 1)], lines
