"""Contexts on a real mount: their lifecycle, several in one process, the debugfs table, and
the bad inputs of CTX_CREATE and CTX_DESTROY."""

from __future__ import annotations

import os

import pytest
from rawdev import RawDev, assert_unharmed, errname
from refusals import Bad, generic, refuse

from abi import uapi, userq


def test_context_lifecycle_and_noop(daemon, dev):
    before = int(daemon.attr(0, "contexts"))
    ctx = dev.ctx_create()
    assert int(daemon.attr(0, "contexts")) == before + 1
    seqnos = [dev.noop(ctx) for _ in range(10)]
    assert seqnos == list(range(1, 11))
    done = dev.wait_done(ctx, 10)
    assert done.completed == 10 and done.timestamp_ns > 0
    dev.call(uapi.ACCEL_CMD_CTX_DESTROY, uapi.accel_ctx_destroy(ctx_id=ctx))
    assert int(daemon.attr(0, "contexts")) == before
    assert errname(lambda: dev.noop(ctx)) == "EBADFD"
    assert dev.ctx_create() > ctx  # the open file may create a new one; ids never reuse


def test_several_contexts_in_one_process(daemon):
    with RawDev(daemon.node(0)) as a, RawDev(daemon.node(0)) as b:
        ca, cb = a.ctx_create(), b.ctx_create()
        assert ca != cb
        assert a.noop(ca) == 1 and a.noop(ca) == 2
        assert b.noop(cb) == 1  # timelines are per context
        assert a.wait_done(ca, 2).completed == 2 and b.wait_done(cb, 1).completed == 1


def test_debugfs_contexts_lists_live_contexts(daemon, dev):
    """Regression: rendering this table once crashed the daemon (a field had moved)."""
    ctx = dev.ctx_create()
    rows = daemon.debug(0, "contexts").read_text().splitlines()
    assert rows[0].split() == ["id", "pid", "uid", "exclusive", "queues", "allocations", "state"]
    mine = [r.split() for r in rows[1:] if r.split()[0] == str(ctx)]
    assert mine == [[str(ctx), str(os.getpid()), str(os.getuid()), "0", "1", "0", "live"]]
    assert dev.query().state == uapi.DeviceState.OPERATIONAL  # and the daemon still serves


def _create(env):
    return env.ctx_arg()


def _second(env):
    env.ctx  # this file holds a context already: one open, one context
    return env.ctx_arg()


CTX_CREATE_BAD = [
    *generic(uapi.ACCEL_CMD_CTX_CREATE, _create, context=False),
    Bad("flags-0x80", "EINVAL", lambda env: env.ctx_arg(flags=0x80)),
    Bad("abi-major", "EPROTO", lambda env: env.ctx_arg(abi_major=uapi.ACCEL_ABI_MAJOR + 1)),
    Bad("abi-minor", "EPROTO", lambda env: env.ctx_arg(abi_minor=uapi.ACCEL_ABI_MINOR + 1)),
    Bad("second-context", "EEXIST", _second),
    Bad("doorbell-fd", "EBADF", lambda env: env.ctx_arg(doorbell_fd=9999)),
    Bad("event-fd", "EBADF", lambda env: env.ctx_arg(event_fd=-1)),
    Bad("doorbell-not-a-pipe", "EMEDIUMTYPE", lambda env: env.ctx_arg(
        doorbell_fd=env.memfd(userq.ACCEL_DB_PAGE_SIZE))),
    Bad("event-not-a-pipe", "EMEDIUMTYPE", lambda env: env.ctx_arg(event_fd=env.memfd(4096))),
    Bad("page-not-a-memfd", "EMEDIUMTYPE", lambda env: env.ctx_arg(db_page_fd=env.pipe()[0])),
    Bad("page-unsealed", "EMEDIUMTYPE", lambda env: env.ctx_arg(
        db_page_fd=env.memfd(userq.ACCEL_DB_PAGE_SIZE, seals=None))),
    Bad("page-small", "EINVAL", lambda env: env.ctx_arg(db_page_fd=env.memfd(64))),
    # each pipe's other end: it would work by accident here (the driver reopens the end
    # it needs) and fail with any other driver, so it is refused
    Bad("doorbell-write-end", "EINVAL", lambda env: env.ctx_arg(doorbell_fd=env.pipe()[1])),
    Bad("event-read-end", "EINVAL", lambda env: env.ctx_arg(event_fd=env.pipe()[0])),
]


@pytest.mark.command("ACCEL_CMD_CTX_CREATE")
@pytest.mark.parametrize("bad", CTX_CREATE_BAD, ids=str)
def test_ctx_create_bad_inputs(env, bad):
    before = env.daemon.attr(0, "contexts")
    refuse(env, uapi.ACCEL_CMD_CTX_CREATE, bad)
    if bad.name != "second-context":
        assert env.daemon.attr(0, "contexts") == before  # the refusal made no context
    ctx = env.ctx  # the file still makes one (or kept the one it had)
    seqno = env.dev.noop(ctx)
    assert env.dev.wait_done(ctx, seqno).completed == seqno
    assert_unharmed(env.dev, env.bystander)


def _destroy(env):
    return uapi.accel_ctx_destroy(ctx_id=env.ctx)


CTX_DESTROY_BAD = [
    *generic(uapi.ACCEL_CMD_CTX_DESTROY, _destroy, context=False),
    # CTX_DESTROY names the context to go: naming another file's is EPERM (counted),
    # whether this file holds one or not (not EBADFD), and one nobody holds ENOENT
    Bad("no-context", "EPERM", lambda env: uapi.accel_ctx_destroy(ctx_id=env.other_ctx),
        no_context=True),
    Bad("bystander-context", "EPERM", lambda env: uapi.accel_ctx_destroy(ctx_id=env.other_ctx)),
    Bad("unknown-context", "ENOENT", lambda env: uapi.accel_ctx_destroy(ctx_id=env.ctx + 1_000_000)),
]


@pytest.mark.command("ACCEL_CMD_CTX_DESTROY")
@pytest.mark.parametrize("bad", CTX_DESTROY_BAD, ids=str)
def test_ctx_destroy_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_CTX_DESTROY, bad)
    other, other_ctx = env.bystander
    assert other.noop(other_ctx) >= 1  # the bystander's context is still there
    env.dev.call(uapi.ACCEL_CMD_CTX_DESTROY, uapi.accel_ctx_destroy(ctx_id=env.ctx))
    assert errname(lambda: env.dev.noop(env.ctx)) == "EBADFD"
    assert_unharmed(env.dev, env.bystander)
