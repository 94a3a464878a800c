"""Contexts, their event pipe, and fences.

A ``Context`` is one open of a device node turned into a driver context. Each process gets
a primary context per device on first use (as CUDA's primary context); more can be made
with ``Context(device)``. Contexts of one process share the device's memory capacity,
engines and firmware; handles, fences, allocations and queues belong to one context and
mean nothing in another.

A context brings three objects of this process's own to the driver (docs/containment.md):
the doorbell page (a sealed memfd: each queue's write pointer goes into its slot, and the
firmware says there whether it sleeps), a doorbell pipe (one byte wakes a sleeping
firmware) and an event pipe (the device writes one byte when a fence a waiter armed passes,
and the driver when the context is lost or memory it freed came back). Waiting never
happens inside the driver, where it would hold the device node for every tenant: a waiter
arms what it waits for and sleeps in poll(2) on the event pipe (:class:`Events`), so
Ctrl-C interrupts it, a timeout is honoured, a lost context is seen at once (the driver
writes the "lost" word of the doorbell page) and a dead daemon too (the pipe hangs up).

A ``Fence`` is a point on the context's default queue, the driver's own (SUBMIT_NOOP).
"""

from __future__ import annotations

import errno
import functools
import os
import select
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from abi import uapi, userq
from runtime import discovery, errors, faults, schedule
from runtime._channel import Channel, fork_message
from runtime._shm import keep_private, sealed_memfd

#: Longest one sleep on the event pipe before the condition is looked at again anyway.
_RECHECK_S = 0.1
#: doorbell-page words, as indices of ``SharedWords.words``
_DB_SEQ, _DB_SLEEPING, _DB_SLOTS = (userq.DB_SEQ >> 3, userq.DB_FW_SLEEPING >> 3,
                                    userq.DB_SLOTS >> 3)


class Events:
    """A context's event pipe, shared by every thread of the process that waits on it.

    One waiter at a time polls the pipe and drains it; the others wait on a condition it
    broadcasts after every wake-up, and every waiter looks at its own condition after
    every broadcast. A condition is always looked at after it was armed and before
    sleeping, so no event is lost."""

    def __init__(self, ctx: Context, fd: int) -> None:
        self._ctx = weakref.ref(ctx)
        self.fd = fd
        self._cond = threading.Condition()
        self._polling = False
        #: a thread spins on a fence before sleeping here (Stream.wait_seqno): only one
        self.spinner = False

    def wait(self, ready: Callable[[], bool], timeout: float | None, what: str,
             arm: Callable[[], None] | None = None) -> None:
        """Return once ``ready()``; ``arm()`` first asks the device for an event."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if arm is not None:
                    arm()
                if ready():
                    return
                ctx = self._ctx()
                if ctx is not None:
                    ctx.check_live(what)
                left = _RECHECK_S if deadline is None else min(_RECHECK_S,
                                                               deadline - time.monotonic())
                if left <= 0:
                    raise errors.AccelTimeoutError(f"{what}: not complete after {timeout} s",
                                                   errno.ETIME)
                if self._polling:
                    self._cond.wait(left)
                    continue
                self._polling = True
                self._cond.release()
                try:
                    hung_up = self._sleep(left)
                finally:
                    self._cond.acquire()
                    self._polling = False
                    self._cond.notify_all()
                if hung_up and ctx is not None:
                    raise ctx.lost_error(what, "the driver and the device are gone (the "
                                               "daemon died)")

    def _sleep(self, timeout: float) -> bool:
        """Sleep until a byte arrives or ``timeout``; True when every writer is gone."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        for _fd, flags in poller.poll(timeout * 1000):
            data = b""
            if flags & select.POLLIN:
                try:
                    data = os.read(self.fd, 4096)
                except BlockingIOError:
                    return False
            return not data and bool(flags & (select.POLLHUP | select.POLLERR))
        return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


#: ``ACCEL_DIAGNOSTIC=1``: this process's contexts are a diagnostic's (docs/contract.md).
DIAGNOSTIC_ENV = "ACCEL_DIAGNOSTIC"


def _diagnostic() -> int:
    """``ACCEL_CTX_DIAGNOSTIC`` when the environment asks for it (accel-diag run as root:
    the faults it provokes on purpose are not a tenant's), else 0."""
    return uapi.ACCEL_CTX_DIAGNOSTIC if os.environ.get(DIAGNOSTIC_ENV) == "1" else 0


class Context:
    """A driver context on one physical device (``accelN``)."""

    #: every context of this process (synchronize() covers each on its device)
    live: weakref.WeakSet[Context] = weakref.WeakSet()

    def __init__(self, physical: str, *, exclusive: bool = False) -> None:
        keep_private()  # before the first memfd or pipe exists (runtime/_shm.py)
        self.physical = physical
        self.channel = Channel(physical)
        # the schedule asked for (docs/schedule.md): its table's descriptor, if any, is
        # the driver's to import, like the doorbell page's
        sched = schedule.plan().ctx_fields(physical)
        db_fd = sealed_memfd("doorbell-page", userq.ACCEL_DB_PAGE_SIZE)
        bell_r, bell_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        event_r, event_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            self.db = userq.SharedWords(db_fd, userq.ACCEL_DB_PAGE_SIZE)
            reply = self.channel.call(
                uapi.ACCEL_CMD_CTX_CREATE,
                uapi.accel_ctx_create(
                    abi_major=uapi.ACCEL_ABI_MAJOR, abi_minor=uapi.ACCEL_ABI_MINOR,
                    flags=(uapi.ACCEL_CTX_EXCLUSIVE if exclusive else 0) | _diagnostic(),
                    doorbell_fd=bell_r, event_fd=event_w, db_page_fd=db_fd, **sched),
            )
        except errors.DriverVersionMismatchError as exc:
            self._abandon(bell_w, event_r)
            raise errors.DriverVersionMismatchError(_abi_message(physical), exc.errno) from None
        except BaseException:
            self._abandon(bell_w, event_r)
            raise
        finally:  # the driver holds its own: ours of what only the device uses can go
            for fd in (db_fd, bell_r, event_w, sched["schedule_fd"]):
                if fd >= 0:
                    os.close(fd)
        self.id: int = reply.ctx_id
        self.channel.ctx_id = self.id
        faults.context_made(physical, self.id)
        self.exclusive = exclusive
        self._bell = bell_w
        self.events = Events(self, event_r)
        #: kernel handle -> name, of the kernels this context's modules gave out: a
        #: launch's packet names its kernel by handle (Stream.kernel_name)
        self.kernel_names: dict[int, str] = {}
        #: kernel handle -> its IR (the sanitizer reads which buffers a launch writes)
        self.kernel_irs: dict[int, dict[str, Any]] = {}
        self._knock_lock = threading.Lock()
        self._imports: dict[tuple[str, int], int] = {}
        #: this context's streams (synchronize() covers them), and its last no-op fence
        self.streams: weakref.WeakSet[Any] = weakref.WeakSet()
        #: streams closed (or dropped) with work still queued: that work runs on
        #: (Stream.close), and synchronize() waits for it as cudaDeviceSynchronize waits for
        #: a destroyed stream's; kept here until seen done, so their rings stay mapped
        self.retiring: list[Any] = []
        self._last_fence: Fence | None = None
        Context.live.add(self)

    def _abandon(self, *fds: int) -> None:
        for fd in fds:
            os.close(fd)
        if hasattr(self, "db"):
            self.db.close()
        self.channel.close()

    def __repr__(self) -> str:
        return f"<Context {self.id} on {self.physical}>"

    # --- liveness -------------------------------------------------------------------------
    def check_fork(self) -> None:
        if os.getpid() != self.channel.pid:
            raise errors.UseAfterForkError(fork_message(self.channel.pid))

    def check_live(self, what: str) -> None:
        """Raise if this process forked since, or the driver marked the context lost."""
        self.check_fork()
        if self.db.get(userq.DB_LOST):
            raise self.lost_error(what)

    @functools.cached_property
    def uuid(self) -> str:
        """The device's stable UUID, for fault records ("" once unreadable)."""
        try:
            return discovery.read_attr(self.physical, "uuid")
        except OSError:
            return ""

    @functools.cached_property
    def queue_depth(self) -> int:
        """How many packets one queue may hold untaken: the driver's ``max_queue_depth``
        (0 from a driver older than ABI 2.2, whose rings hold ``userq.RING_SLOTS``)."""
        return self.query_device().max_queue_depth or userq.RING_SLOTS

    def lost_error(self, what: str, cause: str | None = None) -> errors.DeviceLostError:
        err = self.channel.error(uapi.ACCEL_CMD_WAIT, errno.ENODEV, cause)
        assert isinstance(err, errors.DeviceLostError)
        err.args = (f"{what}: {err}",)
        return err

    # --- submission helpers ---------------------------------------------------------------
    def knock(self, slot: int, wptr: int) -> None:
        """Tell the firmware a queue moved: its doorbell slot, the page's sequence word,
        and -- only if the firmware sleeps -- one byte on the doorbell pipe. (Releasing
        the lock is a locked instruction, the full barrier the protocol needs between
        storing the sequence and loading "sleeping"; the firmware mirrors it.)"""
        words = self.db.words
        with self._knock_lock:
            words[_DB_SLOTS + slot] = wptr
            words[_DB_SEQ] += 1
        if words[_DB_SLEEPING]:
            self.ring_doorbell()

    def ring_doorbell(self) -> None:
        """Wake the firmware (it marked this context's doorbell page "sleeping")."""
        try:
            os.write(self._bell, b"\1")
        except BlockingIOError:
            pass  # the pipe is full of unread rings: the firmware is being woken already
        except BrokenPipeError:
            # reset or failed (the driver marked the page lost: it says why), else gone
            cause = None if self.db.get(userq.DB_LOST) else "the device is gone (nothing " \
                                                            "reads its doorbell)"
            raise self.lost_error(f"{self!r}", cause) from None

    def reset_device(self) -> None:
        """Ask the driver to reset this context's device (DEVICE_RESET); returns once the
        reset has begun (``runtime.reset_device`` also waits for its end). A reset destroys
        every context on the device, this one included, so only a context that holds the
        device exclusively may ask: while it lives no other process has the device open."""
        if not self.exclusive:
            raise errors.InvalidValueError(
                f"{self!r} cannot reset {self.physical}: a reset destroys every context on "
                "the device, so only a context holding it exclusively may ask for one "
                "(runtime.new_context(device, exclusive=True))")
        self.channel.call(uapi.ACCEL_CMD_DEVICE_RESET, uapi.accel_device_reset(ctx_id=self.id))

    def query_device(self) -> uapi.accel_device_info:
        return self.channel.call(uapi.ACCEL_CMD_DEVICE_QUERY, uapi.accel_device_info())

    # --- the default queue (the driver's) ---------------------------------------------------
    def submit_noop(self) -> Fence:
        """Queue a no-op on the device; the fence completes when the firmware ran it."""
        reply = self.channel.call(uapi.ACCEL_CMD_SUBMIT_NOOP,
                                  uapi.accel_submit_noop(ctx_id=self.id))
        self._last_fence = Fence(self, reply.seqno)
        return self._last_fence

    def wait_reply(self, seqno: int) -> uapi.accel_wait | None:
        """One WAIT on the default queue: its reply once ``seqno`` completed, else None
        (the driver then armed an event for it)."""
        try:
            return self.channel.call(uapi.ACCEL_CMD_WAIT,
                                     uapi.accel_wait(ctx_id=self.id, seqno=seqno))
        except errors.AccelTimeoutError as exc:
            if exc.errno == errno.ETIME:
                return None
            raise

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait for everything queued on this context so far, on every stream (like
        ``torch.cuda.synchronize`` for one context); raise the first fault found, or
        AccelTimeoutError once ``timeout`` passes. A lost context raises its loss, as
        ``cudaDeviceSynchronize`` returns a sticky error, even with nothing queued."""
        if self.channel.fd < 0:
            raise self.channel.closed_error()
        self.check_live(f"{self!r}: synchronize")
        deadline = None if timeout is None else time.monotonic() + timeout
        first: errors.DeviceFaultError | None = None
        for s in list(self.streams) + self.retiring:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                s.synchronize(left)
            except errors.DeviceFaultError as exc:
                first = first or exc
        self.retire()
        if self._last_fence is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._last_fence.wait(left)
        if first is not None:
            raise first

    def retire(self, stream: Any = None) -> None:
        """Keep ``stream`` (closed with its queue destroyed) in ``retiring`` while work it
        queued has not completed; drop the retiring streams seen done."""
        pending = [s for s in self.retiring if s.completed < s.last_seqno]
        if stream is not None and stream.completed < stream.last_seqno:
            pending.append(stream)  # from Stream.__del__ too: kept until its work is done
        self.retiring = pending

    def import_queue(self, stream: Any) -> int:
        """The local name of another device's stream, for device-side waits (cached)."""
        key = (stream.ctx.physical, stream.queue_id)
        qid = self._imports.get(key)
        if qid is None:
            qid = self._imports[key] = self.channel.call(
                uapi.ACCEL_CMD_QUEUE_IMPORT, uapi.accel_queue_import(
                    ctx_id=self.id, peer_index=int(stream.ctx.physical[5:]),
                    peer_queue_id=stream.queue_id)).queue_id
        return qid

    def close(self) -> None:
        """Destroy the context (closing the fd does it too, even if the process dies)."""
        Context.live.discard(self)
        for stream in list(self.streams):
            stream.context_closed()
        self.retiring.clear()
        if os.getpid() == self.channel.pid:
            if self._bell >= 0:
                os.close(self._bell)
            self.events.close()
        self._bell = -1
        self.channel.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _abi_message(physical: str) -> str:
    try:
        driver_abi = (discovery.root() / uapi.MODULE_DIR / "abi_version").read_text().strip()
    except OSError:
        driver_abi = "unknown"
    return (
        f"{physical}: the driver speaks uAPI {driver_abi} but this runtime speaks "
        f"{uapi.ACCEL_ABI_MAJOR}.{uapi.ACCEL_ABI_MINOR}; install a runtime built for the "
        "installed driver (or upgrade the driver to match this runtime)"
    )


@dataclass(frozen=True)
class Fence:
    context: Context
    seqno: int

    def query(self) -> bool:
        """True once the device has completed this fence (never blocks)."""
        return self.context.wait_reply(self.seqno) is not None

    def wait(self, timeout: float | None = None) -> int:
        """Block until complete; return its device timestamp (ns). Raises on timeout."""
        got: list[uapi.accel_wait] = []

        def done() -> bool:
            reply = self.context.wait_reply(self.seqno)  # arms the event when not done
            if reply is not None:
                got.append(reply)
            return reply is not None

        self.context.events.wait(done, timeout, f"fence {self.seqno} on {self.context.physical}")
        return got[0].timestamp_ns
