"""The memory commands on a real mount, each with its bad inputs: MEM_ALLOC, MEM_FREE,
MEM_EXPORT, MEM_IMPORT, MEM_INFO and PEER_ENABLE. Besides the usual checks (the command
still works, a bystander context keeps completing work), a refusal must have charged
nothing: this context holds no memory and this process pinned none."""

from __future__ import annotations

import pytest
from rawdev import RawDev, assert_unharmed
from refusals import Bad, generic, refuse

from abi import uapi

MiB = 1 << 20


def _info(env) -> uapi.accel_mem_info:
    return env.dev.call(uapi.ACCEL_CMD_MEM_INFO, uapi.accel_mem_info(ctx_id=env.ctx))


def _alloc(env, size=4096, kind=uapi.MemKind.DEVICE, fd=-1, **kw):
    return uapi.accel_mem_alloc(ctx_id=env.ctx, size=size, kind=kind, fd=fd, **kw)


MEM_ALLOC_BAD = [
    *generic(uapi.ACCEL_CMD_MEM_ALLOC, _alloc),
    Bad("size-0", "EINVAL", lambda env: _alloc(env, size=0)),
    Bad("size-over-2**44", "EINVAL", lambda env: _alloc(env, size=(1 << 44) + 1)),
    Bad("kind-9", "EINVAL", lambda env: _alloc(env, kind=9)),
    Bad("device-with-fd", "EINVAL", lambda env: _alloc(env, fd=env.memfd(4096))),
    Bad("more-than-the-device", "ENOMEM", lambda env: _alloc(env, size=512 * MiB)),
    Bad("host-fd-unknown", "EBADF", lambda env: _alloc(env, kind=uapi.MemKind.HOST_PINNED,
                                                     fd=9999)),
    Bad("host-fd-minus-1", "EBADF", lambda env: _alloc(env, kind=uapi.MemKind.HOST_PINNED)),
    Bad("host-pipe", "EMEDIUMTYPE", lambda env: _alloc(env, kind=uapi.MemKind.HOST_PINNED,
                                                     fd=env.pipe()[0])),
    Bad("host-unsealed", "EMEDIUMTYPE", lambda env: _alloc(
        env, kind=uapi.MemKind.HOST_PINNED, fd=env.memfd(4096, seals=None))),
    Bad("managed-unsealed", "EMEDIUMTYPE", lambda env: _alloc(
        env, kind=uapi.MemKind.MANAGED, fd=env.memfd(4096, seals=None))),
    Bad("host-immutable", "EMEDIUMTYPE", lambda env: _alloc(  # the device writes it
        env, kind=uapi.MemKind.HOST_PINNED, fd=env.memfd(4096, data=bytes(4096)))),
    Bad("host-smaller-than-size", "EINVAL", lambda env: _alloc(
        env, size=8192, kind=uapi.MemKind.HOST_PINNED, fd=env.memfd(4096))),
]


@pytest.mark.command("ACCEL_CMD_MEM_ALLOC")
@pytest.mark.parametrize("bad", MEM_ALLOC_BAD, ids=str)
def test_mem_alloc_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_MEM_ALLOC, bad)
    info = _info(env)
    assert (info.context_bytes, info.pinned_bytes) == (0, 0)  # the refusal charged nothing
    a = env.dev.mem_alloc(env.ctx, MiB)
    p = env.dev.mem_alloc(env.ctx, 4096, uapi.MemKind.HOST_PINNED)
    assert a.va >> uapi.ACCEL_VA_DEVICE_SHIFT == 1 and p.handle != a.handle
    info = _info(env)
    assert (info.context_bytes, info.pinned_bytes) == (MiB, 4096)
    assert_unharmed(env.dev, env.bystander)


def _bystander_alloc(env) -> int:
    other, other_ctx = env.bystander
    return other.mem_alloc(other_ctx, 4096).handle


def _freed(env) -> int:
    handle = env.dev.mem_alloc(env.ctx, 4096).handle
    env.dev.call(uapi.ACCEL_CMD_MEM_FREE, uapi.accel_mem_free(ctx_id=env.ctx, handle=handle))
    return handle


MEM_FREE_BAD = [
    *generic(uapi.ACCEL_CMD_MEM_FREE, lambda env: uapi.accel_mem_free(ctx_id=env.ctx)),
    Bad("unknown-handle", "ENOENT", lambda env: uapi.accel_mem_free(ctx_id=env.ctx, handle=1)),
    Bad("bystander-allocation", "EPERM", lambda env: uapi.accel_mem_free(
        ctx_id=env.ctx, handle=_bystander_alloc(env))),
    Bad("freed-twice", "ENOENT", lambda env: uapi.accel_mem_free(ctx_id=env.ctx,
                                                                handle=_freed(env))),
]


@pytest.mark.command("ACCEL_CMD_MEM_FREE")
@pytest.mark.parametrize("bad", MEM_FREE_BAD, ids=str)
def test_mem_free_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_MEM_FREE, bad)
    other, other_ctx = env.bystander
    for d, ctx in ((env.dev, env.ctx), (other, other_ctx)):  # each frees its own
        handle = d.mem_alloc(ctx, 4096).handle
        d.call(uapi.ACCEL_CMD_MEM_FREE, uapi.accel_mem_free(ctx_id=ctx, handle=handle))
    assert _info(env).context_bytes == 0
    assert_unharmed(env.dev, env.bystander)


def _export(env, handle=None):
    if handle is None:
        handle = env.dev.mem_alloc(env.ctx, 4096).handle
    return uapi.accel_mem_export(ctx_id=env.ctx, handle=handle)


MEM_EXPORT_BAD = [
    *generic(uapi.ACCEL_CMD_MEM_EXPORT, _export),
    Bad("unknown-handle", "ENOENT", lambda env: _export(env, handle=1)),
    Bad("bystander-allocation", "EPERM", lambda env: _export(env, _bystander_alloc(env))),
    Bad("host-memory", "EINVAL", lambda env: _export(env, env.dev.mem_alloc(
        env.ctx, 4096, uapi.MemKind.HOST_PINNED).handle)),
]


@pytest.mark.command("ACCEL_CMD_MEM_EXPORT")
@pytest.mark.parametrize("bad", MEM_EXPORT_BAD, ids=str)
def test_mem_export_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_MEM_EXPORT, bad)
    e = env.dev.call(uapi.ACCEL_CMD_MEM_EXPORT, _export(env))
    assert e.token and e.export_id
    assert_unharmed(env.dev, env.bystander)


def _bystander_export(env, free: bool = False) -> uapi.accel_mem_export:
    """The bystander's export of 1 MiB (freed again with ``free``)."""
    other, other_ctx = env.bystander
    handle = other.mem_alloc(other_ctx, MiB).handle
    e = other.call(uapi.ACCEL_CMD_MEM_EXPORT, uapi.accel_mem_export(ctx_id=other_ctx,
                                                                   handle=handle))
    if free:
        other.call(uapi.ACCEL_CMD_MEM_FREE, uapi.accel_mem_free(ctx_id=other_ctx, handle=handle))
    return e


def _import(env, e=None, **change):
    e = e or _bystander_export(env)
    arg = uapi.accel_mem_import(ctx_id=env.ctx, export_handle=e.export_id, token=e.token)
    for field, value in change.items():
        setattr(arg, field, value)
    return arg


MEM_IMPORT_BAD = [
    *generic(uapi.ACCEL_CMD_MEM_IMPORT, _import),
    Bad("wrong-token", "EACCES", lambda env: _import(env, token=_bystander_export(env).token ^ 1)),
    Bad("unknown-export", "ENOENT", lambda env: _import(env, export_handle=1, token=1)),
    Bad("not-exported", "ENOENT", lambda env: _import(  # an allocation handle, no export
        env, export_handle=_bystander_alloc(env), token=0)),
    Bad("freed-by-every-holder", "ENOENT", lambda env: _import(env, _bystander_export(
        env, free=True))),
]


@pytest.mark.command("ACCEL_CMD_MEM_IMPORT")
@pytest.mark.parametrize("bad", MEM_IMPORT_BAD, ids=str)
def test_mem_import_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_MEM_IMPORT, bad)
    assert _info(env).context_bytes == 0
    got = env.dev.call(uapi.ACCEL_CMD_MEM_IMPORT, _import(env))
    assert (got.size, got.kind) == (MiB, uapi.MemKind.DEVICE) and got.handle
    assert_unharmed(env.dev, env.bystander)


MEM_INFO_BAD = generic(uapi.ACCEL_CMD_MEM_INFO, lambda env: uapi.accel_mem_info(ctx_id=env.ctx))


@pytest.mark.command("ACCEL_CMD_MEM_INFO")
@pytest.mark.parametrize("bad", MEM_INFO_BAD, ids=str)
def test_mem_info_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_MEM_INFO, bad)
    info = _info(env)
    assert info.total == 256 * MiB and info.free <= info.total and info.context_bytes == 0
    assert_unharmed(env.dev, env.bystander)


def _peer(env, index=1, **kw):
    return uapi.accel_peer_enable(ctx_id=env.ctx, peer_index=index, **kw)


PEER_ENABLE_BAD = [
    *generic(uapi.ACCEL_CMD_PEER_ENABLE, _peer),
    Bad("itself", "EINVAL", lambda env: _peer(env, index=0)),
    Bad("no-such-device", "EINVAL", lambda env: _peer(env, index=7)),
    Bad("no-context-on-the-peer", "EPERM", _peer),
]


@pytest.mark.command("ACCEL_CMD_PEER_ENABLE")
@pytest.mark.parametrize("bad", PEER_ENABLE_BAD, ids=str)
def test_peer_enable_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_PEER_ENABLE, bad)
    with RawDev(env.daemon.node(1)) as on1:  # with a context of this process on device 1
        on1.ctx_create()
        env.dev.call(uapi.ACCEL_CMD_PEER_ENABLE, _peer(env))
        env.dev.call(uapi.ACCEL_CMD_PEER_ENABLE, _peer(env))  # again: nothing more to do
    assert_unharmed(env.dev, env.bystander)
