"""``with runtime.profile() as p:``: host calls and the device packets they queued.

While a profile runs, every traced runtime call (runtime/_trace.py) is a host
event (name, thread, host start and end), and every packet ``Stream._write`` puts on a
ring is a device event sharing its host call's correlation id. The ring keeps one
completion timestamp per slot (device time: the firmware's ``CLOCK_MONOTONIC``) and no
start, so a packet's device start is derived: the later of the previous packet's end on
the same queue (a queue runs in order) and its host submit time mapped to device time
(it cannot start before it was written). The host/device offset is measured per device
as tinygrad does: the median over a few no-op round trips of (device stamp) - (midpoint
of host before and after), lowered where the profile proves it too high (a packet would
complete before it was submitted). Timestamps are read back while their slots are still
live: at each submission to the stream and when the profile stops (docs/profiler.md).
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic_ns
from typing import Any, NamedTuple

from abi import userq
from runtime import _trace, errors
from runtime import devices as _device
from runtime.stream import Stream

#: no-op round trips per device for the clock offset (the first may find the firmware
#: asleep: the median drops it)
OFFSET_ROUNDS = 7
#: the copy direction a host call's packets have, in kineto's names ("Memcpy HtoD")
_COPY_DIRECTION = {"DeviceArray.copy_from_host": "HtoD", "DeviceArray.copy_to_host": "DtoH",
                   "DeviceArray.copy_": "DtoD"}


@dataclass(slots=True)
class HostEvent:
    """A runtime API call on the host: times are host ``CLOCK_MONOTONIC`` ns."""

    name: str
    tid: int
    start_ns: int
    end_ns: int
    correlation: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class DeviceEvent:
    """One packet's execution, on the host's clock (the device's stamps less the offset).
    ``cat`` is kineto's: ``kernel``, ``gpu_memcpy``, ``gpu_memset``, or ``gpu_sync`` for
    markers and waits."""

    name: str
    cat: str
    device: int
    stream: int
    seqno: int
    start_ns: int
    end_ns: int
    correlation: int
    args: dict[str, Any] = field(default_factory=dict)


class _Pending(NamedTuple):
    seqno: int
    packet: Any  # bytes or a typed packet (abi/userq.py), as written
    submit_ns: int
    correlation: int
    call: str  # the host call's name


class _Done(NamedTuple):
    device: int
    stream: int
    pending: _Pending
    kernel: str | None
    prev_end_ns: int  # device time the queue's previous packet ended; 0: unknown
    end_ns: int  # device time
    compile_ns: int = 0  # how long a launch waited for its kernel's compile


def clock_offset(device: int, rounds: int = OFFSET_ROUNDS) -> int:
    """Device time minus host time (ns) on ``device``, from no-ops on a queue of its own."""
    s = Stream(device)
    try:
        samples = []
        for _ in range(rounds):
            before = monotonic_ns()
            stamp = s.wait_seqno(s.submit_nop())
            samples.append(stamp - (before + monotonic_ns()) // 2)
        return int(statistics.median(samples))
    finally:
        s.close()


class _Recorder:
    """What ``runtime._trace.active`` points at while a profile runs."""

    def __init__(self) -> None:
        self.host: list[HostEvent] = []
        self.thread_names: dict[int, str] = {}
        self.done: list[_Done] = []
        self.lost = 0
        self._pending: dict[Stream, deque[_Pending]] = {}
        self._last_end: dict[Stream, int] = {}
        self._ids = itertools.count(1)
        self._tls = threading.local()

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self.thread_names:
            self.thread_names[tid] = threading.current_thread().name
        return tid

    def outermost(self) -> bool:
        return getattr(self._tls, "call", None) is None

    def call(self, name: str, args: dict[str, Any], fn: Callable[..., Any],
             *fn_args: Any) -> Any:
        corr = next(self._ids)
        event = HostEvent(name, self._tid(), 0, 0, corr, args)
        self._tls.call = (corr, name)
        event.start_ns = monotonic_ns()
        try:
            return fn(*fn_args)
        finally:
            event.end_ns = monotonic_ns()
            self._tls.call = None
            self.host.append(event)

    def submitting(self, stream: Stream, wptr: int, packets: Sequence[Any]) -> None:
        """``stream`` is about to write ``packets`` after seqno ``wptr`` (under its lock)."""
        now = monotonic_ns()
        call = getattr(self._tls, "call", None)
        if call is None:  # a bare Stream.submit: a host event of its own, at the write
            call = (next(self._ids), "Stream.submit")
            self.host.append(HostEvent(call[1], self._tid(), now, now, call[0]))
        queue = self._pending.setdefault(stream, deque())
        self._harvest(stream, queue)
        queue.extend(_Pending(seqno, pkt, now, *call)
                     for seqno, pkt in enumerate(packets, wptr + 1))

    def _harvest(self, stream: Stream, queue: deque[_Pending]) -> None:
        """Read the completion stamps of what completed, before their slots are reused."""
        done = stream.completed
        last = self._last_end.get(stream)
        while queue and queue[0].seqno <= done:
            p = queue.popleft()
            if last is None:  # its predecessor was not profiled: the ring may still know it
                last = stream.timestamp(p.seqno - 1)
            end = stream.timestamp(p.seqno)
            if not end:  # its slot was reused before it was read
                self.lost += 1
                last = None
                continue
            self.done.append(_Done(stream.device, stream.queue_id, p,
                                   stream.kernel_name(p.seqno), last, end,
                                   stream.compile_ns(p.seqno)))
            last = end
        if last is not None:
            self._last_end[stream] = last

    def finish(self) -> None:
        """Wait for every recorded packet and read its stamp. A stream's fault is not
        raised here: the next synchronisation on it raises it, as without a profiler."""
        for stream, queue in self._pending.items():
            if queue:
                try:
                    stream.wait_seqno(queue[-1].seqno)
                except errors.AccelError:
                    pass  # faulted (later packets complete cancelled) or lost: keep what came
                self._harvest(stream, queue)
                self.lost += len(queue)


def _device_events(d: _Done, offset: int) -> list[DeviceEvent]:
    """The packet as device events on the host clock: itself, and before a launch that
    waited for its kernel's first compile, that wait as an event of its own (``compile
    <kernel>``, category ``kernel_compile``), so the compile never counts as the kernel's
    time. The wait is placed at the packet's start (the firmware compiles when an engine
    takes the launch), the kernel after it."""
    event = _device_event(d, offset)
    if not d.compile_ns or event.cat != "kernel":
        return [event]
    split = min(event.start_ns + d.compile_ns, event.end_ns)
    wait = DeviceEvent(f"compile {event.name}", "kernel_compile", event.device, event.stream,
                       event.seqno, event.start_ns, split, event.correlation,
                       {"kernel": event.name})
    event.start_ns = split
    return [wait, event]


def _device_event(d: _Done, offset: int) -> DeviceEvent:
    """The packet as a device event on the host clock, named as kineto names its kind."""
    p = d.pending
    words = userq.RAW_PACKET.unpack(p.packet if isinstance(p.packet, bytes)
                                    else p.packet.encode())
    opcode = words[0]
    pkt = userq.decode(words) if opcode in userq.LAYOUTS else None
    end = d.end_ns - offset
    start = p.submit_ns if not d.prev_end_ns else max(p.submit_ns, d.prev_end_ns - offset)
    args: dict[str, Any] = {}
    if isinstance(pkt, userq.Launch):
        name, cat = d.kernel or "kernel", "kernel"
        args = {"grid": list(userq.unpack_dims(pkt.grid)),
                "block": list(userq.unpack_dims(pkt.block)), "shared memory": pkt.shared}
    elif isinstance(pkt, userq.Copy):
        direction = _COPY_DIRECTION.get(p.call)
        name, cat = f"Memcpy {direction}" if direction else "Memcpy", "gpu_memcpy"
        args = {"bytes": pkt.nbytes}
    elif isinstance(pkt, userq.Prefetch):
        name, cat = f"Memcpy {'HtoD' if pkt.to_device else 'DtoH'} (prefetch)", "gpu_memcpy"
        args = {"bytes": pkt.nbytes}
    elif isinstance(pkt, userq.Memset):
        name, cat = "Memset", "gpu_memset"
        args = {"bytes": pkt.nbytes}
    elif isinstance(pkt, userq.WaitQueue):
        name, cat = "Wait Queue Sync", "gpu_sync"
        args = {"wait_on_queue": pkt.queue, "wait_on_seqno": pkt.seqno}
    elif isinstance(pkt, userq.WaitValue):
        name, cat = "Wait Value Sync", "gpu_sync"
        args = {"address": pkt.va, "value": pkt.value}
    elif isinstance(pkt, userq.WriteValue):
        name, cat = "Write Value", "gpu_memset"
        args = {"address": pkt.va, "value": pkt.value}
    else:  # NOP (an event's marker), or a raw packet of another opcode
        name, cat = ("Marker Sync" if opcode == userq.Op.NOP
                     else f"{userq.op_name(opcode)} Sync"), "gpu_sync"
    return DeviceEvent(name, cat, d.device, d.stream, p.seqno, start, end,
                       p.correlation, args)


class Profile:
    """``with runtime.profile() as p:`` records; afterwards ``p.host_events``,
    ``p.device_events``, ``p.export_chrome_trace(path)`` and ``p.key_averages()``."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.host_events: list[HostEvent] = []
        self.device_events: list[DeviceEvent] = []
        self.thread_names: dict[int, str] = {}
        #: device index -> device minus host clock (ns): measured, then lowered to what the
        #: profile allows (``_causal``)
        self.clock_offsets: dict[int, int] = {}
        #: device index -> its properties, for the trace's ``deviceProperties``
        self.devices: dict[int, _device.DeviceProperties] = {}
        #: packets whose completion stamp was overwritten before it was read
        self.lost_packets = 0
        self._recorder: _Recorder | None = None

    def __enter__(self) -> Profile:
        if _trace.active is not None:
            raise errors.InvalidValueError("a profile is already running in this process")
        for index in _device.held():
            self._measure(index)
        self._recorder = _trace.active = _Recorder()
        return self

    def _measure(self, index: int) -> None:
        self.clock_offsets[index] = clock_offset(index)
        self.devices[index] = _device.get_device_properties(index)

    def _causal(self, done: list[_Done]) -> None:
        """Lower each measured offset to what the profile itself proves: no packet
        completes before it was submitted. An asymmetric round trip (a busy firmware
        takes a packet late, the runtime sees the fence at once) overestimates the
        offset, which would show work ending before the call that queued it; with this
        bound every device event starts no earlier than its submission (and so ends
        after it starts: a queue's ends are in order)."""
        for d in done:
            bound = d.end_ns - d.pending.submit_ns
            if bound < self.clock_offsets[d.device]:
                self.clock_offsets[d.device] = bound

    def __exit__(self, *exc: object) -> None:
        rec, self._recorder = self._recorder, None
        assert rec is not None
        _trace.active = None
        rec.finish()
        for index in sorted({d.device for d in rec.done} - set(self.clock_offsets)):
            self._measure(index)  # first used inside the profile: measured now
        self._causal(rec.done)
        self.host_events = sorted(rec.host, key=lambda e: e.start_ns)
        self.device_events = sorted((e for d in rec.done
                                     for e in _device_events(d, self.clock_offsets[d.device])),
                                    key=lambda e: e.start_ns)
        self.thread_names = rec.thread_names
        self.lost_packets = rec.lost

    def export_chrome_trace(self, path: str | os.PathLike[str], *, rank: int = 0,
                            world_size: int = 1) -> None:
        """Write the trace as Chrome trace-event JSON in kineto's layout (Perfetto,
        chrome://tracing and Holistic Trace Analysis read it); ``rank`` and
        ``world_size`` go to ``distributedInfo``, which HTA reads."""
        from runtime._chrome_trace import write

        write(self, path, rank, world_size)

    def key_averages(self) -> Any:
        """Per-name totals and averages (``.table(sort_by=...)``), as torch.profiler's."""
        from runtime._key_averages import KeyAverages

        return KeyAverages.of(self)


def profile() -> Profile:
    """A profiler for ``with``: see :class:`Profile` and docs/profiler.md."""
    return Profile()
