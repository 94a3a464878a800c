"""Device modules: the driver's checks before a module reaches the firmware.

The driver never runs user code and does not compile it; it checks what a real driver's
loader checks: size, format, the target instruction set, and that the device has what the
kernels need (shared memory within the per-block limit, atomics, barriers). Then it hands
a copy to the firmware, which validates the kernels' code itself before lowering it.
Module and kernel handles belong to their context: another context's handle is unknown.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from firmware import abi
from kmod_emul import uapi
from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.context import Context
    from kmod_emul.device import AccelDevice

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_KINDS = {"scalar", "buffer"}


@dataclass(eq=False)
class Module:
    id: int
    kernels: list[tuple[str, int, int]]  # (name, parameter count, static shared bytes)
    path: str  # the firmware's copy


def kernel_handle(module_id: int, index: int) -> int:
    return (module_id << 16) | index


def _invalid(message: str) -> DriverError:
    return DriverError(errno.EINVAL, f"module rejected: {message}")


def check_module(raw: bytes, dev: AccelDevice) -> list[tuple[str, int, int]]:
    """Validate a module's IR against this device; return its kernels' (name, params, shared)."""
    try:
        mod = json.loads(raw)
    except ValueError as exc:
        raise _invalid(f"not JSON ({exc})") from None
    if not isinstance(mod, dict) or mod.get("format") != 1:
        raise _invalid("unknown module format (expected format 1)")
    if (mod.get("isa"), mod.get("isa_version")) != (uapi.ACCEL_ISA, uapi.ACCEL_ISA_VERSION):
        raise DriverError(errno.ENOEXEC, f"module built for {mod.get('isa')} "
                                         f"{mod.get('isa_version')}; {dev.name} runs "
                                         f"{uapi.ACCEL_ISA} {uapi.ACCEL_ISA_VERSION}")
    kernels = mod.get("kernels")
    if not isinstance(kernels, dict) or not kernels or len(kernels) > 0xFFFF:
        raise _invalid("a module holds 1 to 65535 kernels")
    caps = set(dev.config["capabilities"])
    limit = dev.config["max_shared_mem_per_block"]
    out = []
    for name, k in kernels.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name) or not isinstance(k, dict):
            raise _invalid(f"bad kernel entry {name!r}")
        params = k.get("params")
        if not isinstance(params, list) or not all(_param_ok(p) for p in params):
            raise _invalid(f"kernel {name}: malformed parameters")
        if not isinstance(k.get("source"), str):
            raise _invalid(f"kernel {name}: no source")
        shared = k.get("shared_mem")
        if not isinstance(shared, int) or shared < 0:
            raise _invalid(f"kernel {name}: bad shared_mem")
        if shared > limit:
            raise _invalid(f"kernel {name} needs {shared} bytes of block-shared memory; "
                           f"{dev.name} has {limit} per block")
        for flag, cap in uapi.KERNEL_FLAG_CAPS:
            if k.get(flag) and cap not in caps:
                raise DriverError(errno.EOPNOTSUPP, f"kernel {name} needs {cap}; {dev.name} "
                                                    "lacks it")
        out.append((name, len(params), shared))
    return out


def _param_ok(p: Any) -> bool:
    return (isinstance(p, dict) and isinstance(p.get("name"), str) and p.get("kind") in _KINDS
            and (p.get("dtype") is None or p.get("dtype") in uapi.DTYPE_CODES))


def load(dev: AccelDevice, ctx: Context, src_handle: int, size: int) -> Module:
    """MODULE_LOAD: read the IR from one of the caller's pinned allocations, check it, load it."""
    if not 0 < size <= uapi.ACCEL_MODULE_MAX:
        raise DriverError(errno.EINVAL, f"module size {size} not in 1..{uapi.ACCEL_MODULE_MAX}")
    src = ctx.allocation(src_handle)
    if src.backing.kind != uapi.MemKind.HOST_PINNED or src.backing.size < size:
        raise DriverError(errno.EINVAL, "the module must lie in a host-pinned allocation of "
                                        "at least its size")
    with open(src.backing.path, "rb") as f:
        raw = f.read(size)
    kernels = check_module(raw, dev)
    module_id, token = dev.new_id(), secrets.randbits(64)
    path = os.path.join(dev.mem_config.shm_dir, uapi.module_name(module_id, token))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    mod = Module(module_id, kernels, path)
    ctx.modules[module_id] = mod
    ctx.files.append(path)
    dev.fw_send(abi.Op.MODULE_LOAD, ctx.id, (module_id, token))
    return mod


def unload(dev: AccelDevice, ctx: Context, module_id: int) -> None:
    mod = ctx.modules.pop(module_id, None)
    if mod is None:
        raise DriverError(errno.ENOENT, f"module {module_id} does not belong to context {ctx.id}")
    dev.fw_send(abi.Op.MODULE_UNLOAD, ctx.id, (module_id,))


def get_kernel(ctx: Context, module_id: int, name: str) -> tuple[int, int, int]:
    """(handle, parameter count, shared bytes) of ``name`` in the module."""
    mod = ctx.modules.get(module_id)
    if mod is None:
        raise DriverError(errno.ENOENT, f"module {module_id} does not belong to context {ctx.id}")
    for index, (kname, nparams, shared) in enumerate(mod.kernels):
        if kname == name:
            return kernel_handle(module_id, index), nparams, shared
    raise DriverError(errno.ENOENT, f"module {module_id} has no kernel {name!r}")
