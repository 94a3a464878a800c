"""The c10d backend ``accl`` (torch_accel/distributed.py, docs/distributed.md) from the
user's side: ranks started by ``torchrun`` against a real mount, each on its own device,
calling ``torch.distributed`` on accel tensors. Every script checks its values against what
torch's CPU computes and prints one line per rank; the tests read those lines."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testkit import REPO
from testkit.daemon import Daemon

pytestmark = pytest.mark.timeout(300)

PRELUDE = """
import datetime, os, sys, time
import torch
import torch.distributed as dist

local_rank = int(os.environ["LOCAL_RANK"])
torch.accel.set_device(local_rank)
dev = torch.device("accel", local_rank)


def say(text: str) -> None:
    # one write(2) a line: the ranks share the launcher's stdout
    os.write(1, f"rank {dist.get_rank()}: {text}\\n".encode())
"""

COLLECTIVES = """
dist.init_process_group(None if sys.argv[1] == "default" else sys.argv[1])
r, w = dist.get_rank(), dist.get_world_size()
say(f"config {dist.get_backend_config()}")
base = torch.arange(4.0)
t = (base + r).to(dev)
mine = [base + i for i in range(w)]  # every rank's t, on the CPU


def check(name, got, want):
    assert got.device == dev, (name, got.device)
    assert torch.equal(got.cpu(), want), (name, got.cpu(), want)
    return name


done = []
for op, want in [(dist.ReduceOp.SUM, sum(mine)), (dist.ReduceOp.AVG, sum(mine) / w),
                 (dist.ReduceOp.MAX, mine[-1]), (dist.ReduceOp.MIN, mine[0]),
                 (dist.ReduceOp.PRODUCT, mine[0] * mine[1])]:
    x = t.clone()
    dist.all_reduce(x, op=op)
    done.append(check(f"all_reduce.{op.name}", x, want))
i = torch.tensor([5, -7], dtype=torch.int64, device=dev) * (r + 1)
dist.all_reduce(i, op=dist.ReduceOp.AVG)  # integers: truncated, as NCCL's
done.append(check("all_reduce.AVG.int64", i, torch.tensor([7, -10])))
x = t.clone()
dist.broadcast(x, src=1)
done.append(check("broadcast", x, mine[1]))
x = t.clone()
dist.reduce(x, dst=0)
done.append(check("reduce", x, sum(mine) if r == 0 else mine[r]))
outs = [torch.empty(4, device=dev) for _ in range(w)]
dist.all_gather(outs, t)
done.append(check("all_gather", torch.cat(outs), torch.cat(mine)))
big = torch.empty(4 * w, device=dev)
dist.all_gather_into_tensor(big, t)
done.append(check("all_gather_into_tensor", big, torch.cat(mine)))
part = torch.empty(2, device=dev)
dist.reduce_scatter_tensor(part, t, op=dist.ReduceOp.MAX)
done.append(check("reduce_scatter_tensor", part, mine[-1][2 * r:2 * r + 2]))
parts = torch.empty(2, device=dev)
dist.reduce_scatter(parts, [c.clone() for c in t.chunk(w)])
done.append(check("reduce_scatter", parts, sum(mine)[2 * r:2 * r + 2]))
lists = [torch.empty(2, device=dev) for _ in range(w)]
dist.all_to_all(lists, [c.clone() for c in t.chunk(w)])
done.append(check("all_to_all", torch.cat(lists), torch.cat([m[2 * r:2 * r + 2] for m in mine])))
bits = torch.tensor([0b1100, 0b1010], device=dev) | (r + 1)
dist.all_reduce(bits, op=dist.ReduceOp.BAND)
done.append(check("all_reduce.BAND", bits, torch.tensor([0b1100, 0b1010])))  # 1, 2: no common bit
a2a = torch.empty(4, device=dev)
dist.all_to_all_single(a2a, t)
done.append(check("all_to_all_single", a2a, torch.cat([m[2 * r:2 * r + 2] for m in mine])))
got = [torch.empty(4, device=dev) for _ in range(w)] if r == 0 else None
dist.gather(t, got, dst=0)
if r == 0:
    done.append(check("gather", torch.cat(got), torch.cat(mine)))
s = torch.empty(4, device=dev)
dist.scatter(s, [m.to(dev) * 10 for m in mine] if r == 0 else None, src=0)
done.append(check("scatter", s, mine[r] * 10))
strided = torch.zeros(4, 2, device=dev)[:, 1]  # a column: not contiguous
if r == 0:
    dist.send(t * 3, dst=1)
    dist.recv(strided, src=1)
    done.append(check("send/recv strided", strided, mine[1] * 4))
else:
    y = torch.empty(4, device=dev)
    dist.recv(y, src=0)
    dist.send(t * 4, dst=0)
    done.append(check("send/recv", y, mine[0] * 3))
dist.barrier()
c = torch.full((3,), float(r))  # CPU tensors go to gloo as they are
dist.all_reduce(c)
done.append(check("cpu all_reduce", c.to(dev), torch.full((3,), float(sum(range(w))))))
names = [None] * w
dist.all_gather_object(names, torch.accel.get_device_properties().uuid)
assert len(set(names)) == w, names
say(f"ok {len(done)} " + " ".join(done))
dist.destroy_process_group()
"""

ASYNC = """
dist.init_process_group("accl")
r, w = dist.get_rank(), dist.get_world_size()
x = torch.ones(4096, device=dev)
torch.accel._sleep(20_000_000)  # the current stream is busy ...
x.mul_(r + 2)  # ... and x is written behind that: the collective must read it after
if r == 1:
    time.sleep(1.0)  # rank 0's collective cannot complete before this rank joins
work = dist.all_reduce(x, async_op=True)
pending = work.is_completed()
x2 = torch.full((1 << 16,), 7.0, device=dev)
w2 = dist.all_reduce(x2 * 1, async_op=True)  # a temporary: the Work keeps it alive
del x2
fill = [torch.full((1 << 16,), -1.0, device=dev) for _ in range(4)]  # reuse freed blocks
work.wait()
x.add_(1)  # the current stream, after wait(): ordered after the results landed
got = w2.get_future().wait()[0]
assert torch.equal(x.cpu(), torch.full((4096,), float(sum(range(2, w + 2)) + 1))), x[:4].cpu()
assert torch.equal(got.cpu(), torch.full((1 << 16,), 7.0 * w)), got[:4].cpu()
assert all(torch.equal(f.cpu(), torch.full((1 << 16,), -1.0)) for f in fill)
a1 = torch.full((8,), float(r + 1), device=dev)
a2 = torch.full((8,), 10.0 * (r + 1), device=dev)
if r == 1:
    torch.accel._sleep(50_000_000)  # rank 1's a1 is still being staged when ...
h1 = dist.all_reduce(a1, async_op=True)
dist.all_reduce(a2)  # ... this synchronous one comes: it must not reach gloo first
h1.wait()
assert (a1.cpu().tolist(), a2.cpu().tolist()) == ([3.0] * 8, [30.0] * 8), (a1.cpu(), a2.cpu())
say(f"{type(work).__name__} completed at issue {pending} result ok")
dist.destroy_process_group()
"""

#: rank 1 joins the collective only once rank 0 says so through the store, which rank 0
#: does only after its wait() returned: so wait() cannot have waited for the collective
NONBLOCKING = """
dist.init_process_group("accl")
r, w = dist.get_rank(), dist.get_world_size()
store = dist.distributed_c10d._get_default_store()
x = torch.full((4096,), float(r + 1), device=dev)
if r == 0:
    work = dist.all_reduce(x, async_op=True)
    work.wait()  # returns: rank 1 has not even joined
    y = x * 10  # the current stream, ordered after the collective's copies back
    after = torch.accel.Event()
    after.record()
    time.sleep(0.2)
    seen = [work.is_completed(), after.query()]
    store.set("go", "1")
    work.get_future().wait()
    after.synchronize()
    ok = torch.equal(y.cpu(), torch.full((4096,), 30.0))
    say(f"wait returned; completed, later work done before the peer joined: {seen}; {ok}")
else:
    store.wait(["go"])
    dist.all_reduce(x)
    say(f"joined late {x[:2].cpu().tolist()}")
z = torch.full((8,), 1.0, device=dev)
works = [dist.all_reduce(z, async_op=True) for _ in range(3)]  # in order, on one lane
for work in works:
    work.synchronize()
say(f"three in a row {z.cpu().tolist()[:2]}")
dist.destroy_process_group()
"""

#: Both data-parallel tests: a small model trained 3 SGD steps on a batch (the reference
#: is one process training on the whole batch on the CPU).
TRAINING = """
dist.init_process_group("accl")
r, w = dist.get_rank(), dist.get_world_size()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train(net, xs, ys):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xs), ys).backward()
        opt.step()
    return list(net.parameters())


g = torch.Generator().manual_seed(1)
X, Y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
"""

DDP = TRAINING + """
from torch.nn.parallel import DistributedDataParallel as DDP

ref = [p.detach() for p in train(model(), X, Y)]
ddp = DDP(model().to(dev))
got = train(ddp, X.chunk(w)[r].to(dev), Y.chunk(w)[r].to(dev))  # this rank's half
diff = max((a.detach().cpu() - b).abs().max().item() for a, b in zip(got, ref))
assert diff < 1e-5, diff
say(f"DDP on {next(ddp.parameters()).device} matches full-batch CPU training")
dist.destroy_process_group()
"""

FSDP2 = TRAINING + """
from torch.distributed.fsdp import fully_shard

ref = [p.detach() for p in train(model(), X, Y)]
sharded = model().to(dev)
for layer in sharded:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(sharded)
got = train(sharded, X.chunk(w)[r].to(dev), Y.chunk(w)[r].to(dev))
# each rank holds rows r of every parameter (Shard(0))
diff = max((p.to_local().cpu() - q.chunk(w)[r]).abs().max().item() for p, q in zip(got, ref))
assert diff < 1e-5, diff
say(f"FSDP2 shards on {got[0].to_local().device} match full-batch CPU training")
dist.destroy_process_group()
"""

DTENSOR = """
dist.init_process_group("accl")
r, w = dist.get_rank(), dist.get_world_size()
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import torch.distributed._functional_collectives as funcol

mesh = init_device_mesh("accel", (w,))
full = torch.arange(32.0).reshape(8, 4)
d = distribute_tensor(full.to(dev), mesh, [Shard(0)])
got = d.full_tensor()  # an all_gather_into_tensor through the functional ops
assert got.device == dev and torch.equal(got.cpu(), full), got.cpu()
x = torch.arange(4.0, device=dev) + 10 * r
mine = [torch.arange(4.0) + 10 * i for i in range(w)]  # every rank's x, on the CPU
checks = {
    "all_reduce": (funcol.all_reduce(x, "sum", mesh), sum(mine)),
    "all_gather": (funcol.all_gather_tensor(x, 0, mesh), torch.cat(mine)),
    "reduce_scatter": (funcol.reduce_scatter_tensor(x, "max", 0, mesh),
                       mine[-1].chunk(w)[r]),
    "all_to_all": (funcol.all_to_all_single(x, None, None, mesh),
                   torch.cat([m.chunk(w)[r] for m in mine])),
    "all_reduce_coalesced": (funcol.all_reduce_coalesced([x, 2 * x], "avg", mesh)[1],
                             2 * sum(mine) / w),
}
for name, (y, want) in checks.items():
    y = funcol.wait_tensor(y)
    assert y.device == dev and torch.equal(y.cpu(), want), (name, y.cpu(), want)
say(f"full_tensor and {len(checks)} functional collectives match the CPU")
dist.destroy_process_group()
"""

FAULT = """
dist.init_process_group("accl", timeout=datetime.timedelta(seconds=120))
r = dist.get_rank()
x = torch.ones(1024, device=dev)
dist.all_reduce(x)
if r == 1:
    time.sleep(1.0)  # rank 0 is waiting in the next collective by now
    phys = torch.accel.get_device_properties().physical_index
    with open(f"{os.environ['ACCEL_EMU_ROOT']}/sys/class/accel/accel{phys}/reset", "w") as f:
        f.write("1")
for attempt in ("pending", "next"):
    try:
        dist.all_reduce(x)
        say(f"{attempt}: no error")
    except RuntimeError as exc:
        say(f"{attempt}: {exc}")
dist.destroy_process_group()
"""

LINK = """
dist.init_process_group("accl", timeout=datetime.timedelta(seconds=120))
r = dist.get_rank()
x = torch.ones(1024, device=dev)
dist.all_reduce(x)
if r == 1:
    torch.accel._sleep(500_000_000)  # the collective's copy out waits behind this ...
work = dist.all_reduce(x, async_op=True)
if r == 1:  # ... while the device's link goes down under it
    phys = torch.accel.get_device_properties().physical_index
    root = os.environ["ACCEL_EMU_ROOT"]
    with open(f"{root}/sys/kernel/debug/accel/accel{phys}/ras_ctrl", "w") as f:
        f.write("inject link ue 0x1000")
# wait() does not block the host (NCCL's): the pending collective's error is its future's
pending = lambda: work.wait() and work.get_future().wait()  # noqa: E731
for attempt, call in (("pending", pending), ("next", lambda: dist.all_reduce(x))):
    try:
        call()
        say(f"{attempt}: no error")
    except RuntimeError as exc:
        say(f"{attempt}: {exc}")
if r == 0:  # the peer's own device work goes on, on the stream that waited for the
    # failed collective: it was released, not left to wait out its timeout
    say(f"local work {(torch.arange(4.0, device=dev) * 2).cpu().tolist()}")
dist.destroy_process_group()
"""

RESTART = """
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("accl", timeout=datetime.timedelta(seconds=120))
r = dist.get_rank()
x = torch.full((1024,), float(r + 1), device=dev)
if attempt == 0 and r == 1:
    phys = torch.accel.get_device_properties().physical_index
    with open(f"{os.environ['ACCEL_EMU_ROOT']}/sys/class/accel/accel{phys}/reset", "w") as f:
        f.write("1")
try:
    dist.all_reduce(x)
except RuntimeError as exc:
    say(f"attempt {attempt} failed: {str(exc)[:60]}")
    raise
assert torch.equal(x.cpu(), torch.full((1024,), 3.0)), x[:4].cpu()
say(f"attempt {attempt} all_reduce ok on {dev}")
dist.destroy_process_group()
"""


INTRAHOST = """
from torch_accel import intrahost
dist.init_process_group("accl")
r = dist.get_rank()
say(f"same host {dist.distributed_c10d._get_default_group()._intra is not None}")
n = (2 * intrahost.SLOT_BYTES + 12) // 4  # three steps of the shared-memory transport
x = (torch.arange(n, dtype=torch.float32) * (r + 1)).to(dev)
dist.all_reduce(x)
assert torch.equal(x.cpu(), torch.arange(n, dtype=torch.float32) * 3), x[-4:].cpu()
y = torch.full((n,), float(r) - 0.5, dtype=torch.float64, device=dev)
dist.all_reduce(y, op=dist.ReduceOp.MAX, async_op=True).wait()
assert torch.equal(y.cpu(), torch.full((n,), 0.5, dtype=torch.float64)), y[:4].cpu()
b = torch.tensor([0b1100 << r, 7], dtype=torch.int32, device=dev)
dist.all_reduce(b, op=dist.ReduceOp.BXOR)
assert b.cpu().tolist() == [0b1100 ^ 0b11000, 0], b.cpu()
flags = torch.tensor([r == 0, True], device=dev)  # bool: gloo's
dist.all_reduce(flags, op=dist.ReduceOp.MAX)
assert flags.cpu().tolist() == [True, True], flags.cpu()
say("all_reduce over shared memory matches the CPU")
bad = torch.ones(8 if r == 0 else 4, device=dev)
try:
    dist.all_reduce(bad)
    say("mismatched sizes: no error")
except ValueError as exc:
    say(f"mismatched sizes: {exc}")
x = torch.full((5,), float(r + 1), device=dev)
dist.all_reduce(x)
say(f"next all_reduce {x.cpu().tolist()}")
dist.destroy_process_group()
"""


def torchrun(daemon: Daemon, tmp_path: Path, body: str, *args: str,
             timeout: float = 240, launcher: tuple[str, ...] = ()) -> dict[int, list[str]]:
    """``body`` run as 2 ranks by ``torchrun --standalone`` against ``daemon``; each rank's
    lines, by rank."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(body))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", *launcher, str(script), *args],
                         capture_output=True,
                         text=True, env=daemon.env(), timeout=timeout, cwd=REPO)
    assert out.returncode == 0, out.stderr[-6000:] + out.stdout
    lines: dict[int, list[str]] = {0: [], 1: []}
    for rank, text in re.findall(r"^rank (\d): (.*)$", out.stdout, re.M):
        lines[int(rank)].append(text)
    return lines


@pytest.mark.parametrize("backend", ["accl", "default"])
def test_collectives_on_accel_tensors_leave_torchs_results_on_the_device(daemon, tmp_path,
                                                                         backend):
    """Every collective of the brief, on accel tensors, against the CPU's arithmetic; with
    ``init_process_group()`` (no name) the accelerator's default picks accl, as cuda's
    picks nccl."""
    lines = torchrun(daemon, tmp_path, COLLECTIVES, backend)
    config = "accel:accl" if backend == "default" else "accel:accl,cpu:accl"
    for rank in (0, 1):
        assert lines[rank][0] == f"config {config}", lines
        assert lines[rank][1].startswith(f"ok {19 if rank == 0 else 18} all_reduce.SUM"), lines


def test_async_collective_is_ordered_on_streams_and_keeps_its_tensors(daemon, tmp_path):
    """async_op=True returns before the collective is done (the host does not wait for the
    device or the peer), reads its input after the current stream's earlier work, keeps a
    temporary alive for its whole run, and ``wait()`` orders the current stream after it;
    a synchronous collective issued behind a queued one reaches gloo after it."""
    lines = torchrun(daemon, tmp_path, ASYNC)
    assert lines[0] == ["AcclWork completed at issue False result ok"], lines
    assert lines[1] and lines[1][0].endswith("result ok"), lines


def test_async_wait_does_not_block_the_host_and_orders_the_current_stream(daemon, tmp_path):
    """NCCL's contract: ``work.wait()`` returns before the collective is done (the peer
    joins only after rank 0's wait() returned, told through the store: no timing), work
    queued after it on the current stream is not done until the peer joined, and then
    sees the results; collectives queued back to back release in order."""
    lines = torchrun(daemon, tmp_path, NONBLOCKING)
    assert lines[0][0] == ("wait returned; completed, later work done before the peer "
                           "joined: [False, False]; True"), lines
    assert lines[1][0] == "joined late [3.0, 3.0]", lines
    for rank in (0, 1):
        assert lines[rank][1] == "three in a row [8.0, 8.0]", lines


TWO_DEVICES = """
dist.init_process_group("accl")
r = dist.get_rank()
got = []
for d in (r, 1 - r, r):  # each rank's collectives on one device, then the other, then back
    x = torch.full((1024,), float(r + 1), device=f"accel:{d}")
    dist.all_reduce(x)
    y = torch.full((1024,), float(10 * (r + 1)), device=f"accel:{d}")
    dist.all_reduce(y, async_op=True).wait()
    got.append((x.cpu().unique().tolist(), y.cpu().unique().tolist()))
say(f"devices {got}")
dist.destroy_process_group()
"""


def test_one_group_on_two_devices_stages_each_through_its_own_pinned_buffers(daemon,
                                                                             tmp_path):
    """A rank whose collectives use one device, then another, then the first again: a
    pinned buffer is mapped into its own device's context only, so one kept for the first
    device must not stage the second's copies (it faulted, EFAULT, before the group kept
    its buffers per device), and each device's results are right, synchronous or not."""
    lines = torchrun(daemon, tmp_path, TWO_DEVICES)
    for rank in (0, 1):
        assert lines[rank] == ["devices " + str([([3.0], [30.0])] * 3)], lines


def test_all_reduce_of_ranks_on_one_host_goes_through_shared_memory(daemon, tmp_path):
    """Ranks on one host all-reduce through shared memory (torch_accel/intrahost.py): a
    tensor of three of its steps, MAX on float64 asynchronously, BXOR on int32 give the
    CPU's values, bool goes to gloo; ranks all-reducing different sizes both get a
    ValueError naming both sizes, and the group's next all_reduce is right."""
    lines = torchrun(daemon, tmp_path, INTRAHOST)
    for rank in (0, 1):
        other, mine = (1, 32) if rank == 0 else (0, 16)
        assert lines[rank] == [
            "same host True", "all_reduce over shared memory matches the CPU",
            f"mismatched sizes: accl: rank {other} all-reduces {48 - mine} bytes where rank "
            f"{rank} does {mine} (step 10)", "next all_reduce [3.0, 3.0, 3.0, 3.0, 3.0]"], lines


#: two ranks started by hand (rank 0 holds the store, so it outlives rank 1): rank 1 is
#: killed while rank 0 waits for it in a same-host all_reduce
EXIT = """
import datetime, os, signal, sys, time
import torch
import torch.distributed as dist
rank = int(sys.argv[1])
torch.accel.set_device(rank)
dist.init_process_group("accl", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank,
                        world_size=2, timeout=datetime.timedelta(seconds=120))
x = torch.ones(1024, device="accel")
dist.all_reduce(x)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
try:
    dist.all_reduce(x)
    print("no error")
except RuntimeError as exc:
    print(f"within 5 s {time.monotonic() - start < 5}: {exc}")
"""


def test_a_rank_exiting_during_a_same_host_all_reduce_fails_the_waiting_rank(daemon):
    """Rank 1's process is killed while rank 0 waits for it in an all_reduce over shared
    memory: rank 0 raises a RuntimeError naming rank 1 within seconds (its pidfd tells,
    zombie or reaped), not at the group's 120 s timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(EXIT), str(r), port],
                              env=daemon.env(), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = ranks[0].communicate(timeout=120)
        assert ranks[0].returncode == 0, err
        assert out.strip().split("\n")[-1] == (
            "within 5 s True: accl: rank 1 exited during an all_reduce; rank 0 cannot "
            "complete it"), out + err
        assert ranks[1].wait(timeout=30) == -signal.SIGKILL
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.communicate()


#: two ranks started by hand, rank 1 with ACCL_SHM_DISABLE=1
SHM_OFF = """
import os, sys, torch
import torch.distributed as dist
rank = int(sys.argv[1])
torch.accel.set_device(rank)
dist.init_process_group("accl", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank,
                        world_size=2)
x = torch.full((4,), float(rank + 1), device="accel")
dist.all_reduce(x)
group = dist.distributed_c10d._get_default_group()
print(f"shared memory {group._intra is not None} {x.cpu().tolist()}")
dist.destroy_process_group()
"""


def test_one_rank_without_shared_memory_keeps_the_whole_group_on_gloo(daemon):
    """A rank started with ``ACCL_SHM_DISABLE=1`` publishes that it cannot share memory:
    neither rank uses the same-host transport, the all_reduce goes through gloo and is
    right, and no segment is left in /dev/shm."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(SHM_OFF), str(r), port],
                              env=daemon.env(**({"ACCL_SHM_DISABLE": "1"} if r else {})),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0, err
        assert out.strip().split("\n")[-1] == "shared memory False [3.0, 3.0, 3.0, 3.0]", out
    assert not [f for f in os.listdir("/dev/shm") if any(
        f.startswith(f"accl-{p.pid}-") for p in ranks)]


def test_ddp_on_accel_trains_to_full_batch_cpu_parameters(daemon, tmp_path):
    """DistributedDataParallel(model.to("accel")) on 2 ranks, each on half the batch, ends
    at the parameters one CPU process reaches on the whole batch."""
    lines = torchrun(daemon, tmp_path, DDP)
    for rank in (0, 1):
        assert lines[rank] == [f"DDP on accel:{rank} matches full-batch CPU training"], lines


def test_fsdp2_fully_shard_on_accel_trains_to_full_batch_cpu_parameters(daemon, tmp_path):
    """torch's FSDP2 (``fully_shard``) accepts accel: its all-gathers and reduce-scatters
    go through the accl group, and each rank's shard ends at its rows of the parameters one
    CPU process reaches on the whole batch."""
    lines = torchrun(daemon, tmp_path, FSDP2)
    for rank in (0, 1):
        assert lines[rank] == [f"FSDP2 shards on accel:{rank} match full-batch CPU training"], \
            lines


def test_dtensor_full_tensor_and_functional_collectives_on_accel(daemon, tmp_path):
    """DTensor's ``full_tensor()`` and torch's functional collectives on a 2-rank accel
    mesh give the CPU's values, left on the device: the ops whose C++ kernels call group
    methods torch's Python trampoline does not forward run accl's kernels
    (torch_accel/funcol.py)."""
    lines = torchrun(daemon, tmp_path, DTENSOR)
    for rank in (0, 1):
        assert lines[rank] == ["full_tensor and 5 functional collectives match the CPU"], lines


def test_a_rank_losing_its_device_fails_every_ranks_collective(make_daemon, tmp_path):
    """Rank 1's device is reset (sysfs ``reset``) while rank 0 waits in a collective: rank
    0's pending collective and its next one raise a RuntimeError naming rank 1, its device
    and the fault, instead of waiting out the group's 120 s timeout, and both exit."""
    d = make_daemon(devices=2)
    lines = torchrun(d, tmp_path, FAULT, timeout=100)
    uuid = d.attr(1, "uuid")
    for rank in (0, 1):
        assert len(lines[rank]) == 2, lines
        for line in lines[rank]:
            assert f"accl: rank 1 lost its device accel:1 (uuid {uuid})" in line, lines
            assert "reset requested through sysfs" in line, lines
    assert "seen by rank 0" in lines[0][0] and "seen by rank 0" in lines[0][1], lines


def test_a_link_error_during_a_collective_fails_every_rank_and_the_package_comes_back(
        make_daemon, tmp_path):
    """An uncorrectable link error (``ras_ctrl`` ``inject link ue``) on rank 1's device while
    its all_reduce waits to copy out: the package/link scope of docs/faults.md runs (rank
    1's context lost, the peer drained, the package reset, the link back up), and both
    ranks' pending and next collectives raise a RuntimeError naming rank 1, its device
    and the fault record (74 LINK_ERROR, package, drain-and-reset, the link), without
    waiting for the group's 120 s timeout; rank 0's own device work goes on."""
    d = make_daemon(devices=2)
    lines = torchrun(d, tmp_path, LINK, timeout=100)
    uuid = d.attr(1, "uuid")
    record = ("74 LINK_ERROR, scope package, action drain-and-reset, link fabric0:port1")
    for rank in (0, 1):
        errors = [line for line in lines[rank] if not line.startswith("local work")]
        assert len(errors) == 2, lines
        for line in errors:
            assert f"accl: rank 1 lost its device accel:1 (uuid {uuid})" in line, lines
            assert "link error on fabric0:port1" in line and record in line, lines
    assert "seen by rank 0" in lines[0][0], lines
    assert lines[0][-1] == "local work [0.0, 2.0, 4.0, 6.0]", lines
    d.wait_state(1, "operational")
    assert (d.attr(1, "link_state"), d.attr(1, "reset_count")) == ("up", "1")
    assert [r["scope"] for r in d.fault_log(1) if r["code"] == 74] == ["package"]
    assert d.attr(0, "reset_count") == "0"  # the peer was drained, not reset


def test_torchrun_restarts_the_job_once_the_lost_device_is_back(make_daemon, tmp_path):
    """``torchrun --max-restarts=1``: the first attempt fails on every rank (rank 1's device
    reset under it), torchrun restarts both ranks, and the second attempt's collective
    completes on the recovered device (its fresh processes get fresh contexts)."""
    d = make_daemon(devices=2)
    lines = torchrun(d, tmp_path, RESTART, timeout=200, launcher=("--max-restarts=1",))
    for rank in (0, 1):
        assert lines[rank][0].startswith("attempt 0 failed: accl: rank 1 lost its device accel:1"
                                         " (uuid ACCEL-"), lines
        assert lines[rank][1] == f"attempt 1 all_reduce ok on accel:{rank}", lines
    assert d.attr(1, "state") == "operational"
