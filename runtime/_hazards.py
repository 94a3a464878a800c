"""In-kernel hazards under ``ACCEL_SANITIZE`` (compute-sanitizer racecheck's job, for the
kernel language): the sanitizer (runtime/sanitizer.py) asks the firmware to run each
launch of a kernel with shared arrays in its checked mode, and reads what it found.

A launch asks by a trailing argument record naming a hazard record (abi/hazard.py) in
the stream's :class:`HazardSlots`, one per seqno modulo the stream's argument arena's
slots: the ring admits seqno P + slots only once P completed (runtime/stream.py
``ArgArena``), so a slot is read before it is reused, and at every host wait that covers
its launch. A hazard becomes a :class:`KernelHazardReport`, raised as ``RaceError`` at the
next host wait (printed under ``warn``), like a stream race.

Kernels without shared arrays are launched as before (nothing in them is checked), and
with the sanitizer off nothing here runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from abi import hazard as H
from abi import userq
from runtime.kernels import KernelSource


@dataclass(frozen=True)
class ThreadAccess:
    """One thread's access to a shared element."""

    block: tuple[int, int, int]   #: the block's ``group_id`` (x, y, z)
    thread: tuple[int, int, int]  #: the thread's ``local_id`` (x, y, z)
    mode: str                     #: ``read``, ``write``, ``atomic`` or ``read+write``
    site: str                     #: ``file:line`` in the user's kernel source

    def __str__(self) -> str:
        return f"{self.mode} by thread {self.thread} at {self.site}"


@dataclass(frozen=True)
class KernelHazardReport:
    """A hazard between two threads of one block of one launch."""

    kind: str        #: ``shared-memory race``
    kernel: str
    array: str       #: the shared array's name in the kernel
    element: int     #: its flat element index
    byte: int        #: its byte offset in the array
    first: ThreadAccess   #: the access recorded first (the threads of a phase run in turn)
    second: ThreadAccess
    stream: str
    seqno: int
    site: str        #: ``file:line`` of the host call that launched it
    count: int       #: hazards this launch found (the report is the first)

    def __str__(self) -> str:
        more = f" ({self.count} hazards in this launch)" if self.count > 1 else ""
        return (f"{self.kind} in kernel {self.kernel} on shared array {self.array}"
                f"[{self.element}] (byte {self.byte}), block {self.first.block}:\n"
                f"  {self.first}\n  {self.second}\n"
                f"  both within one barrier phase, at least one a write{more}; launched on "
                f"{self.stream} seqno {self.seqno} at {self.site}")


@dataclass(frozen=True)
class CheckedLaunch:
    """What a report needs of a launch in checked mode."""

    seqno: int
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    source: KernelSource | None
    stream: str
    site: str


class HazardSlots:
    """A stream's hazard records, one per seqno modulo ``slots`` (the module doc)."""

    __slots__ = ("host", "pending", "slots", "va", "words")

    def __init__(self, device: int, slots: int) -> None:
        from runtime.stream import _pinned  # runtime.stream imports the sanitizer

        self.slots = slots
        self.host = _pinned(slots * H.RECORD_BYTES, device)
        self.words = self.host.reshape(-1).view(np.ndarray).view(np.int64).reshape(
            slots, H.RECORD_WORDS)
        self.va: int = self.host.device_va
        self.pending: dict[int, CheckedLaunch] = {}

    def arm(self, launch: CheckedLaunch, packet: bytes,
            args: bytes) -> tuple[bytes, bytes, KernelHazardReport | None]:
        """Clear ``launch``'s slot (reading the completed launch it held first) and return
        its packet and argument block asking for the checked mode, and the earlier
        launch's hazard, if any."""
        slot = launch.seqno % self.slots
        earlier = self.read(slot)
        self.words[slot] = 0
        self.pending[slot] = launch
        args += userq.ARG_RECORD.pack(H.ARG_HAZARD, 0, self.va + slot * H.RECORD_BYTES,
                                      H.RECORD_BYTES)
        pkt = userq.decode_bytes(packet)._replace(args_len=len(args)).encode()
        return pkt, args, earlier

    def completed(self, seqno: int) -> list[KernelHazardReport]:
        """The hazards of the checked launches up to ``seqno``, which completed."""
        done = [s for s, launch in self.pending.items() if launch.seqno <= seqno]
        return [r for r in map(self.read, done) if r is not None]

    def read(self, slot: int) -> KernelHazardReport | None:
        """The hazard of the (completed) launch in ``slot``, which it forgets."""
        launch = self.pending.pop(slot, None)
        if launch is None:
            return None
        w = [int(v) for v in self.words[slot]]
        if not w[H.COUNT] or w[H.KIND] != H.KIND_RACE:
            return None
        return _report(launch, w)


def _report(launch: CheckedLaunch, w: list[int]) -> KernelHazardReport:
    src = launch.source
    pos = w[H.ARRAY]
    array = src.shared[pos][0] if src is not None and 0 <= pos < len(src.shared) else f"#{pos}"
    block = _unflatten(w[H.BLOCK], launch.grid)

    def access(at: int) -> ThreadAccess:
        line, mode = w[at + 1], w[at + 2]
        site = src.site(line) if src is not None else f"<kernel source line {line}>"
        name = H.MODE_NAMES[mode] if 0 <= mode < len(H.MODE_NAMES) else f"mode {mode}"
        return ThreadAccess(block, _unflatten(w[at], launch.block), name, site)

    return KernelHazardReport("shared-memory race", launch.kernel, array, w[H.ELEMENT],
                              w[H.BYTE], access(H.FIRST), access(H.SECOND), launch.stream,
                              launch.seqno, launch.site, w[H.COUNT])


def _unflatten(i: int, dims: tuple[int, int, int]) -> tuple[int, int, int]:
    """A linear id (x fastest) in ``dims`` as (x, y, z)."""
    return i % dims[0], i // dims[0] % dims[1], i // (dims[0] * dims[1])
