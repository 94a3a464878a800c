"""The dump of a device-scope fault (``sys/class/accel/accelN/devcoredump/``, as Linux's
devcoredump): a firmware killed under a waiting client leaves one naming the fault, the
firmware's last words, the client's context and its queues as their rings had them; the
reset that recovers it does not replace it; only root reads it; a write clears it, and
the next device-scope fault is dumped again; a reset someone asked for is no fault and
is not dumped."""

from __future__ import annotations

import errno
import json
import os
import signal
import time

import pytest
from rawdev import RawDev, errname
from refusals import NOP, ring_done
from scenario import IDLE

from abi import uapi
from testkit.tenants import tenant_code
from testkit.waiting import wait_until
from testkit.waiting import wait_until

LAST_WORDS = "firmware: last words before the kill"

READ_AS_ANOTHER_USER = """
for name in ("state", "devcoredump/data", "devcoredump/time"):
    try:
        open({cls!r} + "/" + name).read()
        print(name, "read")
    except OSError as exc:
        print(name, errno.errorcode[exc.errno])
"""


def _dump_dir(d):
    return d.root / uapi.CLASS_DIR / "accel0" / "devcoredump"


def _dump(d) -> dict:
    return json.loads((_dump_dir(d) / "data").read_text())


def _held(d) -> tuple[str, str]:
    return ((_dump_dir(d) / "data").read_text(), (_dump_dir(d) / "time").read_text())


def _wait_in_log(d, text: str, timeout: float = 10.0) -> None:
    """Wait until the daemon's log has ``text`` (the driver keeps a line of the firmware's
    log in its tail before it copies it there)."""
    log = d.state_dir / "accel-emud.log"
    wait_until(lambda: text in log.read_text(errors="replace"), timeout,
               f"{text!r} in {log}")


@pytest.mark.timeout(120)
def test_a_firmware_killed_under_a_waiting_client_is_dumped_for_root(make_daemon, other_user):
    d = make_daemon(devices=1, tenants=True)
    assert _held(d) == ("\n", "\n")  # none yet
    with RawDev(d.node(0)) as client:
        ctx = client.ctx_create()
        ran = client.queue_create(ctx, uapi.ACCEL_QUEUE_PRIORITY_HIGH)
        ring_done(client, ran, client.submit(ran, [NOP] * 3))
        d.debug(0, "sched_hold").write_text("1")  # what comes next stays queued
        queued = client.queue_create(ctx)
        client.submit(queued, [NOP] * 5)
        seqno = client.noop(ctx)
        assert errname(lambda: client.wait(ctx, seqno)) == "ETIME"  # waiting, armed
        fw = int(d.debug(0, "fw_pid").read_text())
        with open(f"/proc/{fw}/fd/2", "w") as fw_log:  # a line of the firmware's own log
            fw_log.write(LAST_WORDS + "\n")
        _wait_in_log(d, LAST_WORDS)
        before = time.time()
        os.kill(fw, signal.SIGKILL)
        client.sleep_event(5.0)  # the waiter is told at once
        assert errname(lambda: client.wait(ctx, seqno)) == "ENODEV"
        d.wait_attrs(0, {"state": "operational", "reset_count": "1"})  # recovery auto
        slots = {q: slot for q, (slot, _ring) in client.rings.items()}

    dump = _dump(d)
    assert (dump["fault"]["name"], dump["fault"]["contexts"]) == ("FIRMWARE_DIED", [ctx])
    # the recovery's reset came after, and is in the fault log, not in the dump
    assert json.loads(d.attr(0, "fault_log").splitlines()[-1])["name"] == "DEVICE_RESET"
    assert (dump["state"], dump["failure"]["errno"]) == ("failed", "ENODEV")
    assert dump["firmware"]["pid"] == fw and dump["firmware"]["exit_status"] == -signal.SIGKILL
    assert LAST_WORDS in dump["firmware"]["log_tail"]
    [mine] = [c for c in dump["contexts"] if c["id"] == ctx]
    assert mine["pid"] == os.getpid() and "firmware process exited" in mine["lost"]
    queues = {q["id"]: q for q in mine["queues"]}
    assert set(queues) == {0, ran, queued}
    assert (queues[0]["ring"]["wptr"], queues[0]["ring"]["completed"]) == (seqno, 0)
    for qid, priority, wptr, completed in [(ran, 1, 3, 3), (queued, 0, 5, 0)]:
        q = queues[qid]
        assert (q["priority"], q["doorbell"]) == (priority, slots[qid])
        assert (q["ring"]["wptr"], q["ring"]["completed"], q["ring"]["fault"]) == (
            wptr, completed, None)
    assert before - 1 < float(_held(d)[1]) < time.time() + 1

    # root's alone: another user reaches the device's attributes, not its dump
    cls = str(d.root / uapi.CLASS_DIR / "accel0")
    out = other_user.run(d, tenant_code(READ_AS_ANOTHER_USER.format(cls=cls)), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["state read", "devcoredump/data EACCES",
                                       "devcoredump/time EACCES"]
    (_dump_dir(d) / "data").write_text("clear")
    assert _held(d) == ("\n", "\n")
    d.wait_attrs(0, IDLE)


def _kill_firmware(d, resets: int) -> None:
    """A fault: the firmware dies; recovery auto resets the device (``resets`` in all)."""
    os.kill(int(d.debug(0, "fw_pid").read_text()), signal.SIGKILL)
    d.wait_attrs(0, {"state": "operational", "reset_count": str(resets)})


@pytest.mark.timeout(120)
def test_a_requested_reset_is_not_dumped_and_a_dump_is_held_until_cleared(make_daemon):
    """Resets someone asked for (an exclusive owner's DEVICE_RESET, root's sysfs ``reset``)
    are recorded with origin ``requested`` and not dumped, so a routine reset never takes
    the place a later firmware death's dump needs; a fault's dump is held until cleared."""
    d = make_daemon(devices=1)
    with RawDev(d.node(0)) as owner:
        ctx = owner.ctx_create(uapi.ACCEL_CTX_EXCLUSIVE)
        owner.call(uapi.ACCEL_CMD_DEVICE_RESET, uapi.accel_device_reset(ctx_id=ctx))
        d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
    (d.root / uapi.CLASS_DIR / "accel0" / "reset").write_text("1")
    d.wait_attrs(0, {"state": "operational", "reset_count": "2"})
    resets = [r for r in d.fault_log() if r["name"] == "DEVICE_RESET"]
    assert [r["origin"] for r in resets] == ["requested", "requested"]
    assert _held(d) == ("\n", "\n")  # neither was dumped
    _kill_firmware(d, 3)  # a real fault after routine resets is dumped
    first = _held(d)
    assert _dump(d)["fault"]["name"] == "FIRMWARE_DIED"
    assert _dump(d)["fault"]["origin"] is None
    _kill_firmware(d, 4)  # while one is held
    assert _held(d) == first  # the first of an incident stays until cleared
    with pytest.raises(OSError) as refused:  # the dump is no attribute to write a value to
        (_dump_dir(d) / "time").write_text("0")
    assert refused.value.errno == errno.EACCES
    (_dump_dir(d) / "data").write_text("1")
    assert _held(d) == ("\n", "\n")
    _kill_firmware(d, 5)
    assert _dump(d)["fault"]["name"] == "FIRMWARE_DIED" and _held(d) != first
    d.wait_attrs(0, IDLE)
