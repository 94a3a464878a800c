"""Two hosts on one machine: two daemons on two roots stand for two machines' drivers, and
one ``torchrun --nnodes=2`` per "host" (each with its own ``ACCEL_EMU_ROOT``) meets the
other at a c10d rendezvous on 127.0.0.1, as on a cluster (docs/distributed.md, "Several
hosts"). The job is examples/distributed_ddp.py: DDP over ``accl`` whose ranks each hold
their own host's device. The second "host" is started with ``ACCL_SHM_DISABLE=1``: ranks
on one machine would otherwise all-reduce through shared memory (torch_accel/intrahost.py),
and the group would not carry its gradients over gloo as between two machines."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from testkit import REPO

pytestmark = pytest.mark.timeout(300)

LINE = re.compile(r"rank (\d)/2 on accel:0 uuid (\S+): 5 DDP steps, parameters within \S+ "
                  r"of full-batch CPU training")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_across_two_hosts_each_on_its_own_daemon(make_daemon):
    hosts = [make_daemon(devices=1, name="host") for _ in range(2)]
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
         f"--node-rank={k}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--rdzv-id=accl-two-hosts", str(REPO / "examples" / "distributed_ddp.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=host.env(**({"ACCL_SHM_DISABLE": "1"} if k else {})))
        for k, host in enumerate(hosts)]
    outs = []
    try:
        for node in nodes:
            outs.append(node.communicate(timeout=240))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, (out, err) in zip(nodes, outs):
        assert node.returncode == 0, err[-6000:] + out
    found = sorted(m.groups() for out, _ in outs for m in LINE.finditer(out))
    assert [rank for rank, _ in found] == ["0", "1"], outs
    # each rank computed on a device of its own host's daemon, none shared
    assert {uuid for _, uuid in found} == {h.attr(0, "uuid") for h in hosts}, found
    assert hosts[0].attr(0, "uuid") != hosts[1].attr(0, "uuid")
