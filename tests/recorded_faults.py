"""A program hit by an operator's fault injection while it records its schedule, for the
tests of injected faults in recordings (runtime/test_replayed_faults.py) and of shrinking
them (tools/test_accel_replay.py); docs/schedule.md, "Injected faults"."""

from __future__ import annotations

import json
from pathlib import Path

from testkit.daemon import Daemon

#: Puts an array on device 0, then (with FAULT_GO set) says its pid and waits for the
#: test to inject, then uses the array: exit 1 naming the error's class and its record's
#: code when the use fails, 0 when it runs.
PROGRAM = """
import os, sys, time, numpy as np, runtime
x = runtime.to_device(np.arange(1 << 18, dtype=np.float32))
runtime.synchronize()
go = os.environ.get("FAULT_GO")
if go:
    print(os.getpid(), flush=True)
    while not os.path.exists(go):  # the operator injects now
        time.sleep(0.01)
try:
    y = x.copy_to_host()
    runtime.synchronize()
except runtime.AccelError as exc:
    rec = getattr(exc, "record", None) or {}
    print(type(exc).__name__, rec.get("code"), rec.get("origin"), flush=True)
    sys.exit(1)
print("ran", float(y.sum()), flush=True)
"""


def recorded_with_fault(d: Daemon, tmp_path: Path, inject: str, **env: str
                        ) -> tuple[Path, str]:
    """Run PROGRAM recording, inject ``inject`` (``{offset}``: a page into the array's
    VRAM) while it waits; its recording and its output (it must fail)."""
    rec, go = tmp_path / "rec.json", tmp_path / "go"
    proc = d.popen_py(PROGRAM, ACCEL_RECORD=str(rec), FAULT_GO=str(go), **env)
    try:
        pid = int(proc.stdout.readline())
        rows = [r.split() for r in d.debug(0, "vram_mm").read_text().splitlines()[1:]]
        offset = max((r for r in rows if int(r[2]) == pid), key=lambda r: int(r[1], 16))[0]
        d.debug(0, "ras_ctrl").write_text(inject.format(offset=int(offset, 16) + 4096))
        go.touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out + err
    return rec, out


def faults_of(path: Path) -> list[list]:
    """A recording's fault entries on accel0."""
    return [x for x in json.loads(path.read_text())["devices"]["accel0"]["decisions"]
            if x[2] == "fault"]
