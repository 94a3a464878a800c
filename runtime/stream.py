"""Streams and events: the ordering contract.

A ``Stream`` is a hardware queue of the process's primary context on one device. Work on
one stream runs in order; work on different streams may overlap unless an event joins
them (``wait_event`` queues a device-side wait, so the host does not block). Host calls
return once work is queued: a failing operation's error surfaces at the next
synchronisation point on that stream (``synchronize``, an event's ``synchronize``, or
``query``) as a ``DeviceFaultError`` that names the failed packet.

Priorities follow ``torch.cuda``: lower numbers are higher priority; ``priority < 0``
asks for the device's high-priority queues.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kmod_emul import uapi
from runtime import devices as _device
from runtime import errors
from runtime.context import Context


class Stream:
    """An in-order queue of device work."""

    def __init__(self, device: _device.DeviceLike = None, priority: int = 0) -> None:
        self.device = _device._index(device)
        self.priority = priority
        self.ctx: Context = _device.primary_context(self.device)
        reply = self.ctx.channel.call(
            uapi.ACCEL_CMD_QUEUE_CREATE,
            uapi.accel_queue_create(
                ctx_id=self.ctx.id,
                priority=uapi.ACCEL_QUEUE_PRIORITY_HIGH if priority < 0
                else uapi.ACCEL_QUEUE_PRIORITY_LOW),
        )
        self.queue_id: int = reply.queue_id
        self.last_seqno = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Stream queue {self.queue_id} on accel:{self.device} priority {self.priority}>"

    # --- submission -------------------------------------------------------------------
    def submit(self, packets: Sequence[uapi.accel_packet]) -> int:
        """Queue packets in order; return the seqno of the last one."""
        with self._lock:
            for start in range(0, len(packets), uapi.ACCEL_SUBMIT_MAX):
                chunk = packets[start : start + uapi.ACCEL_SUBMIT_MAX]
                arg = uapi.accel_submit(ctx_id=self.ctx.id, queue_id=self.queue_id,
                                        count=len(chunk))
                for i, pkt in enumerate(chunk):
                    arg.packets[i] = pkt
                self.last_seqno = self.ctx.channel.call(uapi.ACCEL_CMD_SUBMIT, arg).last_seqno
            return self.last_seqno

    def record_event(self) -> Event:
        """An event at this point of the stream (what the caching allocator records)."""
        ev = Event()
        ev.record(self)
        return ev

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event`` (device side; the host goes on).

        Waiting on an event never recorded is a no-op, as in torch.cuda.
        """
        if event.stream is None or event.seqno == 0:
            return
        src = event.stream
        if src.ctx is self.ctx:
            if src is not self:
                self.submit([uapi.accel_packet(opcode=uapi.Op.WAIT_QUEUE,
                                               a=(src.queue_id, event.seqno, 0, 0, 0, 0, 0))])
        else:
            event.synchronize()  # another device: the host waits (device-side is issue 4)

    def wait_stream(self, other: Stream) -> None:
        self.wait_event(other.record_event())

    # --- completion --------------------------------------------------------------------
    def _wait(self, seqno: int, timeout_ns: int) -> uapi.accel_wait | None:
        """One bounded driver wait; None on ETIME; raises the fault that covers ``seqno``."""
        try:
            reply = self.ctx.channel.call(
                uapi.ACCEL_CMD_WAIT,
                uapi.accel_wait(ctx_id=self.ctx.id, queue_id=self.queue_id, seqno=seqno,
                                timeout_ns=timeout_ns))
        except errors.AccelTimeoutError:
            return None
        if reply.error_seqno:
            raise fault_error(self, reply)
        return reply

    def wait_seqno(self, seqno: int, timeout: float | None = None) -> int:
        """Block until ``seqno`` completed; return its device timestamp (ns)."""
        if seqno == 0:
            return 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slice_ns = uapi.ACCEL_WAIT_SLICE_NS
            if deadline is not None:
                slice_ns = max(0, min(slice_ns, int((deadline - time.monotonic()) * 1e9)))
            reply = self._wait(seqno, slice_ns)
            if reply is not None:
                return reply.timestamp_ns
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.AccelTimeoutError(
                    f"{self!r}: seqno {seqno} not complete after {timeout} s", errno.ETIME)

    def query(self) -> bool:
        """True when all work queued so far has completed (raises a fault it covers)."""
        return self.last_seqno == 0 or self._wait(self.last_seqno, 0) is not None

    def synchronize(self, timeout: float | None = None) -> None:
        self.wait_seqno(self.last_seqno, timeout)


def _op_name(opcode: int) -> str:
    try:
        return uapi.Op(opcode).name
    except ValueError:
        return f"opcode {opcode}"


def fault_error(stream: Stream, reply: uapi.accel_wait) -> errors.DeviceFaultError:
    record = {
        "device": stream.device, "queue": stream.queue_id, "seqno": reply.error_seqno,
        "errno": errno.errorcode.get(reply.error_code, str(reply.error_code)),
        "opcode": _op_name(reply.error_opcode),
        "address": reply.error_addr,
    }
    return errors.DeviceFaultError(
        f"accel:{stream.device} queue {stream.queue_id}: {record['opcode']} (seqno "
        f"{record['seqno']}) failed with {record['errno']} at address {record['address']:#x}; "
        "later work on this stream was cancelled, create a new stream", reply.error_code, record)


class Event:
    """A point in a stream; ``enable_timing`` gives it a device timestamp."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.stream: Stream | None = None
        self.seqno = 0
        self._timestamp_ns = 0

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream()
        if self.enable_timing:  # a marker of its own, so the timestamp is exactly here
            seqno = stream.submit([uapi.accel_packet(opcode=uapi.Op.NOP)])
        else:
            seqno = stream.last_seqno
        self.stream, self.seqno, self._timestamp_ns = stream, seqno, 0

    def query(self) -> bool:
        if self.stream is None or self.seqno == 0:
            return True
        reply = self.stream._wait(self.seqno, 0)
        if reply is not None and self.enable_timing:
            self._timestamp_ns = reply.timestamp_ns
        return reply is not None

    def synchronize(self, timeout: float | None = None) -> None:
        if self.stream is not None and self.seqno:
            ts = self.stream.wait_seqno(self.seqno, timeout)
            if self.enable_timing:
                self._timestamp_ns = ts

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between this event and ``end`` (both recorded with timing)."""
        if not (self.enable_timing and end.enable_timing):
            raise errors.InvalidValueError("elapsed_time needs events created with enable_timing=True")
        if self.stream is None or end.stream is None:
            raise errors.InvalidValueError("elapsed_time needs both events recorded")
        self.synchronize()
        end.synchronize()
        return (end._timestamp_ns - self._timestamp_ns) / 1e6


# --- default and current streams ---------------------------------------------------------
_defaults: dict[int, Stream] = {}
_defaults_lock = threading.Lock()
class _ThreadStreams(threading.local):
    def __init__(self) -> None:
        self.streams: dict[int, Stream] = {}  # device index -> this thread's current stream


_tls = _ThreadStreams()


def default_stream(device: _device.DeviceLike = None) -> Stream:
    idx = device if type(device) is int else _device._index(device)
    ctx = _device.primary_context(idx)  # the fork check and lazy init
    s = _defaults.get(idx)
    if s is not None and s.ctx is ctx:
        return s
    with _defaults_lock:
        s = _defaults.get(idx)
        if s is None or s.ctx is not _device.primary_context(idx):
            s = _defaults[idx] = Stream(idx)
        return s


def current_stream(device: _device.DeviceLike = None) -> Stream:
    idx = device if type(device) is int else _device._index(device)
    s = _tls.streams.get(idx)
    return s if s is not None else default_stream(idx)


def set_stream(stream: Stream) -> None:
    _tls.streams[stream.device] = stream


@contextmanager
def stream(s: Stream | None) -> Iterator[Stream | None]:
    """Make ``s`` the current stream of its device (and that device current) for the body."""
    if s is None:
        yield None
        return
    prev = _tls.streams.get(s.device)
    with _device.device(s.device):
        set_stream(s)
        try:
            yield s
        finally:
            if prev is None:
                _tls.streams.pop(s.device, None)
            else:
                _tls.streams[s.device] = prev
