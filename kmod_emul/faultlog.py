"""A device's fault log: every record the driver makes, kept, persisted and streamed.

Three readers, one source (:mod:`abi.faults` defines the record):

* ``sys/class/accel/accelN/fault_log``: the records kept, oldest first, one line each
  (what ``runtime.fault_records()`` and ``accel-smi -q -d ERRORS`` read);
* ``dev/accel-events/accelN``: a blocking, pollable stream of new records, like KFD's
  SMI events and /dev/kmsg: each open is a watcher with its own queue, of up to
  ``WATCH_QUEUE`` unread events *per share* (a user's, the device-wide ones: ``_share``),
  so a tenant flooding a watcher too slow for it drops only its own events, never
  another's; the watcher reads one ``{"dropped": N, "share": S, "time": T}`` marker where
  the N events of share S it lost would have been (after the ones it kept); writing
  ``pid N`` keeps only that process's records (``pid all`` undoes it);
* ``STATE_DIR/faults/<uuid>.log``: the persistent log, keyed by the device's stable UUID,
  so that a record survives daemon restarts (the daemon reloads it at start).

Who sees what: root sees every record; another user sees the records of their own
processes and the device-wide ones (no pid), as ``processes`` shows a user only theirs.

Records are evidence, and no tenant may erase another's: the last ``KEEP`` records are kept
*per user*, and the device-wide ones apart, so a tenant faulting in a loop evicts only its
own (``Kept``). Its daemon log lines are rate-limited per device (kmod_emul/ratelimit.py);
the records are not.

A blocking read of the event node holds one of the daemon's FUSE request tasks while it
waits (kmod_emul/daemon.py runs ``MAX_TASKS``), and ``pread(2)`` is not serialised by the
kernel as ``read(2)`` is: so waiting reads are bounded per watcher, per user and
daemon-wide, far below ``MAX_TASKS``, some kept for root (``WaitingReads``), and the
excess is answered at once. Whatever a tenant does with the event node, every other
request finds a task. Watchers are bounded per process, per user and per device, some kept
for root.
"""

from __future__ import annotations

import errno
import heapq
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from abi import faults
from kmod_emul import limits
from kmod_emul.errors import DriverError
from kmod_emul.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

#: Records kept of each user's processes, and of the device-wide records apart (``Kept``).
KEEP = 256
#: Records kept in all, whoever they are of: past it, the oldest of the largest share goes.
#: Only more than MAX_RECORDS // KEEP full shares (users faulting) reach it.
MAX_RECORDS = 16 * KEEP
#: Events of one share (``_share``) one watcher may have unread before it drops that
#: share's; and of all shares (only root's watchers see more than two shares).
WATCH_QUEUE = 256
WATCH_TOTAL = MAX_RECORDS
#: The persistent log is cut back to the records kept once it is past this size, or past
#: twice what the last cut left, whichever is more (so a cut is never redone at once).
LOG_MAX_BYTES = 4 << 20
#: Open watchers of one device, of one user and of one process: each holds a queue of up
#: to WATCH_QUEUE records, so opens are bounded like every other table a tenant fills
#: (ENOSPC device-wide, EDQUOT for one user or process; docs/containment.md). The last
#: ROOT_WATCHERS of the table are root's, and root has no per-user share: one user's
#: processes cannot keep the operator from watching.
MAX_WATCHERS = 64
ROOT_WATCHERS = 16
MAX_WATCHERS_PER_UID = 16
MAX_WATCHERS_PER_PROCESS = 8
#: A blocking read of the event node waits at most this long, then answers EINTR (which
#: read loops retry): a FUSE request the daemon never answers would keep a killed reader
#: from exiting.
READ_SLICE_S = 1.0
#: Blocking reads waiting at once in the daemon (each holds a request task: a quarter of
#: kmod_emul.daemon.MAX_TASKS), of which the last ROOT_WAITING_READS are root's; of one
#: user (root has no share); of one watcher (as read(2) is serialised per open file).
#: Past them a read answers ENOSPC, EDQUOT, EBUSY at once.
MAX_WAITING_READS = 64
ROOT_WAITING_READS = 16
MAX_WAITING_READS_PER_UID = 16
#: A ``pid N`` filter has at most this many digits (pids are below 2**22 on Linux).
PID_DIGITS = 10


def visible(rec: dict[str, Any], uid: int) -> bool:
    """May ``uid`` see ``rec``? Root all; others their own and the device-wide records. A
    record of a context whose owner the driver no longer knew (the context was destroyed
    before the firmware's report of its fault came) is root's: it names no process, but
    it is not device-wide either."""
    owner = rec.get("uid")
    return uid == 0 or owner == uid or (owner is None and rec.get("context") is None)


def _share(rec: dict[str, Any]) -> int | str:
    """Whose share of the kept records ``rec`` is in: its user's, the device's (no
    context), or that of the records whose owner is unknown (see ``visible``)."""
    owner = rec.get("uid")
    if owner is not None:
        return int(owner)
    return "device" if rec.get("context") is None else "unowned"


class Kept:
    """The records kept, by share (``_share``): the last KEEP of each, at most MAX_RECORDS
    in all. A tenant faulting in a loop evicts its own records, never another user's nor
    the device-wide ones: records are evidence. (With one log of the last KEEP, a tenant
    faulting 378-1,116 times a second evicted every other tenant's records.) Each is kept
    with its line, made once: ``fault_log`` is read at every fault a process raises
    (runtime/faults.py), and rendering every record again for each read was most of it."""

    def __init__(self) -> None:
        self._shares: dict[int | str, deque[tuple[dict[str, Any], str]]] = {}
        self._count = 0

    def add(self, rec: dict[str, Any], line: str) -> None:
        share = self._shares.setdefault(_share(rec), deque(maxlen=KEEP))
        if len(share) < KEEP:  # a full share drops its oldest itself
            self._count += 1
        share.append((rec, line))
        while self._count > MAX_RECORDS:
            largest = max(self._shares, key=lambda k: len(self._shares[k]))
            self._shares[largest].popleft()
            self._count -= 1
            if not self._shares[largest]:
                del self._shares[largest]

    def entries(self) -> Iterator[tuple[dict[str, Any], str]]:
        """Every record kept with its line, oldest first (each share is in order)."""
        return heapq.merge(*self._shares.values(), key=lambda e: int(e[0].get("seq") or 0))

    def records(self) -> list[dict[str, Any]]:
        """Every record kept, oldest first."""
        return [rec for rec, _line in self.entries()]


class WaitingReads:
    """The blocking reads of event nodes waiting in this daemon, by user. Each holds one of
    the daemon's FUSE request tasks until an event comes or READ_SLICE_S passes; 8 watchers
    and 400 threads in pread(2) on them, as uid 65534, took every task and a bystander's
    driver round trip went from 0.1 ms to 1-2 s. So at most MAX_WAITING_READS wait (root
    keeps ROOT_WAITING_READS of them), MAX_WAITING_READS_PER_UID of one user, one per
    watcher; the excess is answered at once, and the daemon always has request tasks for
    everyone else. One per daemon (``WAITING``): request tasks are the process's."""

    def __init__(self) -> None:
        self.by_uid: Counter[int] = Counter()

    @contextmanager
    def hold(self, w: Watcher) -> Iterator[None]:
        """Room for one waiting read of ``w``, for as long as the block; DriverError EBUSY
        (its watcher), EDQUOT (its user) or ENOSPC (the daemon) if there is none."""
        if w.waiting:
            raise DriverError(errno.EBUSY, "another read of this watcher is waiting: read "
                                           "it from one thread, or poll")
        if w.uid != 0:
            limits.check(self.by_uid[w.uid], 1, MAX_WAITING_READS_PER_UID,
                         f"waiting event reads of uid {w.uid}", device_wide=False)
        limits.check(self.by_uid.total(), 1,
                     MAX_WAITING_READS - (0 if w.uid == 0 else ROOT_WAITING_READS),
                     "waiting event reads", device_wide=True)
        w.waiting = True
        self.by_uid[w.uid] += 1
        try:
            yield
        finally:
            w.waiting = False
            self.by_uid[w.uid] -= 1
            if not self.by_uid[w.uid]:
                del self.by_uid[w.uid]


WAITING = WaitingReads()


class Watcher:
    """One open of the event node: its queue, its filter, and who waits on it."""

    def __init__(self, flog: FaultLog, uid: int, pid: int, nonblocking: bool) -> None:
        self.flog = flog
        self.uid = uid
        self.owner = pid  # the process that opened it (its share of the watchers)
        self.nonblocking = nonblocking
        self.pid: int | None = None
        #: records and dropped markers to read, in order
        self.queue: deque[dict[str, Any]] = deque()
        #: unread records in ``queue``, by share
        self._unread: Counter[int | str] = Counter()
        #: each share's dropped marker still counting: unread, and no record of its share
        #: queued after it (a later drop goes after that record, in a marker of its own)
        self._counting: dict[int | str, dict[str, Any]] = {}
        self._arrived = trio.Event()
        self.waiting = False  # a read of it waits (WaitingReads)
        self.poll_handle: Any = None

    def configure(self, text: str) -> None:
        """``pid N``: only process N's records; ``pid all``: every record again. N is ASCII
        digits, at most PID_DIGITS of them: ``str.isdigit`` also takes ``²`` and other
        digits ``int`` refuses, and ``int`` refuses more than 4,300 digits."""
        words = text.split()
        if len(words) != 2 or words[0] != "pid" or not (words[1] == "all" or (
                words[1].isascii() and words[1].isdigit() and len(words[1]) <= PID_DIGITS)):
            raise DriverError(errno.EINVAL,
                              f"write 'pid N' or 'pid all', not {text.strip()[:40]!r}")
        self.pid = None if words[1] == "all" else int(words[1])

    def offer(self, rec: dict[str, Any]) -> None:
        if not visible(rec, self.uid) or (self.pid is not None and rec.get("pid") != self.pid):
            return
        share = _share(rec)
        if self._unread[share] < WATCH_QUEUE and self._unread.total() < WATCH_TOTAL:
            self.queue.append(rec)
            self._unread[share] += 1
            self._counting.pop(share, None)
        elif (marker := self._counting.get(share)) is not None:
            marker["dropped"] += 1
        else:
            marker = self._counting[share] = faults.dropped_marker(1, time.time(), share)
            self.queue.append(marker)
        self._arrived.set()
        handle, self.poll_handle = self.poll_handle, None
        if handle is not None:
            handle.notify()

    def ready(self) -> bool:
        return bool(self.queue)

    async def read(self, size: int) -> bytes:
        """Whole lines up to ``size`` bytes, at least one: blocks while there is none; a
        ``size`` shorter than the next line answers EINVAL and leaves it for the next read,
        as /dev/kmsg does."""
        if not self.ready():
            await self._wait()
        out = bytearray()
        while self.queue:
            line = (faults.to_line(self.queue[0]) + "\n").encode()
            if len(out) + len(line) > size:
                break
            out += line
            self._taken(self.queue.popleft())
        if not out:
            raise DriverError(errno.EINVAL, f"a read of {size} bytes is shorter than the next "
                                            f"event ({len(line)} bytes)")
        return bytes(out)

    def _taken(self, event: dict[str, Any]) -> None:
        if "dropped" in event:
            if self._counting.get(event["share"]) is event:
                del self._counting[event["share"]]
        else:
            self._unread[_share(event)] -= 1

    async def _wait(self) -> None:
        """Until there is an event: EAGAIN at once if non-blocking, EINTR after
        READ_SLICE_S, EBUSY/EDQUOT/ENOSPC at once past the bounds of ``WaitingReads``."""
        if self.nonblocking:
            raise DriverError(errno.EAGAIN, "no event yet")
        with WAITING.hold(self), trio.move_on_after(READ_SLICE_S):
            while not self.ready():
                self._arrived = trio.Event()
                await self._arrived.wait()
        if not self.ready():
            raise DriverError(errno.EINTR, "no event yet; read again")

    def close(self) -> None:
        self.flog.watchers.discard(self)


class FaultLog:
    """The records of one device, their persistent copy, and the watchers to tell."""

    def __init__(self, index: int, uuid: str, state_dir: Path | None) -> None:
        self.index = index
        self.uuid = uuid
        self.path = state_dir / "faults" / f"{uuid}.log" if state_dir is not None else None
        self.kept = Kept()
        self.watchers: set[Watcher] = set()
        #: called with every new record, before the watchers hear of it, while what the
        #: fault left is still there (the device's coredump, kmod_emul/coredump.py)
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.seq = 0
        self._log = RateLimitedLog(log, f"accel{index}", "fault records")
        self._cut_at = LOG_MAX_BYTES
        self._load()

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every record kept, oldest first."""
        return self.kept.records()

    def _load(self) -> None:
        """The records of earlier daemons, from the persistent log (a torn last line, from
        a daemon killed mid-write, is skipped)."""
        if self.path is None or not self.path.exists():
            return
        for rec in faults.from_lines(self.path.read_text(errors="replace")):
            self.kept.add(rec, faults.to_line(rec))
            self.seq = max(self.seq, int(rec.get("seq") or 0))
        if self.path.stat().st_size > self._cut_at:
            self._rewrite(self.records)

    def _rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        assert self.path is not None
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(faults.to_line(r) + "\n" for r in records))
        tmp.replace(self.path)
        self._cut_at = max(LOG_MAX_BYTES, 2 * self.path.stat().st_size)

    def report(self, code: int, **fields: Any) -> dict[str, Any]:
        """Record a fault of catalogue ``code``: log it, persist it, tell the watchers."""
        kind = faults.CATALOGUE[code]
        self.seq += 1
        rec = faults.record(kind, device=self.index, device_uuid=self.uuid, seq=self.seq,
                            time=round(time.time(), 6), **fields)
        line = faults.to_line(rec)
        self.kept.add(rec, line)
        level = logging.INFO if kind.severity == faults.Severity.CORRECTED else logging.WARNING
        self._log.log(level, "accel%d fault %d %s: %s", self.index, kind.code, kind.name, line)
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write(line + "\n")
                if self.path.stat().st_size > self._cut_at:
                    self._rewrite(self.records)
            except OSError as exc:  # a full disk must not lose the device
                log.error("accel%d: cannot persist a fault record: %s", self.index, exc)
        for listen in self.listeners:
            listen(rec)
        for w in list(self.watchers):
            w.offer(rec)
        return rec

    def watch(self, uid: int, pid: int, nonblocking: bool) -> Watcher:
        """A new watcher for process ``pid`` of user ``uid`` (an open of the event node)."""
        limits.check(len(self.watchers), 1, MAX_WATCHERS - (0 if uid == 0 else ROOT_WATCHERS),
                     f"accel{self.index} event watchers", device_wide=True)
        if uid != 0:
            limits.check(sum(w.uid == uid for w in self.watchers), 1, MAX_WATCHERS_PER_UID,
                         f"event watchers of uid {uid}", device_wide=False)
        limits.check(sum(w.owner == pid for w in self.watchers), 1, MAX_WATCHERS_PER_PROCESS,
                     f"event watchers of process {pid}", device_wide=False)
        w = Watcher(self, uid, pid, nonblocking)
        self.watchers.add(w)
        return w

    def render(self, uid: int) -> str:
        """The ``fault_log`` attribute: the kept records ``uid`` may see, one line each."""
        return "\n".join(line for rec, line in self.kept.entries() if visible(rec, uid))
