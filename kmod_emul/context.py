"""Per-open-file driver state: the open file and the context it may hold.

One open of ``dev/accel/accelN`` is one ``OpenFile``; ``CTX_CREATE`` turns it into a
context. Contexts of one process share the device (its memory capacity, engines and
firmware) and its virtual address space; handles, queues, fences and allocations are per
context.
The owner (tgid and uid) is bound at open, the only request on which FUSE says who calls.
"""

from __future__ import annotations

import errno
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice
    from kmod_emul.memory import Allocation


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


#: Completion timestamps kept per queue, so an event's time can be read after the fact.
TIMESTAMPS_KEPT = 4096


@dataclass(eq=False)
class Queue:
    """One hardware queue's fence timeline as the driver sees it."""

    id: int
    ctx: Context
    priority: int
    submitted: int = 0
    completed: int = 0
    #: first faulted packet: (seqno, errno, address, opcode)
    fault: tuple[int, int, int, int] | None = None
    timestamps: OrderedDict[int, int] = field(default_factory=OrderedDict)
    _progress: trio.Event = field(default_factory=trio.Event)

    def complete(self, seqno: int, timestamp_ns: int, status: int, addr: int,
                 opcode: int) -> None:
        if status and self.fault is None:
            self.fault = (seqno, status, addr, opcode)
        self.completed = max(self.completed, seqno)
        self.timestamps[seqno] = timestamp_ns
        if len(self.timestamps) > TIMESTAMPS_KEPT:
            self.timestamps.popitem(last=False)
        self.wake()

    def wake(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def wait(self, seqno: int, timeout_s: float) -> bool:
        """Wait until ``seqno`` completes; False on timeout. Raises if the context dies."""
        with trio.move_on_after(timeout_s):
            while self.completed < seqno:
                self.ctx.check_live()
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

    def queue(self, queue_id: int) -> Queue:
        """The queue a command names (0: the default queue); ENOENT if not this context's."""
        q = self.default_queue if queue_id == 0 else self.queues.get(queue_id)
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
