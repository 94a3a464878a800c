"""Per-open-file driver state: the open file and the context it may hold.

One open of ``dev/accel/accelN`` is one ``OpenFile``; ``CTX_CREATE`` turns it into a
context. Contexts of one process share the device (its memory capacity, engines and
firmware) and nothing else: handles, fences and (later) memory and queues are per context.
The owner (tgid and uid) is bound at open, the only request on which FUSE says who calls.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice


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


@dataclass(eq=False)
class Context:
    """A context's fence timeline and fate. Torn down by ``AccelDevice.destroy_context``."""

    id: int
    file: OpenFile
    exclusive: bool
    submitted: int = 0
    completed: int = 0
    completed_ts: int = 0
    #: Why the context can no longer be used (device reset or failure); None while live.
    lost: str | None = None
    #: First failed submission: (seqno, errno); reported by the next wait that covers it.
    error: tuple[int, int] | None = None
    _progress: trio.Event = field(default_factory=trio.Event)

    def check_live(self) -> None:
        if self.lost is not None:
            raise DriverError(errno.ENODEV, f"context {self.id} lost: {self.lost}")

    def complete(self, seqno: int, timestamp_ns: int, status: int) -> None:
        if status and self.error is None:
            self.error = (seqno, status)
        if seqno > self.completed:
            self.completed, self.completed_ts = seqno, timestamp_ns
        self._wake()

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            self._wake()

    def _wake(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def wait(self, seqno: int, timeout_s: float) -> bool:
        """Wait until ``seqno`` completes; False on timeout. Raises if the context dies."""
        with trio.move_on_after(timeout_s):
            while self.completed < seqno:
                self.check_live()
                await self._progress.wait()
        self.check_live()
        return self.completed >= seqno


@dataclass(eq=False)
class OpenFile:
    """One open of a device node: who opened it, its unread replies, its context."""

    device: AccelDevice
    pid: int
    uid: int
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
