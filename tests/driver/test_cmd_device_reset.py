"""DEVICE_RESET on a real mount: every refusal with its exact errno on the shared daemon
(nothing reset, nothing harmed), then the exclusive owner's reset on a private daemon: the
owner's in-flight work and every context of its process are lost and told, the reset is
counted and names the pid, and the other device and its tenant never notice."""

from __future__ import annotations

import errno
import json
import os

import pytest
from rawdev import RawDev, assert_unharmed, errname
from refusals import Bad, generic, refuse
from scenario import IDLE

from abi import uapi, userq
from testkit.bystander import Bystander


def _reset(env):
    return uapi.accel_device_reset(ctx_id=env.ctx)


DEVICE_RESET_BAD = [
    *generic(uapi.ACCEL_CMD_DEVICE_RESET, _reset),
    # the shared daemon's contexts are not exclusive: the test's own, and the bystander's
    Bad("not-exclusive", "EPERM", _reset),
]


@pytest.mark.command("ACCEL_CMD_DEVICE_RESET")
@pytest.mark.parametrize("bad", DEVICE_RESET_BAD, ids=str)
def test_device_reset_bad_inputs(env, bad):
    before = env.daemon.attr(0, "reset_count")
    refuse(env, uapi.ACCEL_CMD_DEVICE_RESET, bad)
    assert env.daemon.attr(0, "reset_count") == before  # no refusal reset anything
    assert env.dev.noop(env.ctx) == 1  # the caller's context lives on
    assert_unharmed(env.dev, env.bystander)


def _reset_of(dev: RawDev, ctx: int) -> None:
    dev.call(uapi.ACCEL_CMD_DEVICE_RESET, uapi.accel_device_reset(ctx_id=ctx))


OPEN_IN_ANOTHER_PROCESS = """
import errno, os
try:
    os.close(os.open({node!r}, os.O_RDWR))
    print("opened")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


@pytest.mark.timeout(120)
def test_the_exclusive_owner_resets_its_device_and_nothing_else(make_daemon):
    d = make_daemon(devices=2)
    node = str(d.node(0))

    def other_process_opens() -> str:
        out = d.run_py(OPEN_IN_ANOTHER_PROCESS.format(node=node))
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    with Bystander(d, 1, alone=True) as other_tenant, RawDev(d.node(0)) as owner, \
            RawDev(d.node(0)) as mine:
        ctx = owner.ctx_create(uapi.ACCEL_CTX_EXCLUSIVE)
        # why EPERM is the only refusal an owner's process can meet: while the exclusive
        # context lives, no other process can have the device open at all
        assert other_process_opens() == "EBUSY"
        plain = mine.ctx_create()  # the same process may add contexts, not exclusive ones
        assert errname(lambda: _reset_of(mine, plain)) == "EPERM"
        # work in flight on the owner: a no-op the held scheduler does not take, waited on
        d.debug(0, "sched_hold").write_text("1")
        seqno = owner.noop(ctx)
        assert errname(lambda: owner.wait(ctx, seqno)) == "ETIME"  # the interrupt is armed
        d.debug(0, "reset_hold").write_text("1")  # keep it in reset, to look at it there

        _reset_of(owner, ctx)
        assert d.attr(0, "state") == "in_reset"
        owner.sleep_event(5.0)  # told at once: a byte on the event pipe, the lost word
        assert owner.db.get(userq.DB_LOST) == errno.ENODEV
        assert errname(lambda: owner.wait(ctx, seqno)) == "ENODEV"
        assert errname(lambda: mine.noop(plain)) == "ENODEV"  # its process's other context
        assert errname(lambda: _reset_of(owner, ctx)) == "ENODEV"  # lost: no second reset
        assert other_process_opens() == "EAGAIN"  # not exclusive any more, but in reset

        d.debug(0, "reset_hold").write_text("0")
        d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
        reason = f"reset requested by pid {os.getpid()} (DEVICE_RESET)"
        assert d.attr(0, "reset_reason") == reason
        rec = json.loads(d.attr(0, "fault_log").splitlines()[-1])
        assert (rec["name"], rec["message"], sorted(rec["contexts"])) == (
            "DEVICE_RESET", reason, sorted([ctx, plain]))
        assert other_process_opens() == "opened"
        # the owner's open file makes a new context once it gives the lost one back
        owner.call(uapi.ACCEL_CMD_CTX_DESTROY, uapi.accel_ctx_destroy(ctx_id=ctx))
        fresh = owner.ctx_create()
        assert owner.wait_done(fresh, owner.noop(fresh)).completed == 1
        # the other device and its tenant never noticed
        assert d.attr(1, "reset_count") == "0"
        other_tenant.check()
    d.wait_attrs(0, IDLE)
