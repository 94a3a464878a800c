"""Recovery without a process restart: after a reset loses this process's primary context,
everything of that device raises the loss (never a raw OSError, never stale memory from
the cache) until ``runtime.recover(device)`` builds a fresh hold on it; handles from
before keep naming the loss; the other device never notices; nothing prints at exit."""

from __future__ import annotations

import errno
import os
import re
import signal
import time

import pytest
from scenario import SPINNING

from testkit.bystander import Bystander

IDLE = {"contexts": "0", "memory_used": "0", "queues": "0", "pinned_bytes": "0"}

RESET_THEN_RECOVER = """
import os, subprocess, sys
import numpy as np, runtime
from runtime.kernel_lib import SOURCE

lib = runtime.compile(SOURCE, 0)
x = runtime.to_device(np.arange(1 << 16, dtype=np.float32))
s = runtime.Stream(0)
cached = runtime.empty(1024, np.float32)
del cached                      # a block in the caching allocator: gone with the context
other = runtime.to_device(np.arange(4096, dtype=np.float32), device=1)
runtime.synchronize(0)
smi = subprocess.run([sys.executable, "-m", "tools.accel_smi", "--root",
                      os.environ["ACCEL_EMU_ROOT"], "-r", "-i", "0", "--force"],
                     capture_output=True, text=True)
print("reset", smi.returncode, smi.stdout.strip())

def attempt(what, fn):
    try:
        fn()
        print(what, "ran", sep="\\t")
    except runtime.AccelError as exc:
        print(what, type(exc).__name__, exc, sep="\\t")
    except Exception as exc:  # a raw OSError or an AttributeError is the bug this catches
        print(what, "RAW", type(exc).__name__, exc, sep="\\t")

attempt("copy", lambda: x.copy_to_host())
attempt("empty", lambda: runtime.empty(1024, np.float32))
attempt("stream", lambda: runtime.Stream(0))
attempt("to_device", lambda: runtime.to_device(np.ones(4)))
attempt("synchronize", lambda: runtime.synchronize(0))
print("other device wrong", np.count_nonzero(other.copy_to_host() != np.arange(4096, dtype=np.float32)))
runtime.recover(0)
print("recovered")
y = runtime.to_device(np.zeros(256, np.float32))
runtime.compile(SOURCE, 0).fill[1, 256](y, np.float32(2))
print("works", float(y.copy_to_host().sum()))
attempt("old array", lambda: x.copy_to_host())
attempt("old stream", lambda: s.submit_nop())
attempt("old module", lambda: lib.fill[1, 256](y, np.float32(1)))
attempt("synchronize after", lambda: runtime.synchronize(0))
"""


@pytest.mark.timeout(120)
def test_a_reset_is_recovered_in_process_and_old_handles_name_it(make_daemon):
    d = make_daemon(devices=2)
    with Bystander(d, 1) as other_tenant:
        out = d.run_py(RESET_THEN_RECOVER, timeout=90)
        other_tenant.check()  # another process's data and work on the other device
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "reset 0 accel 0: reset complete, operational (reset_count 1)"

    def lost(said: list[str]) -> list[str]:
        """Each attempt's name, if it raised DeviceLostError naming the reset; else its line."""
        parts = [line.split("\t") for line in said]
        return [p[0] if p[1:2] == ["DeviceLostError"] and "reset" in p[2] else "\t".join(p)
                for p in parts]

    assert lost(lines[1:6]) == ["copy", "empty", "stream", "to_device", "synchronize"], lines
    assert lines[6:9] == ["other device wrong 0", "recovered", "works 512.0"], lines
    assert lost(lines[9:12]) == ["old array", "old stream", "old module"], lines
    assert lines[12:] == ["synchronize after\tran"], lines
    assert out.stderr == ""  # nothing printed at interpreter exit, either
    # what the old and the new context held is back (the process has exited)
    d.wait_attrs(0, IDLE)


FIRMWARE_DIES = """
import os, signal, threading, time
import numpy as np, runtime
from runtime import discovery
from runtime.kernel_lib import SOURCE

root = os.environ["ACCEL_EMU_ROOT"]
debug = root + "/sys/kernel/debug/accel/accel0/"
lib = runtime.compile(SOURCE, 0)
x = runtime.to_device(np.ones(1 << 22, np.float32))
runtime.synchronize(0)
for _ in range(100):  # seconds of queued work, so the loss finds this process waiting
    lib.saxpy[(1 << 22) // 64, 64](np.float32(1.0), x, x, x)
fw = int(open(debug + "fw_pid").read())
at = []
def strike():
    at.append(time.monotonic())
    if HOW == "kill":
        os.kill(fw, signal.SIGKILL)
    else:
        open(debug + "fw_hang", "w").write("1")
threading.Timer(0.1, strike).start()
try:
    runtime.synchronize(0)
    print("synchronize returned")
except runtime.DeviceLostError as exc:
    print("lost after", "%.2f" % (time.monotonic() - at[0]), exc)
deadline = time.monotonic() + 30
while discovery.read_attr("accel0", "state") != "operational" and time.monotonic() < deadline:
    time.sleep(0.02)
print("back", discovery.read_attr("accel0", "state"), discovery.read_attr("accel0", "reset_count"))
print("reason", discovery.read_attr("accel0", "reset_reason"))
print("last failure", discovery.read_attr("accel0", "last_failure"))
print("firmware pid", fw, int(open(debug + "fw_pid").read()))
runtime.recover(0)
y = runtime.to_device(np.arange(256, dtype=np.float32))
print("works", float(y.copy_to_host().sum()))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dying_firmware_is_recovered_by_the_driver_and_clients_hear_at_once(make_daemon, how):
    """With recovery auto (the default), a firmware that dies or stops heart-beating fails
    its device, every client of it gets DeviceLostError at once (within a second of the
    death; a hang is seen after the heartbeat timeout), and the driver resets the device:
    it serves again, says why it was reset and what failed, and runtime.recover() works.
    Another tenant on the other device never notices."""
    d = make_daemon(devices=2, extra=["--heartbeat-timeout", "0.5"])
    with Bystander(d, 1) as other_tenant:
        out = d.run_py(f"HOW = {how!r}\n" + FIRMWARE_DIES, timeout=150)
        other_tenant.check()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    failure = ("firmware process exited unexpectedly (status -9)" if how == "kill"
               else "firmware stopped heart-beating")
    words = lines[0].split()
    assert words[:2] == ["lost", "after"], lines
    # a hang is seen after the heartbeat timeout of time the firmware could have run: the
    # watchdog leaves out what the host kept it waiting for a CPU (kmod_emul/watch.py),
    # which the reason gives ("none for 1.4 s, 0.9 s of it waiting for a CPU")
    starved = re.search(r"none for [\d.]+ s, ([\d.]+) s of it waiting for a CPU", lines[0])
    bound = 1.0 if how == "kill" else 0.5 + 1.0 + (float(starved[1]) if starved else 0.0)
    assert float(words[2]) < bound, lines[0]
    assert f"context lost because it was reset (recovery from: {failure}" in lines[0]
    assert lines[1] == "back operational 1"
    assert lines[2].startswith(f"reason recovery from: {failure}")
    assert lines[3].startswith(f"last failure ENODEV {failure}")
    _, _, old_pid, new_pid = lines[4].split()
    assert lines[4].startswith("firmware pid ") and new_pid != old_pid, lines
    assert lines[5:] == ["works 32640.0"], lines
    assert out.stderr == ""
    d.wait_attrs(0, IDLE)


@pytest.mark.timeout(120)
def test_recovery_manual_leaves_the_device_failed_until_reset(make_daemon):
    d = make_daemon(devices=1, extra=["--recovery", "manual"])
    assert d.debug(0, "recovery").read_text() == "manual\n"
    fw = int(d.debug(0, "fw_pid").read_text())
    os.kill(fw, signal.SIGKILL)
    d.wait_state(0, "failed")
    time.sleep(1.0)  # and it stays failed
    assert (d.attr(0, "state"), d.attr(0, "reset_count")) == ("failed", "0")
    assert d.attr(0, "last_failure") == "ENODEV firmware process exited unexpectedly (status -9)"
    with pytest.raises(OSError) as bad:
        d.debug(0, "recovery").write_text("sometimes")
    assert bad.value.errno == errno.EINVAL
    d.debug(0, "recovery").write_text("auto")  # the knob: auto from the next failure on
    (d.root / "sys/class/accel/accel0/reset").write_text("1")
    d.wait_state(0, "operational")
    assert d.attr(0, "reset_reason").startswith(
        f"reset requested through sysfs by pid {os.getpid()} (")
    assert d.attr(0, "last_failure").startswith("ENODEV firmware process exited")  # kept
    os.kill(int(d.debug(0, "fw_pid").read_text()), signal.SIGKILL)
    d.wait_attrs(0, {"state": "operational", "reset_count": "2"})


SURVIVES_THE_DAEMON = SPINNING + """
x = runtime.to_device(np.arange(1024, dtype=np.float32))
try:
    s.synchronize()
    print("synchronize returned")
except runtime.DeviceLostError as exc:
    print("lost at", repr(time.monotonic()), exc, flush=True)
try:
    runtime.empty(16, np.float32)
except runtime.DeviceLostError:
    print("still lost", flush=True)
sys.stdin.readline()  # the daemon is started again
runtime.recover()
y = runtime.to_device(np.arange(256, dtype=np.float32))
print("works", float(y.copy_to_host().sum()))
try:
    x.copy_to_host()
except runtime.DeviceLostError as exc:
    print("old array:", exc)
"""


@pytest.mark.timeout(120)
def test_a_client_survives_the_daemon_dying_and_recovers_once_it_is_back(make_daemon):
    """SIGKILL of accel-emud under a process waiting on its device: the wait raises
    DeviceLostError at once (the event pipe hangs up), nothing of the device works until
    the daemon is started again, and then runtime.recover() -- in the same process, on the
    new mount -- gives a working device; the array from before names its loss."""
    d = make_daemon(devices=1)
    client = d.popen_py(SURVIVES_THE_DAEMON)
    try:
        assert client.stdout.readline().strip() == "waiting"
        time.sleep(0.3)  # it is blocked in synchronize() now
        killed_at = time.monotonic()  # CLOCK_MONOTONIC: one clock for both processes
        os.kill(d.pid, signal.SIGKILL)
        lost = client.stdout.readline().split()
        # at once: the event pipe hangs up (no timeout stands behind it; the bound leaves
        # a loaded host's scheduling delay room, from the kill, not from the wait's start)
        assert lost[:2] == ["lost", "at"] and float(lost[2]) - killed_at < 2.0, lost
        assert "the driver" in " ".join(lost)
        assert client.stdout.readline().strip() == "still lost"
        d.start()  # clears the dead mount and serves again
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "works 32640.0"
        old = client.stdout.readline().strip()
        assert old.startswith("old array:") and "gone" in old, old

        assert client.wait(timeout=60) == 0
        assert client.stderr.read() == ""  # nothing printed at exit
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    d.wait_attrs(0, IDLE)


RECOVER_WAITS = SPINNING + """
try:
    s.synchronize()
except runtime.DeviceLostError as exc:
    print("lost", exc, flush=True)
runtime.recover(0, timeout=30)  # at once: the reset that lost it may not be over
y = runtime.to_device(np.arange(256, dtype=np.float32))
print("works", float(y.copy_to_host().sum()))
try:
    runtime.recover(0, timeout=-1)
except ValueError as exc:
    print("refused", exc)
"""


@pytest.mark.timeout(120)
def test_recover_waits_for_a_reset_and_the_reason_names_who_asked(make_daemon):
    """runtime.recover(timeout=S) called the moment a reset's DeviceLostError arrives waits
    for the device to serve again instead of raising DeviceInResetError (EAGAIN); the
    reset's reason names the writer of ``reset``: its pid, command name and uid."""
    d = make_daemon(devices=1)
    client = d.popen_py(RECOVER_WAITS)
    try:
        assert client.stdout.readline().strip() == "waiting"
        (d.root / "sys/class/accel/accel0/reset").write_text("1")
        assert client.stdout.readline().startswith("lost ")
        assert client.stdout.readline().strip() == "works 32640.0"
        assert client.stdout.readline().startswith("refused timeout is seconds")
        assert client.wait(timeout=60) == 0, client.stderr.read()
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    with open(f"/proc/{os.getpid()}/comm", encoding="utf-8") as f:
        comm = f.read().strip()
    assert d.attr(0, "reset_reason") == (
        f"reset requested through sysfs by pid {os.getpid()} ({comm}), uid {os.getuid()}")
    d.wait_attrs(0, IDLE)
