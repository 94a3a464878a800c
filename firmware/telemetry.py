"""What the firmware tells the outside about itself: its counters and its error log.

The counters are the device's statistics block (``abi.mailbox.STAT_NAMES``, which the
driver shows in sysfs and accel-smi). Every firmware thread moves them -- the control loop
(inline packets, faults of a ring), the engines (copies, launches, preemptions, the JIT's
figures), the managed-memory residency -- and the control loop publishes them. A
read-modify-write of a shared dict from several threads can lose an update, so each goes
through :class:`Counters`, under its one lock. The control loop, the hot path, counts
what it runs inline into a :class:`Tally` of its own, without a lock, and merges it once
per pass: one lock per pass instead of one or two per packet (the counters may lag the
rings by at most that pass; the control loop publishes them between passes).
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Iterable

from abi import mailbox


class Counters:
    """Named counters that any thread may move; ``snapshot`` is a consistent copy."""

    def __init__(self, names: Iterable[str]) -> None:
        self._values = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def peak(self, name: str, value: int) -> None:
        """Raise ``name`` to ``value`` if that is more: a high-water mark, or a copy of a
        count kept elsewhere (the JIT's), which a late writer holding an older reading
        must not move back."""
        with self._lock:
            self._values[name] = max(self._values[name], value)

    def merge(self, deltas: dict[str, int]) -> None:
        """Add every count of ``deltas`` in one step (the control loop's, once a pass)."""
        values, lock = self._values, self._lock
        lock.acquire()  # not ``with``: twice the cost, on every pass
        try:
            for name, n in deltas.items():
                values[name] += n
        finally:
            lock.release()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class EngineTime:
    """One context's engine time by kind (``abi.mailbox.ENGINE_KINDS``), moved by the
    engines and the control loop: the DRM fdinfo ``drm-engine-<kind>`` figures."""

    def __init__(self) -> None:
        self._ns = dict.fromkeys(mailbox.ENGINE_KINDS, 0)
        self._lock = threading.Lock()

    def add(self, kind: str, ns: int) -> None:
        with self._lock:
            self._ns[kind] += ns

    def snapshot(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._ns[k] for k in mailbox.ENGINE_KINDS)


class Tally:
    """Counts one thread keeps without a lock until it merges them (``flush``)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        counts = self._counts
        counts[name] = counts.get(name, 0) + n

    def flush(self, into: Counters) -> None:
        if self._counts:
            into.merge(self._counts)
            self._counts = {}


_LOG_LIMIT = 20  # unexpected errors logged per firmware, then only counted
_log_count = itertools.count()


def log_unexpected(what: str, exc: BaseException) -> None:
    """A hostile input (or a firmware bug) raised something unexpected: it became a fault
    of the packet's queue; say so in the firmware's log, a bounded number of times."""
    if next(_log_count) < _LOG_LIMIT:
        print(f"firmware: {what}: {exc!r}", file=sys.stderr, flush=True)
