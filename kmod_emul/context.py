"""Per-open-file driver state: the open file and the context it may hold.

One open of ``dev/accel/accelN`` is one ``OpenFile``; ``CTX_CREATE`` turns it into a
context. Contexts of one process share the device (its memory capacity, engines and
firmware) and its virtual address space; handles, queues, fences and allocations are per
context. The owner (tgid and uid) is bound at open, the only request on which FUSE says
who calls.

A context's shared objects are the process's own (docs/containment.md): its doorbell page
(the driver writes the "lost" word there), its event pipe (the driver writes a byte when
it has news for a waiter: the context was lost, a module finished loading, memory came
back) and its queues' rings. The driver maps none of a process's rings; it keeps their
descriptors only to hand them to another device's firmware (QUEUE_IMPORT). Everything a
context holds is closed when it is destroyed, not when the garbage collector runs.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from abi import uapi, userq
from kmod_emul.errors import DriverError
from kmod_emul.isolation import foreign_or_unknown

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice
    from kmod_emul.fw import LiveEntry
    from kmod_emul.memory import Allocation
    from kmod_emul.modules import Module


def tgid_of(tid: int) -> int:
    """FUSE reports the calling *thread*; ownership is per process, so map tid -> tgid."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid


def new_ring_memfd(label: str) -> int:
    """A ring of the driver's own (a context's default queue), sealed like a client's."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, userq.RING_FILE_SIZE)
    fcntl.fcntl(fd, uapi.F_ADD_SEALS, uapi.ACCEL_SEALS_PINNED)
    return fd


class DefaultQueue(userq.RingView):
    """A context's default queue: the driver's own ring, the driver its producer
    (SUBMIT_NOOP) and its waiter (WAIT, which never blocks: it arms the interrupt)."""

    id = 0

    @property
    def submitted(self) -> int:
        return self.wptr

    @property
    def fault(self) -> tuple[int, int, int, int] | None:
        """(seqno, errno, address, opcode) of the first faulted packet, if any."""
        seqno, code, opcode, addr = self.read_fault()
        return (seqno, code, addr, opcode) if seqno else None

    def push(self, packet: bytes, depth: int = userq.RING_SLOTS) -> int:
        """Queue ``packet``, or EBUSY once ``depth`` packets wait untaken (the queue's
        depth: the firmware would not take more)."""
        wptr = self.wptr
        if wptr - self.rptr >= depth:
            raise DriverError(errno.EBUSY, f"the default queue is full ({depth} "
                                          "no-ops not yet taken)")
        self.write_packet(wptr, packet)
        self.set(userq.RING_WPTR, wptr + 1)
        return wptr + 1

    def arm(self, seqno: int) -> None:
        """Ask for an event when the fence reaches ``seqno`` (the lowest armed wins)."""
        armed = self.get(userq.RING_IRQ_SEQNO)
        if armed == 0 or armed > seqno or armed <= self.completed:
            self.set(userq.RING_IRQ_SEQNO, seqno)
            userq.full_barrier()  # store the arming, then load the fence (the firmware mirrors)


@dataclass(eq=False)
class Queue:
    """A queue of the context: the process's ring, known by our descriptor of it.
    ``imported``: only a local name for another device's queue (QUEUE_IMPORT), waitable
    by this context's WAIT_QUEUE packets; it has no ring and no doorbell slot here."""

    id: int
    priority: int
    slot: int
    fd: int
    imported: bool = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(eq=False)
class Context:
    """A context: its queues, allocations, modules and fate. Torn down by ``Tenants``
    (kmod_emul/tenants.py)."""

    id: int
    file: OpenFile
    exclusive: bool
    #: the process's doorbell page, mapped (the driver writes DB_LOST and the default
    #: queue's slot)
    db: userq.SharedWords
    #: our descriptor of the write end of the process's event pipe
    event_fd: int
    default_queue: DefaultQueue
    queues: dict[int, Queue] = field(default_factory=dict)
    allocations: dict[int, Allocation] = field(default_factory=dict)
    #: indices of devices whose memory this context's work may reach (PEER_ENABLE)
    peers: set[int] = field(default_factory=set)
    #: loaded device modules, by module id
    modules: dict[int, Module] = field(default_factory=dict)
    #: Why the context can no longer be used (device reset or failure); None while live.
    lost: str | None = None
    #: its entry in the firmware's live table (kmod_emul/fw.py), cleared by ``lose``
    live: LiveEntry | None = None
    #: a diagnostic's (ACCEL_CTX_DIAGNOSTIC, root's): its faults are provoked on purpose
    diagnostic: bool = False
    #: the driver's mapping of a recording context's schedule table, where it notes the
    #: faults injected into it (kmod_emul/ras.py; abi/schedule.py's fault region)
    schedule_table: userq.SharedWords | None = None

    def check_live(self) -> None:
        if self.lost is not None:
            raise DriverError(errno.ENODEV, f"context {self.id} lost: {self.lost}")

    def signal(self) -> None:
        """One byte on the process's event pipe: "look again". Never blocks: a full pipe
        already says so, a closed one has no reader left."""
        if self.event_fd >= 0:
            try:
                os.write(self.event_fd, b"\1")
            except (BlockingIOError, BrokenPipeError):
                pass

    def lose(self, reason: str) -> None:
        """The device was reset or failed, or a fault of context scope hit this context:
        every later command answers ENODEV, and the process's waiters see the "lost" word
        of their doorbell page at once. The firmware is told first, by the context's
        entry in the live table, which it reads before it starts any packet (the caller
        also sends CTX_LOST or CTX_DESTROY on the mailbox, which may queue behind other
        messages). The page's word is for the process alone, which can write it too: the
        firmware never reads it."""
        if self.live is not None:
            self.live.clear()
        if self.lost is None:
            self.lost = reason
            if not self.db.mem.closed:
                self.db.set(userq.DB_LOST, errno.ENODEV)
            self.signal()

    def queue(self, queue_id: int) -> Queue:
        q = self.queues.get(queue_id)
        if q is None:
            raise foreign_or_unknown(self.file, "queue", queue_id, self.file.device.contexts.values(),
                                     f"queue {queue_id} does not belong to context {self.id}")
        return q

    def allocation(self, handle: int) -> Allocation:
        a = self.allocations.get(handle)
        if a is None:
            raise foreign_or_unknown(self.file, "allocation", handle,
                                     self.file.device.contexts.values(),
                                     f"allocation {handle} does not belong to context {self.id}")
        return a

    def ring_slots_used(self) -> set[int]:
        return {q.slot for q in self.queues.values() if not q.imported}

    def close(self) -> None:
        """Give back every descriptor and mapping the driver holds for this context."""
        for q in self.queues.values():
            q.close()
        self.queues.clear()
        if self.event_fd >= 0:
            os.close(self.event_fd)
            self.event_fd = -1
        self.db.close()
        if self.schedule_table is not None:
            self.schedule_table.close()
            self.schedule_table = None
        self.default_queue.close()


@dataclass(eq=False)
class OpenFile:
    """One open of a device node: who opened it, its unread replies, its context."""

    device: AccelDevice
    pid: int
    uid: int
    gid: int
    replies: dict[int, bytes] = field(default_factory=dict)
    ctx: Context | None = None
    #: why its last refused command was refused, one line ("" before any):
    #: ``uapi.ACCEL_LAST_ERROR_OFFSET``
    last_error: str = ""

    def context(self, ctx_id: int) -> Context:
        """The caller's live context, checked against the handle the command names."""
        if self.ctx is None:
            raise DriverError(errno.EBADFD, "no context on this open file (CTX_CREATE first)")
        if ctx_id != self.ctx.id:
            raise self.foreign_context(ctx_id)
        self.ctx.check_live()
        return self.ctx

    def foreign_context(self, ctx_id: int) -> DriverError:
        """The error for naming context ``ctx_id``, not this file's."""
        return foreign_or_unknown(self, "context", ctx_id, self.device.contexts.values(),
                                  f"context {ctx_id} does not belong to this open file")
