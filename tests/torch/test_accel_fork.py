"""The poison-fork rule (OpenReg's test_device_poison_fork, torch.cuda's): after the parent
initialised the device, a forked child that touches it gets torch's RuntimeError naming
the fix, while discovery keeps working there; 'spawn' children start clean."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from testkit import REPO

pytestmark = pytest.mark.timeout(120)

FORK_MESSAGE = ("Cannot re-initialize accel in forked subprocess. To use accel with "
                "multiprocessing, you must use the 'spawn' start method")

SCRIPT = """
import multiprocessing as mp
import os

import torch


def report(q=None):
    # a forked child's device uses, each caught, then its discovery
    lines = []
    for name, use in (("init", torch.accel.init), ("tensor", lambda: torch.ones(2, device="accel")),
                      ("synchronize", torch.accel.synchronize)):
        try:
            use()
            lines.append(f"{name} ok")
        except RuntimeError as e:
            lines.append(f"{name} {type(e).__name__}: {e}")
    lines.append(f"discovery {torch.accel.device_count()} {torch.accel.is_available()} "
                 f"{torch.accel.is_initialized()}")
    if q is None:
        return lines
    q.put(lines)


def spawned(q):
    torch.accelerator.set_device_index(1)
    x = torch.ones(3, device="accel") * 2
    q.put([f"{x.device} {x.sum().item()} {torch.accel.is_initialized()}"])


if __name__ == "__main__":
    torch.ones(1, device="accel")  # the parent initialises
    pid = os.fork()
    if pid == 0:
        print("\\n".join("os.fork " + line for line in report()), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    for method, target in (("fork", report), ("spawn", spawned)):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=target, args=(q,))
        p.start()
        lines = q.get(timeout=60)
        p.join()
        print("\\n".join(f"{method} {line}" for line in lines), flush=True)
        print(method, "exit", p.exitcode, flush=True)
    print("parent", torch.ones(2, device="accel").sum().item())
"""


def test_forked_child_after_init_gets_torchs_error_and_spawn_works(daemon, tmp_path):
    script = tmp_path / "fork_rule.py"  # spawn re-imports __main__: it must be a file
    script.write_text(textwrap.dedent(SCRIPT))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=daemon.env(), timeout=100, cwd=REPO)
    assert out.returncode == 0, out.stderr + out.stdout
    forked = [f"{name} RuntimeError: {FORK_MESSAGE}" for name in ("init", "tensor", "synchronize")]
    forked.append("discovery 2 True False")
    assert out.stdout.split("\n")[:-1] == [
        *(f"os.fork {line}" for line in forked), *(f"fork {line}" for line in forked),
        "fork exit 0", "spawn accel:1 6.0 True", "spawn exit 0", "parent 2.0"]
