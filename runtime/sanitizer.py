"""The stream-race sanitizer: ``ACCEL_SANITIZE=1`` (raise) or ``=warn`` (print, go on).

Every packet a stream writes is read back as the device accesses it makes: byte ranges with
a mode (a copy reads its source and writes its destination, a memset writes, a launch reads
or writes each buffer argument as the kernel's source does: :func:`param_modes`). Each
stream keeps a vector clock; an edge of the runtime's ordering contract joins clocks:

* stream order (a packet follows everything queued before it on its stream);
* a device-side wait (``Stream.wait_event``, ``wait_stream``: its WAIT_QUEUE packet) joins
  the clock the waited stream had at the event's seqno;
* a host wait (stream, event and device synchronize, a blocking copy, a query that found
  the work done, the caching allocator's own event checks) joins that clock into the host
  clock, which every packet submitted afterwards joins.

The caching allocator needs no rule of its own: memory is tracked by address, not by array,
so a block's history survives its free, and the allocator hands a block to a new owner
only after the edges above order the old owner's work (same stream, or record_stream's
events found complete). Two accesses to overlapping bytes, at least one a write, neither
ordered before the other, are a race, whether or not this run's timing made it harmful.
It is reported at the next host wait (:class:`RaceError`, or printed under ``warn``).

Kernels with shared arrays run in the firmware's checked mode, which finds races between
the threads of a block within a barrier phase (runtime/_hazards.py): those are reported the
same way, as :class:`~runtime._hazards.KernelHazardReport`.

With the variable unset, :data:`active` is None: the runtime's hot paths pay one module
attribute load and comparison, as for the profiler (runtime/_trace.py). docs/sanitizer.md
lists what is tracked and what is not.
"""

from __future__ import annotations

import ast
import bisect
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from abi import userq
from runtime import kernels as _kernels
from runtime._hazards import CheckedLaunch, HazardSlots, KernelHazardReport
from runtime.errors import RaceError

#: the files whose frames are the runtime's, not the user's (the call site skips them)
_OWN_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d)
                  + os.sep for d in ("runtime", "torch_accel"))
_REGISTER = os.path.join("torch_accel", "ops", "_register.py")
#: torch_accel's operators registered as functions of their own (not through
#: ``_register.implements``): the copies torch's composite operators end in
_COPY = os.path.join("torch_accel", "ops", "copy.py")
_COPY_OPS = ("_copy_from", "_copy_from_and_resize")
#: the code the runtime generates (runtime/arg_packer.py names it ``<packer of NAME>``,
#: ``<launchers of NAME>``)
_GENERATED = ("<packer of ", "<launchers of ")
_RECORD = userq.ARG_RECORD
#: launches whose accesses are kept parsed, by (context, packet, argument block)
LAUNCH_CACHE = 4096
#: joins a stream's clock remembers (``_Clock``): a program that synchronises every step
#: joins once a step, and the history would otherwise grow without bound
JOIN_HISTORY = 1024


@dataclass(slots=True)
class Access:
    """One packet's access to one byte range: who made it and where the host asked."""

    stream: str
    device: int
    queue: int
    seqno: int
    op: str          #: the kernel's name, ``copy`` or ``memset``
    mode: str        #: ``read``, ``write``, ``read+write`` or ``atomic``
    site: str        #: ``file:line`` of the first host frame outside runtime and torch_accel
    start: int
    end: int
    aten: str | None = None  #: the torch operator that queued it (torch_accel), if any
    #: the stream's serial in the sanitizer (not its queue id, which the driver reuses)
    serial: int = field(default=0, compare=False, repr=False)

    def __str__(self) -> str:
        op = f"{self.op} ({self.aten})" if self.aten else self.op
        return (f"{self.mode} by {op} on {self.stream} queue {self.queue} seqno {self.seqno} "
                f"[{self.start:#x}, {self.end:#x}) queued at {self.site}")


@dataclass(frozen=True)
class RaceReport:
    """Two unordered accesses to overlapping bytes, at least one a write."""

    first: Access    #: the earlier-submitted one
    second: Access
    start: int       #: the overlapping bytes [start, end)
    end: int
    kind: str        #: ``device``, ``host_pinned`` or ``managed`` memory

    def __str__(self) -> str:
        return (f"race on {self.kind} memory [{self.start:#x}, {self.end:#x}) "
                f"({self.end - self.start} bytes):\n"
                f"  {self.first}\n  {self.second}\n"
                "  neither is ordered before the other (no event, wait or host "
                "synchronisation joins them)")


# --- kernel argument modes ------------------------------------------------------------------
#: the built-ins that take a whole buffer (abi/kernel_lang.py) -> the argument they
#: write: mma's ``c`` (read and written; ``a`` and ``b`` read); atomic_add's buffer is
#: its own mode, ``atomic``
_BUFFER_CALLS = {"atomic_add": 0, "mma": 0}


def param_modes(ir: dict[str, Any]) -> list[str | None]:
    """Per buffer parameter of a kernel, in order, how its source uses the buffer's bytes:
    ``read``, ``write``, ``read+write``, ``atomic`` (only through atomic_add), or None
    (only its ``.size``/``.shape``). From the IR's source, which the front end checked
    (abi/kernel_frontend.py): a buffer is reached only by subscripts and by the
    built-ins of ``_BUFFER_CALLS``."""
    buffers = [p["name"] for p in ir["params"] if p["kind"] == "buffer"]
    reads: set[str] = set()
    writes: set[str] = set()
    atomics: set[str] = set()
    for node in ast.walk(ast.parse(ir["source"])):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            (writes if isinstance(node.ctx, ast.Store) else reads).add(node.value.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript) \
                and isinstance(node.target.value, ast.Name):
            reads.add(node.target.value.id)  # ``x[i] += v`` reads x[i] too
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in _BUFFER_CALLS:
            for i, arg in enumerate(node.args):
                if not isinstance(arg, ast.Name):
                    continue
                if node.func.id == "atomic_add":
                    if i == 0:
                        atomics.add(arg.id)
                    continue
                reads.add(arg.id)
                if i == _BUFFER_CALLS[node.func.id]:
                    writes.add(arg.id)
    modes: list[str | None] = []
    for name in buffers:
        r, w = name in reads, name in writes or (name in atomics and name in reads)
        modes.append("read+write" if r and w else "write" if w else "read" if r
                     else "atomic" if name in atomics else None)
    return modes


# --- vector clocks ---------------------------------------------------------------------------
class _Clock:
    """A stream's vector clock: stream serial -> the last seqno of it ordered before this
    stream's next packet; its own entry is its last packet. ``joins`` keeps the clock as
    each join left it (seqno it applies from, the clock), so a wait for an earlier seqno of
    this stream finds what was ordered before that seqno. It keeps the last
    ``JOIN_HISTORY`` joins: a wait for a seqno older than those gets the oldest kept, which
    may order more than was (a missed race, never a false one)."""

    __slots__ = ("serial", "vc", "joins", "pruned", "epoch", "label", "device", "queue",
                 "__weakref__")

    def __init__(self, serial: int, stream: Any) -> None:
        self.serial = serial
        self.vc: dict[int, int] = {serial: stream.last_seqno}
        self.joins: list[tuple[int, dict[int, int]]] = []
        self.pruned = False
        self.epoch = -1
        self.label, self.device, self.queue = repr(stream), stream.device, stream.queue_id

    def at(self, seqno: int) -> dict[int, int]:
        """The clock of this stream's packet ``seqno``."""
        i = bisect.bisect_right(self.joins, seqno, key=lambda j: j[0]) - 1
        if i < 0 and self.pruned:
            i = 0
        vc = dict(self.joins[i][1]) if i >= 0 else {}
        vc[self.serial] = seqno
        return vc

    def join(self, other: dict[int, int], from_seqno: int) -> None:
        changed = False
        vc = self.vc
        for s, n in other.items():
            if s != self.serial and vc.get(s, 0) < n:
                vc[s] = n
                changed = True
        if changed:
            self.joins.append((from_seqno, dict(vc)))
            if len(self.joins) > JOIN_HISTORY:
                del self.joins[: JOIN_HISTORY // 2]
                self.pruned = True


def _ordered(a: Access, clock: _Clock) -> bool:
    return a.serial == clock.serial or clock.vc.get(a.serial, 0) >= a.seqno


# --- shadow memory ---------------------------------------------------------------------------
class _Cell:
    """What is known of the bytes [start, end): the last write, and since it the last read
    and the last atomic access of each stream, keyed (stream serial, atomic) (a later one
    of a stream is ordered after its earlier ones, so a write unordered with an earlier
    read is unordered with the later one too)."""

    __slots__ = ("end", "write", "reads")

    def __init__(self, end: int, write: Access | None,
                 reads: dict[tuple[int, bool], Access]) -> None:
        self.end, self.write, self.reads = end, write, reads


class _Shadow:
    """One device's address space as disjoint cells, sorted by start."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.cells: list[_Cell] = []

    def access(self, acc: Access, clock: _Clock) -> list[Access]:
        """Record ``acc``; return the earlier accesses it races with: a write races with
        every unordered access, a read with unordered writes and atomics, an atomic with
        unordered writes and reads (atomics do not race with atomics). The cells over its
        bytes are split at its ends, gaps filled, each checked and updated, and the
        updated ones that end up alike merged (a write leaves one cell)."""
        lo, hi = acc.start, acc.end
        starts, cells = self.starts, self.cells
        j = bisect.bisect_right(starts, lo) - 1
        if j < 0 or cells[j].end <= lo:
            j += 1
        races: dict[int, Access] = {}
        if j < len(cells) and starts[j] == lo and cells[j].end == hi:  # the same bytes again
            cells[j] = _visit(cells[j], hi, acc, clock, races)
            return list(races.values())
        k = j
        while k < len(cells) and starts[k] < hi:
            k += 1
        head: list[tuple[int, _Cell]] = []
        inside: list[tuple[int, _Cell]] = []
        tail: list[tuple[int, _Cell]] = []
        pos = lo
        for start, c in zip(starts[j:k], cells[j:k]):
            if start < lo:
                head.append((start, _Cell(lo, c.write, c.reads)))
                start = lo
            if start > pos:
                inside.append((pos, _Cell(start, None, {})))
            if c.end > hi:
                tail.append((hi, _Cell(c.end, c.write, c.reads)))
            inside.append((start, c))
            pos = min(c.end, hi)
        if pos < hi:
            inside.append((pos, _Cell(hi, None, {})))
        out: list[tuple[int, _Cell]] = []
        for start, c in inside:
            new = _visit(c, min(c.end, hi), acc, clock, races)
            last = out[-1][1] if out else None
            if last is not None and last.write is new.write and last.reads == new.reads:
                last.end = new.end
            else:
                out.append((start, new))
        merged = head + out + tail
        starts[j:k] = [s for s, _ in merged]
        cells[j:k] = [c for _, c in merged]
        return list(races.values())


def _visit(c: _Cell, end: int, acc: Access, clock: _Clock, races: dict[int, Access]) -> _Cell:
    """Check ``acc`` against cell ``c`` (adding what it races with to ``races``); the
    cell as it is after ``acc``, up to ``end``."""
    mode = acc.mode
    write = mode != "read" and mode != "atomic"
    atomic = mode == "atomic"
    w = c.write
    if w is not None and not _ordered(w, clock):
        races[id(w)] = w
    for (_, was_atomic), r in c.reads.items():
        if (write or was_atomic != atomic) and not _ordered(r, clock):
            races[id(r)] = r
    if write:
        return _Cell(end, acc, {})
    reads = dict(c.reads)
    reads[acc.serial, atomic] = acc
    return _Cell(end, w, reads)


# --- the sanitizer ---------------------------------------------------------------------------
class _ContextCache(NamedTuple):
    """What the sanitizer keeps parsed per context."""

    modes: dict[int, list[str | None] | None]
    launches: dict[tuple[bytes, bytes], tuple[tuple[str, str, int, int], ...]]
    #: LAUNCH packets of kernels without shared arrays (they run unchecked): decoding the
    #: packet to find out cost ~1 us of every launch's host call
    plain: set[bytes]


class Sanitizer:
    """The process's race tracker (one, :data:`active`)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._lock = threading.RLock()
        self._clocks: weakref.WeakKeyDictionary[Any, _Clock] = weakref.WeakKeyDictionary()
        self._queues: dict[tuple[str, int], _Clock] = {}
        self._serial = 0
        self.host: dict[int, int] = {}
        self.epoch = 0
        #: the process's device addresses: unique per (device, process), a peer mapping a
        #: device's memory at the same address (docs/memory.md), so one map for all devices
        #: compares a peer copy's bytes with the owner's kernels
        self._shadow = _Shadow()
        #: per context (weakly: a context id is unique on its device only, and a rebuilt
        #: context reuses ids and handles): kernel handle -> its parameters' modes, and
        #: (packet, argument block) -> the launch's accesses
        self._contexts: weakref.WeakKeyDictionary[Any, _ContextCache] = \
            weakref.WeakKeyDictionary()
        self._host_memory: list[tuple[int, int, str]] = []
        #: per stream: the hazard records of its launches in checked mode
        self._hazards: weakref.WeakKeyDictionary[Any, HazardSlots] = \
            weakref.WeakKeyDictionary()
        self.pending: list[RaceReport | KernelHazardReport] = []
        #: every race found, raised or printed or not
        self.found: list[RaceReport | KernelHazardReport] = []

    # --- clocks ------------------------------------------------------------------------
    def _clock(self, stream: Any) -> _Clock:
        c = self._clocks.get(stream)
        if c is None:
            self._serial += 1
            c = self._clocks[stream] = _Clock(self._serial, stream)
            self._queues[stream.ctx.physical, stream.queue_id] = c
        return c

    def waited(self, stream: Any, seqno: int, check: bool = True) -> None:
        """The host saw ``stream`` complete ``seqno``: join its clock into the host's, then
        (``check``) raise the races found so far."""
        with self._lock:
            vc = self._clock(stream).at(seqno)
            host = self.host
            for s, n in vc.items():
                if host.get(s, 0) < n:
                    host[s] = n
                    self.epoch += 1
            slots = self._hazards.get(stream)
            if slots is not None and slots.pending:
                for report in slots.completed(seqno):
                    self._found(report)
        if check:
            self.check()

    def check(self) -> None:
        """Raise the races found since the last check (``raise`` mode)."""
        if self.pending and self.mode == "raise":
            with self._lock:
                reports, self.pending = self.pending, []
            if reports:
                raise RaceError(reports)

    # --- submissions -------------------------------------------------------------------
    def submitting(self, stream: Any, wptr: int, packets: Any) -> None:
        """``stream`` writes ``packets`` after seqno ``wptr`` (``Stream._write``)."""
        site, aten = _call_site()
        with self._lock:
            clock = self._enter(stream, wptr + 1)
            for n, pkt in enumerate(packets, wptr + 1):
                clock.vc[clock.serial] = n
                if hasattr(pkt, "args"):  # a launch with its block (ArgLaunch): a replay
                    self._launch(stream, clock, n, pkt.packet, pkt.args, site, aten)
                else:
                    self._packet(stream, clock, n, userq.decode_bytes(pkt) if type(pkt)
                                 is bytes else pkt, site, aten)

    def launching(self, stream: Any, seqno: int, packet: bytes,
                  args: bytes) -> tuple[bytes, bytes]:
        """``stream`` writes one LAUNCH as ``seqno`` (``Stream._write_launch``): the packet
        and argument block to write, which ask for the firmware's checked mode when the
        kernel has shared arrays (runtime/_hazards.py)."""
        site, aten = _call_site()
        with self._lock:
            clock = self._enter(stream, seqno)
            clock.vc[clock.serial] = seqno
            self._launch(stream, clock, seqno, packet, args, site, aten)
            return self._checked(stream, seqno, packet, args, site)

    def _checked(self, stream: Any, seqno: int, packet: bytes, args: bytes,
                 site: str) -> tuple[bytes, bytes]:
        """A launch of a kernel with shared arrays, in checked mode; any other as it is (and
        one whose argument block has no room for the record)."""
        plain = self._cache(stream.ctx).plain
        if packet in plain:
            return packet, args
        from runtime.stream import LONG_ARGS  # runtime.stream imports this module

        pkt = userq.decode_bytes(packet)
        ir = stream.ctx.kernel_irs.get(pkt.handle)
        if ir is None or not (ir.get("shared_mem") or ir.get("dynamic_shared")):
            if len(plain) >= LAUNCH_CACHE:
                plain.clear()
            plain.add(packet)
            return packet, args
        if len(args) + _RECORD.size > LONG_ARGS:
            return packet, args
        slots = self._hazards.get(stream)
        if slots is None:
            slots = self._hazards[stream] = HazardSlots(stream.device,
                                                        (stream._arena or stream.arena()).slots)
        launch = CheckedLaunch(seqno, stream.ctx.kernel_names.get(pkt.handle, ir["name"]),
                               userq.unpack_dims(pkt.grid), userq.unpack_dims(pkt.block),
                               _kernels.source_of(ir), repr(stream), site)
        packet, args, earlier = slots.arm(launch, packet, args)
        if earlier is not None:
            self._found(earlier)
        return packet, args

    def _enter(self, stream: Any, seqno: int) -> _Clock:
        clock = self._clock(stream)
        if clock.epoch != self.epoch:
            clock.join(self.host, seqno)
            clock.epoch = self.epoch
        return clock

    def _packet(self, stream: Any, clock: _Clock, seqno: int, pkt: Any, site: str,
                aten: str | None) -> None:
        """A packet other than a launch with its argument block: a LAUNCH a client wrote
        itself names its block's address in memory the sanitizer does not read, so its
        accesses are not tracked (docs/sanitizer.md)."""
        op = type(pkt)
        if op is userq.Copy:
            self._touch(clock, seqno, "copy", "read", pkt.src, pkt.nbytes, site, aten)
            self._touch(clock, seqno, "copy", "write", pkt.dst, pkt.nbytes, site, aten)
        elif op is userq.Memset:
            self._touch(clock, seqno, "memset", "write", pkt.dst, pkt.nbytes, site, aten)
        elif op is userq.WaitQueue:
            src = self._waited_queue(stream, pkt.queue)
            if src is not None:
                clock.join(src.at(pkt.seqno), seqno)

    def _launch(self, stream: Any, clock: _Clock, seqno: int, packet: bytes, args: bytes,
                site: str, aten: str | None) -> None:
        cache = self._cache(stream.ctx)
        accesses = cache.launches.get((packet, args))
        if accesses is None:  # a program launches a few (kernel, arguments) over and over
            if len(cache.launches) >= LAUNCH_CACHE:
                cache.launches.clear()
            accesses = cache.launches[packet, args] = self._launch_accesses(stream.ctx,
                                                                            packet, args)
        for name, mode, va, nbytes in accesses:
            self._touch(clock, seqno, name, mode, va, nbytes, site, aten)

    def _launch_accesses(self, ctx: Any, packet: bytes,
                         args: bytes) -> tuple[tuple[str, str, int, int], ...]:
        """(kernel name, mode, address, bytes) of each buffer a launch reaches: its
        argument block's buffer records, in order, with the kernel's parameter modes
        (written, conservatively, when the kernel's IR is unknown)."""
        handle = userq.decode_bytes(packet).handle
        name = ctx.kernel_names.get(handle, f"kernel {handle:#x}")
        modes = self._kernel_modes(ctx, handle)
        out = []
        k = 0
        for off in range(0, len(args) - _RECORD.size + 1, _RECORD.size):
            kind, _, va, nbytes = _RECORD.unpack_from(args, off)
            if kind != userq.ARG_BUFFER:
                continue
            mode = modes[k] if modes is not None and k < len(modes) else "write"
            k += 1
            if mode is not None:
                out.append((name, mode, va, nbytes))
        return tuple(out)

    def _waited_queue(self, stream: Any, qid: int) -> _Clock | None:
        """The stream a WAIT_QUEUE of ``stream`` names: a queue of its device, or one it
        imported from another device (``Context.import_queue``)."""
        for (physical, peer_qid), local in stream.ctx._imports.items():
            if local == qid:
                return self._queues.get((physical, peer_qid))
        return self._queues.get((stream.ctx.physical, qid))

    def _cache(self, ctx: Any) -> _ContextCache:
        cache = self._contexts.get(ctx)
        if cache is None:
            cache = self._contexts[ctx] = _ContextCache({}, {}, set())
        return cache

    def _kernel_modes(self, ctx: Any, handle: int) -> list[str | None] | None:
        modes = self._cache(ctx).modes
        if handle not in modes:
            ir = ctx.kernel_irs.get(handle)
            modes[handle] = param_modes(ir) if ir is not None else None
        return modes[handle]

    def _touch(self, clock: _Clock, seqno: int, op: str, mode: str, va: int,
               nbytes: int, site: str, aten: str | None) -> None:
        if nbytes <= 0:
            return
        acc = Access(clock.label, clock.device, clock.queue, seqno, op, mode, site, va,
                     va + nbytes, aten, clock.serial)
        for prev in self._shadow.access(acc, clock):
            lo, hi = max(prev.start, acc.start), min(prev.end, acc.end)
            self._found(RaceReport(prev, acc, lo, hi, self._kind(lo)))

    def _found(self, report: RaceReport | KernelHazardReport) -> None:
        self.found.append(report)
        if self.mode == "warn":
            print(f"accel sanitizer: {report}", file=sys.stderr, flush=True)
        else:
            self.pending.append(report)

    # --- memory kinds ------------------------------------------------------------------
    def host_memory(self, va: int, nbytes: int, kind: str) -> None:
        """Pinned or managed memory was mapped for a device at ``va``."""
        with self._lock:
            self._host_memory.append((va, va + nbytes, kind))

    def _kind(self, va: int) -> str:
        for lo, hi, kind in reversed(self._host_memory):
            if lo <= va < hi:
                return kind
        return "device"


def _call_site() -> tuple[str, str | None]:
    """``file:line`` of the first frame outside the runtime and torch_accel, and the
    torch operator being run (torch_accel's registered wrapper holds it as ``_op``; its
    copy operators are functions of their own). Only called while the sanitizer is on."""
    f = sys._getframe(2)
    aten = None
    while f is not None:
        path = f.f_code.co_filename
        if not path.startswith(_OWN_DIRS) and not path.startswith(_GENERATED):
            return f"{path}:{f.f_lineno}", aten
        if aten is None and path.endswith(_REGISTER) and "_op" in f.f_locals:
            aten = f.f_locals["_op"].name()
        elif aten is None and path.endswith(_COPY) and f.f_code.co_name in _COPY_OPS:
            aten = f"aten::{f.f_code.co_name}"
        f = f.f_back
    return "?", aten


#: the process's sanitizer, None when off (the hot paths test this)
active: Sanitizer | None = None


def enable(mode: str = "raise") -> Sanitizer:
    """Turn the sanitizer on for this process (what ``ACCEL_SANITIZE`` does at import):
    ``raise`` or ``warn``. Work queued before is not tracked."""
    global active
    if mode not in ("raise", "warn"):
        raise ValueError(f"sanitizer mode {mode!r}: 'raise' or 'warn'")
    active = Sanitizer(mode)
    return active


def disable() -> None:
    """Turn it off; races found and not yet raised are dropped."""
    global active
    active = None


def _from_environment() -> None:
    value = os.environ.get("ACCEL_SANITIZE", "").strip().lower()
    if value in ("", "0", "off", "no"):
        return
    enable("warn" if value == "warn" else "raise")


_from_environment()
