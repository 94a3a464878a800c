"""Injected faults in schedule recordings (docs/schedule.md, "Injected faults"), on a real
mount, through the runtime's public names and debugfs ``ras_ctrl``.

A recording process hit by an operator's injection fails with the fault's record, and its
recording holds the fault; replaying the recording, with no operator, makes the same
failure every time while a bystander on the same device is untouched; a recorded device
reset is not replayed from a context sharing the device; a forged fault
entry beyond what the replaying context may cause itself is refused exactly as
documented (counted and logged as a ``privileged`` refusal, nothing injected), and the
bystander is untouched again.
"""

from __future__ import annotations

import json

import pytest

from recorded_faults import PROGRAM, faults_of, recorded_with_fault
from testkit.bystander import Bystander

pytestmark = pytest.mark.timeout(300)

def test_an_injected_fault_is_recorded_and_replays_every_time(make_daemon, tmp_path):
    d = make_daemon(devices=1)
    rec, out = recorded_with_fault(d, tmp_path, "inject memory ue {offset:#x}")
    assert out.split() == ["DeviceLostError", "94", "None"]
    (recorded,) = faults_of(rec)
    queue, seqno, kind, text = recorded
    block, severity, address = text.split()
    # the array's own device address (its VA), not the VRAM offset the operator named
    assert (block, severity) == ("memory", "ue") and int(address, 16) >> 32
    assert json.loads(rec.read_text())["schedule"] == "default"

    with Bystander(d, 0) as bystander:
        for i in range(3):
            again = tmp_path / f"again{i}.json"
            r = d.run_py(PROGRAM, timeout=120, ACCEL_REPLAY=str(rec), ACCEL_RECORD=str(again))
            assert (r.returncode, r.stdout.split()) == (1, ["DeviceLostError", "94", "replay"]), \
                r.stdout + r.stderr
            assert faults_of(again) == [recorded]  # replayed at the same packet, noted again
            bystander.check()
    replayed = [f for f in d.fault_log(0) if f.get("origin") == "replay"]
    assert [(f["code"], f["scope"]) for f in replayed] == [(94, "context")] * 3
    assert d.attr(0, "reset_count") == "0"
    # a replay retires no page: the one bad page is the operator's
    assert len(d.attr(0, "bad_pages").splitlines()) == 1


def test_an_injected_device_reset_is_recorded_and_its_replay_refused_on_a_shared_device(
        make_daemon, tmp_path):
    """The operator's ``compute ue`` resets the device: recorded, but a replay from a
    context that does not hold the device alone would reset it under everyone else, so it
    is refused and the program runs to its end."""
    d = make_daemon(devices=1)
    rec, out = recorded_with_fault(d, tmp_path, "inject compute ue 0x5")
    assert out.split() == ["DeviceLostError", "120", "None"]  # the reset that lost it
    assert [f[2:] for f in faults_of(rec)] == [["fault", "compute ue 0x5"]]
    d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
    r = d.run_py(PROGRAM, timeout=120, ACCEL_REPLAY=str(rec))
    assert (r.returncode, r.stdout.split()[0]) == (0, "ran"), r.stdout + r.stderr
    assert d.attr(0, "reset_count") == "1"
    assert d.attr(0, "isolation/privileged") == "1"


FORGED = [
    # a device reset, asked for by a context that does not hold the device alone
    ("compute ue 0x0", "it reaches beyond the context, which does not hold the device "
                       "exclusively"),
    # memory the context does not hold (nobody's: the device's first page)
    ("memory ue 0x0", "not in its device memory"),
]


@pytest.mark.parametrize("fault, why", FORGED, ids=["device-scope", "not-its-memory"])
def test_a_forged_fault_beyond_the_context_is_refused(make_daemon, tmp_path, fault, why):
    d = make_daemon(devices=1)
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps({
        "format": "accel-schedule", "version": 1, "schedule": "default",
        "devices": {"accel0": {"dropped": 0, "decisions": [[0, 1, "fault", fault]]}}}))
    with Bystander(d, 0) as bystander:
        before = d.fault_log(0)
        again = tmp_path / "again.json"
        r = d.run_py(PROGRAM, timeout=120, ACCEL_REPLAY=str(forged), ACCEL_RECORD=str(again))
        assert (r.returncode, r.stdout.split()) == (0, ["ran", str(float(sum(range(1 << 18))))]), \
            r.stdout + r.stderr
        bystander.check()
    assert d.fault_log(0) == before  # nothing injected, nothing recorded
    assert faults_of(again) == []
    assert d.attr(0, "reset_count") == "0"
    assert d.attr(0, "isolation/privileged") == "1"
    assert f"replayed fault '{fault}' of context" in d.log_text()
    assert f"refused: {why}" in d.log_text()


@pytest.mark.parametrize("value", ["link ue 0x0", "memory ue", "compute bad 0x1", 7],
                         ids=["link", "no-address", "severity", "number"])
def test_a_malformed_fault_entry_is_refused_by_the_runtime(daemon, tmp_path, value):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({
        "format": "accel-schedule", "version": 1, "schedule": "default",
        "devices": {"accel0": {"dropped": 0, "decisions": [[0, 1, "fault", value]]}}}))
    r = daemon.run_py("""
        import runtime
        try:
            runtime.Stream()
        except runtime.InvalidValueError as e:
            print(e)
    """, timeout=60, ACCEL_REPLAY=str(path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        f"ACCEL_REPLAY={path}: not an accel-schedule recording of version 1: bad decision "
        f"[0, 1, 'fault', {value!r}] of accel0: a fault is 'BLOCK ue|ce ADDRESS' with BLOCK "
        f"one of memory compute copy firmware, not {value!r}")
