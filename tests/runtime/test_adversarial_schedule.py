"""Adversarial scheduling and record/replay (``ACCEL_SCHEDULE``, ``ACCEL_RECORD``,
``ACCEL_REPLAY``; docs/schedule.md), on a real mount, through the runtime's public names.

A program that forgets a ``wait_stream`` passes under the default scheduler and fails
under a few adversarial seeds; the sanitizer corpus's correct programs compute the same
under every seed; a seed makes the same decisions each time; a recorded failing run fails
again each time it is replayed; another process keeps the default schedule; malformed
variables and recordings are refused with exact messages.
"""

from __future__ import annotations

import json
import time

import pytest

from schedule_corpus import CORRECT, MISSING_WAIT, outcomes

pytestmark = pytest.mark.timeout(300)

#: seeds tried for a failure: the racy program fails in about a quarter of them
SEEDS = range(12)


def run(daemon, timeout: float = 60, **env: str):
    return daemon.run_py(MISSING_WAIT, timeout=timeout, **env)


def first_failing_seed(daemon, tmp_path) -> tuple[int, str]:
    """The first seed of ``SEEDS`` under which the racy program fails, and its recording."""
    for seed in SEEDS:
        path = str(tmp_path / f"seed{seed}.json")
        r = run(daemon, ACCEL_SCHEDULE=f"adversarial:{seed}", ACCEL_RECORD=path)
        assert r.returncode in (0, 1), r.stderr
        if r.returncode == 1:
            return seed, path
    raise AssertionError(f"no seed of {SEEDS} exposed the missing wait_stream")


def decisions(path: str) -> list[list]:
    with open(path) as f:
        return json.load(f)["devices"]["accel0"]["decisions"]


def test_a_missing_wait_stream_passes_by_default_and_fails_within_a_few_seeds(daemon,
                                                                             tmp_path):
    for _ in range(3):
        r = run(daemon)
        assert r.returncode == 0, r.stdout + r.stderr  # the default: submission order
    seed, _ = first_failing_seed(daemon, tmp_path)
    assert seed < len(SEEDS)


def test_correct_programs_compute_the_same_under_every_seed(daemon):
    """The sanitizer corpus's correct programs (every ordering rule: events, waits, host
    syncs, record_stream, graphs, peers): each one's result (the bytes of every array it
    allocated) is program order's under the default schedule and under five seeds."""
    want = outcomes(daemon, CORRECT, serial=True)
    assert outcomes(daemon, CORRECT) == want
    for seed in range(5):
        assert outcomes(daemon, CORRECT, ACCEL_SCHEDULE=f"adversarial:{seed}") == want, seed


def test_a_seed_makes_the_same_decisions_every_time(daemon, tmp_path):
    runs = []
    for i, seed in enumerate((3, 3, 4)):
        path = str(tmp_path / f"run{i}.json")
        r = run(daemon, ACCEL_SCHEDULE=f"adversarial:{seed}", ACCEL_RECORD=path)
        assert r.returncode in (0, 1), r.stderr
        runs.append(decisions(path))
    # the seeded choices; the start order ("order") is what the run made of them
    chosen = [[d for d in run if d[2] != "order"] for run in runs]
    assert chosen[0] and chosen[0] == chosen[1]
    assert chosen[2] != chosen[0]
    assert {d[2] for d in chosen[0] + chosen[2]} == {"delay", "rank"}
    assert [d[3] for d in runs[0] if d[2] == "order"] == list(range(len(runs[0]) - len(chosen[0])))


def test_replaying_a_failing_recording_fails_every_time(daemon, tmp_path):
    _, path = first_failing_seed(daemon, tmp_path)
    again = str(tmp_path / "again.json")
    codes = []
    for _ in range(5):
        r = run(daemon, ACCEL_REPLAY=path, ACCEL_RECORD=again)
        codes.append(r.returncode)
        assert "wrong" in r.stdout, r.stderr
    assert codes == [1] * 5
    # the replay applied exactly the recorded decisions, and recorded them again; the
    # file lists them as the firmware made them, and a packet's delay is decided when the
    # host has published it, so only their interleaving may differ between runs
    assert sorted(decisions(again)) == sorted(decisions(path))
    starts = [d for d in decisions(path) if d[2] == "order"]
    assert [d for d in decisions(again) if d[2] == "order"] == starts  # in start order
    with open(again) as f:
        assert json.load(f)["schedule"] == "replay"


def test_a_bystander_process_keeps_the_default_schedule(daemon, tmp_path):
    """While one process runs adversarially, another's context gets no decision: the
    firmware's recording of its run is empty, and its racy program passes."""
    busy = tmp_path / "busy.json"
    loop = MISSING_WAIT.replace("runtime.synchronize()\nprint(", "runtime.synchronize()\n"
                                "for _ in range(40):\n"
                                "    a.copy_from_host(src, s1)\n"
                                "    a.copy_to_host(dst, stream=s2)\n"
                                "runtime.synchronize()\nprint(")
    assert loop != MISSING_WAIT
    adversary = daemon.popen_py(loop, ACCEL_SCHEDULE="adversarial:1", ACCEL_RECORD=str(busy))
    try:
        time.sleep(1.0)  # its context exists and its delays are running
        mine = tmp_path / "bystander.json"
        r = run(daemon, ACCEL_RECORD=str(mine))
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        adversary.wait(timeout=120)
    assert adversary.returncode in (0, 1)
    assert decisions(str(mine)) == []
    with open(mine) as f:
        assert json.load(f)["schedule"] == "default"
    assert len(decisions(str(busy))) > 40  # the adversary's, made meanwhile


BAD_SCHEDULE = ("ACCEL_SCHEDULE='adversarial:x': expected 'default' or 'adversarial:SEED' "
                "with SEED a decimal integer below 2**64")


@pytest.mark.parametrize("env, message", [
    ({"ACCEL_SCHEDULE": "adversarial:x"}, BAD_SCHEDULE),
    ({"ACCEL_SCHEDULE": "adversarial"},
     BAD_SCHEDULE.replace("'adversarial:x'", "'adversarial'")),
    ({"ACCEL_SCHEDULE": "chaos:1"}, BAD_SCHEDULE.replace("'adversarial:x'", "'chaos:1'")),
    ({"ACCEL_REPLAY": "{missing}"},
     "ACCEL_REPLAY={missing}: cannot read it: No such file or directory"),
    ({"ACCEL_REPLAY": "{corrupt}"},
     "ACCEL_REPLAY={corrupt}: not an accel-schedule recording of version 1: Expecting value: "
     "line 1 column 1 (char 0)"),
    ({"ACCEL_REPLAY": "{wrong_kind}"},
     "ACCEL_REPLAY={wrong_kind}: not an accel-schedule recording of version 1: bad decision "
     "[1, 1, 'swap', 5] of accel0"),
    ({"ACCEL_REPLAY": "{wrong_kind}", "ACCEL_SCHEDULE": "adversarial:1"},
     "ACCEL_REPLAY and ACCEL_SCHEDULE='adversarial:1' are exclusive: a replay makes exactly "
     "the recorded decisions"),
], ids=["seed", "no-seed", "mode", "missing", "corrupt", "kind", "both"])
def test_bad_inputs_are_refused_exactly(daemon, tmp_path, env, message):
    files = {"missing": tmp_path / "nope.json", "corrupt": tmp_path / "corrupt.json",
             "wrong_kind": tmp_path / "kind.json"}
    files["corrupt"].write_text("garbage\n")
    files["wrong_kind"].write_text(json.dumps({
        "format": "accel-schedule", "version": 1, "schedule": "adversarial:1",
        "devices": {"accel0": {"dropped": 0, "decisions": [[1, 1, "swap", 5]]}}}))
    env = {k: v.format(**files) for k, v in env.items()}
    message = message.format(**files)
    r = daemon.run_py("""
        import runtime
        try:
            runtime.Stream()
        except runtime.InvalidValueError as e:
            print(e)
    """, timeout=60, **env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == message
