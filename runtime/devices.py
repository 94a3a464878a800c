"""Lazy initialisation, the fork rule, devices and the per-thread current device.

Initialisation (``init_state``) is implicit in the first device call: it records the
visible devices and the initialising pid, and opens no device. A device's primary context
is opened by the first use of that device, so a process touches only the devices it uses
(``set_device(1)`` then work on 1 leaves device 0 alone, as ``torch.cuda.set_device``
does). ``init()`` is the explicit form for a program that wants its failures early: it
opens the current device too. A forked child that inherited initialised state gets
UseAfterForkError from every device call, while discovery keeps working. The current
device is per thread (``set_device``/``device``), as in ``torch.cuda``.

Everything this process holds on one visible device hangs off one :class:`Device`: its
primary context and the parts built on it (the caching allocator, staging buffers, the
default stream, the modules of ``@runtime.kernel`` functions and of the torch backend's
kernel library). Launch argument blocks are no part of it: each stream has its own arena
(runtime/stream.py ``ArgArena``).
Each part's module makes it on first use (``Device.part``); dropping the ``Device`` drops
them all, so a rebuilt device never mixes old and new state.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, Union

from abi import uapi, userq
from runtime import _trace, discovery, errors, faults
from runtime._channel import fork_message
from runtime.allocator import CachingAllocator
from runtime.context import Context

_lock = threading.RLock()
_init_pid: int | None = None
_visible: list[str] = []
T = TypeVar("T")


class Device:
    """This process's hold on one visible device (``index`` in the runtime's numbering,
    ``physical`` the driver's ``accelN``): its primary context, as CUDA's, and the parts
    built on it, each made once by the module that owns it."""

    def __init__(self, index: int, physical: str) -> None:
        self.index = index
        self.physical = physical
        self.context = Context(physical)
        self._parts: dict[Any, Any] = {}
        self._lock = threading.RLock()  # making a part may need another (allocator: backend)
        #: why the primary context was lost (a reset, a device failure); None while it lives
        self.lost: errors.DeviceLostError | None = None
        self.context.channel.on_lost = self._context_lost

    def __repr__(self) -> str:
        return f"<Device accel:{self.index} ({self.physical})>"

    def part(self, key: Any, make: Callable[[], T]) -> T:
        """The part ``key`` of this device, made by ``make()`` on first use."""
        got = self._parts.get(key)
        if got is None:
            with self._lock:
                got = self._parts.get(key)
                if got is None:
                    got = self._parts[key] = make()
        return got

    def _context_lost(self, exc: errors.DeviceLostError) -> None:
        """The driver lost the primary context: everything built on it is gone with it.
        The Device stays in place, so that every later use raises (the driver refuses the
        lost context, the closed parts name ``exc``) until :func:`recover`."""
        self.lost = exc
        self._close_parts(exc)

    def _close_parts(self, cause: errors.AccelError | None) -> None:
        with self._lock:
            parts, self._parts = list(self._parts.values()), {}
        for part in reversed(parts):  # made later, so possibly built on an earlier one
            if isinstance(part, CachingAllocator):
                part.close(cause)  # what its arrays will say when used
            elif (close := getattr(type(part), "close", None)) is not None:
                close(part)  # looked up on the type: a Module's __getattr__ is its kernels

    def close(self) -> None:
        """Give up everything this process holds on the device, to build it again.

        Destroying the primary context makes the driver release what every part held
        (memory, queues, modules, pinned buffers). Parts with a ``close`` (the default
        stream, the caching allocator) are closed first, so that what a user kept from
        before -- arrays, streams, modules -- raises :class:`InvalidValueError` when used
        instead of reaching the new context, and is freed silently. Reset and fault
        recovery rebuild a device this way (:func:`drop`)."""
        self._close_parts(self.lost)
        self.context.close()


_devices: dict[int, Device] = {}


def drop(index: int) -> None:
    """Close this process's :class:`Device` for visible device ``index`` (if it has one);
    the next use of the device makes a new one, with a new primary context."""
    with _lock:
        dev = _devices.pop(index, None)
    if dev is not None:
        dev.close()


#: How often ``recover(timeout=...)`` tries again while the device is still resetting.
_RECOVER_POLL_S = 0.05


def recover(device: DeviceLike = None, timeout: float = 0.0) -> None:
    """Rebuild this process's hold on a device after its primary context was lost (a
    reset, a device failure): drop the lost state whole and make a new primary context.
    Arrays, streams and modules from before keep failing with the error that names the
    loss. A reset's DeviceLostError reaches a process before the reset is over, so
    ``timeout`` (seconds) waits that long for the device to serve again; past it, or with
    the default 0, it raises as creating a context does when the device is not operational
    yet (``DeviceInResetError``, EAGAIN; ``DeviceLostError`` at once for a failed device,
    which no wait mends). CUDA and torch need a new process for this."""
    if timeout < 0:
        raise ValueError(f"timeout is seconds, at least 0, not {timeout!r}")
    idx = _index(device)
    drop(idx)
    deadline = time.monotonic() + timeout
    while True:
        try:
            get(idx)
            return
        except errors.DeviceInResetError:
            if time.monotonic() + _RECOVER_POLL_S > deadline:
                raise
        time.sleep(_RECOVER_POLL_S)


class _ThreadState(threading.local):
    device = 0  # a class default: reading it costs no AttributeError on the hot path


_tls = _ThreadState()

#: Bumped at every change of a thread's current device or current stream (set_device, the
#: ``device`` and ``stream`` context managers, ``set_stream``): a framework that keeps a
#: copy of the current device and stream outside Python (torch_accel's C++ device guard,
#: asked ~100 times a training step) reads this word at its address
#: (``ctypes.addressof(current_epoch)``), without the interpreter's lock, to know its copy
#: is still the runtime's. Any thread's change bumps it, so a copy is never stale, at worst
#: refreshed needlessly.
current_epoch = ctypes.c_uint64(0)


def current_changed() -> None:
    """Note a change of this thread's current device or stream (:data:`current_epoch`)."""
    current_epoch.value += 1


#: This process's pid, refreshed in a forked child: comparing it costs no syscall, and the
#: fork check runs on every allocation.
_pid = os.getpid()


def _after_fork_in_child() -> None:
    # A lock held by another parent thread at fork time would never be released here.
    global _lock, _pid
    _lock = threading.RLock()
    _pid = os.getpid()
    faults.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_fork() -> None:
    """Raise UseAfterForkError in a child forked after init. Compares the refreshed
    ``_pid``: no syscall, as events and streams check it on their hot paths (a channel
    compares ``os.getpid()`` itself before every command, whatever made the child)."""
    if _init_pid is not None and _init_pid != _pid:
        raise errors.UseAfterForkError(fork_message(_init_pid))


def is_initialized() -> bool:
    """Initialised in this process (a child forked after initialisation is not: ``_pid``
    is refreshed at fork, so no system call here, as in ``_check_fork``)."""
    return _init_pid is not None and _init_pid == _pid


def init_state() -> None:
    """Initialise the runtime without opening any device (idempotent): the visible
    devices, the initialising pid. What every device call does first; the device it is
    about opens its own primary context when used."""
    global _init_pid, _visible
    _check_fork()
    with _lock:
        if _init_pid is None:
            visible = discovery.visible_devices()
            if not visible:
                spec = os.environ.get("ACCEL_VISIBLE_DEVICES")
                hint = (f"ACCEL_VISIBLE_DEVICES={spec!r} hides every device" if spec is not None
                        else f"no accel-emud serves {discovery.root()} (start one with "
                             "`accel-emud --root DIR`, or set ACCEL_EMU_ROOT)")
                raise errors.NoDeviceError(f"no accelerator visible: {hint}")
            _visible, _init_pid = visible, os.getpid()


def init() -> None:
    """Initialise the runtime and the current device's primary context (idempotent): a
    program's way to meet the current device's failures (no firmware, a driver version
    mismatch, ...) up front rather than at its first use."""
    init_state()
    primary_context(current_device())


def visible_count() -> int:
    """How many devices this process sees, as initialisation recorded them: the device
    tree is read once per process, not on every device-guard switch."""
    if not is_initialized():
        init_state()
    return len(_visible)


def _physical(index: int) -> str:
    if not 0 <= index < len(_visible):
        raise errors.InvalidValueError(
            f"invalid device index {index}: {len(_visible)} device(s) visible")
    return _visible[index]


def get(index: int | None = None) -> Device:
    """This process's :class:`Device` for visible device ``index`` (made on first use)."""
    idx = current_device() if index is None else index
    dev = _devices.get(idx)
    if dev is not None and _init_pid == _pid:
        return dev  # the hot path: every allocation and copy asks
    _check_fork()
    if _init_pid is None:
        init_state()
    with _lock:
        dev = _devices.get(idx)
        if dev is None:
            dev = _devices[idx] = Device(idx, _physical(idx))
        return dev


def held() -> list[int]:
    """The visible devices this process holds (has a live :class:`Device` for), without
    initialising any: the profiler measures their clocks when it starts."""
    if not is_initialized():
        return []
    return sorted(i for i, dev in list(_devices.items()) if dev.lost is None)


def primary_context(index: int | None = None) -> Context:
    """This process's primary context on device ``index`` (created on first use)."""
    return get(index).context


DeviceLike = Union[int, "device", None]


def _index(dev: DeviceLike) -> int:
    if dev is None:
        return current_device()
    if isinstance(dev, device):
        return dev.idx
    return int(dev)


def current_device() -> int:
    return _tls.device


def set_device(index: int) -> None:
    """Make ``index`` this thread's current device."""
    _check_fork()
    if _init_pid is None:
        init_state()
    _physical(index)
    _tls.device = index
    current_changed()


class device:
    """Context manager that makes ``idx`` the current device for its body."""

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self._prev: int | None = None

    def __enter__(self) -> device:
        self._prev = current_device()
        set_device(self.idx)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._prev is not None
        _tls.device = self._prev
        current_changed()


@dataclass(frozen=True)
class DeviceProperties:
    """What ``get_device_properties`` reports; the driver's DEVICE_QUERY, typed."""

    index: int
    name: str
    uuid: str
    serial: str
    pci_bus_id: str
    numa_node: int
    package_id: int
    partition_id: int
    fabric_endpoint: str
    driver_version: str
    firmware_version: str
    isa_version: str
    isa_stepping: str
    capabilities: tuple[str, ...]
    total_memory: int
    compute_engines: int
    copy_engines: int
    max_threads_per_block: int
    max_shared_mem_per_block: int
    max_contexts: int
    state: str
    physical_index: int


def get_device_properties(dev: DeviceLike = None) -> DeviceProperties:
    idx = _index(dev)
    raw = primary_context(idx).query_device()
    s = uapi.cstr
    return DeviceProperties(
        index=idx, name=s(raw.name), uuid=s(raw.uuid), serial=s(raw.serial),
        pci_bus_id=s(raw.pci_bus_id), numa_node=raw.numa_node, package_id=raw.package_id,
        partition_id=raw.partition_id, fabric_endpoint=s(raw.fabric_endpoint),
        driver_version=s(raw.driver_version), firmware_version=s(raw.firmware_version),
        isa_version=s(raw.isa_version), isa_stepping=s(raw.isa_stepping),
        capabilities=tuple(uapi.caps_to_names(raw.capabilities)),
        total_memory=raw.memory_total, compute_engines=raw.compute_engines,
        copy_engines=raw.copy_engines, max_threads_per_block=raw.max_threads_per_block,
        max_shared_mem_per_block=raw.max_shared_mem_per_block, max_contexts=raw.max_contexts,
        state=uapi.DeviceState(raw.state).label, physical_index=raw.index,
    )


def get_device_name(dev: DeviceLike = None) -> str:
    return get_device_properties(dev).name


def synchronize(dev: DeviceLike = None, timeout: float | None = None) -> None:
    """Like ``torch.cuda.synchronize``: wait until the device has finished everything every
    context of this process queued on it before the call, on every stream; raise the first
    fault found (a ``DeviceFaultError`` with its record), or ``AccelTimeoutError`` once
    ``timeout`` seconds pass."""
    if (rec := _trace.active) is not None and rec.outermost():
        return rec.call("synchronize", {}, synchronize, dev, timeout)
    physical = primary_context(_index(dev)).physical
    deadline = None if timeout is None else time.monotonic() + timeout
    first: errors.DeviceFaultError | None = None
    for ctx in [c for c in list(Context.live) if c.physical == physical]:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            ctx.synchronize(left)
        except errors.DeviceFaultError as exc:
            first = first or exc
    if first is not None:
        raise first


def fault_records(device: DeviceLike = None) -> list[dict[str, Any]]:
    """This process's fault records, oldest first: on ``device``, or on every visible
    device when None. Each is a dict of ``abi.faults.FIELDS`` (code, device, device_uuid,
    engine, queue, context, pid, address, bank, severity, corrected, scope, action, time,
    ...): the faults its exceptions carried, and the ones the driver recorded for its
    contexts that it has not synchronised on yet (docs/faults.md). Reads sysfs only: works
    on a lost device too, and never initialises one."""
    visible = discovery.visible_devices()
    if device is None:
        physicals = visible
    else:
        idx = _index(device)
        if not 0 <= idx < len(visible):
            raise errors.InvalidValueError(
                f"device {idx} is not visible ({len(visible)} visible)")
        physicals = [visible[idx]]
    uuids = set()
    for physical in physicals:
        try:
            uuids.add(discovery.read_attr(physical, "uuid"))
        except OSError:
            pass
    return faults.records(physicals, uuids)


def new_context(dev: DeviceLike = None, *, exclusive: bool = False) -> Context:
    """A further context on a device (its own fd); ``exclusive`` holds the device alone."""
    _check_fork()
    if _init_pid is None:
        init_state()
    return Context(_physical(_index(dev)), exclusive=exclusive)


#: How long ``reset_device`` waits for the device to serve again, by default (a reset is
#: well under a second here; a cold firmware start takes longer on a loaded machine).
RESET_TIMEOUT_S = 60.0
#: How often ``reset_device`` looks at the device's state while it waits.
_RESET_POLL_S = 0.02


def reset_device(dev: DeviceLike = None, timeout: float | None = RESET_TIMEOUT_S) -> None:
    """Reset a device -- the device itself, where ``cudaDeviceReset`` drops only the
    calling process's state -- and return once it serves again.

    A reset destroys every context on the device, so it goes through a context of this
    process that holds the device exclusively (``new_context(dev, exclusive=True)``):
    while one does, no other process has the device open and what is lost is this
    process's own. Without one this raises :class:`InvalidValueError` and sends nothing.
    Every context of this process on the device is lost: work in flight raises
    ``DeviceLostError`` naming the reset. Once this returns, :func:`recover` rebuilds the
    primary context; the contexts the process made itself (the exclusive one too) are its
    own to close and replace. Raises as the reset's boot ended (``FirmwareMissingError``
    and the like) when the device came back failed, ``AccelTimeoutError`` after
    ``timeout`` seconds."""
    _check_fork()
    if _init_pid is None:
        init_state()
    physical = _physical(_index(dev))
    owners = [c for c in list(Context.live) if c.physical == physical and c.exclusive]
    if not owners:
        raise errors.InvalidValueError(
            f"cannot reset {physical}: this process holds no exclusive context on it. A "
            "reset destroys every context on the device, so it needs one: "
            "runtime.new_context(device, exclusive=True), which no other process may have "
            "open meanwhile")
    # a lost one (of an earlier reset) would only raise its loss
    owner = next((c for c in owners if not c.db.get(userq.DB_LOST)), owners[0])
    before = int(discovery.read_attr(physical, "reset_count"))
    owner.reset_device()
    _wait_for_reset(physical, before, timeout)


def _wait_for_reset(physical: str, before: int, timeout: float | None) -> None:
    """Return once the reset that followed ``reset_count`` ``before`` has booted the device
    again (the driver counts a reset once its boot settled the state); raise as a
    device that boots failed does."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done = int(discovery.read_attr(physical, "reset_count")) > before
        state = discovery.read_attr(physical, "state")
        if done and state in ("operational", "failed"):
            break
        if deadline is not None and time.monotonic() > deadline:
            raise errors.AccelTimeoutError(
                f"{physical}: the reset did not finish within {timeout} s (state {state})",
                errno.ETIME)
        time.sleep(_RESET_POLL_S)
    if state == "failed":
        code = discovery.read_attr(physical, "failure_code")
        raise errors.from_errno(getattr(errno, code, errno.ENODEV),
                                f"{physical}: the reset ended with the device failed: "
                                f"{discovery.read_attr(physical, 'failure')}")
