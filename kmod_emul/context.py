"""Per-open-file driver state: the open file and the context it may hold.

One open of ``dev/accel/accelN`` is one ``OpenFile``; ``CTX_CREATE`` turns it into a
context. Contexts of one process share the device (its memory capacity, engines and
firmware) and its virtual address space; handles, queues, fences and allocations are per
context.
The owner (tgid and uid) is bound at open, the only request on which FUSE says who calls.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from kmod_emul import uapi
from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice
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


class Queue(uapi.RingView):
    """A user-mode queue's ring as the driver sees it: it reads the fence and the fault the
    firmware writes, arms the completion interrupt for waiters, and is the producer of the
    context's default queue (SUBMIT_NOOP)."""

    def __init__(self, qid: int, ctx: Context, priority: int, path: str,
                 fence_only: bool = False) -> None:
        super().__init__(path)
        self.id, self.ctx, self.priority, self.path = qid, ctx, priority, path
        self.fence_only = fence_only
        self._progress = trio.Event()

    @property
    def submitted(self) -> int:
        return self.wptr

    @property
    def fault(self) -> tuple[int, int, int, int] | None:
        """(seqno, errno, address, opcode) of the first faulted packet, if any."""
        seqno, code, opcode, addr = self.read_fault()
        return (seqno, code, addr, opcode) if seqno else None

    def push(self, packet: bytes) -> int:
        """Driver as producer (the default queue only): write one packet, publish it."""
        wptr = self.wptr
        if wptr - self.rptr >= uapi.RING_SLOTS:
            raise DriverError(errno.EAGAIN, f"queue {self.id} is full")
        self.write_packet(wptr, packet)
        self.set(uapi.RING_WPTR, wptr + 1)
        return wptr + 1

    def _arm(self, seqno: int) -> None:
        armed = self.get(uapi.RING_IRQ_SEQNO)
        if armed == 0 or armed > seqno or armed <= self.completed:
            self.set(uapi.RING_IRQ_SEQNO, seqno)

    def wake(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def wait(self, seqno: int, timeout_s: float) -> bool:
        """Wait until ``seqno`` completes; False on timeout. Raises if the context dies."""
        with trio.move_on_after(timeout_s):
            while self.completed < seqno:
                self.ctx.check_live()
                self._arm(seqno)
                if self.completed >= seqno:  # completed while arming: no interrupt comes
                    break
                await self._progress.wait()
        self.ctx.check_live()
        return self.completed >= seqno


@dataclass(eq=False)
class Context:
    """A context: its queues, allocations and fate. Torn down by ``AccelDevice``."""

    id: int
    file: OpenFile
    exclusive: bool
    queues: dict[int, Queue] = field(default_factory=dict)
    default_queue: Queue | None = None
    allocations: dict[int, Allocation] = field(default_factory=dict)
    #: indices of devices whose memory this context's work may reach (PEER_ENABLE)
    peers: set[int] = field(default_factory=set)
    doorbell_path: str = ""
    #: loaded device modules, by module id
    modules: dict[int, Module] = field(default_factory=dict)
    #: destroyed queues: no new work, but their fences stay waitable until the context goes
    retired_queues: dict[int, Queue] = field(default_factory=dict)
    #: files (rings, doorbell) to unlink once the firmware has let go of the context
    files: list[str] = field(default_factory=list)
    #: Why the context can no longer be used (device reset or failure); None while live.
    lost: str | None = None

    def check_live(self) -> None:
        if self.lost is not None:
            raise DriverError(errno.ENODEV, f"context {self.id} lost: {self.lost}")

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            for q in self.queues.values():
                q.wake()

    def queue(self, queue_id: int, *, retired_too: bool = False) -> Queue:
        """The queue a command names (0: the default queue); ENOENT if not this context's.
        ``retired_too``: also a destroyed queue, whose fence can still be waited for."""
        q = self.default_queue if queue_id == 0 else self.queues.get(queue_id)
        if q is None and retired_too:
            q = self.retired_queues.get(queue_id)
        if q is None:
            raise DriverError(errno.ENOENT, f"queue {queue_id} does not belong to context {self.id}")
        return q

    def allocation(self, handle: int) -> Allocation:
        a = self.allocations.get(handle)
        if a is None:
            raise DriverError(errno.ENOENT, f"allocation {handle} does not belong to context {self.id}")
        return a


@dataclass(eq=False)
class OpenFile:
    """One open of a device node: who opened it, its unread replies, its context."""

    device: AccelDevice
    pid: int
    uid: int
    gid: int
    replies: dict[int, bytes] = field(default_factory=dict)
    ctx: Context | None = None

    def context(self, ctx_id: int) -> Context:
        """The caller's live context, checked against the handle the command names."""
        if self.ctx is None:
            raise DriverError(errno.EBADFD, "no context on this open file (CTX_CREATE first)")
        if ctx_id != self.ctx.id:
            raise DriverError(errno.ENOENT, f"context {ctx_id} does not belong to this open file")
        self.ctx.check_live()
        return self.ctx
