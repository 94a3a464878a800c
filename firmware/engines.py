"""Queues and engines: how the firmware runs packets.

Every hardware queue has a worker thread that runs its packets in order; queues run side
by side, so work on different streams overlaps. Copies and memsets take one of the
device's copy engines (a semaphore as wide as the image says), so at most that many run
at once; numpy releases the GIL while it moves bytes, so they really run in parallel.

A packet is validated against its context's address space when it runs; a bad one
*faults its own queue*: its completion carries the errno and the faulting address, the
queue's later packets complete as ECANCELED without running, and nothing else is touched.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from firmware import memory

# Packet opcodes, as in kmod_emul.uapi.Op (the firmware does not import the driver).
NOP, COPY, MEMSET, WAIT_QUEUE, PREFETCH = 0, 1, 2, 3, 4
_PACKET = np.dtype([("opcode", "<u4"), ("flags", "<u4"), ("a", "<u8", 7)])
assert _PACKET.itemsize == 64


@dataclass(eq=False)
class FwContext:
    id: int
    space: memory.AddressSpace = field(default_factory=memory.AddressSpace)
    queues: dict[int, QueueWorker] = field(default_factory=dict)


#: complete(ctx, queue, seqno, status, fault address, opcode)
Completer = Callable[[int, int, int, int, int, int], None]


class Engines:
    """Device-wide execution state shared by every queue worker."""

    def __init__(self, copy_engines: int, residency: memory.Residency,
                 stats: dict[str, int], complete: Completer) -> None:
        self.copy_sem = threading.Semaphore(copy_engines)
        self.residency = residency
        self.stats = stats
        self.complete = complete
        #: notified whenever any queue completes a packet (cross-queue waits, unmaps)
        self.progress = threading.Condition()
        self.hung = False


class QueueWorker(threading.Thread):
    """Runs one queue's packets in submission order."""

    def __init__(self, engines: Engines, ctx: FwContext, qid: int, priority: int) -> None:
        super().__init__(name=f"queue-{ctx.id}-{qid}", daemon=True)
        self.engines = engines
        self.ctx = ctx
        self.qid = qid
        self.priority = priority
        self.submitted = 0
        self.completed = 0
        self.fault: tuple[int, int, int, int] | None = None  # seqno, errno, addr, opcode
        self.cancelled = False  # stop now, dropping queued packets (context teardown)
        self.closing = False  # stop once queued packets are done (queue destroy)
        self._pending: deque[tuple[int, bytes]] = deque()
        self._cond = threading.Condition()

    def submit(self, seqno: int, packet: bytes) -> None:
        with self._cond:
            self.submitted = seqno
            self._pending.append((seqno, packet))
            self._cond.notify()

    def stop(self, *, drain: bool) -> None:
        with self._cond:
            if drain:
                self.closing = True
            else:
                self.cancelled = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self.cancelled and not self.closing:
                    self._cond.wait()
                if self.cancelled or (self.closing and not self._pending):
                    return
                seqno, raw = self._pending.popleft()
            while self.engines.hung:  # a hung device makes no progress, but can be torn down
                if self.cancelled:
                    return
                time.sleep(0.05)
            self._run_one(seqno, raw)

    def _run_one(self, seqno: int, raw: bytes) -> None:
        pkt = np.frombuffer(raw, _PACKET)[0]
        opcode = int(pkt["opcode"])
        status, addr = 0, 0
        if self.fault is not None:
            status = errno.ECANCELED
        else:
            try:
                if int(pkt["flags"]):
                    raise memory.Fault(0, errno.EINVAL)
                self._execute(opcode, [int(x) for x in pkt["a"]])
            except memory.Fault as f:
                status, addr = f.code, f.addr
                self.fault = (seqno, f.code, f.addr, opcode)
                self.engines.stats["faults"] += 1
        self.engines.stats["packets"] += 1
        with self.engines.progress:
            self.completed = seqno
            self.engines.progress.notify_all()
        self.engines.complete(self.ctx.id, self.qid, seqno, status, addr, opcode)

    def _execute(self, opcode: int, a: list[int]) -> None:
        space, eng = self.ctx.space, self.engines
        if opcode == NOP:
            return
        if opcode == COPY:
            dst, src, n = a[0], a[1], a[2]
            (md, od), (ms, osrc) = space.resolve(dst, n), space.resolve(src, n)
            for m, off in ((md, od), (ms, osrc)):
                if m.resident is not None and n:
                    eng.residency.touch_device(m, off, off + n)
            with eng.copy_sem:
                np.copyto(md.data[od : od + n], ms.data[osrc : osrc + n])
            eng.stats["copies"] += 1
            eng.stats["copy_bytes"] += n
        elif opcode == MEMSET:
            dst, n, value = a[0], a[1], a[2]
            if value > 0xFF:
                raise memory.Fault(0, errno.EINVAL)
            m, off = space.resolve(dst, n)
            if m.resident is not None and n:
                eng.residency.touch_device(m, off, off + n)
            with eng.copy_sem:
                m.data[off : off + n] = value
        elif opcode == WAIT_QUEUE:
            other = self.ctx.queues.get(a[0])
            if other is None or other is self:
                raise memory.Fault(0, errno.EINVAL)
            with eng.progress:
                while other.completed < a[1] and not self.cancelled:
                    eng.progress.wait(0.1)
        elif opcode == PREFETCH:
            va, n, to_device = a[0], a[1], a[2]
            m, off = space.resolve(va, n)
            if m.resident is None or to_device > 1:
                raise memory.Fault(va, errno.EINVAL)
            if n:
                (eng.residency.touch_device if to_device else eng.residency.to_host)(
                    m, off, off + n)
        else:
            raise memory.Fault(0, errno.EINVAL)
