"""SUBMIT_NOOP and WAIT on a real mount: the context's default queue, and their bad inputs."""

from __future__ import annotations

import pytest
from rawdev import assert_unharmed
from refusals import Bad, generic, refuse

from abi import uapi


def _noop(env):
    return uapi.accel_submit_noop(ctx_id=env.ctx)


SUBMIT_NOOP_BAD = [
    *generic(uapi.ACCEL_CMD_SUBMIT_NOOP, _noop),
    Bad("flags-4", "EINVAL", lambda env: uapi.accel_submit_noop(ctx_id=env.ctx, flags=4)),
    Bad("pad-1", "EINVAL", lambda env: uapi.accel_submit_noop(ctx_id=env.ctx, pad=1)),
]


@pytest.mark.command("ACCEL_CMD_SUBMIT_NOOP")
@pytest.mark.parametrize("bad", SUBMIT_NOOP_BAD, ids=str)
def test_submit_noop_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_SUBMIT_NOOP, bad)
    assert env.dev.noop(env.ctx) == 1  # the refused submission consumed no seqno
    assert env.dev.wait_done(env.ctx, 1).completed == 1
    assert_unharmed(env.dev, env.bystander)


def _wait(env):
    return uapi.accel_wait(ctx_id=env.ctx, seqno=0)


WAIT_BAD = [
    *generic(uapi.ACCEL_CMD_WAIT, _wait),
    Bad("never-submitted", "EINVAL", lambda env: uapi.accel_wait(ctx_id=env.ctx, seqno=5)),
]


@pytest.mark.command("ACCEL_CMD_WAIT")
@pytest.mark.parametrize("bad", WAIT_BAD, ids=str)
def test_wait_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_WAIT, bad)
    seqno = env.dev.noop(env.ctx)
    done = env.dev.wait_done(env.ctx, seqno)
    assert done.completed == seqno and done.timestamp_ns > 0 and done.error_seqno == 0
    assert_unharmed(env.dev, env.bystander)
