"""This process's fault records: the ones its exceptions carried, and the driver's.

A record (``abi.faults``) reaches a process two ways: the exception that raised it carries
it (built here from the ring's fault words, at once), and the driver keeps its own copy in
the device's ``fault_log`` (from the firmware's report, a moment later; it also has the
faults nobody synchronised on yet, and the device-wide ones). ``fault_records()`` merges the
two, one record per fault, the driver's copy first where both exist.

Which of the driver's records are this process's: those of a context it made (ids are the
driver's, unique per daemon run, so a record must also be no older than the context), and
the context-, device- and package-scope records that list one of them as lost.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any

from abi import faults
from runtime import discovery

#: Records this process raised, newest last (bounded: a loop that faults forever must not
#: grow the process).
_RAISED: deque[dict[str, Any]] = deque(maxlen=1024)
#: physical device -> {context id: wall-clock time it was made}, for every context of
#: this process (alive or not)
_CONTEXTS: dict[str, dict[int, float]] = {}
_lock = threading.Lock()


def context_made(physical: str, ctx_id: int) -> None:
    with _lock:
        _CONTEXTS.setdefault(physical, {})[ctx_id] = time.time()


def after_fork_in_child() -> None:
    """A child made none of its parent's contexts and raised none of its faults."""
    _RAISED.clear()
    _CONTEXTS.clear()


def raised(rec: dict[str, Any]) -> dict[str, Any]:
    """Keep a record this process is about to raise (once: a lost context raises its loss
    on every later use); returns it."""
    key = _key(rec)
    if not any(_key(r) == key for r in _RAISED):
        _RAISED.append(rec)
    return rec


def driver_records(physical: str) -> list[dict[str, Any]]:
    """The device's fault log as this user may see it (oldest first); [] if unreadable."""
    try:
        text = discovery.read_attr(physical, "fault_log")
    except OSError:
        return []
    return faults.from_lines(text)


def _mine(rec: dict[str, Any], made: dict[int, float]) -> bool:
    when = rec.get("time") or 0.0
    ids = [rec.get("context"), *(rec.get("contexts") or ())]
    return any(i in made and when >= made[i] - 1.0 for i in ids if i is not None)


def loss_record(physical: str, ctx_id: int) -> dict[str, Any] | None:
    """The driver's record of the fault that lost context ``ctx_id``, if it has one: the
    first that lists it (a reset that follows its cause names it again)."""
    made = {ctx_id: _CONTEXTS.get(physical, {}).get(ctx_id, 0.0)}
    for rec in driver_records(physical):
        if rec.get("scope") in ("context", "device", "package") and _mine(rec, made):
            return rec
    return None


def _key(rec: dict[str, Any]) -> tuple[Any, ...]:
    return (rec.get("device_uuid"), rec.get("code"), rec.get("context"), rec.get("queue"),
            rec.get("seqno"), rec.get("seq") if rec.get("queue") is None else None)


def records(physicals: list[str], device_uuids: set[str]) -> list[dict[str, Any]]:
    """This process's records on those devices, oldest first."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for physical in physicals:
        made = dict(_CONTEXTS.get(physical, {}))
        for rec in driver_records(physical):
            if rec.get("pid") in (None, os.getpid()) and _mine(rec, made):
                merged[_key(rec)] = rec
    for rec in list(_RAISED):
        if rec.get("device_uuid") in device_uuids:
            merged.setdefault(_key(rec), rec)
    return sorted(merged.values(), key=lambda r: r.get("time") or 0.0)
