"""Device modules: the driver's checks before a module reaches the firmware.

The driver never runs user code and does not compile it; it checks what a real driver's
loader checks: size, format, the target instruction set, and that the device has what the
kernels need (shared memory within the per-block limit, atomics, barriers). Then it hands
the image to the firmware, which validates the kernels' code itself before lowering it.
Module and kernel handles belong to their context: another context's handle is unknown.

The image is the process's memfd, sealed against writing (:mod:`kmod_emul.userfd`): what
the driver checked is what the firmware gets, and no copy lands in a shared directory.
Checking is JSON parsing, which holds the daemon's interpreter lock, so it runs on a worker
thread, one load at a time per device, and its cost is bounded by ``ACCEL_MODULE_MAX``.
Every value is type-checked before it is used: a malformed module is EINVAL, never a
driver error.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from abi import kernel_lang, mailbox, uapi
from kmod_emul import limits, userfd
from kmod_emul.errors import DriverError
from kmod_emul.isolation import foreign_or_unknown

if TYPE_CHECKING:
    from kmod_emul.context import Context
    from kmod_emul.device import AccelDevice

_KINDS = {"scalar", "buffer"}


@dataclass(eq=False)
class Module:
    id: int
    kernels: list[tuple[str, int, int]]  # (name, parameter count, static shared bytes)
    size: int  # bytes of the image, charged to the context

    def release(self) -> None:
        """Nothing to remove: the image lives in the process's memfd and the firmware's
        memory, and goes with them."""


def kernel_handle(module_id: int, index: int) -> int:
    return (module_id << 16) | index


def _invalid(message: str) -> DriverError:
    return DriverError(errno.EINVAL, f"module rejected: {message}")


def check_module(raw: bytes, caps: set[str], limit: int,
                 device_name: str) -> list[tuple[str, int, int]]:
    """Validate a module's IR for a device with capabilities ``caps`` and ``limit`` bytes
    of shared memory per block (``device_name`` for messages); return its kernels' (name,
    params, shared). Runs on a worker thread: it reads no device state."""
    try:
        mod = json.loads(raw)
    except (ValueError, RecursionError, MemoryError) as exc:  # Recursion: nesting too deep
        raise _invalid(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(mod, dict) or mod.get("format") != 1:
        raise _invalid("unknown module format (expected format 1)")
    if (mod.get("isa"), mod.get("isa_version")) != (kernel_lang.ISA, kernel_lang.ISA_VERSION):
        raise DriverError(errno.ENOEXEC, f"module built for {mod.get('isa')!r:.40} "
                                         f"{mod.get('isa_version')!r:.40}; {device_name} runs "
                                         f"{kernel_lang.ISA} {kernel_lang.ISA_VERSION}")
    kernels = mod.get("kernels")
    if not isinstance(kernels, dict) or not kernels or len(kernels) > 0xFFFF:
        raise _invalid("a module holds 1 to 65535 kernels")
    out = []
    for name, k in kernels.items():
        if (not isinstance(name, str) or not kernel_lang.KERNEL_NAME.fullmatch(name)
                or not isinstance(k, dict)):
            raise _invalid(f"bad kernel entry {name!r}")
        params = k.get("params")
        if not isinstance(params, list) or not all(_param_ok(p) for p in params):
            raise _invalid(f"kernel {name}: malformed parameters")
        source = k.get("source")
        if not isinstance(source, str) or len(source) > uapi.ACCEL_KERNEL_SOURCE_MAX:
            raise _invalid(f"kernel {name}: no source, or over {uapi.ACCEL_KERNEL_SOURCE_MAX} "
                           "characters")
        shared = k.get("shared_mem")
        if type(shared) is not int or shared < 0:
            raise _invalid(f"kernel {name}: bad shared_mem")
        if shared > limit:
            raise _invalid(f"kernel {name} needs {shared} bytes of block-shared memory; "
                           f"{device_name} has {limit} per block")
        for flag, cap in kernel_lang.KERNEL_FLAG_CAPS:
            if k.get(flag) and cap not in caps:
                raise DriverError(errno.EOPNOTSUPP, f"kernel {name} needs {cap}; {device_name} "
                                                    "lacks it")
        out.append((name, len(params), shared))
    return out


def _param_ok(p: Any) -> bool:
    if not isinstance(p, dict) or not isinstance(p.get("name"), str):
        return False
    kind, dtype = p.get("kind"), p.get("dtype")
    return (isinstance(kind, str) and kind in _KINDS
            and (dtype is None or (isinstance(dtype, str) and dtype in kernel_lang.DTYPE_CODES)))


def module_bytes(dev: AccelDevice, pid: int | None = None) -> int:
    """Bytes of the modules loaded on ``dev`` (by ``pid``, or by everyone): the firmware
    keeps each image, so they are bounded per context, per process and per device."""
    return sum(m.size for c in dev.tenants.live_contexts() if pid in (None, c.file.pid)
               for m in c.modules.values())


def _read_image(fd: int, size: int) -> bytes:
    raw = os.pread(fd, size, 0)
    if len(raw) != size:
        raise DriverError(errno.EINVAL, f"module image has {len(raw)} bytes, {size} named")
    return raw


async def load(dev: AccelDevice, ctx: Context, fd: int, size: int) -> Module:
    """MODULE_LOAD: import the process's sealed image, check it (off the event loop, one
    load at a time per device), hand it to the firmware."""
    if not 0 < size <= uapi.ACCEL_MODULE_MAX:
        raise DriverError(errno.EINVAL, f"module size {size} not in 1..{uapi.ACCEL_MODULE_MAX}")
    lim = dev.limits
    limits.check(len(ctx.modules), 1, lim.max_modules_per_context,
                 f"modules of context {ctx.id}", device_wide=False)
    limits.check(sum(m.size for m in ctx.modules.values()), size,
                 lim.max_module_bytes_per_context, f"module bytes of context {ctx.id}",
                 device_wide=False)
    limits.check(module_bytes(dev, ctx.file.pid), size, lim.max_module_bytes_per_process,
                 f"module bytes of process {ctx.file.pid} on {dev.name}", device_wide=False)
    limits.check(module_bytes(dev), size, lim.max_module_bytes,
                 f"module bytes on {dev.name}", device_wide=True)
    mine = userfd.import_memfd(ctx.file.pid, fd, size, uapi.ACCEL_SEALS_IMMUTABLE, "module")
    try:
        caps = set(dev.config["capabilities"])
        shared_limit = dev.config["max_shared_mem_per_block"]
        async with dev.module_checks:
            raw = await trio.to_thread.run_sync(_read_image, mine, size)
            kernels = await trio.to_thread.run_sync(check_module, raw, caps, shared_limit,
                                                    dev.name)
        ctx.check_live()  # lost (reset, or destroyed by a release) while we checked
    except BaseException:
        os.close(mine)
        raise
    mod = Module(dev.new_id(), kernels, size)
    ctx.modules[mod.id] = mod
    dev.fw_send(ctx.id, mailbox.fw_module_load(module_id=mod.id, size=size), fds=[mine])
    return mod


def _not_held(ctx: Context, module_id: int) -> DriverError:
    return foreign_or_unknown(ctx.file, "module", module_id, ctx.file.device.contexts.values(),
                              f"module {module_id} does not belong to context {ctx.id}")


def unload(dev: AccelDevice, ctx: Context, module_id: int) -> None:
    mod = ctx.modules.pop(module_id, None)
    if mod is None:
        raise _not_held(ctx, module_id)
    mod.release()
    dev.fw_send(ctx.id, mailbox.fw_module_unload(module_id=module_id))


def get_kernel(ctx: Context, module_id: int, name: str) -> tuple[int, int, int]:
    """(handle, parameter count, shared bytes) of ``name`` in the module."""
    mod = ctx.modules.get(module_id)
    if mod is None:
        raise _not_held(ctx, module_id)
    for index, (kname, nparams, shared) in enumerate(mod.kernels):
        if kname == name:
            return kernel_handle(module_id, index), nparams, shared
    raise DriverError(errno.ENOENT, f"module {module_id} has no kernel {name!r}")
