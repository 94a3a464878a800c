"""The event node and the fault log against another user (issue 29: findings 2, 4, 5, 10).

Every attack is replayed by uid 65534 in a fresh interpreter that never was root
(``other_user``) on a 2-device daemon with a bystander tenant of root's on each device;
each answer is checked for its exact errno, and the bystanders' data, work and records are
checked after (and that nothing leaked: ``assert_contained``).

- 8 watchers and 400 threads in pread(2) held every FUSE request task of the daemon: now
  pread answers ESPIPE (the node is a stream) and the bystander's driver round trip stays
  within ``events_flood.SLOWDOWN`` of the quiet one measured in the same test, no request
  over a second; a user's waiting reads past 16 answer EDQUOT, and root still reads.
- One user's processes took all 64 watchers of a device: now 16 per user (EDQUOT), and the
  last 16 are root's (ENOSPC for everyone else).
- ``pid ²`` or 4,301 digits as a filter, and a read shorter than the next event, answered
  EIO (a driver bug, logged with a traceback; the event lost): now EINVAL, and the event
  waits for the next read.
- A tenant faulting in a loop evicted everyone's records and flooded the daemon's log: now
  a victim's one record stays in ``fault_log``, the persistent log and its watcher, the
  device-wide records stay, and the log grows by the rate limit's lines.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time

import pytest

from abi import faults, uapi
from kmod_emul.faultlog import (
    KEEP,
    MAX_WAITING_READS_PER_UID,
    MAX_WATCHERS,
    MAX_WATCHERS_PER_PROCESS,
    MAX_WATCHERS_PER_UID,
    ROOT_WATCHERS,
    WATCH_QUEUE,
)
from kmod_emul.ratelimit import LOG_INTERVAL_S
from stress._common import timed
from stress.events_flood import round_trips, slowdown
from stress.fault_flood import FAULT_LOOP, Victim, fault_lines, log_lines_bound
from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def tenants(contained):
    """conftest's ``contained``: checked for containment at the test's end."""
    return contained


def _ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:.3f} ms, max {max(xs) * 1e3:.1f} ms"


#: The attack of finding 2: 8 watchers of accel0, 400 threads in pread(2) on them; each
#: prints nothing until all have had their answer, then waits in read(2) for good.
PREADERS = """
import collections, errno, json, os, sys, threading
node = os.environ["ACCEL_EMU_ROOT"] + "/dev/accel-events/accel0"
fds = [os.open(node, os.O_RDONLY) for _ in range(8)]
answers = collections.Counter()
lock = threading.Lock()
answered = threading.Semaphore(0)
def reader(fd):
    try:
        os.pread(fd, 4096, 0)
        got = "ok"
    except OSError as exc:
        got = errno.errorcode[exc.errno]
    with lock:
        answers[got] += 1
    answered.release()
    while True:
        os.read(fd, 65536)
for i in range(400):
    threading.Thread(target=reader, args=(fds[i % 8],), daemon=True).start()
for _ in range(400):
    answered.acquire()
print(json.dumps(answers), flush=True)
sys.stdin.readline()
"""


def test_preads_by_the_hundred_are_espipe_and_leave_every_request_task_to_others(
        tenants, other_user):
    d = tenants
    quiet = round_trips(d, 0, 300)
    attacker = other_user.popen(d, PREADERS)
    try:
        answers = timed(attacker.stdout.readline, 60)
        assert json.loads(answers or "null") == {"ESPIPE": 400}, attacker.stderr.read()
        time.sleep(1.5)  # its 400 threads now wait in read(2), past a read slice too
        flooded = round_trips(d, 0, 300)
        assert attacker.poll() is None
    finally:
        # killed, its threads' queued reads are withdrawn: the daemon must not freeze in
        # a read of /dev/fuse (kmod_emul/daemon.py, LoopWatch), and the process dies at once
        attacker.kill()
        attacker.wait(60)
    print(f"DEVICE_QUERY round trip: quiet {_ms(quiet)}; under 8 watchers x 400 threads "
          f"{_ms(flooded)}")
    assert slowdown(quiet, flooded) is None, slowdown(quiet, flooded)


#: One read(2) per watcher, each from a thread of its own (argv: the device); prints the
#: answers of the reads that came back after 3 s (two read slices), and how many still wait.
READERS = """
import collections, errno, json, os, sys, threading, time
node = os.environ["ACCEL_EMU_ROOT"] + "/dev/accel-events/accel" + sys.argv[1]
fds = [os.open(node, os.O_RDONLY) for _ in range(8)]
answers = collections.Counter()
lock = threading.Lock()
def reader(fd):
    try:
        os.read(fd, 65536)
        got = "ok"
    except OSError as exc:
        got = errno.errorcode[exc.errno]
    with lock:
        answers[got] += 1
threads = [threading.Thread(target=reader, args=(fd,), daemon=True) for fd in fds]
for t in threads:
    t.start()
time.sleep(3)
print(json.dumps([answers, sum(t.is_alive() for t in threads)]), flush=True)
sys.stdin.readline()
"""

#: Root: one blocking read of the node (argv: the device), printed as the record's code.
ROOT_READ = """
import json, os, sys
fd = os.open(os.environ["ACCEL_EMU_ROOT"] + "/dev/accel-events/accel" + sys.argv[1],
             os.O_RDONLY)
print("reading", flush=True)
print(json.loads(os.read(fd, 65536).splitlines()[0])["code"], flush=True)
"""


def test_a_users_waiting_reads_past_its_share_are_edquot_and_root_still_reads(
        tenants, other_user):
    """Four processes of the user, 8 watchers each (their share: 16 a device on both
    devices), a thread in read(2) on every one: 16 wait, 16 answer EDQUOT at once. Root's
    blocking read then waits beside them and gets the event it waits for."""
    d = tenants
    readers = [other_user.popen(d, READERS, str(dev)) for dev in (0, 1, 0, 1)]
    try:
        seen = [json.loads(timed(p.stdout.readline, 60) or "null") for p in readers]
        assert all(seen), [p.stderr.read() for p in readers]
        answers = {k: sum(a.get(k, 0) for a, _ in seen) for k in ("EDQUOT", "ok")}
        assert answers == {"EDQUOT": 32 - MAX_WAITING_READS_PER_UID, "ok": 0}, seen
        assert sum(waiting for _, waiting in seen) == MAX_WAITING_READS_PER_UID, seen
        root = d.popen_py(ROOT_READ, "0")
        assert timed(root.stdout.readline, 60).strip() == "reading"
        time.sleep(0.5)  # its read is in the daemon, waiting
        (d.root / "sys/kernel/debug/accel/accel0/ras_ctrl").write_text("inject compute ce 0")
        assert timed(root.stdout.readline, 30).strip() == "121", root.stderr.read()
        root.wait(10)
    finally:
        for p in readers:
            p.kill()
            p.wait()


#: Processes of one user (argv: device, how many), each opening 8 watchers and holding
#: them; prints the answers of all the opens (sorted), then holds until stdin closes.
HOLDERS = """
import errno, json, os, sys
node = os.environ["ACCEL_EMU_ROOT"] + "/dev/accel-events/accel" + sys.argv[1]
r, w = os.pipe()
for _ in range(int(sys.argv[2])):
    if os.fork() == 0:
        got = []
        for _ in range(8):
            try:
                os.open(node, os.O_RDONLY)
                got.append("ok")
            except OSError as exc:
                got.append(errno.errorcode[exc.errno])
        os.write(w, (json.dumps(got) + "\\n").encode())
        sys.stdin.read()
        os._exit(0)
lines = os.fdopen(r).readline
print(json.dumps(sorted(a for _ in range(int(sys.argv[2])) for a in json.loads(lines()))),
      flush=True)
sys.stdin.read()
"""


def _opens(proc) -> list[str]:
    line = timed(proc.stdout.readline, 60)
    assert line, proc.stderr.read()
    return json.loads(line)


def test_one_users_processes_get_their_share_of_watchers_and_root_keeps_its_own(
        tenants, other_user):
    """accel0: the user's 8 processes open 64 watchers: 16 (its share), then EDQUOT.
    accel1: root holds 40; the user gets 8 (up to MAX_WATCHERS - ROOT_WATCHERS), then
    ENOSPC; root gets the last 16, then ENOSPC too."""
    d = tenants
    held = []
    try:
        held.append(other_user.popen(d, HOLDERS, "0", "8"))
        share = MAX_WATCHERS_PER_UID
        assert _opens(held[-1]) == ["EDQUOT"] * (64 - share) + ["ok"] * share
        roots = MAX_WATCHERS - ROOT_WATCHERS - MAX_WATCHERS_PER_PROCESS
        held.append(d.popen_py(HOLDERS, "1", str(roots // 8)))
        assert _opens(held[-1]) == ["ok"] * roots
        held.append(other_user.popen(d, HOLDERS, "1", "8"))
        assert _opens(held[-1]) == ["ENOSPC"] * 56 + ["ok"] * 8
        held.append(d.popen_py(HOLDERS, "1", "3"))
        assert _opens(held[-1]) == ["ENOSPC"] * 8 + ["ok"] * ROOT_WATCHERS
    finally:
        for p in held:
            p.stdin.close()
            p.wait(30)


#: Bad filters, then a short read of the user's own fault's record.
FILTERS_AND_SHORT_READ = """
import errno, json, os, select, runtime
from abi import userq
fd = os.open(os.environ["ACCEL_EMU_ROOT"] + "/dev/accel-events/accel0",
             os.O_RDWR | os.O_NONBLOCK)
def attempt(fn):
    try:
        return fn()
    except OSError as exc:
        return errno.errorcode[exc.errno]
answers = {name: attempt(lambda: os.write(fd, text.encode()) and "ok") for name, text in (
    ("superscript two", "pid \\u00b2"), ("arabic-indic three", "pid \\u0663"),
    ("4,301 digits", "pid " + "9" * 4301), ("11 digits", "pid " + "1" * 11))}
answers["filter"] = attempt(lambda: os.write(fd, f"pid {os.getpid()}".encode()) and "ok")
s = runtime.Stream(0)
s.submit([userq.Copy(1 << 40, 1 << 40, 8)])
try:
    s.synchronize()
except runtime.DeviceFaultError:
    pass
select.select([fd], [], [], 10)
answers["short read"] = attempt(lambda: os.read(fd, 16))
rec = json.loads(os.read(fd, 65536))
answers["then"] = [rec["code"], rec["pid"] == os.getpid()]
answers["after"] = attempt(lambda: os.read(fd, 65536))
print(json.dumps(answers))
"""


def test_bad_filters_and_short_reads_are_einval_and_the_event_waits(tenants, other_user):
    d = tenants
    log_before = len(d.log_text())
    out = other_user.run(d, FILTERS_AND_SHORT_READ)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "superscript two": "EINVAL", "arabic-indic three": "EINVAL", "4,301 digits": "EINVAL",
        "11 digits": "EINVAL", "filter": "ok", "short read": "EINVAL", "then": [31, True],
        "after": "EAGAIN"}
    log = d.log_text()[log_before:]
    assert "driver bug" not in log and "Traceback" not in log, log[-3000:]


#: faults of the flood: enough that the old log (the last 256) and the old persistent log
#: (cut back past 1 MiB, about 2,300 records) both lost the victims' records
FLOOD = 2_500


@pytest.mark.timeout(300)
def test_a_tenant_faulting_in_a_loop_erases_no_one_elses_records(make_daemon, other_user):
    d = make_daemon(devices=2, tenants=True)
    for dev in (0, 1):  # the device-wide records: before the bystanders, whom it would lose
        (d.root / f"sys/class/accel/accel{dev}/reset").write_text("1")
        d.wait_state(dev, "operational")
    device_wide = [d.fault_log(dev) for dev in (0, 1)]
    assert [[r["code"] for r in recs] for recs in device_wide] == [[120], [120]]
    # root's unfiltered watcher, not read until the flood is over
    operator = os.open(d.root / uapi.EVENTS_DIR / "accel0", os.O_RDONLY | os.O_NONBLOCK)
    with Bystander(d, 0) as by0, Bystander(d, 1) as by1:
        before = snapshot(d)
        victims = [Victim(d, 0), Victim(d, 1)]
        try:
            log_before, t0 = len(d.log_text()), time.monotonic()
            out = other_user.run(d, FAULT_LOOP, "0", str(FLOOD), timeout=240)
            seconds = time.monotonic() - t0
            assert out.returncode == 0 and int(out.stdout) == FLOOD, out.stderr
            assert [v.lost(d) for v in victims] == [[], []]
        finally:
            for v in victims:
                v.close()
        kept = [d.fault_log(dev) for dev in (0, 1)]
        assert all(r in kept[dev] for dev in (0, 1) for r in device_wide[dev])
        assert sum(r["uid"] == 65534 for r in kept[0]) == KEEP  # the flood keeps its own
        # one more record once the window the flood ended in is over: the line counting
        # the rest of it
        time.sleep(max(0.0, t0 + seconds + LOG_INTERVAL_S - time.monotonic()))
        (d.root / "sys/kernel/debug/accel/accel0/ras_ctrl").write_text("inject compute ce 0")
        try:
            seen = faults.from_lines(os.read(operator, 1 << 24).decode())
        finally:
            os.close(operator)
        # the flood filled its own share of the operator's queue, and the record after it
        # (device-wide) was still queued: one queue for all dropped it
        assert [(m["dropped"], m["share"]) for m in seen if "dropped" in m] == \
            [(FLOOD - WATCH_QUEUE, 65534)]
        assert seen[-1]["code"] == faults.BY_NAME["COMPUTE_CE"].code, seen[-1]
        log = d.log_text()[log_before:]
        print(f"{FLOOD} faults in {seconds:.1f} s: {fault_lines(log)} lines logged")
        assert fault_lines(log) <= log_lines_bound(1, seconds + LOG_INTERVAL_S)
        logged = len(re.findall(r"accel0 fault 31 ", log))
        counted = sum(map(int, re.findall(r"accel0: (\d+) more fault records not logged", log)))
        assert logged + counted >= FLOOD, (logged, counted)  # each fault logged or counted
        by0.check()
        by1.check()
        assert_contained(d, before)
