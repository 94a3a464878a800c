"""accel-replay: a failing recording shrinks to a minimal schedule that still fails, on a
real mount; bad recordings and recordings that do not fail are refused exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recorded_faults import PROGRAM, faults_of, recorded_with_fault
from schedule_corpus import MISSING_WAIT

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]


def accel_replay(daemon, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.accel_replay", *args],
                          capture_output=True, text=True, env=daemon.env(), cwd=REPO,
                          timeout=timeout)


def decisions(path: Path) -> list[list]:
    return json.loads(path.read_text())["devices"]["accel0"]["decisions"]


@pytest.fixture
def program(tmp_path) -> Path:
    p = tmp_path / "missing_wait.py"
    p.write_text(MISSING_WAIT)
    return p


def test_a_failing_recording_shrinks_to_a_schedule_that_still_fails(daemon, tmp_path, program):
    for seed in range(12):
        rec = tmp_path / f"seed{seed}.json"
        r = daemon.run_py(MISSING_WAIT, timeout=60, ACCEL_SCHEDULE=f"adversarial:{seed}",
                          ACCEL_RECORD=str(rec))
        if r.returncode == 1:
            break
    else:
        raise AssertionError("no seed of 12 exposed the missing wait_stream")
    out = tmp_path / "min.json"
    r = accel_replay(daemon, str(rec), "-o", str(out), "--", sys.executable, str(program))
    assert r.returncode == 0, r.stdout + r.stderr
    full, small = decisions(rec), decisions(out)
    assert 0 < len(small) < len(full), r.stdout
    assert all(d in full for d in small)
    assert r.stdout.startswith(f"{len(full)} decisions -> {len(small)} in "), r.stdout
    for _ in range(3):  # the shrunk schedule fails every time
        again = daemon.run_py(MISSING_WAIT, timeout=60, ACCEL_REPLAY=str(out))
        assert again.returncode == 1 and "wrong" in again.stdout, r.stdout + again.stderr


def test_a_recording_with_decisions_and_a_fault_shrinks_to_the_fault(make_daemon, tmp_path):
    """A correct program failed only because an operator injected a memory error into its
    context: the adversarial schedule's decisions did nothing, and the shrunk recording
    keeps the fault alone, which fails every time replayed."""
    d = make_daemon(devices=1)
    rec, _ = recorded_with_fault(d, tmp_path, "inject memory ue {offset:#x}",
                                 ACCEL_SCHEDULE="adversarial:2")
    full = decisions(rec)
    (fault,) = faults_of(rec)
    assert len(full) > 1, full
    program = tmp_path / "uses_an_array.py"
    program.write_text(PROGRAM)
    out = tmp_path / "min.json"
    r = accel_replay(d, str(rec), "-o", str(out), "--", sys.executable, str(program))
    assert r.returncode == 0, r.stdout + r.stderr
    assert decisions(out) == [fault]
    queue, seqno, _, text = fault
    assert r.stdout.splitlines()[0].startswith(f"{len(full)} decisions -> 1 in ")
    assert r.stdout.splitlines()[1:] == [f"  accel0 queue {queue} seqno {seqno}: fault {text}"]
    for _ in range(3):
        again = d.run_py(PROGRAM, timeout=120, ACCEL_REPLAY=str(out))
        assert again.stdout.split() == ["DeviceLostError", "94", "replay"], again.stderr


def test_a_recording_that_does_not_fail_is_refused(daemon, tmp_path, program):
    rec = tmp_path / "passing.json"
    r = daemon.run_py(MISSING_WAIT, timeout=60, ACCEL_RECORD=str(rec))  # the default passes
    assert r.returncode == 0, r.stdout + r.stderr
    r = accel_replay(daemon, str(rec), "--", sys.executable, str(program))
    assert r.returncode == 1
    assert r.stderr == (f"accel-replay: {rec}: the command does not fail when its 0 "
                        f"decisions are replayed: nothing to shrink\n")


def test_bad_recordings_and_arguments_are_refused(daemon, tmp_path):
    missing, corrupt = tmp_path / "nope.json", tmp_path / "corrupt.json"
    corrupt.write_text('{"format": "accel-schedule", "version": 2, "devices": {}}')
    r = accel_replay(daemon, str(missing), "--", "true")
    assert (r.returncode, r.stderr) == (
        2, f"accel-replay: {missing}: cannot read it: No such file or directory\n")
    r = accel_replay(daemon, str(corrupt), "--", "true")
    assert (r.returncode, r.stderr) == (
        2, f"accel-replay: {corrupt}: not an accel-schedule recording of version 1: format "
           f"or version missing or wrong\n")
    r = accel_replay(daemon, str(corrupt))
    assert r.returncode == 2
    assert r.stderr.endswith("error: no command: accel-replay RECORDING -- COMMAND [ARG...]\n")
