"""Streams and events: the ordering contract.

A ``Stream`` is a hardware queue of the process's primary context on one device. Work on
one stream runs in order; work on different streams may overlap unless an event joins
them (``wait_event`` queues a device-side wait, so the host does not block). Host calls
return once work is queued: a failing operation's error surfaces at the next
synchronisation point on that stream (``synchronize``, an event's ``synchronize``, or
``query``) as a ``DeviceFaultError`` that names the failed packet.

Priorities follow ``torch.cuda``: lower numbers are higher priority; the device has two,
0 (the default) and -1 (high), and ``Stream.priority_range()`` says so. A priority outside
that range raises InvalidValueError (torch maps it to the nearest one silently, which hides
a mistake: asking for -5 on a device with two levels).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from abi import uapi, userq
from runtime import _trace, errors, faults
from runtime import sanitizer as _sanitizer
from runtime import devices as _device
from runtime._shm import sealed_memfd
from runtime.context import Context

_NOP = userq.Nop().encode()
#: ring words, as indices of ``RingView.words``
_WPTR, _RPTR = userq.RING_WPTR >> 3, userq.RING_RPTR >> 3
_ERROR_SEQNO = userq.RING_ERROR_SEQNO >> 3
_DB_LOST = userq.DB_LOST >> 3
_ON_ENGINE = userq.RING_ON_ENGINE >> 3
_SLOTS = userq.RING_SLOTS
#: ``wait_value32``'s comparisons by name (CUDA's CU_STREAM_WAIT_VALUE_*)
_WAIT_CMP = {"geq": userq.WAIT_VALUE_GEQ, "eq": userq.WAIT_VALUE_EQ,
             "and": userq.WAIT_VALUE_AND, "nor": userq.WAIT_VALUE_NOR}
#: an argument block up to this long goes in its seqno's slot, which the firmware finds
#: itself (the packet names no address: ``userq.RING_ARGS_VA``)
SHORT_ARGS = userq.RING_ARGS_SLOT_BYTES
#: the longest argument block a launch may have: a longer one is refused at the launch
#: (below the firmware's ``userq.ACCEL_ARGS_MAX``: each seqno keeps a slot this long)
LONG_ARGS = 1024
#: Poll the fence in shared memory this long before sleeping on the context's event pipe
#: (waking a sleeping waiter takes a few hundred microseconds here)...
SPIN_WAIT_S = 2e-3
#: ...tightly (yielding) for this long: a small launch or copy completes within it...
SPIN_TIGHT_S = 100e-6
#: ...then, while the firmware says an engine runs the stream's packet (``RING_ON_ENGINE``),
#: napping this long between polls: the device's engines are threads on the same two CPUs,
#: and a waiter that keeps one busy (even yielding: the engines run at a lower priority)
#: held a 1 Mi-element launch's second engine off for most of the launch. Work the
#: firmware's loop runs itself needs no CPU of ours, and a nap costs a halted vCPU's
#: wake-up (tens of microseconds here), so then the waiter keeps yielding.
SPIN_NAP_S = 20e-6


class ArgArena:
    """The one place launch argument blocks go: a stream's pinned slots, one per seqno
    modulo ``slots`` = the queue's depth + 1, each written by :meth:`write` only, under the
    stream's lock, as the launch's packet is written: a plain launch, a graph's replayed
    launch and the torch backend's launches alike.

    Seqno P's slot is next written for P + depth + 1, which the ring admits only once the
    firmware took P + 1; it takes a queue's packets one at a time, in order, so by then P
    has completed. So a block is never overwritten while the device may read it, and a
    launch needs neither a completion check nor an address per launch. A block up to
    ``SHORT_ARGS`` goes in the short slot the firmware finds from the seqno (the ring
    names the slots: ``RING_ARGS_VA``), so a kernel's LAUNCH packet is the same bytes at
    every launch; a longer one (up to ``LONG_ARGS``) in the seqno's long slot, made on the
    stream's first long block, which its packet names."""

    __slots__ = ("device", "host", "long", "long_host", "long_va", "mem", "slots", "va")

    def __init__(self, device: int, slots: int) -> None:
        self.device, self.slots = device, slots
        self.host = _pinned(SHORT_ARGS * slots, device)
        #: a plain memoryview: slicing the HostArray runs its Python-level finaliser
        self.mem = memoryview(self.host.reshape(-1).view(np.ndarray))
        self.va: int = self.host.device_va
        self.long_host: Any = None
        self.long: memoryview | None = None
        self.long_va = 0

    def write(self, seqno: int, raw: bytes) -> int:
        """Place ``raw``, the argument block of the launch that is packet ``seqno``; return
        the address its packet names: 0 for the short slot, which the firmware finds."""
        n = len(raw)
        if n <= SHORT_ARGS:
            off = seqno % self.slots * SHORT_ARGS
            self.mem[off : off + n] = raw
            return 0
        if self.long is None:
            self.long_host = _pinned(LONG_ARGS * self.slots, self.device)
            self.long = memoryview(self.long_host.reshape(-1).view(np.ndarray))
            self.long_va = self.long_host.device_va
        off = seqno % self.slots * LONG_ARGS
        self.long[off : off + n] = raw
        return self.long_va + off


def _pinned(nbytes: int, device: int) -> Any:
    """Pinned bytes for an arena: the runtime's own memory, never a graph pool's, so made
    whether or not this thread captures."""
    from runtime.memory import _map_host  # runtime.memory imports this module

    return _map_host(nbytes, np.uint8, device, uapi.MemKind.HOST_PINNED)


class ArgLaunch(NamedTuple):
    """A LAUNCH packet with its argument block, for the stream's arena to place when the
    packet is written (what a graph captures: a replay writes the block again, as it was
    at capture, for the replay's seqno)."""

    packet: bytes
    args: bytes

    def encode(self) -> bytes:
        """The packet as captured (its args_va 0; a long block's slot is set at the write)."""
        return self.packet


#: the byte offset of a LAUNCH packet's ``args_va`` word (after the opcode and flags words)
_ARGS_VA_AT = 8 + 8 * userq.Launch._fields.index("args_va")


def _name_args(words: memoryview, index: int, va: int) -> None:
    """Name ``va``, a long argument block's slot (the arena's answer), in the LAUNCH packet
    just written at ring index ``index`` (``RingView.words``): one store into its
    ``args_va`` word. Decoding and encoding the packet cost ~1.5 us of every launch whose
    block is longer than a short slot, as an elementwise one's is; a copy of its bytes
    with the word replaced, ~0.3 us."""
    words[(userq.RING_PACKETS + index % _SLOTS * userq.PACKET_SIZE + _ARGS_VA_AT) >> 3] = va


class Stream:
    """An in-order queue of device work: a ring of this process's own memory, which it
    writes directly (the driver imports it; the firmware maps it)."""

    #: (lowest, highest) priority, as ``torch.cuda.Stream.priority_range()``
    PRIORITY_RANGE = (0, -1)

    def __init__(self, device: _device.DeviceLike = None, priority: int = 0) -> None:
        low, high = self.PRIORITY_RANGE
        if isinstance(priority, bool) or not isinstance(priority, int) \
                or not high <= priority <= low:
            raise errors.InvalidValueError(
                f"stream priority {priority!r} is outside the device's range: {low} "
                f"(default) to {high} (highest); see Stream.priority_range()")
        self.device = _device._index(device)
        self.priority = priority
        self.ctx: Context = _device.primary_context(self.device)
        fd = sealed_memfd("ring", userq.RING_FILE_SIZE)
        try:
            self._ring = userq.RingView(fd)
            reply = self.ctx.channel.call(
                uapi.ACCEL_CMD_QUEUE_CREATE,
                uapi.accel_queue_create(
                    ctx_id=self.ctx.id, ring_fd=fd,
                    priority=uapi.ACCEL_QUEUE_PRIORITY_HIGH if priority < 0
                    else uapi.ACCEL_QUEUE_PRIORITY_LOW),
            )
        finally:
            os.close(fd)  # the mapping and the driver keep the ring
        self.queue_id: int = reply.queue_id
        self._slot: int = reply.doorbell
        self._closed = False
        #: the process that made the queue: a forked child shares the ring's memory, and a
        #: packet it wrote there would run as the parent's (the driver cannot tell them apart)
        self._pid = _device._pid
        #: the context's doorbell page: its "lost" word refuses work once the driver lost
        #: the context (the firmware may still run a moment before it is stopped)
        self._db = self.ctx.db.words
        #: packets the firmware takes past what it has taken: more wait for room
        self._depth = self.ctx.queue_depth
        #: the write pointer the queue has room below, as of the last read of its read
        #: pointer: the firmware moves that word with every packet it takes, so reading it
        #: per packet is a cache miss per packet; it is read again only at this bound
        self._room = self._depth
        self.ctx.streams.add(self)
        #: this stream's argument arena, from its first launch (``arena``)
        self._arena: ArgArena | None = None
        self.last_seqno = 0
        self._lock = threading.Lock()
        #: the graph this stream captures into (runtime.graphs), else None
        self.capturing: Any = None

    def __repr__(self) -> str:
        return f"<Stream queue {self.queue_id} on accel:{self.device} priority {self.priority}>"

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(lowest, highest) stream priority: lower numbers run first."""
        return Stream.PRIORITY_RANGE

    # --- submission -------------------------------------------------------------------
    def submit(self, packets: Sequence[userq.Packet | bytes], uses: Sequence[Any] = ()) -> int:
        """Queue packets in order; return the seqno of the last one. No system call unless
        the firmware sleeps. ``uses``: the arrays the packets touch (graph capture keeps
        them, to refuse a replay after they were freed)."""
        if self.capturing is not None:
            return self.capturing.record(self, packets, uses)
        return self._write(packets)

    def _write(self, packets: Sequence[Any]) -> int:
        """The hot path of every submission: plain word accesses, no method per word."""
        ring = self._ring
        words = ring.words
        if self._closed or self._pid != _device._pid or self._db[_DB_LOST]:
            self._refuse()
        with self._lock:
            if words[_ERROR_SEQNO]:
                self._raise_fault(self.last_seqno, refusing=True)
            wptr = self.last_seqno
            if (tracer := _trace.active) is not None:
                tracer.submitting(self, wptr, packets)
            if (san := _sanitizer.active) is not None:
                san.submitting(self, wptr, packets)
            for pkt in packets:
                if wptr >= self._room:
                    self._make_room(wptr)
                if type(pkt) is ArgLaunch:  # its block goes in the arena for its seqno
                    assert self._arena is not None  # made by whoever captured it (arena)
                    va = self._arena.write(wptr + 1, pkt.args)
                    ring.write_packet(wptr, pkt.packet)
                    if va:
                        _name_args(words, wptr, va)
                else:
                    ring.write_packet(wptr, pkt if isinstance(pkt, bytes) else pkt.encode())
                wptr += 1
            self._publish(wptr)
            self.last_seqno = wptr
            return wptr

    def _write_launch(self, pkt: bytes, args: bytes) -> int:
        """``_write`` of one LAUNCH packet, the hot path of a framework (an operator is a
        launch): one packet, so no loop and no conversion. ``args``, the argument block,
        goes in the stream's arena (``ArgArena.write``) for the packet's seqno before the
        packet is published (the seqno is known only here, under the lock). Its first
        lines are ``_write``'s again: ``_write`` taking the block instead (a one-packet
        tuple, the loop, the conversion check) read 1.05x on the host-call row of
        ``bench.compare --only tiny``, half the row's margin to its goal."""
        ring = self._ring
        words = ring.words
        if self._closed or self._pid != _device._pid or self._db[_DB_LOST]:
            self._refuse()
        arena = self._arena or self.arena()
        with self._lock:
            if words[_ERROR_SEQNO]:
                self._raise_fault(self.last_seqno, refusing=True)
            wptr = self.last_seqno
            if (tracer := _trace.active) is not None:
                tracer.submitting(self, wptr, (pkt,))
            if wptr >= self._room:
                self._make_room(wptr)
            wptr += 1
            if (san := _sanitizer.active) is not None:
                pkt, args = san.launching(self, wptr, pkt, args)
            va = arena.write(wptr, args)
            ring.write_packet(wptr - 1, pkt)
            if va:
                _name_args(words, wptr - 1, va)
            words[_WPTR] = wptr  # _publish, without its frame
            self.ctx.knock(self._slot, wptr)
            self.last_seqno = wptr
            return wptr

    def arena(self) -> ArgArena:
        """The stream's argument arena, made on its first launch, and named to the firmware
        in the ring (``RING_ARGS_VA``, abi/userq.py) before any packet uses it. Threads
        launching first on one stream at once may each make one: the first wins, under the
        lock the writes take, so no launch's block goes in one arena while the ring names
        another."""
        if self._arena is not None:
            return self._arena
        arena = ArgArena(self.device, self._depth + 1)
        with self._lock:
            if self._arena is None:
                self._ring.set(userq.RING_ARGS_VA, arena.va)
                self._ring.set(userq.RING_ARGS_SLOTS, arena.slots)
                self._arena = arena
            return self._arena

    def _refuse(self) -> None:
        """Raise why this stream takes no submission: closed, used across a fork, or its
        context lost."""
        if self._closed or self._pid != _device._pid:
            raise self._closed_error()
        raise self.ctx.lost_error(f"{self!r}: submit")

    def _make_room(self, wptr: int) -> None:
        """The ring may be full at ``wptr`` (the caller holds the lock): look at what the
        firmware took and, if it is full, let the firmware see what is there and wait."""
        words = self._ring.words
        self._room = words[_RPTR] + self._depth
        if wptr >= self._room:
            self._publish(wptr)
            self._wait_room(wptr)
            self._room = words[_RPTR] + self._depth

    def _wait_room(self, wptr: int) -> None:
        """The queue is full (its depth of packets untaken): wait until a quarter of it is
        free again (waking for every freed slot would cost an event per packet), the queue
        faulted (nothing more will be taken) or the context is lost. The firmware is busy
        taking packets, so spin briefly before sleeping on the event pipe with the
        completion armed."""
        words = self._ring.words
        want = wptr - self._depth + max(1, self._depth // 4)  # rptr at which to go on

        def room() -> bool:
            if words[_ERROR_SEQNO]:
                self._raise_fault(wptr, refusing=True)
            return words[_RPTR] >= want

        spin_until = time.perf_counter() + SPIN_WAIT_S
        while not room() and time.perf_counter() < spin_until:
            os.sched_yield()
        if not room():
            self.ctx.events.wait(room, None, f"{self!r} (ring full)",
                                 arm=lambda: self._arm(want))

    def _publish(self, wptr: int) -> None:
        self._ring.words[_WPTR] = wptr
        self.ctx.knock(self._slot, wptr)

    def _arm(self, seqno: int) -> None:
        """Ask the firmware for an event when the fence reaches ``seqno`` (the lowest
        armed wins: other threads may wait for earlier points of this stream)."""
        ring = self._ring
        armed = ring.get(userq.RING_IRQ_SEQNO)
        if armed == 0 or armed > seqno or armed <= ring.completed:
            ring.set(userq.RING_IRQ_SEQNO, seqno)
            userq.full_barrier()  # store the arming, then load the fence (the firmware mirrors)

    def kernel_name(self, seqno: int) -> str | None:
        """The kernel a LAUNCH of this stream ran (fault records, the profiler), read back
        from its packet, which the ring holds until a later one takes its slot: the
        packet's kernel handle names it (``Context.kernel_names``). Nothing is kept per
        launch for this (keeping one per launch read 1.03x on the host-call row of
        ``bench.compare --only tiny``)."""
        if not 0 < seqno <= self.last_seqno or self.last_seqno - seqno >= _SLOTS:
            return None
        words = self._ring.read_packet(seqno)
        if words[0] != userq.Op.LAUNCH:
            return None
        return self.ctx.kernel_names.get(userq.decode(words).handle)

    def submit_nop(self) -> int:
        """Queue a no-op (a marker); return its seqno."""
        return self.submit([_NOP])

    def record_event(self) -> Event:
        """An event at this point of the stream (what the caching allocator records)."""
        ev = Event()
        ev.record(self)
        return ev

    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits for ``event``, on the device (the host goes on),
        also when the event is on another device of this process.

        Waiting on an event never recorded is a no-op, as in torch.cuda.
        """
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("Stream.wait_event", {}, self.wait_event, event)
        if self.capturing is not None or (event.stream is not None
                                          and event.stream.capturing is not None):
            raise errors.InvalidValueError("events cannot cross a graph capture; record them "
                                           "outside the capture")
        if event.stream is None or event.seqno == 0 or event.stream is self:
            return
        src = event.stream
        qid = src.queue_id if src.ctx is self.ctx else self.ctx.import_queue(src)
        self.submit([userq.WaitQueue(qid, event.seqno)])

    def wait_stream(self, other: Stream) -> None:
        self.wait_event(other.record_event())

    # --- stream memory operations (CUDA's cuStreamWaitValue32/64, cuStreamWriteValue32/64)
    def wait_value32(self, buf: Any, offset: int, value: int, cmp: str = "geq",
                     timeout: float | None = None) -> None:
        """Later work on this stream waits, on the device, until the 32-bit word at byte
        ``offset`` of ``buf`` (pinned memory of this stream's device: ``pinned_empty``)
        satisfies ``cmp`` against ``value``: ``"geq"`` (the word, a counter that may wrap,
        has reached ``value``), ``"eq"``, ``"and"`` (a bit of ``value`` is set) or ``"nor"``
        (CUDA's ``CU_STREAM_WAIT_VALUE_*``). The host goes on; whoever writes the word ends
        the wait, the host with a plain store (``buf`` is its memory) or a stream with
        ``write_value32``. A wait still unsatisfied after ``timeout`` seconds (None: the
        device's watchdog) faults this stream with ETIMEDOUT, as a hung kernel does."""
        self._wait_value(buf, offset, value, 4, cmp, timeout)

    def wait_value64(self, buf: Any, offset: int, value: int, cmp: str = "geq",
                     timeout: float | None = None) -> None:
        """``wait_value32`` on a 64-bit word."""
        self._wait_value(buf, offset, value, 8, cmp, timeout)

    def write_value32(self, buf: Any, offset: int, value: int) -> None:
        """Write ``value`` as the 32-bit word at byte ``offset`` of ``buf`` (pinned memory,
        as ``wait_value32``'s) once the work queued before it on this stream is done: the
        host sees the stream reach this point by reading it, without a system call."""
        self._write_value(buf, offset, value, 4)

    def write_value64(self, buf: Any, offset: int, value: int) -> None:
        """``write_value32`` of a 64-bit word."""
        self._write_value(buf, offset, value, 8)

    def _write_value(self, buf: Any, offset: int, value: int, width: int) -> None:
        va = self._memop_va(buf, offset, width, value)
        self.submit([userq.WriteValue(va, value, width)], (buf,))

    def _wait_value(self, buf: Any, offset: int, value: int, width: int, cmp: str,
                    timeout: float | None) -> None:
        code = _WAIT_CMP.get(cmp)
        if code is None:
            raise errors.InvalidValueError(
                f"wait_value: comparison {cmp!r} is not one of {sorted(_WAIT_CMP)}")
        timeout_ns = 0 if timeout is None else round(timeout * 1e9)
        if timeout is not None and not 0 < timeout_ns <= userq.WAIT_VALUE_TIMEOUT_MAX_NS:
            raise errors.InvalidValueError(
                f"wait_value: timeout {timeout!r} s is outside (0, "
                f"{userq.WAIT_VALUE_TIMEOUT_MAX_NS // 10**9}] s")
        va = self._memop_va(buf, offset, width, value)
        self.submit([userq.WaitValue(va, value, width, code, timeout_ns)], (buf,))

    def _memop_va(self, buf: Any, offset: int, width: int, value: int) -> int:
        """The device address of the ``width``-byte word at ``offset`` of ``buf``, which
        must be pinned memory of this stream's context, aligned, holding ``value``: what
        the device would refuse (docs/submission.md, "Stream memory operations") is refused
        here first, with the reason."""
        from runtime.memory import HostArray  # runtime.memory imports this module

        owner = buf._accel if isinstance(buf, HostArray) else None
        if owner is None or owner.kind != uapi.MemKind.HOST_PINNED or owner.ctx is not self.ctx:
            raise errors.InvalidValueError(
                f"stream memory operations need pinned memory of accel:{self.device} "
                f"(runtime.pinned_empty), got {type(buf).__name__}")
        if isinstance(offset, bool) or not isinstance(offset, int) \
                or not 0 <= offset <= buf.nbytes - width:
            raise errors.InvalidValueError(
                f"offset {offset!r}: a {width}-byte word must lie in the buffer's "
                f"{buf.nbytes} bytes")
        va = int(buf.device_va) + offset
        if va % width:
            raise errors.InvalidValueError(f"offset {offset}: a {width}-byte word must be "
                                           f"aligned to {width} bytes (address {va:#x})")
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 0 <= value < 1 << (8 * width):
            raise errors.InvalidValueError(f"value {value!r} does not fit {8 * width} "
                                           "unsigned bits")
        return va

    # --- completion --------------------------------------------------------------------
    @property
    def completed(self) -> int:
        """The fence: the last seqno the device completed (read from shared memory)."""
        return self._ring.completed

    def _raise_fault(self, seqno: int, refusing: bool = False) -> None:
        """Raise the stream's fault if it covers ``seqno``. ``refusing``: new work is being
        refused because of it (errno ECANCELED, the record names the original fault)."""
        err_seqno, code, opcode, addr = self._ring.read_fault()
        if err_seqno and (refusing or err_seqno <= seqno):
            err = fault_error(self, err_seqno, code, opcode, addr)
            if refusing:
                err.errno = errno.ECANCELED
            raise err

    def timestamp(self, seqno: int) -> int:
        """Device time (ns) ``seqno`` completed, while its slot is not reused."""
        return self._ring.timestamp(seqno)

    def compile_ns(self, seqno: int) -> int:
        """How long launch ``seqno`` waited for its kernel's compile in the firmware (ns;
        0: none, or its slot was reused), once it completed."""
        return self._ring.compile_ns(seqno)

    def _check_host_wait(self) -> None:
        self.ctx.check_fork()
        if self.capturing is not None:
            raise errors.InvalidValueError(
                f"{self!r} is capturing a graph: synchronizing or querying it is not "
                "capturable; end the capture first")

    def wait_seqno(self, seqno: int, timeout: float | None = None) -> int:
        """Block until ``seqno`` completed; return its device timestamp (ns).

        Spins on the fence in shared memory briefly, then sleeps on the context's event
        pipe with the fence armed (so Ctrl-C interrupts it, a timeout is honoured and a
        lost device is noticed). Raises the fault that covers ``seqno``; with
        ``ACCEL_SANITIZE`` on, the host now knows ``seqno``'s work done (an ordering edge),
        and the races found so far raise ``RaceError`` (runtime/sanitizer.py).
        """
        self._check_host_wait()
        if seqno == 0:
            return 0
        events = self.ctx.events
        if self.completed < seqno and not events.spinner:
            # one thread of a context spins at a time: many spinning threads would take the
            # CPUs the device (and everyone else) needs, on a machine with two
            events.spinner = True
            words = self._ring.words
            try:
                now = time.perf_counter()
                spin_until, nap_after = now + SPIN_WAIT_S, now + SPIN_TIGHT_S
                while self.completed < seqno and (now := time.perf_counter()) < spin_until:
                    if now > nap_after and words[_ON_ENGINE]:  # lend the CPU to the engines
                        time.sleep(SPIN_NAP_S)
                    else:
                        os.sched_yield()
            finally:
                events.spinner = False
        if self.completed < seqno:
            # a fault cancels what follows it (those complete too); a queue the device
            # could not map at all has only its fault record
            self.ctx.events.wait(
                lambda: self.completed >= seqno or self._ring.read_fault()[0] != 0,
                timeout, repr(self), arm=lambda: self._arm(seqno))
        self._raise_fault(seqno)
        if (san := _sanitizer.active) is not None:
            san.waited(self, seqno)
        return self.timestamp(seqno)

    def query(self) -> bool:
        """True when all work queued so far has completed (raises a fault it covers)."""
        self._check_host_wait()
        done = self.completed >= self.last_seqno
        if done:
            self._raise_fault(self.last_seqno)
            if (san := _sanitizer.active) is not None:
                san.waited(self, self.last_seqno, check=False)
        return done

    def synchronize(self, timeout: float | None = None) -> None:
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("Stream.synchronize", {}, self.synchronize, timeout)
        self.wait_seqno(self.last_seqno, timeout)

    def __del__(self) -> None:
        if hasattr(self, "queue_id"):
            self.close()

    def _closed_error(self) -> errors.AccelError:
        """Why the queue takes no work: this process is a fork of its maker's (raised
        here), its context was lost, or it was closed."""
        self.ctx.check_fork()
        if self.ctx.channel.lost is not None:  # closed because its context was lost
            return self.ctx.channel.closed_error()
        return errors.InvalidValueError(f"{self!r} is closed")

    def context_closed(self) -> None:
        """Its context is being destroyed, which destroys the queue in the driver: refuse
        further work (writing to the ring would queue work that never runs)."""
        self._closed = True

    def close(self) -> None:
        """Give the queue back; work already queued still runs to completion (and its
        events stay waitable: the ring is this process's memory), and a device or context
        synchronize still waits for it, as for a destroyed CUDA stream's work."""
        if self._closed:
            return
        self._closed = True
        if self.ctx.channel.fd >= 0 and os.getpid() == self.ctx.channel.pid:
            try:
                self.ctx.channel.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(
                    ctx_id=self.ctx.id, queue_id=self.queue_id))
            except errors.AccelError:
                return
            self.ctx.retire(self)


def fault_error(stream: Stream, seqno: int, code: int, opcode: int,
                addr: int) -> errors.DeviceFaultError:
    """The exception for the ring's fault words (which packet, its errno and address),
    carrying the driver's record of that fault (runtime/faults.py)."""
    op = userq.op_name(opcode)
    record = faults.queue_fault_record(stream.ctx.physical, stream.ctx.id, stream.queue_id,
                                       seqno)
    what = op
    cls: type[errors.DeviceFaultError] = errors.DeviceFaultError
    if opcode == userq.Op.LAUNCH:
        cls = errors.KernelFaultError
        record["kernel"] = stream.kernel_name(seqno) or "?"
        what = f"kernel {record['kernel']}"
        if code == errno.ETIMEDOUT:
            what += " (stopped by the watchdog)"
    elif opcode == userq.Op.WAIT_VALUE and code == errno.ETIMEDOUT:
        what += " (the word was not written before the wait's timeout)"
    return cls(
        f"accel:{stream.device} queue {stream.queue_id}: {what} (seqno {seqno}) failed with "
        f"{errno.errorcode.get(code, str(code))} at address {addr:#x}; later work on this "
        "stream was cancelled, create a new stream", code, record)


class Event:
    """A point in a stream; ``enable_timing`` gives it a device timestamp."""

    def __init__(self, enable_timing: bool = False) -> None:
        _device._check_fork()
        self.enable_timing = enable_timing
        self.stream: Stream | None = None
        self.seqno = 0

    def record(self, stream: Stream | None = None) -> None:
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("Event.record", {}, self.record, stream)
        stream = stream or current_stream()
        stream.ctx.check_fork()  # recording reads the stream only: no write would check
        if stream.capturing is not None:
            raise errors.InvalidValueError(f"recording an event on {stream!r} while it captures "
                                           "a graph is not supported")
        if self.enable_timing:  # a marker of its own, so the timestamp is exactly here
            seqno = stream.submit_nop()
        else:
            seqno = stream.last_seqno
        self.stream, self.seqno = stream, seqno

    def _check_fork(self) -> None:
        """Refuse a forked child before the shortcuts of an event with nothing to wait
        for (never recorded, or recorded on an idle stream), which touch no device."""
        if self.stream is not None:
            self.stream.ctx.check_fork()
        else:
            _device._check_fork()

    def query(self) -> bool:
        self._check_fork()
        if self.stream is None or self.seqno == 0:
            return True
        self.stream._check_host_wait()
        done = self.stream.completed >= self.seqno
        if done:
            self.stream._raise_fault(self.seqno)
            if (san := _sanitizer.active) is not None:
                san.waited(self.stream, self.seqno, check=False)
        return done

    def synchronize(self, timeout: float | None = None) -> None:
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("Event.synchronize", {}, self.synchronize, timeout)
        self._check_fork()
        if self.stream is not None and self.seqno:
            self.stream.wait_seqno(self.seqno, timeout)

    def wait(self, stream: Stream | None = None) -> None:
        (stream or current_stream()).wait_event(self)

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between this event and ``end`` (both recorded with timing), from
        the device's completion timestamps."""
        if not (self.enable_timing and end.enable_timing):
            raise errors.InvalidValueError("elapsed_time needs events created with enable_timing=True")
        if self.stream is None or end.stream is None:
            raise errors.InvalidValueError("elapsed_time needs both events recorded")
        start_ns = self.stream.wait_seqno(self.seqno)
        end_ns = end.stream.wait_seqno(end.seqno)
        return (end_ns - start_ns) / 1e6


# --- default and current streams ---------------------------------------------------------
class _ThreadStreams(threading.local):
    def __init__(self) -> None:
        self.streams: dict[int, Stream] = {}  # device index -> this thread's current stream


_tls = _ThreadStreams()


#: per device, its default stream as last looked up: every launch on a thread without a
#: current stream of its own asks (``current_stream``), and the lookup through the
#: ``Device`` and its parts was three frames of an eager operator's few dozen. Trusted
#: while open (a reset or a lost context closes it: the lookup makes the new one) and in
#: the process that made it (a forked child takes the lookup, which refuses it).
_defaults: dict[int, Stream] = {}


def default_stream(device: _device.DeviceLike = None) -> Stream:
    idx = device if type(device) is int else _device._index(device)
    s = _defaults[idx] = _device.get(idx).part("default_stream", lambda: Stream(idx))
    return s


def current_stream(device: _device.DeviceLike = None) -> Stream:
    idx = device if type(device) is int else _device._index(device)
    s = _tls.streams.get(idx)
    if s is not None:
        return s
    s = _defaults.get(idx)
    if s is None or s._closed or s._pid != _device._pid:
        s = default_stream(idx)
    return s


def set_stream(stream: Stream) -> None:
    _tls.streams[stream.device] = stream
    _device.current_changed()


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
            _device.current_changed()
