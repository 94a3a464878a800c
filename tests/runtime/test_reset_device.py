"""``runtime.reset_device``: a process that holds a device exclusively resets it (the
device, not only its own state), its work in flight raises the loss naming the reset,
``recover()`` then gives a working device, and the other device -- this process's memory
there and another tenant on it -- never notices. Without an exclusive context the call is
refused before anything is sent."""

from __future__ import annotations

import pytest
from scenario import IDLE, REPORT, reports

from testkit.bystander import Bystander

RESET_BY_THE_OWNER = """
import os, threading
import numpy as np, runtime
from runtime import discovery
from runtime.kernel_lib import SOURCE

def refused(fn):
    try:
        fn()
        return "ran"
    except runtime.InvalidValueError as exc:
        return str(exc)

report(no_exclusive_context=refused(lambda: runtime.reset_device(0)),
       primary_context=refused(lambda: runtime.primary_context(0).reset_device()),
       reset_count_before=discovery.read_attr("accel0", "reset_count"))
owner = runtime.new_context(0, exclusive=True)
lib = runtime.compile(SOURCE, 0)
x = runtime.to_device(np.ones(1 << 22, np.float32))
other = runtime.to_device(np.arange(4096, dtype=np.float32), device=1)
runtime.synchronize(0)
for _ in range(100):  # seconds of queued work, so the reset finds this process waiting
    lib.saxpy[(1 << 22) // 64, 64](np.float32(1.0), x, x, x)
returned = []
resetter = threading.Timer(0.1, lambda: returned.append(runtime.reset_device(0)))
resetter.start()
try:
    runtime.synchronize(0)
    report(synchronize="returned")
except runtime.DeviceLostError as exc:
    report(synchronize=str(exc), pid=os.getpid())
resetter.join()
report(reset_device_returned=returned, state=discovery.read_attr("accel0", "state"),
       reset_count=discovery.read_attr("accel0", "reset_count"))
try:
    owner.synchronize()
    report(owner="not lost")
except runtime.DeviceLostError:
    report(owner="lost")
owner.close()
runtime.recover(0)
y = runtime.to_device(np.arange(256, dtype=np.float32))
report(works=float(y.copy_to_host().sum()),
       other_device_wrong=np.count_nonzero(other.copy_to_host() != np.arange(4096, dtype=np.float32)))
"""


@pytest.mark.timeout(180)
def test_the_exclusive_owner_resets_its_device_and_recovers(make_daemon):
    d = make_daemon(devices=2)
    with Bystander(d, 1, alone=True) as other_tenant:
        out = d.run_py(REPORT + RESET_BY_THE_OWNER, timeout=150)
        other_tenant.check()
    assert out.returncode == 0, out.stderr
    r = reports(out.stdout.splitlines())
    assert "exclusive" in r["no_exclusive_context"] and "exclusive" in r["primary_context"], r
    assert r["reset_count_before"] == "0", r
    assert f"reset requested by pid {r.get('pid')} (DEVICE_RESET)" in r["synchronize"], r
    assert r["reset_device_returned"] == [None], r
    assert (r["state"], r["reset_count"], r["owner"]) == ("operational", "1", "lost"), r
    assert r["works"] == 32640.0 and r["other_device_wrong"] == 0, r
    assert out.stderr == ""  # nothing printed at exit either
    assert d.attr(1, "reset_count") == "0"
    for dev in (0, 1):
        d.wait_attrs(dev, IDLE)


RESET_ENDS_BADLY = """
import os, time
import runtime
from runtime import discovery

debug = os.environ["ACCEL_EMU_ROOT"] + "/sys/kernel/debug/accel/accel0/"
def knob(name, value):
    open(debug + name, "w").write(value)
def operational():
    deadline = time.monotonic() + 30
    while discovery.read_attr("accel0", "state") != "operational":
        assert time.monotonic() < deadline
        time.sleep(0.02)

knob("fw_boot_fail", "1")
with runtime.new_context(0, exclusive=True):
    try:
        runtime.reset_device(0)
    except runtime.FirmwareBootError as exc:
        print("boot failed:", exc)
knob("fw_boot_fail", "0")
open(os.environ["ACCEL_EMU_ROOT"] + "/sys/class/accel/accel0/reset", "w").write("1")
operational()
knob("reset_hold", "1")
with runtime.new_context(0, exclusive=True):
    try:
        runtime.reset_device(0, timeout=0.5)
    except runtime.AccelTimeoutError as exc:
        print("held:", exc)
knob("reset_hold", "0")
operational()
runtime.recover(0)
print("back", discovery.read_attr("accel0", "reset_count"))
"""


@pytest.mark.timeout(120)
def test_reset_device_says_how_the_reset_ended(make_daemon):
    """A reset whose boot fails raises as the device's failure (here a boot failure); one
    that does not finish in time raises AccelTimeoutError."""
    d = make_daemon(devices=1)
    out = d.run_py(RESET_ENDS_BADLY, timeout=90)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith("boot failed:"), lines
    assert "the reset ended with the device failed" in lines[0], lines
    assert lines[1].startswith("held:"), lines
    assert "did not finish within 0.5 s (state in_reset)" in lines[1], lines
    assert lines[2] == "back 3", lines

    assert out.stderr == ""
    d.wait_attrs(0, IDLE)
