"""This process's fault records: the driver's, as its exceptions carried them and as the
device's ``fault_log`` keeps them.

A fault has one record, and the driver makes it (kmod_emul/faultlog.py ``FaultLog.report``,
from the firmware's report or its own finding); docs/faults.md "Life of a fault" follows
one. The runtime reads it, never builds its own: a queue fault's exception carries the
record ``queue_fault_record`` finds in ``fault_log`` (the ring's fault words only say
which packet: the firmware writes them first, then reports to the driver, so the record
may be an interrupt behind), a lost context's the record ``loss_record`` finds. The one
record the runtime makes is DRIVER_GONE: when the daemon died there is no driver to ask.
``fault_records()`` lists the driver's records of this process, and the ones its
exceptions carried that the log no longer keeps, one per fault.

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


#: How long a raise waits for the driver's record of a fault its ring already shows (the
#: driver records it once the firmware's report reaches it); past it, the driver is gone
#: or wedged, and the exception carries no record.
RECORD_WAIT_S = 2.0


def queue_fault_record(physical: str, ctx_id: int, queue_id: int, seqno: int) -> dict[str, Any]:
    """The driver's record of the fault queue ``queue_id`` of context ``ctx_id`` showed
    at ``seqno`` (kept as raised); ``{}`` if none comes within RECORD_WAIT_S. Ids start
    again with each daemon, whose persistent log keeps an earlier one's records: a record
    older than the context is another's."""
    made = {ctx_id: _CONTEXTS.get(physical, {}).get(ctx_id, 0.0)}
    marks = (f'"queue":{queue_id},', f'"context":{ctx_id},', f'"seqno":{seqno},')
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        try:
            lines = discovery.read_attr(physical, "fault_log").splitlines()
        except OSError:  # no driver to ask (the daemon died): nothing will come
            return {}
        for line in reversed(lines):  # newest first; parse only the candidate's line
            if all(m in line for m in marks):
                rec = faults.from_line(line)
                if (rec.get("context"), rec.get("queue"), rec.get("seqno")) == \
                        (ctx_id, queue_id, seqno) and _mine(rec, made):
                    return raised(rec)
        if time.monotonic() >= deadline:
            return {}
        time.sleep(0.001)


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
