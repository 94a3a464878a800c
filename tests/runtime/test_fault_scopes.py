"""The fault scopes the runtime and driver implement today, each proven exactly as wide as
documented (docs/faults.md, "Scopes"): the faulting process's view, a bystander process on
the same device, another on the other device, and nothing left behind. The context and
package scopes, which need RAS injection, have files of their own
(test_fault_scope_context.py, test_fault_scope_package.py)."""

from __future__ import annotations

import pytest

from scenario import IDLE, STREAM_PRELUDE
from testkit.bystander import Bystander

PRELUDE = """
import os, subprocess, sys
import numpy as np, runtime
from runtime import kernel_lib
lib = runtime.compile(kernel_lib.SOURCE)
mod = runtime.compile('''
def oob(x, n):
    i = global_id(0)
    x[i + n] = 1.0
''')
"""

OPERATION = PRELUDE + """
s = runtime.Stream()
a = runtime.to_device(np.arange(1024, dtype=np.float32), stream=s)
for what, bad in [("copy", lambda: a.copy_(runtime.empty(10, np.float32), stream=s)),
                  ("launch", lambda: lib.fill[1, 1 << 20](a, np.float32(1), stream=s)),
                  ("memset", lambda: a.memset(256, stream=s))]:
    try:
        bad()
        print(what, "ran")
    except runtime.InvalidValueError:
        print(what, "refused")
lib.fill[4, 256](a, np.float32(7), stream=s)  # the same stream goes on
s.synchronize()
print("stream", s.query(), float(a.copy_to_host(stream=s).sum()))
"""

STREAM = STREAM_PRELUDE + PRELUDE + """
bad, good = runtime.Stream(), runtime.Stream()
x = runtime.to_device(np.zeros(64, np.float32), stream=good)
y = runtime.to_device(np.zeros(64, np.float32), stream=good)
good.synchronize()
# held, so that the fill is queued behind the fault: without the hold the firmware could
# fault oob first (the fill's first launch builds its launcher), and the stream refuses it
hold(True)
mod.oob[1, 64](x, 10, stream=bad)           # faults
lib.fill[1, 64](x, np.float32(5), stream=bad)  # queued behind it: cancelled, never runs
hold(False)
lib.fill[1, 64](y, np.float32(3), stream=good)
good.synchronize()
print("same context, other stream", float(y.copy_to_host(stream=good).sum()))
try:
    bad.synchronize()
except runtime.KernelFaultError as e:
    print("fault", e.record["kernel"], e.record["errno"], e.record["queue"] - bad.queue_id)
print("max after the cancelled fill of 5:", float(x.copy_to_host(stream=good).max()))
try:
    lib.fill[1, 64](x, np.float32(1), stream=bad)
    print("faulted stream took work")
except runtime.DeviceFaultError as e:
    print("faulted stream refuses:", e)
rebuilt = runtime.Stream()
lib.fill[1, 64](x, np.float32(2), stream=rebuilt)
rebuilt.synchronize()
print("rebuilt", float(x.copy_to_host(stream=rebuilt).sum()))
try:
    runtime.synchronize()  # the faulted stream still is: synchronize says so
except runtime.KernelFaultError:
    print("synchronize raises while it lives")
"""


def _beside_bystanders(d, code: str) -> list[str]:
    """Run ``code`` with a bystander process on each device, which must both keep working;
    its output lines, once the books of both devices are back to idle."""
    with Bystander(d, 0) as b0, Bystander(d, 1) as b1:
        out = d.run_py(code, timeout=150)
        b0.check()
        b1.check()
    assert out.returncode == 0, out.stderr
    for dev in (0, 1):
        d.wait_attrs(dev, IDLE)
    return out.stdout.splitlines()


@pytest.mark.timeout(180)
def test_operation_scope_the_call_fails_and_its_stream_goes_on(make_daemon):
    lines = _beside_bystanders(make_daemon(devices=2), OPERATION)
    assert lines == ["copy refused", "launch refused", "memset refused", "stream True 7168.0"]


@pytest.mark.timeout(180)
def test_stream_scope_dependent_work_is_cancelled_and_the_rest_goes_on(make_daemon):
    d = make_daemon(devices=2)
    lines = _beside_bystanders(d, STREAM)
    # the fault names the faulted stream's queue (offset 0 from it)
    assert lines[:2] == ["same context, other stream 192.0", "fault oob EFAULT 0"], lines
    assert float(lines[2].split(":")[1]) != 5.0, lines  # the cancelled work never ran
    refusal = lines[3]
    assert refusal.startswith("faulted stream refuses:"), lines
    assert "oob" in refusal or "EFAULT" in refusal, lines
    assert lines[4:] == ["rebuilt 128.0", "synchronize raises while it lives"], lines
    assert d.attr(0, "state") == "operational" and d.attr(0, "reset_count") == "0"


DEVICE = PRELUDE + """
x = runtime.to_device(np.ones(64, np.float32))
runtime.synchronize()
smi = subprocess.run([sys.executable, "-m", "tools.accel_smi", "--root",
                      os.environ["ACCEL_EMU_ROOT"], "-r", "-i", "0", "--force"],
                     capture_output=True, text=True)
print("reset", smi.returncode)
try:
    x.copy_to_host()
except runtime.DeviceLostError as e:
    print("told:", e)
runtime.recover()
y = runtime.to_device(np.ones(64, np.float32))
print("back", float(y.copy_to_host().sum()))
"""


@pytest.mark.timeout(180)
def test_device_scope_every_context_on_it_is_told_and_the_other_device_goes_on(make_daemon):
    d = make_daemon(devices=2)
    with Bystander(d, 0) as b0, Bystander(d, 1) as b1:
        out = d.run_py(DEVICE, timeout=150)
        # the bystander on the same device lost its context too, and is told so
        b0.proc.stdin.write("check\n")
        b0.proc.stdin.flush()
        answer = b0.proc.stdout.readline().strip()
        assert answer.startswith("error DeviceLostError(") and "reset" in answer, answer
        b1.check()  # the other device never noticed
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and lines[0] == "reset 0" and lines[2] == "back 64.0", lines
    assert lines[1].startswith("told:") and "reset" in lines[1][len("told:"):], lines

    assert d.attr(0, "reset_count") == "1" and d.attr(1, "reset_count") == "0"
    for dev in (0, 1):
        d.wait_attrs(dev, IDLE)
