"""The module commands on a real mount, each with its bad inputs: MODULE_LOAD,
MODULE_UNLOAD and KERNEL_GET. A module is the JSON IR the runtime's front end makes, in a
sealed immutable memfd of the caller's (docs/kernels.md); nothing here launches a kernel
(tests/runtime/test_kernel.py does, and tests/contain/test_module_corpus.py attacks)."""

from __future__ import annotations

import json

import pytest
from rawdev import assert_unharmed
from refusals import Bad, generic, refuse

from abi import uapi
from runtime.kernels import compile_module

FILL = compile_module('def fill(out: "float32", v: "float32"):\n    out[0] = v\n')


def _load(env, doc=FILL, size=None, fd=None, **kw):
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    if fd is None:
        fd = env.memfd(len(raw), data=raw)
    return uapi.accel_module_load(ctx_id=env.ctx, fd=fd, size=len(raw) if size is None else size,
                                  **kw)


def _loaded(env) -> int:
    return env.dev.call(uapi.ACCEL_CMD_MODULE_LOAD, _load(env)).module_id


FILL_RAW = json.dumps(FILL).encode()

MODULE_LOAD_BAD = [
    *generic(uapi.ACCEL_CMD_MODULE_LOAD, _load),
    Bad("size-0", "EINVAL", lambda env: _load(env, size=0)),
    Bad("size-over-max", "EINVAL", lambda env: _load(env, size=uapi.ACCEL_MODULE_MAX + 1)),
    Bad("size-past-the-image", "EINVAL", lambda env: _load(env, size=len(FILL_RAW) + 1)),
    Bad("fd-unknown", "EBADF", lambda env: _load(env, fd=9999)),
    Bad("writable", "EMEDIUMTYPE", lambda env: _load(env, fd=env.memfd(len(FILL_RAW)))),
    Bad("a-pipe", "EMEDIUMTYPE", lambda env: _load(env, fd=env.pipe()[0])),
    Bad("not-json", "EINVAL", lambda env: _load(env, doc=b"{not json")),
    Bad("format-2", "EINVAL", lambda env: _load(env, doc={**FILL, "format": 2})),
    Bad("other-isa", "ENOEXEC", lambda env: _load(env, doc={**FILL, "isa": "other-isa"})),
    Bad("no-kernels", "EINVAL", lambda env: _load(env, doc={**FILL, "kernels": {}})),
    Bad("shared-over-the-limit", "EINVAL", lambda env: _load(env, doc={**FILL, "kernels": {
        "fill": {**FILL["kernels"]["fill"], "shared_mem": 1 << 30}}})),
]


@pytest.mark.command("ACCEL_CMD_MODULE_LOAD")
@pytest.mark.parametrize("bad", MODULE_LOAD_BAD, ids=str)
def test_module_load_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_MODULE_LOAD, bad)
    mod = env.dev.call(uapi.ACCEL_CMD_MODULE_LOAD, _load(env))
    assert mod.kernel_count == 1 and mod.module_id
    assert_unharmed(env.dev, env.bystander)


def _unload(env, module_id=None):
    return uapi.accel_module_unload(ctx_id=env.ctx,
                                    module_id=_loaded(env) if module_id is None else module_id)


def _unloaded(env) -> uapi.accel_module_unload:
    arg = _unload(env)
    env.dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD, arg)
    return arg


def _bystander_module(env) -> int:
    other, other_ctx = env.bystander
    raw = FILL_RAW
    return other.call(uapi.ACCEL_CMD_MODULE_LOAD, uapi.accel_module_load(
        ctx_id=other_ctx, fd=env.memfd(len(raw), data=raw), size=len(raw))).module_id


MODULE_UNLOAD_BAD = [
    *generic(uapi.ACCEL_CMD_MODULE_UNLOAD, _unload),
    Bad("unknown-module", "ENOENT", lambda env: _unload(env, module_id=1)),
    Bad("unloaded-twice", "ENOENT", _unloaded),
    Bad("bystander-module", "EPERM", lambda env: _unload(env, _bystander_module(env))),
]


@pytest.mark.command("ACCEL_CMD_MODULE_UNLOAD")
@pytest.mark.parametrize("bad", MODULE_UNLOAD_BAD, ids=str)
def test_module_unload_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_MODULE_UNLOAD, bad)
    env.dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD, _unload(env))
    assert_unharmed(env.dev, env.bystander)


def _get(env, name=b"fill", module_id=None):
    return uapi.accel_kernel_get(ctx_id=env.ctx, name=name,
                                 module_id=_loaded(env) if module_id is None else module_id)


KERNEL_GET_BAD = [
    *generic(uapi.ACCEL_CMD_KERNEL_GET, _get),
    Bad("unknown-name", "ENOENT", lambda env: _get(env, name=b"nope")),
    Bad("empty-name", "ENOENT", lambda env: _get(env, name=b"")),
    Bad("name-not-utf8", "EINVAL", lambda env: _get(env, name=b"\xff\xfe")),
    Bad("unknown-module", "ENOENT", lambda env: _get(env, module_id=1)),
    Bad("unloaded-module", "ENOENT", lambda env: _get(env, module_id=_unloaded(env).module_id)),
    Bad("bystander-module", "EPERM", lambda env: _get(env, module_id=_bystander_module(env))),
]


@pytest.mark.command("ACCEL_CMD_KERNEL_GET")
@pytest.mark.parametrize("bad", KERNEL_GET_BAD, ids=str)
def test_kernel_get_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_KERNEL_GET, bad)
    k = env.dev.call(uapi.ACCEL_CMD_KERNEL_GET, _get(env))
    assert (k.param_count, k.shared_mem) == (2, 0) and k.handle
    assert_unharmed(env.dev, env.bystander)
