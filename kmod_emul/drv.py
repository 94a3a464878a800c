"""The command table and the transaction parser: the driver's ``drm_ioctl``.

``execute`` takes one write to a device node, validates it without trusting any byte
(header, command number, size, reserved fields, flags, handles), runs the handler and
stores the reply under the caller's tag. Each handler is a small function over the
caller's ``OpenFile``; the table pairs commands (from :mod:`kmod_emul.uapi`) with them.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kmod_emul import uapi
from kmod_emul.context import OpenFile
from kmod_emul.device import DRIVER_VERSION
from kmod_emul.errors import DriverError

_HDR = ctypes.sizeof(uapi.accel_cmd_hdr)


@dataclass(frozen=True)
class DriverInfo:
    """Daemon-wide facts the handlers report (``--driver-abi`` can emulate version skew)."""

    abi_major: int = uapi.ACCEL_ABI_MAJOR
    abi_minor: int = uapi.ACCEL_ABI_MINOR
    version: str = DRIVER_VERSION


Handler = Callable[[DriverInfo, OpenFile, Any], Awaitable[Any]]


def _no_flags(arg: Any, mask: int = 0) -> None:
    if arg.flags & ~mask:
        raise DriverError(errno.EINVAL, f"unknown flags {arg.flags & ~mask:#x}")


async def get_version(info: DriverInfo, f: OpenFile, arg: uapi.accel_version) -> Any:
    arg.abi_major, arg.abi_minor = info.abi_major, info.abi_minor
    arg.driver_version = info.version.encode()
    return arg


async def device_query(info: DriverInfo, f: OpenFile, arg: uapi.accel_device_info) -> Any:
    return f.device.describe()


async def ctx_create(info: DriverInfo, f: OpenFile, arg: uapi.accel_ctx_create) -> Any:
    _no_flags(arg, uapi.ACCEL_CTX_FLAGS_MASK)
    if arg.abi_major != info.abi_major or arg.abi_minor > info.abi_minor:
        raise DriverError(
            errno.EPROTO,
            f"runtime speaks ABI {arg.abi_major}.{arg.abi_minor}, driver {info.abi_major}."
            f"{info.abi_minor}",
        )
    if f.ctx is not None:
        raise DriverError(errno.EEXIST, f"this open file already holds context {f.ctx.id}")
    ctx = f.device.create_context(f, bool(arg.flags & uapi.ACCEL_CTX_EXCLUSIVE))
    arg.ctx_id = ctx.id
    return arg


async def ctx_destroy(info: DriverInfo, f: OpenFile, arg: uapi.accel_ctx_destroy) -> None:
    _no_flags(arg)
    if f.ctx is None or f.ctx.id != arg.ctx_id:
        raise DriverError(errno.ENOENT, f"context {arg.ctx_id} does not belong to this open file")
    f.device.destroy_context(f.ctx)


async def submit_noop(info: DriverInfo, f: OpenFile, arg: uapi.accel_submit_noop) -> Any:
    _no_flags(arg)
    ctx = f.context(arg.ctx_id)
    f.device.check_usable()
    arg.seqno = await f.device.submit_noop(ctx)
    return arg


async def wait(info: DriverInfo, f: OpenFile, arg: uapi.accel_wait) -> Any:
    _no_flags(arg)
    ctx = f.context(arg.ctx_id)
    if arg.seqno > ctx.submitted:
        raise DriverError(
            errno.EINVAL, f"seqno {arg.seqno} was never submitted (last is {ctx.submitted})"
        )
    timeout_ns = min(arg.timeout_ns, uapi.ACCEL_WAIT_SLICE_NS)
    done = await ctx.wait(arg.seqno, timeout_ns / 1e9)
    if ctx.error is not None and ctx.error[0] <= arg.seqno:
        seqno, err = ctx.error
        raise DriverError(err, f"submission {seqno} failed in the firmware")
    if not done:
        raise DriverError(errno.ETIME, f"seqno {arg.seqno} not complete")
    arg.completed = ctx.completed
    arg.timestamp_ns = ctx.completed_ts
    return arg


TABLE: dict[int, Handler] = {
    uapi.ACCEL_CMD_GET_VERSION.code: get_version,
    uapi.ACCEL_CMD_DEVICE_QUERY.code: device_query,
    uapi.ACCEL_CMD_CTX_CREATE.code: ctx_create,
    uapi.ACCEL_CMD_CTX_DESTROY.code: ctx_destroy,
    uapi.ACCEL_CMD_SUBMIT_NOOP.code: submit_noop,
    uapi.ACCEL_CMD_WAIT.code: wait,
}
assert TABLE.keys() == uapi.COMMANDS.keys(), "every uAPI command needs a handler"


def _decode(raw: bytes) -> tuple[uapi.Command, int, Any]:
    if len(raw) < _HDR:
        raise DriverError(errno.EINVAL, f"short write: {len(raw)} bytes, header is {_HDR}")
    hdr = uapi.accel_cmd_hdr.from_buffer_copy(raw)
    cmd = uapi.COMMANDS.get(hdr.cmd)
    if cmd is None:
        known = uapi.COMMANDS_BY_NR.get(uapi.ioc_nr(hdr.cmd))
        if known is not None and uapi.ioc_type(hdr.cmd) == uapi.ACCEL_IOCTL_BASE:
            raise DriverError(
                errno.EINVAL,
                f"{known.name} with size {uapi.ioc_size(hdr.cmd)} / direction "
                f"{uapi.ioc_dir(hdr.cmd)}; this driver's is size {ctypes.sizeof(known.struct)}",
            )
        raise DriverError(errno.ENOTTY, f"unknown command {hdr.cmd:#010x}")
    if hdr.flags:
        raise DriverError(errno.EINVAL, f"header flags {hdr.flags:#x} must be 0")
    if hdr.tag >= uapi.ACCEL_TAG_LIMIT:
        raise DriverError(errno.EINVAL, f"tag {hdr.tag:#x} not below {uapi.ACCEL_TAG_LIMIT:#x}")
    want = _HDR + ctypes.sizeof(cmd.struct)
    if len(raw) != want:
        raise DriverError(errno.EINVAL, f"{cmd.name}: {len(raw)} bytes written, expected {want}")
    if not cmd.struct.reserved_clear(raw, _HDR):
        raise DriverError(errno.EINVAL, f"{cmd.name}: reserved or padding fields must be 0")
    return cmd, hdr.tag, cmd.struct.from_buffer_copy(raw, _HDR)


async def execute(info: DriverInfo, f: OpenFile, raw: bytes) -> None:
    """Run one command transaction; store its reply under its tag. Raises DriverError."""
    cmd, tag, arg = _decode(raw)
    if cmd.has_reply:
        if tag in f.replies:
            raise DriverError(errno.EEXIST, f"the reply for tag {tag} is still unread")
        if len(f.replies) >= uapi.ACCEL_MAX_PENDING_REPLIES:
            raise DriverError(errno.EBUSY, f"{len(f.replies)} replies unread; read them first")
    out = await TABLE[cmd.code](info, f, arg)
    if cmd.has_reply:
        f.replies[tag] = bytes(out)


def take_reply(f: OpenFile, tag: int, size: int) -> bytes:
    """The reply stored under ``tag`` (a read at offset ``tag``), removed once read whole."""
    reply = f.replies.get(tag)
    if reply is None:
        raise DriverError(errno.ENOMSG, f"no reply pending for tag {tag}")
    if size < len(reply):
        raise DriverError(errno.EINVAL, f"read of {size} bytes; the reply has {len(reply)}")
    del f.replies[tag]
    return reply
