"""The context scope (docs/faults.md, "Scopes"): an uncorrectable memory error in memory
that one process's context alone holds loses that context and nothing else. The process
meets ``DeviceLostError`` naming the fault (its record) at its next use and can
``recover()``; a bystander process on the
same device and one on the other device keep working, their data intact; no device
resets; once the process is gone, the books, descriptors and /dev/shm are as before."""

from __future__ import annotations

import json

import pytest

from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot

VICTIM = """
import os, sys, numpy as np, runtime
x = runtime.to_device(np.arange(1 << 20, dtype=np.float32))
runtime.synchronize()
print(os.getpid(), flush=True)
sys.stdin.readline()  # the error is injected now
for what, use in [("copy", lambda: x.copy_to_host()),
                  ("empty", lambda: runtime.empty(16, np.float32)),
                  ("synchronize", lambda: runtime.synchronize(0))]:
    try:
        use()
        print(what, "ran")
    except runtime.DeviceLostError as exc:
        print(what, "lost", exc.record.get("code"), exc, sep="\\t")
runtime.recover(0)
y = runtime.to_device(np.ones(1 << 16, np.float32))
print("recovered", float(y.copy_to_host().sum()))
"""


@pytest.mark.timeout(180)
def test_an_error_in_one_contexts_memory_loses_that_context_alone(make_daemon):
    d = make_daemon(devices=2)
    with Bystander(d, 0) as b0, Bystander(d, 1) as b1:
        before = snapshot(d)
        victim = d.popen_py(VICTIM)
        try:
            pid = int(victim.stdout.readline())
            rows = [r.split() for r in d.debug(0, "vram_mm").read_text().splitlines()[1:]]
            offset, _, _, ctx = max((r for r in rows if int(r[2]) == pid),
                                       key=lambda r: int(r[1], 16))
            assert "," not in ctx  # its own context alone reaches it
            bad = int(offset, 16) + 4096
            d.debug(0, "ras_ctrl").write_text(f"inject memory ue {bad:#x}")
            victim.stdin.write("\n")
            victim.stdin.flush()
            out, err = victim.communicate(timeout=120)
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait()
        assert victim.returncode == 0, err
        lines = out.splitlines()
        said = [line.split("\t") for line in lines[:3]]
        assert [s[:3] for s in said] == [["copy", "lost", "94"], ["empty", "lost", "94"],
                                         ["synchronize", "lost", "94"]], lines
        assert all("MEMORY_UE_CONTAINED" in s[3] for s in said), lines
        assert lines[3:] == ["recovered 65536.0"], lines

        b0.check()
        b1.check()
        rec = json.loads(d.attr(0, "fault_log").splitlines()[0])
        assert (rec["code"], rec["pid"], rec["context"], rec["contexts"], rec["address"]) == (
            94, pid, int(ctx), [int(ctx)], bad)
        assert [d.attr(i, "reset_count") for i in (0, 1)] == ["0", "0"]
        assert d.attr(0, "bad_pages") == f"0x{bad // 4096:08x} : 0x00001000 : P"
        # the bystanders still hold theirs; the page is out of service, not in anyone's books
        assert_contained(d, before)
