"""The queue commands on a real mount, each with its bad inputs: QUEUE_CREATE,
QUEUE_DESTROY and QUEUE_IMPORT. After a refusal a queue of the same context still runs."""

from __future__ import annotations

import pytest
from rawdev import RawDev, assert_unharmed
from refusals import NOP, Bad, generic, refuse, ring_done

from abi import uapi, userq


def _create(env, ring_fd=None, **kw):
    if ring_fd is None:
        ring_fd = env.memfd(userq.RING_FILE_SIZE)
    return uapi.accel_queue_create(ctx_id=env.ctx, ring_fd=ring_fd, **kw)


def _runs(env) -> None:
    """A new queue of the test's context takes and completes packets."""
    q = env.dev.queue_create(env.ctx)
    ring_done(env.dev, q, env.dev.submit(q, [NOP, NOP]))


QUEUE_CREATE_BAD = [
    *generic(uapi.ACCEL_CMD_QUEUE_CREATE, _create),
    Bad("priority-2", "EINVAL", lambda env: _create(env, priority=2)),
    Bad("ring-fd-unknown", "EBADF", lambda env: _create(env, ring_fd=9999)),
    Bad("ring-fd-minus-1", "EBADF", lambda env: _create(env, ring_fd=-1)),
    Bad("ring-small", "EINVAL", lambda env: _create(
        env, ring_fd=env.memfd(userq.RING_FILE_SIZE - 8))),
    Bad("ring-unsealed", "EMEDIUMTYPE", lambda env: _create(
        env, ring_fd=env.memfd(userq.RING_FILE_SIZE, seals=None))),
    Bad("ring-immutable", "EMEDIUMTYPE", lambda env: _create(
        env, ring_fd=env.memfd(userq.RING_FILE_SIZE, data=bytes(userq.RING_FILE_SIZE)))),
    Bad("ring-a-pipe", "EMEDIUMTYPE", lambda env: _create(env, ring_fd=env.pipe()[0])),
]


@pytest.mark.command("ACCEL_CMD_QUEUE_CREATE")
@pytest.mark.parametrize("bad", QUEUE_CREATE_BAD, ids=str)
def test_queue_create_bad_inputs(env, bad):
    before = env.daemon.attr(0, "queues")
    refuse(env, uapi.ACCEL_CMD_QUEUE_CREATE, bad)
    assert env.daemon.attr(0, "queues") == before  # the refusal made no queue
    _runs(env)
    assert_unharmed(env.dev, env.bystander)


def _destroy(env, queue_id=None):
    if queue_id is None:
        queue_id = env.dev.queue_create(env.ctx)
    return uapi.accel_queue_destroy(ctx_id=env.ctx, queue_id=queue_id)


def _destroyed(env) -> uapi.accel_queue_destroy:
    arg = _destroy(env)
    env.dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, arg)
    return arg


def _bystander_queue(env) -> int:
    other, other_ctx = env.bystander
    return other.queue_create(other_ctx)


QUEUE_DESTROY_BAD = [
    *generic(uapi.ACCEL_CMD_QUEUE_DESTROY, _destroy),
    Bad("default-queue", "EINVAL", lambda env: _destroy(env, queue_id=0)),
    Bad("unknown-queue", "ENOENT", lambda env: _destroy(env, queue_id=1)),
    Bad("destroyed-twice", "ENOENT", _destroyed),
    Bad("bystander-queue", "EPERM", lambda env: _destroy(env, _bystander_queue(env))),
]


@pytest.mark.command("ACCEL_CMD_QUEUE_DESTROY")
@pytest.mark.parametrize("bad", QUEUE_DESTROY_BAD, ids=str)
def test_queue_destroy_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_QUEUE_DESTROY, bad)
    env.dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, _destroy(env))
    _runs(env)
    assert_unharmed(env.dev, env.bystander)


def _peer_queue(env) -> int:
    """A queue of this process on device 1 (another open file, closed at the end)."""
    on1 = env.fresh(node=1)
    return on1.queue_create(on1.ctx_create())


def _import(env, index=1, peer_queue_id=None):
    if peer_queue_id is None:
        peer_queue_id = _peer_queue(env)
    return uapi.accel_queue_import(ctx_id=env.ctx, peer_index=index, peer_queue_id=peer_queue_id)


QUEUE_IMPORT_BAD = [
    *generic(uapi.ACCEL_CMD_QUEUE_IMPORT, _import),
    Bad("itself", "EINVAL", lambda env: _import(env, index=0,
                                               peer_queue_id=env.dev.queue_create(env.ctx))),
    Bad("no-such-device", "EINVAL", lambda env: _import(env, index=5)),
    Bad("unknown-peer-queue", "ENOENT", lambda env: _import(env, peer_queue_id=_peer_queue(env)
                                                            + 1_000_000)),
    Bad("peer-default-queue", "ENOENT", lambda env: _import(env, peer_queue_id=0)),
]


@pytest.mark.command("ACCEL_CMD_QUEUE_IMPORT")
@pytest.mark.parametrize("bad", QUEUE_IMPORT_BAD, ids=str)
def test_queue_import_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_QUEUE_IMPORT, bad)
    with RawDev(env.daemon.node(1)) as on1:
        c1 = on1.ctx_create()
        q1 = on1.queue_create(c1)
        ring_done(on1, q1, on1.submit(q1, [NOP]))
        local = env.dev.call(uapi.ACCEL_CMD_QUEUE_IMPORT, _import(env, peer_queue_id=q1)).queue_id
        # a WAIT_QUEUE packet of this context may name it: it waits for device 1's fence
        q = env.dev.queue_create(env.ctx)
        wait = userq.WaitQueue(local, 1).encode()
        ring_done(env.dev, q, env.dev.submit(q, [wait, NOP]))
    assert_unharmed(env.dev, env.bystander)
