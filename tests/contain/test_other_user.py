"""Isolation from another user who never was root: a fresh interpreter started as uid 65534
(``other_user``, testkit/tenants.py ``OtherUser``) importing a world-readable copy of the
runtime. ``as_user`` snippets import as root and then drop their uid, so root's head start
(files opened, the import's view of the tree) could pass a check a real second user
fails; these cannot.

Each attempt fails with its exact errno, and then the usual containment checks hold: a
bystander (root's) keeps its data and work, and nothing leaked.
"""

from __future__ import annotations

import json

import pytest

from scenario import KERNEL_FAULT_PRELUDE
from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot
from testkit.tenants import NOBODY

#: the other user's answer to one attempt: "ok" or the errno's name
ATTEMPT = """
import errno, json, os, sys, numpy as np, runtime
root = os.environ["ACCEL_EMU_ROOT"]
cls = root + "/sys/class/accel/"
def attempt(fn):
    try:
        fn()
        return "ok"
    except (OSError, runtime.AccelError) as e:  # each carries the errno it was answered
        return errno.errorcode[e.errno]
"""
#: root's process holding device 1 exclusively and an export on device 0; it prints its
#: pid and the export's handle, then waits for a line on stdin
HOLDER = """
import os, pickle, sys, numpy as np, runtime
c = runtime.new_context(1, exclusive=True)
secret = runtime.to_device(np.full(4096, 7, np.uint8), device=0)
print(os.getpid(), pickle.dumps(secret.ipc_handle()).hex(), flush=True)
sys.stdin.readline()
print("read back", np.unique(secret.copy_to_host()).tolist(), flush=True)
"""


@pytest.fixture
def tenants(make_daemon):
    """A 2-device daemon the other user can reach, a bystander of root's on device 0 alone
    (device 1 is left free for a root process to hold exclusively), and a snapshot taken
    once it runs, checked against at the test's end."""
    d = make_daemon(devices=2, tenants=True)
    with Bystander(d, 0, alone=True) as by:
        before = snapshot(d)
        yield d
        by.check()
        assert_contained(d, before)


def test_a_fresh_interpreter_of_another_user_imports_the_runtime(tenants, other_user):
    """The process is uid/gid 65534 with no groups from its start, imports the copy, and
    cannot read root's tree (the repository under /work is not where it imports from)."""
    out = other_user.run(tenants, ATTEMPT + """
x = runtime.to_device(np.arange(1024, dtype=np.float32))
print(json.dumps([os.getresuid(), os.getresgid(), os.getgroups(), runtime.__file__,
                  float(x.copy_to_host().sum()), attempt(lambda: os.listdir("/root"))]))
""")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    uids, gids, groups, where, total, root_dir = json.loads(out.stdout)
    assert (uids, gids, groups, total, root_dir) == ([NOBODY] * 3, [NOBODY] * 3, [],
                                                      float(sum(range(1024))), "EACCES")
    assert where.startswith(str(other_user.path))


def test_another_user_meets_an_exclusive_device_a_forged_export_and_roots_attributes(
        tenants, other_user):
    """Against root's process holding device 1 exclusively and an export on device 0: the
    other user's context on device 1 is EBUSY (device 0, shared, works), an import of the
    export with a guessed token EACCES, an exclusive context on device 0 EBUSY (root's
    bystander has it open); ``processes`` shows its own process only, ``exclusive_owner``
    reads "another user"; writing ``reset`` and reading debugfs are EACCES. Device 0
    counted the import and the reset as isolation refusals. Root's export is intact
    after."""
    d = tenants
    holder = d.popen_py(HOLDER)
    try:
        pid, handle = holder.stdout.readline().split()
        out = other_user.run(d, ATTEMPT + """
import dataclasses, pickle
h = pickle.loads(bytes.fromhex(sys.argv[1]))
forged = dataclasses.replace(h, token=h.token ^ 1)
x = runtime.empty(1 << 20, np.uint8, device=0)
rows = open(cls + "accel0/processes").read().splitlines()[1:]
print(json.dumps({
    "ctx1": attempt(lambda: runtime.new_context(1)),
    "import": attempt(lambda: runtime.open_ipc_handle(forged)),
    "exclusive0": attempt(lambda: runtime.new_context(0, exclusive=True)),
    "processes": [r.split()[0] for r in rows],
    "me": str(os.getpid()),
    "owner": open(cls + "accel1/exclusive_owner").read().strip(),
    "reset": attempt(lambda: open(cls + "accel0/reset", "w").write("1")),
    "debug": attempt(lambda: os.listdir(root + "/sys/kernel/debug/accel")),
}))
""", handle)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        got = json.loads(out.stdout)
        assert got == {
            "ctx1": "EBUSY", "import": "EACCES", "exclusive0": "EBUSY", "processes": [got["me"]],
            "me": got["me"], "owner": "another user", "reset": "EACCES", "debug": "EACCES"}, got
        assert [d.attr(0, f"isolation/{k}") for k in ("export", "privileged", "total")] == [
            "1", "1", "2"]
        assert pid in d.attr(0, "processes")  # root sees the holder
        holder.stdin.write("done\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "read back [7]"

    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0, holder.stderr.read()


def test_another_user_sees_only_device_wide_fault_records(make_daemon, other_user):
    """Root's kernel fault is root's: the other user's ``fault_log`` and its watcher on
    ``dev/accel-events/accel0`` (opened before the fault) show nothing of it (a read
    answers EAGAIN), while the device-wide record of a reset reaches both. (No bystander:
    the reset would take its context; the reset device has a new firmware.)"""
    d = make_daemon(tenants=True)
    before = snapshot(d)
    watcher = other_user.popen(d, ATTEMPT + """
fd = os.open(root + "/dev/accel-events/accel0", os.O_RDONLY | os.O_NONBLOCK)
print("watching", flush=True)
for line in sys.stdin:
    events = []
    while (got := attempt(lambda: events.append(os.read(fd, 65536)))) == "ok":
        pass
    text = b"".join(events).decode()
    log = open(cls + "accel0/fault_log").read()
    print(json.dumps([got, [json.loads(l)["code"] for l in text.splitlines() if l.strip()],
                      [json.loads(l)["code"] for l in log.splitlines() if l.strip()]]), flush=True)
""")
    try:
        assert watcher.stdout.readline().strip() == "watching", watcher.stderr.read()
        fault = d.run_py(KERNEL_FAULT_PRELUDE + "print(exc.record['code'])")
        assert fault.returncode == 0, fault.stderr
        assert [json.loads(line)["uid"] for line in d.attr(0, "fault_log").splitlines()] == [0]
        answers = []
        for act in (lambda: None, lambda: (d.root / "sys/class/accel/accel0/reset").write_text("1")):
            act()
            d.wait_state(0, "operational")
            watcher.stdin.write("read\n")
            watcher.stdin.flush()
            answers.append(json.loads(watcher.stdout.readline()))
        assert answers == [["EAGAIN", [], []], ["EAGAIN", [120], [120]]]
    finally:
        watcher.stdin.close()
        assert watcher.wait(timeout=60) == 0, watcher.stderr.read()
    assert_contained(d, before, reset=(0,))
