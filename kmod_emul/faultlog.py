"""A device's fault log: every record the driver makes, kept, persisted and streamed.

Three readers, one source (:mod:`abi.faults` defines the record):

* ``sys/class/accel/accelN/fault_log``: the last ``KEEP`` records, oldest first, one line each
  (what ``runtime.fault_records()`` and ``accel-smi -q -d ERRORS`` read);
* ``dev/accel-events/accelN``: a blocking, pollable stream of new records, like KFD's
  SMI events and /dev/kmsg: each open is a watcher with its own queue of ``WATCH_QUEUE``
  events; a watcher too slow for its queue reads one ``{"dropped": N, "time": T}`` marker
  where the N events it lost would have been (after the ones it kept); writing ``pid N``
  keeps only that process's records (``pid all`` undoes it);
* ``STATE_DIR/faults/<uuid>.log``: the persistent log, keyed by the device's stable UUID,
  so that a record survives daemon restarts (the daemon reloads it at start).

Who sees what: root sees every record; another user sees the records of their own
processes and the device-wide ones (no pid), as ``processes`` shows a user only theirs.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import trio

from abi import faults
from kmod_emul import limits
from kmod_emul.errors import DriverError

log = logging.getLogger(__name__)

#: Records the in-memory log (and the ``fault_log`` attribute) keeps.
KEEP = 256
#: Events one watcher may have unread before it starts dropping.
WATCH_QUEUE = 256
#: The persistent log is cut back to its last KEEP records past this size.
LOG_MAX_BYTES = 1 << 20
#: Open watchers of one device, and of one process: each holds a queue of up to
#: WATCH_QUEUE records, so opens are bounded like every other table a tenant fills
#: (ENOSPC device-wide, EDQUOT for one process; docs/containment.md).
MAX_WATCHERS = 64
MAX_WATCHERS_PER_PROCESS = 8
#: A blocking read of the event node waits at most this long, then answers EINTR (which
#: read loops retry): a FUSE request the daemon never answers would keep a killed reader
#: from exiting.
READ_SLICE_S = 1.0


def visible(rec: dict[str, Any], uid: int) -> bool:
    """May ``uid`` see ``rec``? Root all; others their own and the device-wide records."""
    return uid == 0 or rec.get("uid") is None or rec.get("uid") == uid


class Watcher:
    """One open of the event node: its queue, its filter, and who waits on it."""

    def __init__(self, flog: FaultLog, uid: int, pid: int, nonblocking: bool) -> None:
        self.flog = flog
        self.uid = uid
        self.owner = pid  # the process that opened it (its share of the watchers)
        self.nonblocking = nonblocking
        self.pid: int | None = None
        #: records to read, and at most one dropped marker, last (the queue is full then)
        self.queue: deque[dict[str, Any]] = deque()
        self._arrived = trio.Event()
        self.poll_handle: Any = None

    def configure(self, text: str) -> None:
        """``pid N``: only process N's records; ``pid all``: every record again."""
        words = text.split()
        if len(words) != 2 or words[0] != "pid" or not (words[1] == "all" or words[1].isdigit()):
            raise DriverError(errno.EINVAL, f"write 'pid N' or 'pid all', not {text.strip()!r}")
        self.pid = None if words[1] == "all" else int(words[1])

    def offer(self, rec: dict[str, Any]) -> None:
        if not visible(rec, self.uid) or (self.pid is not None and rec.get("pid") != self.pid):
            return
        if len(self.queue) < WATCH_QUEUE:
            self.queue.append(rec)
        elif "dropped" in self.queue[-1]:
            self.queue[-1]["dropped"] += 1
        else:
            self.queue.append(faults.dropped_marker(1, time.time()))
        self._arrived.set()
        handle, self.poll_handle = self.poll_handle, None
        if handle is not None:
            handle.notify()

    def ready(self) -> bool:
        return bool(self.queue)

    async def read(self, size: int) -> bytes:
        """Whole lines up to ``size`` bytes (at least one); blocks while there is none."""
        if not self.ready():
            if self.nonblocking:
                raise DriverError(errno.EAGAIN, "no event yet")
            with trio.move_on_after(READ_SLICE_S):
                await self._arrived.wait()
            if not self.ready():
                raise DriverError(errno.EINTR, "no event yet; read again")
        self._arrived = trio.Event()
        out = bytearray()
        while self.queue:
            line = (faults.to_line(self.queue[0]) + "\n").encode()
            if out and len(out) + len(line) > size:
                break
            out += line
            self.queue.popleft()
        if self.ready():
            self._arrived.set()
        return bytes(out)

    def close(self) -> None:
        self.flog.watchers.discard(self)


class FaultLog:
    """The records of one device, their persistent copy, and the watchers to tell."""

    def __init__(self, index: int, uuid: str, state_dir: Path | None) -> None:
        self.index = index
        self.uuid = uuid
        self.path = state_dir / "faults" / f"{uuid}.log" if state_dir is not None else None
        self.records: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self.watchers: set[Watcher] = set()
        #: called with every new record, before the watchers hear of it, while what the
        #: fault left is still there (the device's coredump, kmod_emul/coredump.py)
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.seq = 0
        self._load()

    def _load(self) -> None:
        """The records of earlier daemons, from the persistent log (a torn last line, from
        a daemon killed mid-write, is skipped)."""
        if self.path is None or not self.path.exists():
            return
        for rec in faults.from_lines(self.path.read_text(errors="replace")):
            self.records.append(rec)
            self.seq = max(self.seq, int(rec.get("seq") or 0))
        if self.path.stat().st_size > LOG_MAX_BYTES:
            self._rewrite(self.records)

    def _rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        assert self.path is not None
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(faults.to_line(r) + "\n" for r in records))
        tmp.replace(self.path)

    def report(self, code: int, **fields: Any) -> dict[str, Any]:
        """Record a fault of catalogue ``code``: log it, persist it, tell the watchers."""
        kind = faults.CATALOGUE[code]
        self.seq += 1
        rec = faults.record(kind, device=self.index, device_uuid=self.uuid, seq=self.seq,
                            time=round(time.time(), 6), **fields)
        self.records.append(rec)
        line = faults.to_line(rec)
        level = logging.INFO if kind.severity == faults.Severity.CORRECTED else logging.WARNING
        log.log(level, "accel%d fault %d %s: %s", self.index, kind.code, kind.name, line)
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write(line + "\n")
                if self.path.stat().st_size > LOG_MAX_BYTES:
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
        limits.check(len(self.watchers), 1, MAX_WATCHERS, f"accel{self.index} event watchers",
                     device_wide=True)
        limits.check(sum(w.owner == pid for w in self.watchers), 1, MAX_WATCHERS_PER_PROCESS,
                     f"event watchers of process {pid}", device_wide=False)
        w = Watcher(self, uid, pid, nonblocking)
        self.watchers.add(w)
        return w

    def render(self, uid: int) -> str:
        """The ``fault_log`` attribute: the kept records ``uid`` may see, one line each."""
        return "\n".join(faults.to_line(r) for r in self.records if visible(r, uid))
