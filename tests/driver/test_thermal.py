"""Thermal faults through ``ras_ctrl``: a correctable one throttles (visible in
``temperature``, ``clock`` and ``throttle_reasons``, record 140) and cools back; an
uncorrectable one shuts the device down (record 141, its contexts lost, the firmware
stopped) and the driver resets it once cooled; the other device never notices. The
temperature follows load: it is a model, not a constant."""

from __future__ import annotations

import errno
import time

import pytest
from scenario import HOLD_DATA, NOP_LOAD

from kmod_emul import thermal
from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot
from testkit.waiting import wait_until



def test_throttling_is_visible_then_cools_back(make_daemon):
    d = make_daemon()
    idle = float(d.attr(0, "temperature"))
    assert thermal.AMBIENT_C - 1 <= idle < thermal.SLOWDOWN_C
    assert (d.attr(0, "clock"), d.attr(0, "throttle_reasons")) == (
        str(thermal.BASE_CLOCK_MHZ), "none")
    d.debug(0, "ras_ctrl").write_text("inject thermal ce 90")
    assert float(d.attr(0, "temperature")) >= 89
    assert (d.attr(0, "clock"), d.attr(0, "throttle_reasons")) == (
        str(thermal.THROTTLED_CLOCK_MHZ), "sw_thermal_slowdown")
    assert d.attr(0, "state") == "operational"
    rec = d.fault_log()[-1]
    assert (rec["code"], rec["name"], rec["corrected"], rec["scope"]) == (
        140, "THERMAL_THROTTLE", True, "operation")
    wait_until(lambda: d.attr(0, "throttle_reasons"), 20, "accel0 to cool back",
               ok=lambda reasons: reasons == "none")
    assert d.attr(0, "clock") == str(thermal.BASE_CLOCK_MHZ)




def test_an_injected_throttle_holds_long_enough_for_a_one_second_monitor(make_daemon):
    """``inject thermal ce D S`` holds the heat S seconds (default 3): a monitor sampling
    once a second (``accel-smi -l 1``, a 1 s scrape) sees it. Before, the die fell back
    under the slowdown threshold in under 0.25 s."""
    d = make_daemon()
    d.debug(0, "ras_ctrl").write_text("inject thermal ce 0")  # the default hold
    time.sleep(1.0)
    assert d.attr(0, "throttle_reasons") == "sw_thermal_slowdown"
    d.debug(0, "ras_ctrl").write_text("inject thermal ce 90 60")
    time.sleep(2.5)
    assert (float(d.attr(0, "temperature")), d.attr(0, "throttle_reasons")) == (
        pytest.approx(90, abs=1), "sw_thermal_slowdown")
    assert "for 60 s at least" in d.fault_log(0)[-1]["message"]
    for bad in ("inject thermal ce 90 0", "inject thermal ce 90 x",
                "inject thermal ce 90 3601", "inject thermal ue 100 5",
                "inject memory ce 0 5"):
        with pytest.raises(OSError) as exc:
            d.debug(0, "ras_ctrl").write_text(bad)
        assert exc.value.errno == errno.EINVAL, bad


def test_the_temperature_follows_load(make_daemon):
    d = make_daemon()
    idle = float(d.attr(0, "temperature"))
    out = d.run_py(NOP_LOAD, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(d.attr(0, "temperature")) > idle


HOLDER = HOLD_DATA + """
try:
    x.copy_to_host()
    print("ran")
except runtime.DeviceLostError as exc:
    print(exc.record["code"], exc)
"""


@pytest.mark.timeout(120)
def test_a_thermal_shutdown_loses_the_device_and_recovers_once_cooled(make_daemon):
    d = make_daemon(devices=2)
    before = snapshot(d)
    with Bystander(d, 1) as other:
        holder = d.popen_py(HOLDER)
        assert holder.stdout.readline() == "ready\n"
        d.debug(0, "ras_ctrl").write_text("inject thermal ue 0")
        assert d.attr(0, "state") in ("failed", "in_reset", "booting")
        out, err = holder.communicate("\n", timeout=30)
        said = out.splitlines()
        assert len(said) == 1 and said[0].startswith("141 ") and "thermal shutdown" in said[0], (
            said, err)

        d.wait_state(0, "operational")
        other.check()
    assert d.attr(0, "reset_count") == "1"
    assert float(d.attr(0, "temperature")) < thermal.SLOWDOWN_C
    assert "thermal shutdown" in d.attr(0, "last_failure")
    rec = [r for r in d.fault_log() if r["code"] == 141]
    assert len(rec) == 1 and (rec[0]["severity"], rec[0]["scope"]) == ("fatal", "device")
    assert d.attr(1, "reset_count") == "0" and d.fault_log(1) == []
    assert_contained(d, before, reset=(0,))


def test_manual_recovery_leaves_a_shut_down_device_failed(make_daemon):
    d = make_daemon(extra=["--recovery", "manual"])
    d.debug(0, "ras_ctrl").write_text("inject thermal ue 0")
    d.wait_state(0, "failed")
    time.sleep(1.5)  # cooled by now: still failed, nobody reset it
    assert d.attr(0, "state") == "failed" and d.attr(0, "reset_count") == "0"
    (d.root / "sys/class/accel/accel0/reset").write_text("1")
    d.wait_state(0, "operational")
