"""``runtime.reset_device``: a process that holds a device exclusively resets it (the
device, not only its own state), its work in flight raises the loss naming the reset,
``recover()`` then gives a working device, and the other device -- this process's memory
there and another tenant on it -- never notices. Without an exclusive context the call is
refused before anything is sent."""

from __future__ import annotations

import pytest
from scenario import IDLE

from testkit.bystander import Bystander

RESET_BY_THE_OWNER = """
import os, threading
import numpy as np, runtime
from runtime import discovery
from runtime.kernel_lib import SOURCE

def refused(what, fn):
    try:
        fn()
        print(what, "ran")
    except runtime.InvalidValueError as exc:
        print(what, "refused", "exclusive" in str(exc))

refused("no exclusive context", lambda: runtime.reset_device(0))
refused("primary context", lambda: runtime.primary_context(0).reset_device())
print("reset_count", discovery.read_attr("accel0", "reset_count"))
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
    print("synchronize returned")
except runtime.DeviceLostError as exc:
    print("lost", f"reset requested by pid {os.getpid()} (DEVICE_RESET)" in str(exc))
resetter.join()
print("reset_device returned", returned == [None], discovery.read_attr("accel0", "state"),
      discovery.read_attr("accel0", "reset_count"))
try:
    owner.synchronize()
except runtime.DeviceLostError:
    print("the exclusive context is lost too")
owner.close()
runtime.recover(0)
y = runtime.to_device(np.arange(256, dtype=np.float32))
print("works", float(y.copy_to_host().sum()))
print("other device", np.array_equal(other.copy_to_host(), np.arange(4096, dtype=np.float32)))
"""


@pytest.mark.timeout(180)
def test_the_exclusive_owner_resets_its_device_and_recovers(make_daemon):
    d = make_daemon(devices=2)
    with Bystander(d, 1, alone=True) as other_tenant:
        out = d.run_py(RESET_BY_THE_OWNER, timeout=150)
        other_tenant.check()
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "no exclusive context refused True", "primary context refused True", "reset_count 0",
        "lost True", "reset_device returned True operational 1",
        "the exclusive context is lost too", "works 32640.0", "other device True"]
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
        print("boot failed", "the reset ended with the device failed" in str(exc))
knob("fw_boot_fail", "0")
open(os.environ["ACCEL_EMU_ROOT"] + "/sys/class/accel/accel0/reset", "w").write("1")
operational()
knob("reset_hold", "1")
with runtime.new_context(0, exclusive=True):
    try:
        runtime.reset_device(0, timeout=0.5)
    except runtime.AccelTimeoutError as exc:
        print("held", "did not finish within 0.5 s (state in_reset)" in str(exc))
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
    assert out.stdout.splitlines() == ["boot failed True", "held True", "back 3"]
    assert out.stderr == ""
    d.wait_attrs(0, IDLE)
