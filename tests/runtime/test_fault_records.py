"""Fault records, read from the user's side: the exception carries the full record, the
driver's log has the same fault, ``runtime.fault_records()`` lists this process's, the
event node streams them (blocking, pollable, per-pid, with a dropped marker), the log
survives a daemon restart, and another user sees none of them."""

from __future__ import annotations

import errno
import json
import os
import select
import time

import pytest

from abi import faults, uapi
from scenario import KERNEL_FAULT_PRELUDE
from testkit.tenants import tenant_code

KERNEL_FAULT = KERNEL_FAULT_PRELUDE + """
rec = exc.record
deadline = time.monotonic() + 30
while time.monotonic() < deadline:   # the driver's copy comes from the firmware's report
    mine = runtime.fault_records()
    if mine and mine[-1]["seq"] is not None:
        break
    time.sleep(0.02)
print(json.dumps({"exc": rec, "mine": mine, "uuid": runtime.get_device_properties(0).uuid,
                  "pid": os.getpid()}))
"""



def test_a_kernel_fault_record_has_every_field_and_matches_the_drivers(daemon):
    before = daemon.fault_log()
    out = daemon.run_py(KERNEL_FAULT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    exc, pid = got["exc"], got["pid"]
    assert set(faults.FIELDS) <= set(exc)
    assert (exc["code"], exc["name"], exc["scope"], exc["severity"], exc["action"]) == (
        31, "PAGE_FAULT", "queue", "uncorrected-contained", "restart-app")
    assert (exc["device"], exc["device_uuid"], exc["pid"], exc["engine"], exc["opcode"],
            exc["errno"], exc["corrected"], exc["kernel"]) == (
        0, got["uuid"], pid, "compute", "LAUNCH", "EFAULT", False, "oob")
    assert exc["address"] > 0 and exc["queue"] and exc["context"] and exc["seqno"] == 1
    # the driver's record of the same fault, listed for this process (and only it)
    new = [r for r in daemon.fault_log() if r not in before]
    assert len(new) == 1 and new[0]["pid"] == pid
    assert {k: v for k, v in exc.items() if k != "kernel"} == new[0]  # one record: the driver's
    assert [r["seq"] for r in got["mine"]] == [new[0]["seq"]]


DRIVER_RECORD = KERNEL_FAULT_PRELUDE + """
from runtime import faults
r = exc.record
found = faults.queue_fault_record("accel0", r["context"], r["queue"], r["seqno"])
faults.RECORD_WAIT_S = 0.2
t = time.monotonic()
none = faults.queue_fault_record("accel0", r["context"], r["queue"], r["seqno"] + 1)
print(json.dumps({"found": found, "none": none, "waited": time.monotonic() - t}))
"""


def test_the_runtime_reads_the_drivers_record_of_a_queue_fault(daemon):
    """``runtime.faults.queue_fault_record`` answers the driver's record of a queue fault
    (the one ``fault_log`` keeps, ``seq`` and all), and ``{}`` once it has waited
    ``RECORD_WAIT_S`` for a fault the driver never recorded."""
    before = daemon.fault_log()
    out = daemon.run_py(DRIVER_RECORD)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    new = [r for r in daemon.fault_log() if r not in before]
    assert got["found"] == new[0] and got["found"]["seq"] is not None
    assert got["none"] == {} and got["waited"] >= 0.2


WATCH = """
import os, select, sys, time
node = os.path.join(os.environ["ACCEL_EMU_ROOT"], "dev/accel-events/accel0")
fd = os.open(node, os.O_RDWR)
if len(sys.argv) > 1:
    os.write(fd, f"pid {sys.argv[1]}".encode())
print("ready", flush=True)
p = select.poll(); p.register(fd, select.POLLIN)
print("poll", p.poll(30000), flush=True)
print(os.read(fd, 65536).decode(), end="", flush=True)
"""


def test_the_event_node_blocks_polls_and_filters_by_pid(daemon):
    everyone = daemon.popen_py(WATCH)
    nobody_else = daemon.popen_py(WATCH, "1")  # pid 1 never faults: sees nothing
    for w in (everyone, nobody_else):
        assert w.stdout.readline() == "ready\n"
    out = daemon.run_py(KERNEL_FAULT)
    assert out.returncode == 0, out.stderr
    pid = json.loads(out.stdout)["pid"]
    assert everyone.stdout.readline().startswith("poll [(")
    line = json.loads(everyone.stdout.readline())
    assert (line["code"], line["pid"], line["device"]) == (31, pid, 0)
    everyone.wait(10)
    assert nobody_else.poll() is None  # still blocked: filtered out
    nobody_else.kill()
    nobody_else.wait(10)


def test_event_node_errors_nonblocking_and_bad_filter(daemon):
    fd = os.open(daemon.root / uapi.EVENTS_DIR / "accel0", os.O_RDWR | os.O_NONBLOCK)
    try:
        with pytest.raises(BlockingIOError):
            os.read(fd, 4096)
        for bad in (b"pid", b"pid -3", b"uid 0", b"pid 1 2", b""):
            with pytest.raises(OSError) as e:
                os.write(fd, bad or b"\n")
            assert e.value.errno == errno.EINVAL
        p = select.poll()
        p.register(fd, select.POLLIN)
        assert p.poll(0) == []  # nothing to read: not readable
    finally:
        os.close(fd)
    assert daemon.attr(0, "state") == "operational"


MANY_FAULTS = """
import sys, numpy as np, runtime
from abi import userq
for _ in range(COUNT):
    s = runtime.Stream()
    s.submit([userq.Copy(1 << 40, 1 << 40, 8)])
    try:
        s.synchronize()
    except runtime.DeviceFaultError:
        pass
    s.close()
print("ok")
"""


@pytest.mark.timeout(180)
def test_a_slow_watcher_reads_the_events_it_kept_then_a_dropped_marker(daemon):
    from kmod_emul.faultlog import WATCH_QUEUE
    fd = os.open(daemon.root / uapi.EVENTS_DIR / "accel0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        n = WATCH_QUEUE + 10
        out = daemon.run_py(MANY_FAULTS.replace("COUNT", str(n)), timeout=150)
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 10
        lines: list[dict] = []
        while time.monotonic() < deadline:
            try:
                chunk = os.read(fd, 1 << 20).decode()
            except BlockingIOError:
                if lines and "dropped" in lines[-1]:
                    break
                time.sleep(0.05)
                continue
            lines += [json.loads(x) for x in chunk.splitlines()]
        assert lines[-1] == {"dropped": 10, "share": 0, "time": lines[-1]["time"]}  # root's
        records = lines[:-1]
        assert len(records) == WATCH_QUEUE and {r["code"] for r in records} == {31}
        assert [r["seq"] for r in records] == sorted(r["seq"] for r in records)
    finally:
        os.close(fd)


def test_the_log_persists_per_uuid_across_a_daemon_restart(make_daemon):
    d = make_daemon()
    uuid = d.attr(0, "uuid")
    out = d.run_py(KERNEL_FAULT)
    assert out.returncode == 0, out.stderr
    first = d.fault_log()
    assert [r["code"] for r in first] == [31]
    d.stop()
    assert (d.state_dir / "faults" / f"{uuid}.log").exists()
    d.start()
    assert d.attr(0, "uuid") == uuid
    assert d.fault_log() == first  # the same record, read back by the new daemon
    (d.root / "sys/class/accel/accel0/reset").write_text("1")
    d.wait_state(0, "operational")
    after = d.fault_log()
    assert after[:1] == first and after[1]["code"] == 120
    assert after[1]["seq"] == first[0]["seq"] + 1  # numbering goes on


def test_another_user_sees_only_their_own_and_device_wide_records(make_daemon, other_user):
    d = make_daemon(tenants=True)
    out = d.run_py(KERNEL_FAULT)  # root's fault
    assert out.returncode == 0, out.stderr
    (d.root / "sys/class/accel/accel0/reset").write_text("1")  # a device-wide record
    d.wait_state(0, "operational")
    code = tenant_code("""
        text = open(os.path.join(os.environ["ACCEL_EMU_ROOT"],
                                 "sys/class/accel/accel0/fault_log")).read()
        print(json.dumps([json.loads(l) for l in text.splitlines()]))
        print(json.dumps(runtime.fault_records()))
    """)
    seen = other_user.run(d, code)
    assert seen.returncode == 0, seen.stderr
    visible, mine = (json.loads(x) for x in seen.stdout.splitlines())
    assert [r["code"] for r in visible] == [120]  # not root's page fault
    assert mine == []  # nothing of it is this process's


FIRMWARE_DEATH = """
import json, os, signal, numpy as np, runtime
x = runtime.to_device(np.ones(1024, np.float32))
runtime.synchronize()
fw = int(open(os.path.join(os.environ["ACCEL_EMU_ROOT"],
                           "sys/kernel/debug/accel/accel0/fw_pid")).read())
os.kill(fw, signal.SIGKILL)
try:
    while True:
        x.copy_to_host()
except runtime.DeviceLostError as exc:
    rec = exc.record
print(json.dumps({"exc": rec, "ctx": runtime.primary_context(0).id,
                  "mine": [r["code"] for r in runtime.fault_records(0)]}))
"""


def test_a_firmware_death_reaches_the_process_as_a_device_scope_record(make_daemon):
    d = make_daemon()
    out = d.run_py(FIRMWARE_DEATH, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    exc = got["exc"]
    assert (exc["code"], exc["name"], exc["scope"], exc["severity"], exc["action"]) == (
        79, "FIRMWARE_DIED", "device", "fatal", "reset-device")
    assert got["ctx"] in exc["contexts"] and exc["seq"] is not None  # the driver's record
    assert got["mine"] == [79]  # the recovery's reset lost none of its contexts again
    d.wait_state(0, "operational")
    assert [r["code"] for r in d.fault_log()] == [79, 120]


def test_watchers_are_bounded_per_process_and_device_wide(make_daemon):
    from kmod_emul.faultlog import MAX_WATCHERS, MAX_WATCHERS_PER_PROCESS
    d = make_daemon()
    node = d.root / uapi.EVENTS_DIR / "accel0"
    mine = [os.open(node, os.O_RDONLY) for _ in range(MAX_WATCHERS_PER_PROCESS)]
    try:
        with pytest.raises(OSError) as e:
            os.open(node, os.O_RDONLY)
        assert e.value.errno == errno.EDQUOT
        holders = [d.popen_py(WATCH) for _ in range(
            (MAX_WATCHERS - len(mine)) // MAX_WATCHERS_PER_PROCESS)]
        # each holder takes one; fill the rest of the table from one more process each
        code = f"""
import os, sys, time
node = {str(node)!r}
fds = [os.open(node, os.O_RDONLY) for _ in range({MAX_WATCHERS_PER_PROCESS - 1})]
print("ok", flush=True); sys.stdin.read()
"""
        fillers = [d.popen_py(code) for _ in holders]
        for p in holders:
            assert p.stdout.readline() == "ready\n"
        for p in fillers:
            assert p.stdout.readline() == "ok\n"
        other = d.run_py(f"import os\ntry:\n    os.open({str(node)!r}, os.O_RDONLY)\n"
                         "except OSError as e:\n    print(e.errno)")
        assert other.stdout.strip() == str(errno.ENOSPC)
        for p in holders + fillers:
            p.kill()
            p.wait(10)
    finally:
        for fd in mine:
            os.close(fd)
    # released with their opens: there is room again. A killed process's opens reach the
    # daemon as FUSE releases some time after its death (a loaded machine: after this line)
    deadline = time.monotonic() + 30
    while True:
        try:
            fd = os.open(node, os.O_RDONLY)
            break
        except OSError as exc:
            assert exc.errno == errno.EDQUOT and time.monotonic() < deadline, exc
            time.sleep(0.05)
    os.close(fd)
    assert d.attr(0, "state") == "operational"
