"""The command table and the transaction parser: the driver's ``drm_ioctl``.

``execute`` takes one write to a device node, validates it without trusting any byte
(header, command number, size, reserved fields, flags, handles), runs the handler and
stores the reply under the caller's tag. Each handler is a small function over the
caller's ``OpenFile``; the table pairs commands (from :mod:`abi.uapi`) with them.

No handler waits for the device: the kernel holds the device node's lock for every
tenant while a write runs (FUSE direct I/O), so a handler that slept would stall them all.
Waiting happens in the caller (docs/containment.md). So the handlers are plain functions
and ``execute`` runs a command to its stored reply without a coroutine (two coroutines per
command were a tenth of the driver's share of a DEVICE_QUERY round trip); the one
exception is MODULE_LOAD, whose checks of the module run in a thread
(:mod:`kmod_emul.modules`): its handler is a coroutine, which ``execute`` hands back for
the daemon to await.
"""

from __future__ import annotations

import ctypes
import errno
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from abi import faults, schedule, uapi
from kmod_emul import modules
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


#: a command's handler: its reply (a struct or its bytes), or None for a command without
#: one; MODULE_LOAD's is a coroutine function (see the module doc)
Handler = Callable[[DriverInfo, OpenFile, Any], Any]


def _no_flags(arg: Any, mask: int = 0) -> None:
    if arg.flags & ~mask:
        raise DriverError(errno.EINVAL, f"unknown flags {arg.flags & ~mask:#x}")


def get_version(info: DriverInfo, f: OpenFile, arg: uapi.accel_version) -> Any:
    arg.abi_major, arg.abi_minor = info.abi_major, info.abi_minor
    arg.driver_version = info.version.encode()
    return arg


def device_query(info: DriverInfo, f: OpenFile, arg: uapi.accel_device_info) -> Any:
    return f.device.describe()


def ctx_create(info: DriverInfo, f: OpenFile, arg: uapi.accel_ctx_create) -> Any:
    _no_flags(arg, uapi.ACCEL_CTX_FLAGS_MASK)
    if arg.abi_major != info.abi_major or arg.abi_minor > info.abi_minor:
        raise DriverError(
            errno.EPROTO,
            f"runtime speaks ABI {arg.abi_major}.{arg.abi_minor}, driver {info.abi_major}."
            f"{info.abi_minor}",
        )
    if f.ctx is not None:
        raise DriverError(errno.EEXIST, f"this open file already holds context {f.ctx.id}")
    diagnostic = bool(arg.flags & uapi.ACCEL_CTX_DIAGNOSTIC)
    if diagnostic and f.uid != 0:  # its faults leave the tenant counters: root's alone
        raise f.device.isolation.refuse(
            "privileged", f.pid, f.uid, "ACCEL_CTX_DIAGNOSTIC is root's (accel-diag): its "
            "faults are not counted as a tenant's")
    if arg.schedule & ~schedule.SCHED_FLAGS_MASK \
            or arg.schedule & schedule.SCHED_MODE_MASK not in set(schedule.Mode):
        raise DriverError(errno.EINVAL, f"unknown schedule {arg.schedule:#x}")
    ctx = f.device.tenants.create_context(f, bool(arg.flags & uapi.ACCEL_CTX_EXCLUSIVE),
                                          arg.doorbell_fd, arg.event_fd, arg.db_page_fd,
                                          diagnostic=diagnostic, schedule=arg.schedule,
                                          schedule_fd=arg.schedule_fd, seed=arg.seed)
    arg.ctx_id = ctx.id
    return arg


def ctx_destroy(info: DriverInfo, f: OpenFile, arg: uapi.accel_ctx_destroy) -> None:
    _no_flags(arg)
    if f.ctx is None or f.ctx.id != arg.ctx_id:
        raise f.foreign_context(arg.ctx_id)
    f.device.tenants.destroy_context(f.ctx)


def submit_noop(info: DriverInfo, f: OpenFile, arg: uapi.accel_submit_noop) -> Any:
    _no_flags(arg)
    ctx = f.context(arg.ctx_id)
    f.device.check_usable()
    arg.seqno = f.device.tenants.submit_noop(ctx)
    return arg


def wait(info: DriverInfo, f: OpenFile, arg: uapi.accel_wait) -> Any:
    """Never blocks (see the module doc): complete, or ETIME with the interrupt armed."""
    _no_flags(arg)
    q = f.context(arg.ctx_id).default_queue
    if arg.seqno > q.submitted:
        raise DriverError(
            errno.EINVAL, f"seqno {arg.seqno} was never submitted (last is {q.submitted})"
        )
    if q.completed < arg.seqno:
        q.arm(arg.seqno)
        if q.completed < arg.seqno:  # completed while arming: no event comes, answer now
            raise DriverError(errno.ETIME, f"seqno {arg.seqno} not complete yet")
    arg.completed = q.completed
    arg.timestamp_ns = q.timestamp(arg.seqno)
    fault = q.fault
    if fault is not None and fault[0] <= arg.seqno:
        arg.error_seqno, arg.error_code, arg.error_addr, arg.error_opcode = fault
    return arg


def mem_alloc(info: DriverInfo, f: OpenFile, arg: uapi.accel_mem_alloc) -> Any:
    _no_flags(arg)
    ctx = f.context(arg.ctx_id)
    f.device.check_usable()
    try:
        kind = uapi.MemKind(arg.kind)
    except ValueError:
        raise DriverError(errno.EINVAL, f"unknown memory kind {arg.kind}") from None
    alloc = f.device.memory.alloc(ctx, arg.size, kind, arg.fd)
    arg.handle, arg.va = alloc.handle, alloc.va
    return arg


def mem_free(info: DriverInfo, f: OpenFile, arg: uapi.accel_mem_free) -> None:
    """Drop the handle now; the bytes come back once the device is done with them (work
    queued before the free still uses them), with a byte on the process's event pipe.
    MEM_INFO's ``pending_free`` says how much is still on its way back, so an allocator
    that frees its cache and retries knows whether waiting can help."""
    ctx = f.context(arg.ctx_id)
    f.device.memory.free(ctx, ctx.allocation(arg.handle))


def mem_export(info: DriverInfo, f: OpenFile, arg: uapi.accel_mem_export) -> Any:
    ctx = f.context(arg.ctx_id)
    alloc = ctx.allocation(arg.handle)
    arg.token, arg.export_id = f.device.memory.export(alloc), alloc.backing.id
    return arg


def mem_import(info: DriverInfo, f: OpenFile, arg: uapi.accel_mem_import) -> Any:
    ctx = f.context(arg.ctx_id)
    f.device.check_usable()
    alloc = f.device.memory.import_(ctx, arg.export_handle, arg.token)
    arg.handle, arg.va, arg.size = alloc.handle, alloc.va, alloc.backing.size
    arg.kind = alloc.backing.kind
    return arg


def mem_info(info: DriverInfo, f: OpenFile, arg: uapi.accel_mem_info) -> Any:
    ctx = f.context(arg.ctx_id)
    mem = f.device.memory
    arg.free, arg.total = mem.free_bytes(), f.device.memory_total
    arg.context_bytes = mem.context_bytes(ctx)
    arg.process_bytes = mem.process_bytes(f.pid)
    arg.process_limit = mem.process_limit
    arg.managed_resident = f.device.fw_stat("managed_resident")
    arg.pending_free = mem.pending_free(f.pid)
    arg.pinned_bytes = mem.pinned_bytes(f.pid)
    return arg


def peer_enable(info: DriverInfo, f: OpenFile, arg: uapi.accel_peer_enable) -> None:
    _no_flags(arg)
    ctx = f.context(arg.ctx_id)
    f.device.tenants.enable_peer(ctx, arg.peer_index)


def queue_create(info: DriverInfo, f: OpenFile, arg: uapi.accel_queue_create) -> Any:
    _no_flags(arg)
    ctx = f.context(arg.ctx_id)
    f.device.check_usable()
    if arg.priority not in (uapi.ACCEL_QUEUE_PRIORITY_LOW, uapi.ACCEL_QUEUE_PRIORITY_HIGH):
        raise DriverError(errno.EINVAL, f"priority {arg.priority} is neither low (0) nor high (1)")
    q = f.device.tenants.create_queue(ctx, arg.priority, arg.ring_fd)
    arg.queue_id, arg.doorbell = q.id, q.slot
    return arg


def queue_destroy(info: DriverInfo, f: OpenFile, arg: uapi.accel_queue_destroy) -> None:
    ctx = f.context(arg.ctx_id)
    if arg.queue_id == 0:
        raise DriverError(errno.EINVAL, "the context's default queue lives as long as it does")
    f.device.tenants.destroy_queue(ctx, ctx.queue(arg.queue_id))


def queue_import(info: DriverInfo, f: OpenFile, arg: uapi.accel_queue_import) -> Any:
    ctx = f.context(arg.ctx_id)
    arg.queue_id = f.device.tenants.import_queue(ctx, arg.peer_index, arg.peer_queue_id).id
    return arg


async def module_load(info: DriverInfo, f: OpenFile, arg: uapi.accel_module_load) -> Any:
    _no_flags(arg)
    ctx = f.context(arg.ctx_id)
    f.device.check_usable()
    mod = await modules.load(f.device, ctx, arg.fd, arg.size)
    arg.module_id, arg.kernel_count = mod.id, len(mod.kernels)
    return arg


def module_unload(info: DriverInfo, f: OpenFile, arg: uapi.accel_module_unload) -> None:
    modules.unload(f.device, f.context(arg.ctx_id), arg.module_id)


def kernel_get(info: DriverInfo, f: OpenFile, arg: uapi.accel_kernel_get) -> Any:
    ctx = f.context(arg.ctx_id)
    try:
        name = arg.name.decode()
    except UnicodeDecodeError:
        raise DriverError(errno.EINVAL, "kernel name is not UTF-8") from None
    arg.handle, arg.param_count, arg.shared_mem = modules.get_kernel(ctx, arg.module_id, name)
    return arg


def device_reset(info: DriverInfo, f: OpenFile, arg: uapi.accel_device_reset) -> None:
    """Only the exclusive owner may reset: a reset destroys every context on the device,
    and while a context holds it exclusively no other process can have it open (open and
    CTX_CREATE answer EBUSY), so what is lost is the caller's own process's. That one
    check is therefore all that is needed: the refusal of a non-exclusive context (EPERM)
    comes before the device's state (EAGAIN in reset), since no retry would cure it."""
    _no_flags(arg)
    ctx = f.context(arg.ctx_id)
    if not ctx.exclusive:
        raise f.device.isolation.refuse(  # it would take the device from the others
            "privileged", f.pid, f.uid, f"context {ctx.id} does not hold {f.device.name} "
            "exclusively; only such a context may reset it (CTX_CREATE with "
            "ACCEL_CTX_EXCLUSIVE)")
    f.device.check_usable()
    f.device.resets.request(f"reset requested by pid {f.pid} (DEVICE_RESET)",
                            faults.ORIGIN_REQUESTED)


TABLE: dict[int, Handler] = {
    uapi.ACCEL_CMD_GET_VERSION.code: get_version,
    uapi.ACCEL_CMD_DEVICE_QUERY.code: device_query,
    uapi.ACCEL_CMD_CTX_CREATE.code: ctx_create,
    uapi.ACCEL_CMD_CTX_DESTROY.code: ctx_destroy,
    uapi.ACCEL_CMD_SUBMIT_NOOP.code: submit_noop,
    uapi.ACCEL_CMD_WAIT.code: wait,
    uapi.ACCEL_CMD_MEM_ALLOC.code: mem_alloc,
    uapi.ACCEL_CMD_MEM_FREE.code: mem_free,
    uapi.ACCEL_CMD_MEM_EXPORT.code: mem_export,
    uapi.ACCEL_CMD_MEM_IMPORT.code: mem_import,
    uapi.ACCEL_CMD_MEM_INFO.code: mem_info,
    uapi.ACCEL_CMD_PEER_ENABLE.code: peer_enable,
    uapi.ACCEL_CMD_QUEUE_CREATE.code: queue_create,
    uapi.ACCEL_CMD_QUEUE_DESTROY.code: queue_destroy,
    uapi.ACCEL_CMD_QUEUE_IMPORT.code: queue_import,
    uapi.ACCEL_CMD_MODULE_LOAD.code: module_load,
    uapi.ACCEL_CMD_MODULE_UNLOAD.code: module_unload,
    uapi.ACCEL_CMD_KERNEL_GET.code: kernel_get,
    uapi.ACCEL_CMD_DEVICE_RESET.code: device_reset,
}
assert TABLE.keys() == uapi.COMMANDS.keys(), "every uAPI command needs a handler"
#: the commands whose handler waits (a coroutine function): MODULE_LOAD's checks
_WAITING = frozenset(code for code, handler in TABLE.items()
                     if inspect.iscoroutinefunction(handler))

_unpack_hdr = uapi.CMD_HDR.unpack_from
_COMMANDS = uapi.COMMANDS


def _unknown(code: int) -> DriverError:
    """The refusal of a command number this driver does not know."""
    known = uapi.COMMANDS_BY_NR.get(uapi.ioc_nr(code))
    if known is not None and uapi.ioc_type(code) == uapi.ACCEL_IOCTL_BASE:
        return DriverError(
            errno.EINVAL,
            f"{known.name} with size {uapi.ioc_size(code)} / direction "
            f"{uapi.ioc_dir(code)}; this driver's is size {ctypes.sizeof(known.struct)}",
        )
    return DriverError(errno.ENOTTY, f"unknown command {code:#010x}")


def execute(info: DriverInfo, f: OpenFile, raw: bytes) -> Awaitable[None] | None:
    """Run one command transaction: decode and check the header and struct, run the
    handler, store its reply under the tag. None once done; for a command whose handler
    waits (``_WAITING``: MODULE_LOAD), the awaitable that runs it. Raises DriverError (the
    awaitable too): ENODEV for every one once the device was removed, whoever opened it
    when. A refusal's reason is kept as the file's ``last_error``
    (``uapi.ACCEL_LAST_ERROR_OFFSET``)."""
    name = "write"
    try:
        f.device.check_present()
        if len(raw) < _HDR:
            raise DriverError(errno.EINVAL, f"short write: {len(raw)} bytes, header is {_HDR}")
        code, flags, tag = _unpack_hdr(raw)
        cmd = _COMMANDS.get(code)
        if cmd is None:
            raise _unknown(code)
        if flags:
            raise DriverError(errno.EINVAL, f"header flags {flags:#x} must be 0")
        if tag >= uapi.ACCEL_TAG_LIMIT:
            raise DriverError(errno.EINVAL, f"tag {tag:#x} not below {uapi.ACCEL_TAG_LIMIT:#x}")
        if len(raw) != _HDR + cmd.size:
            raise DriverError(errno.EINVAL, f"{cmd.name}: {len(raw)} bytes written, expected "
                                            f"{_HDR + cmd.size}")
        struct = cmd.struct
        if not struct.reserved_clear(raw, _HDR):
            raise DriverError(errno.EINVAL, f"{cmd.name}: reserved or padding fields must be 0")
        arg = struct.from_buffer_copy(raw, _HDR)
        name = cmd.name  # a refusal from here on names the command
        if cmd.has_reply:
            if tag in f.replies:
                raise DriverError(errno.EEXIST, f"the reply for tag {tag} is still unread")
            if len(f.replies) >= uapi.ACCEL_MAX_PENDING_REPLIES:
                raise DriverError(errno.EBUSY,
                                  f"{len(f.replies)} replies unread; read them first")
        if code in _WAITING:
            return _execute_waiting(info, f, cmd, tag, arg)
        out = TABLE[code](info, f, arg)
        if cmd.has_reply:
            f.replies[tag] = bytes(out)
    except DriverError as exc:
        _refused(f, name, exc)
        raise
    return None


async def _execute_waiting(info: DriverInfo, f: OpenFile, cmd: uapi.Command, tag: int,
                           arg: Any) -> None:
    """The rest of ``execute`` for a command whose handler waits."""
    try:
        out = await TABLE[cmd.code](info, f, arg)
    except DriverError as exc:
        _refused(f, cmd.name, exc)
        raise
    if cmd.has_reply:
        f.replies[tag] = bytes(out)


def _refused(f: OpenFile, name: str, exc: DriverError) -> None:
    f.last_error = (f"{name} {errno.errorcode.get(exc.errno, exc.errno)}: "
                    f"{exc.message}")[:uapi.ACCEL_LAST_ERROR_MAX - 1] + "\n"


def read(f: OpenFile, off: int, size: int) -> bytes:
    """A read at offset ``off``: the reply stored under tag ``off``, removed once read
    whole, or at ``uapi.ACCEL_LAST_ERROR_OFFSET`` (no tag's) the reason of the file's last
    refused command."""
    reply = f.replies.pop(off, None)
    if reply is None:
        if off == uapi.ACCEL_LAST_ERROR_OFFSET:
            return f.last_error.encode()[:size]
        raise DriverError(errno.ENOMSG, f"no reply pending for tag {off}")
    if size < len(reply):
        f.replies[off] = reply  # a short read takes nothing
        raise DriverError(errno.EINVAL, f"read of {size} bytes; the reply has {len(reply)}")
    return reply
