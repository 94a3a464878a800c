"""Device-node requests served in turns by process (docs/containment.md, "Worst-case delay").

The daemon's request loop (pyfuse3, one trio thread) reads FUSE requests one at a time in
the order the kernel queued them, and used to serve each as it was read. A process whose
threads keep commands in flight therefore had requests queued ahead of every other
tenant's: under
64 threads looping SUBMIT_NOOP + WAIT, a bystander's write and its reply's read each found
about two of the flood's requests ahead of them, and each of those costs the daemon ~50 us,
most of it the reply's write to /dev/fuse, which wakes the flooding thread (profiled
2026-12-06). Serving faster cannot help: the wait is the order.

So the daemon serves device-node writes and reads (``AccelFS.write``/``read``) by start-time
fair queueing over processes, each request costing one unit: a request of process ``p``
gets the start tag ``max(V, F[p])``, where ``V`` is the tag of the request that started
last and ``F[p]`` is one past ``p``'s previous tag, and the waiting request with the
smallest tag starts next. Of equal tags, the one that was less far ahead of ``V`` when read
goes first (its process had fewer requests queued: a bystander's reply read right after
its command, against a flood's request tagged long before), then the one read first. A
process that was idle starts at ``V``, so its request is served after at most the one in
progress and one request of each other process, however many they have queued. One
process's own requests keep the order they were read in (their tags grow), which is the
order the kernel queued them.

To choose among what is queued the daemon must have read it: while the kernel holds
requests not read yet (the FUSE device polls readable) and the smallest waiting tag is
ahead of ``V`` (so an unread request of an idle process would come first), the turn waits a
scheduler round for the loop to read on, and again while rounds bring new requests;
``IDLE_ROUNDS_MAX`` rounds in a row that bring none (pyfuse3's loop takes a few rounds to
read one request), or ``PARKED_MAX`` waiting requests (pyfuse3 runs at most
``kmod_emul.daemon.MAX_TASKS`` request tasks: some must stay free to read), end the wait.
A request that
nobody waits before and that no unread request could precede starts at once, without a
round. Only another process's device-node request can precede one, and a process sends
those only through a device node it opened, which the daemon has seen (its OPEN was
answered first): while one process alone has device nodes open (``opened``/``closed``),
nothing unread can come first and the quiet path makes no system call; with others it
costs one poll(2).

A turn orders the starts of requests only: the next request is let go as the previous one
starts, and runs once that one yields, which for a driver command is after its reply (no
handler waits, kmod_emul/drv.py), and for a module load is while its checks run in a thread.
"""

from __future__ import annotations

import heapq
import itertools
import select
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

#: Most requests that wait for a turn at once before the rest start without reading on.
PARKED_MAX = 64
#: Scheduler rounds in a row that may bring no new request while the kernel holds unread
#: ones before the smallest tag starts anyway: pyfuse3's loop needs a few rounds to read
#: one (the read lock passed on, the wait for /dev/fuse, the read): with 2, 25 of 32
#: queued requests started before the one behind them, with 4 two did
#: (tests/contain/test_contain_qos.py); twice that, for a loop busy with other tasks.
IDLE_ROUNDS_MAX = 8
#: Requests remembered in ``Turns.served`` (debugfs ``accel/turns``).
SERVED_KEPT = 1024


@dataclass(order=True)
class _Waiting:
    start: int
    #: how far its tag was ahead of ``V`` when it was read: of two equal tags, the one of
    #: the process that had fewer requests queued goes first
    lead: int
    seq: int
    pid: int = field(compare=False)
    task: trio.lowlevel.Task = field(compare=False)
    #: woken to look again after a round of reading, not to start
    look_again: bool = field(default=False, compare=False)


class Turns:
    """The order device-node requests start in: start-time fair queueing over processes."""

    def __init__(self) -> None:
        self._vtime = 0
        self._finish: dict[int, int] = {}
        self._waiting: list[_Waiting] = []
        self._seq = itertools.count()
        self._woken: _Waiting | None = None  # told to go (or to look again), not yet running
        self._idle_rounds = 0
        #: poll(2) of /dev/fuse with a timeout: a non-empty list while requests are unread
        self._poll: Callable[[int], list[tuple[int, int]]] = lambda timeout: []
        #: process -> its open files of device nodes (``opened``, ``closed``)
        self._openers: dict[int, int] = {}
        #: the pid of each request started, oldest first (the last ``SERVED_KEPT``)
        self.served: deque[int] = deque(maxlen=SERVED_KEPT)
        self._started = 0

    def watch(self, fuse_fd: int) -> None:
        """Poll ``fuse_fd`` (the daemon's /dev/fuse) for requests not read yet; until then
        every request is taken as the last one queued."""
        poller = select.poll()
        poller.register(fuse_fd, select.POLLIN)
        self._poll = poller.poll

    def opened(self, pid: int) -> None:
        """Process ``pid`` opened a device node (before it can send a request on it)."""
        self._openers[pid] = self._openers.get(pid, 0) + 1

    def closed(self, pid: int) -> None:
        """One of process ``pid``'s open device nodes was released."""
        left = self._openers[pid] - 1
        if left:
            self._openers[pid] = left
        else:
            del self._openers[pid]

    def _unread(self) -> bool:
        """Whether the kernel may hold another process's device-node request not read yet:
        never while one process alone has device nodes open, else one poll(2)."""
        return len(self._openers) > 1 and bool(self._poll(0))

    def start_now(self, pid: int) -> bool:
        """The quiet path of :meth:`take`, without a coroutine (the daemon calls it on every
        device-node request, and ``await take`` only when it says False): start process
        ``pid``'s request, just read, if nothing waits or was let go, and no unread request
        could come before it (``_unread`` when its tag is ahead of ``V``, inlined: it runs
        on every request). False, changing nothing, when it must wait its turn."""
        if self._waiting or self._woken is not None:
            return False
        start = self._finish.get(pid, 0)
        if start <= self._vtime:
            start = self._vtime
        elif len(self._openers) > 1 and self._poll(0):
            return False
        self._finish[pid] = start + 1  # (``_idle_rounds`` counts while requests wait: none do)
        self._start(pid, start)
        return True

    async def take(self, pid: int) -> None:
        """Return when it is the turn of process ``pid``'s request, just read (after
        :meth:`start_now` said False; alone it starts the same requests, a little slower)."""
        start = max(self._vtime, self._finish.get(pid, 0))
        self._finish[pid] = start + 1
        self._idle_rounds = 0
        me = _Waiting(start, start - self._vtime, next(self._seq), pid,
                      trio.lowlevel.current_task())
        if self._first(me):
            self._start(pid, start)
            return
        heapq.heappush(self._waiting, me)
        while True:
            if self._woken is None:
                head = self._choose()
                if head is me:
                    if not me.look_again:
                        break
                    self._woken = me  # a round in which the loop reads on
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    self._woken = None
                    continue
                if head is not None:
                    self._woken = head
                    trio.lowlevel.reschedule(head.task)
            await trio.lowlevel.wait_task_rescheduled(lambda _: self._abort(me))
            self._woken = None
            if not me.look_again:
                break
        self._start(pid, start)

    def _first(self, me: _Waiting) -> bool:
        """Whether request ``me``, just read, goes before every other: none waits or was let
        go ahead of it, and no unread request could come before it (one of a process that
        is not ahead of ``V``). One let go behind it goes back in line and looks again
        once it runs."""
        if me.start > self._vtime and self._unread():
            return False
        if self._waiting and self._waiting[0] < me:
            return False
        woken = self._woken
        if woken is not None and not woken.look_again:
            if woken < me:
                return False
            woken.look_again = True
            heapq.heappush(self._waiting, woken)
        return True

    def _start(self, pid: int, start: int) -> None:
        self._vtime = start
        self._started += 1
        self.served.append(pid)
        if len(self._finish) > PARKED_MAX:  # processes caught up need no entry
            self._finish = {p: f for p, f in self._finish.items() if f > self._vtime}
        if self._waiting:  # never on the quiet path (start_now)
            self._wake_next()

    def _wake_next(self) -> None:
        if self._woken is None:
            head = self._choose()
            if head is not None:
                self._woken = head
                trio.lowlevel.reschedule(head.task)

    def _choose(self) -> _Waiting | None:
        """The waiting request with the smallest tag, taken from the line if it starts now;
        left in it, marked ``look_again``, while an unread request could come before it."""
        if not self._waiting:
            return None
        head = self._waiting[0]
        head.look_again = (head.start > self._vtime and len(self._waiting) < PARKED_MAX
                           and self._idle_rounds < IDLE_ROUNDS_MAX and self._unread())
        if head.look_again:
            self._idle_rounds += 1
        else:
            heapq.heappop(self._waiting)
        return head

    def _abort(self, me: _Waiting) -> trio.lowlevel.Abort:
        """A waiting request cancelled (the daemon stops): it leaves the line."""
        self._waiting.remove(me)
        heapq.heapify(self._waiting)
        return trio.lowlevel.Abort.SUCCEEDED

    def render(self) -> str:
        """debugfs ``accel/turns``: ``serial pid`` of the requests started last, in order."""
        first = self._started - len(self.served) + 1
        return "\n".join(f"{first + i} {pid}" for i, pid in enumerate(self.served))
