"""Sharing accel tensors between processes through torch.multiprocessing (OpenReg's
test_ipc, torch.cuda's semantics): a tensor put on a 'spawn' queue arrives in the consumer
on the same device, sharing the producer's device memory (values, views with an offset or
strides, writes seen both ways), a received tensor cannot be shared again, and an accel
storage alone is refused. Before, the consumer hung. Every process is joined with a
timeout and killed if it is still alive."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from testkit import REPO

pytestmark = pytest.mark.timeout(240)

SCRIPT = """
import json
import pickle
import sys

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler


def producer(kind, queue, results, done):
    base = torch.arange(0.0, 8.0, device=kind.get("device", "accel:0"))
    t = eval(kind["view"])
    queue.put(t)
    done.wait(timeout=60)            # the consumer wrote through its tensor; read it back
    results.put({"producer_sees": base.cpu().tolist()})


def consumer(queue, results, done):
    t = queue.get(timeout=60)
    out = {"device": str(t.device), "values": t.cpu().tolist(), "size": list(t.shape),
           "stride": list(t.stride())}
    t.add_(100)                       # a kernel writing into the producer's memory
    torch.accel.synchronize(t.device)  # done only once the write is there
    try:
        ForkingPickler.dumps(t)
        out["reshare"] = None
    except RuntimeError as e:
        out["reshare"] = str(e)
    del t
    results.put(out)
    done.set()


def run(kind):
    ctx = mp.get_context("spawn")
    queue, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=producer, args=(kind, queue, results, done)),
             ctx.Process(target=consumer, args=(queue, results, done))]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            got.update(results.get(timeout=90))
        for p in procs:
            p.join(timeout=30)
        got["exitcodes"] = [p.exitcode for p in procs]
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


if __name__ == "__main__":
    out = {}
    for name, kind in json.loads(sys.argv[1]).items():
        out[name] = run(kind)
    try:
        pickle.dumps(torch.ones(2, device="accel").untyped_storage())
        ForkingPickler.dumps(torch.ones(2, device="accel").untyped_storage())
        out["storage"] = None
    except RuntimeError as e:
        out["storage"] = str(e)
    print(json.dumps(out))
"""

KINDS = {"basic": {"view": "base"}, "offset": {"view": "base[4:]"},
         "strided": {"view": "base[::2]"}, "device1": {"view": "base[1:3]", "device": "accel:1"}}


def test_tensors_shared_through_torch_multiprocessing(daemon, tmp_path):
    script = tmp_path / "ipc.py"  # spawn re-imports __main__: it must be a file
    script.write_text(textwrap.dedent(SCRIPT))
    out = subprocess.run([sys.executable, str(script), json.dumps(KINDS)], capture_output=True,
                         text=True, env=daemon.env(), timeout=220, cwd=REPO)
    assert out.returncode == 0, out.stderr + out.stdout
    r = json.loads(out.stdout.strip().split("\n")[-1])
    base = [float(v) for v in range(8)]
    want = {"basic": (base, [8], [1], range(0, 8)), "offset": (base[4:], [4], [1], range(4, 8)),
            "strided": (base[::2], [4], [2], range(0, 8, 2)),
            "device1": (base[1:3], [2], [1], range(1, 3))}
    for name, (values, size, stride, written) in want.items():
        got = r[name]
        assert got["exitcodes"] == [0, 0], (name, got)
        device = "accel:1" if name == "device1" else "accel:0"
        assert [got["device"], got["values"], got["size"], got["stride"]] == [
            device, values, size, stride], (name, got)
        assert got["producer_sees"] == [v + 100 if i in written else v
                                        for i, v in enumerate(base)], (name, got)
        assert "received from another process" in got["reshare"], (name, got)
    assert "Cannot pickle accel storage" in r["storage"], r


#: the producer drops its tensor and exits while the consumer still holds the shared one
#: (OpenReg's and torch.cuda's "limbo" case)
LIMBO = """
import json
import torch
import torch.multiprocessing as mp


def producer(queue, received):
    t = torch.arange(1.0, 5.0, device="accel:0")
    queue.put(t)
    received.wait(timeout=60)
    del t
    torch.accel.empty_cache()         # the block leaves this process's cache too


def consumer(queue, received, gone, results):
    t = queue.get(timeout=60)
    received.set()
    gone.wait(timeout=60)             # the producer has exited
    results.put(t.cpu().tolist())
    del t


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue, results, received, gone = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    prod = ctx.Process(target=producer, args=(queue, received))
    cons = ctx.Process(target=consumer, args=(queue, received, gone, results))
    prod.start(), cons.start()
    try:
        prod.join(timeout=90)
        gone.set()
        values = results.get(timeout=60)
        cons.join(timeout=30)
        print(json.dumps({"values": values, "exitcodes": [prod.exitcode, cons.exitcode]}))
    finally:
        for p in (prod, cons):
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
"""


def test_consumer_keeps_the_memory_after_the_producer_exits(daemon, tmp_path):
    """The producer frees the tensor, empties its cache and exits while the consumer
    holds the shared tensor: both exit 0 and the consumer still reads the values (the
    driver keeps the memory mapped while an importer holds it)."""
    script = tmp_path / "limbo.py"
    script.write_text(textwrap.dedent(LIMBO))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=daemon.env(), timeout=220, cwd=REPO)
    assert out.returncode == 0, out.stderr + out.stdout
    r = json.loads(out.stdout.strip().split("\n")[-1])
    assert r == {"values": [1.0, 2.0, 3.0, 4.0], "exitcodes": [0, 0]}, (r, out.stderr)
