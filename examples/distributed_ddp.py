"""DistributedDataParallel on accel devices over the ``accl`` backend, on one host or several.

One host (a serving accel-emud with 2 devices, ACCEL_EMU_ROOT set)::

    python examples/distributed_ddp.py

launches itself as ``python -m torch.distributed.run --standalone --nproc-per-node=2``.
Several hosts (one daemon per host, each rank on its host's device ``LOCAL_RANK``)::

    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=K --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29400 --rdzv-id=job1 examples/distributed_ddp.py

Each rank trains a copy of a small MLP on its share of one batch; DDP averages the
gradients with ``accl``'s all_reduce, so every copy ends where one process training on the
whole batch on the CPU ends, which each rank checks. Each rank prints its host's device
(UUID), and rank 0 checks that no two ranks share one.
"""

import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

RANKS = 2
STEPS = 5


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank and the CPU reference start from the same weights
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def rank_main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.accel.set_device(local_rank)
    dev = torch.device("accel", local_rank)
    dist.init_process_group("accl")
    rank, world = dist.get_rank(), dist.get_world_size()

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * world, 8, generator=g), torch.randint(0, 4, (8 * world,), generator=g)
    params = train(DDP(mlp().to(dev)), x.chunk(world)[rank].to(dev), y.chunk(world)[rank].to(dev))
    reference = train(mlp(), x, y)  # one process, the whole batch, the CPU
    diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
    assert diff < 1e-5, f"rank {rank}: DDP parameters differ from full-batch CPU by {diff}"

    uuid = torch.accel.get_device_properties(dev).uuid
    uuids: list[object] = [None] * world
    dist.all_gather_object(uuids, uuid)
    assert len(set(uuids)) == world, f"ranks share a device: {uuids}"
    line = (f"rank {rank}/{world} on {dev} uuid {uuid}: {STEPS} DDP steps, parameters "
            f"within {diff:.1e} of full-batch CPU training\n")
    os.write(sys.stdout.fileno(), line.encode())  # one write(2): the ranks' lines never mix
    dist.destroy_process_group()


def launch() -> None:
    """The launcher side: RANKS ranks of this file on this host."""
    if torch.accel.device_count() < RANKS:  # discovery only: the launcher holds no device
        sys.exit(f"needs {RANKS} devices, {torch.accel.device_count()} visible")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={RANKS}", __file__], check=True)


if __name__ == "__main__":
    rank_main() if "LOCAL_RANK" in os.environ else launch()
