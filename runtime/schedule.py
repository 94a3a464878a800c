"""The schedule this process asks the firmware for, from the environment
(docs/schedule.md):

* ``ACCEL_SCHEDULE=adversarial:SEED`` (or ``default``): the firmware delays this
  process's packets and reorders its queues, seeded, within the contract;
* ``ACCEL_RECORD=PATH``: the decisions the firmware applied are written to PATH (JSON)
  when the process exits;
* ``ACCEL_REPLAY=PATH``: the firmware applies exactly the decisions PATH lists, so the
  recorded schedule, and the failure it caused, happens again.

A recording also lists the faults an operator injected into this process's contexts
(``fault`` entries, whose value is what the operator wrote after ``inject``); a replay
injects them again at the same packets, as far as the driver lets a process hurt itself.

Every context the process makes asks for the same schedule (``CTX_CREATE``'s ``schedule``,
``seed`` and ``schedule_fd``, abi/schedule.py); other processes keep theirs. The
variables are read when the first context is made; a malformed one raises
:class:`~runtime.errors.InvalidValueError` there, naming it.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from abi import schedule as sched
from abi.schedule import Decision, Entry
from runtime._shm import sealed_memfd
from runtime.errors import InvalidValueError

SCHEDULE_ENV = "ACCEL_SCHEDULE"
RECORD_ENV = "ACCEL_RECORD"
REPLAY_ENV = "ACCEL_REPLAY"
#: a recording's ``format`` (and its ``version``): what ``ACCEL_REPLAY`` accepts
FORMAT = "accel-schedule"
VERSION = 1
_KINDS = {d.name.lower(): d for d in Decision}


@dataclass
class Plan:
    """What the environment asked for, and the tables of the contexts made so far."""

    mode: sched.Mode
    seed: int = 0
    record: str | None = None
    #: a replay's decisions, by physical device (accel0, ...)
    replay: dict[str, list[Entry]] = field(default_factory=dict)
    #: the decision table of each context made, by physical device
    tables: dict[str, list[int]] = field(default_factory=dict)
    pid: int = field(default_factory=os.getpid)

    @property
    def name(self) -> str:
        return f"adversarial:{self.seed}" if self.mode == sched.Mode.ADVERSARIAL \
            else self.mode.name.lower()

    def ctx_fields(self, physical: str) -> dict[str, int]:
        """``accel_ctx_create``'s schedule fields for a context on ``physical``; the
        caller closes ``schedule_fd`` once the driver took it (ours stays, for the
        recording)."""
        flags = int(self.mode) | (sched.SCHED_RECORD if self.record else 0)
        if self.mode != sched.Mode.REPLAY and not self.record:
            return {"schedule": flags, "seed": self.seed, "schedule_fd": -1}
        fd = sealed_memfd(f"schedule-{physical}", sched.SCHED_FILE_SIZE)
        # the faults first: a table too small for every decision still holds them
        entries = sorted(self.replay.get(physical, []),
                         key=lambda e: e.kind != Decision.FAULT)[:sched.SCHED_CAPACITY]
        words = [w for e in entries for w in sched.entry_words(e)]
        os.pwrite(fd, _u64s(words), sched.SCHED_ENTRIES)
        os.pwrite(fd, _u64s([len(entries)]), sched.SCHED_COUNT)
        if self.record:
            self.tables.setdefault(physical, []).append(os.dup(fd))
        return {"schedule": flags, "seed": self.seed, "schedule_fd": fd}

    def dump(self) -> None:
        """Write the recording (at exit): each context's decisions as its firmware noted
        them, in the order applied, then the faults the driver noted for it."""
        if self.record is None or os.getpid() != self.pid:
            return
        devices: dict[str, Any] = {}
        for physical, fds in self.tables.items():
            decisions: list[list[Any]] = []
            dropped = 0
            for fd in fds:
                head = [int.from_bytes(os.pread(fd, 8, off), "little")
                        for off in (sched.SCHED_COUNT, sched.SCHED_DROPPED,
                                    sched.SCHED_FAULT_COUNT)]
                count, lost, faults = head
                dropped += lost + max(0, faults - sched.SCHED_FAULT_CAPACITY)
                for base, n in ((sched.SCHED_ENTRIES, min(count, sched.SCHED_CAPACITY)),
                                (sched.SCHED_FAULT_ENTRIES,
                                 min(faults, sched.SCHED_FAULT_CAPACITY))):
                    decisions.extend(_entries(fd, base, n))
            devices[physical] = {"decisions": decisions, "dropped": dropped}
        with open(self.record, "w") as f:
            f.write(dumps({"format": FORMAT, "version": VERSION, "schedule": self.name,
                           "devices": devices}))


def dumps(doc: dict[str, Any]) -> str:
    """A recording's text: JSON with one decision a line (diffable, easy to edit)."""
    head = {k: v for k, v in doc.items() if k != "devices"}
    lines = [json.dumps(head)[:-1] + ', "devices": {']
    for i, (physical, dev) in enumerate(doc["devices"].items()):
        rows = ",\n".join("   " + json.dumps(d) for d in dev["decisions"])
        lines.append(f' {json.dumps(physical)}: {{"dropped": {dev["dropped"]}, "decisions": ['
                     + (f"\n{rows}\n  " if rows else "") + "]}"
                     + ("," if i < len(doc["devices"]) - 1 else ""))
    lines.append("}}")
    return "\n".join(lines) + "\n"


def _u64s(words: list[int]) -> bytes:
    return b"".join(w.to_bytes(8, "little") for w in words)


def _entries(fd: int, base: int, count: int) -> list[list[Any]]:
    """``count`` table entries from offset ``base``, as a recording lists them:
    ``[queue, seqno, kind, value]``, a fault's value its text (``schedule.fault_text``)."""
    raw = os.pread(fd, count * sched.SCHED_ENTRY_SIZE, base)
    out: list[list[Any]] = []
    for i in range(count):
        w = [int.from_bytes(raw[32 * i + 8 * j: 32 * i + 8 * j + 8], "little")
             for j in range(4)]
        e = sched.entry_of(w)
        value = sched.fault_text(e.value, e.address) if e.kind == Decision.FAULT else e.value
        out.append([e.queue, e.seqno, e.kind.name.lower(), value])
    return out


def load_recording(path: str) -> dict[str, list[Entry]]:
    """A recording's decisions by device; InvalidValueError naming ``ACCEL_REPLAY`` and
    what is wrong when it cannot be read or is not a recording."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise InvalidValueError(f"{REPLAY_ENV}={path}: cannot read it: {exc.strerror}") \
            from None
    try:
        doc = json.loads(text)
        return parse_recording(doc)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise InvalidValueError(
            f"{REPLAY_ENV}={path}: not an {FORMAT} recording of version {VERSION}: "
            f"{exc}") from None


def parse_recording(doc: Any) -> dict[str, list[Entry]]:
    """The decisions of a recording's JSON document (ValueError: not one)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError("format or version missing or wrong")
    out: dict[str, list[Entry]] = {}
    for physical, dev in doc["devices"].items():
        entries = []
        for d in dev["decisions"]:
            queue, seqno, kind, value = d
            address = 0
            if kind == "fault":  # its value is its text, what ras_ctrl takes after inject
                try:
                    value, address = sched.parse_fault_text(value)
                except ValueError as exc:
                    raise ValueError(f"bad decision {d!r} of {physical}: {exc}") from None
            if kind not in _KINDS or not all(
                    isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32
                    for v in (queue, seqno, value)):
                raise ValueError(f"bad decision {d!r} of {physical}")
            entries.append(Entry(queue, seqno, _KINDS[kind], value, address))
        out[str(physical)] = entries
    return out


def parse_schedule(value: str) -> tuple[sched.Mode, int]:
    """``ACCEL_SCHEDULE``'s mode and seed; InvalidValueError for anything else."""
    v = value.strip()
    if v in ("", "default"):
        return sched.Mode.DEFAULT, 0
    name, sep, seed = v.partition(":")
    if name == "adversarial" and sep and seed.isdigit() and int(seed) < 2**64:
        return sched.Mode.ADVERSARIAL, int(seed)
    raise InvalidValueError(
        f"{SCHEDULE_ENV}={value!r}: expected 'default' or 'adversarial:SEED' with SEED a "
        f"decimal integer below 2**64")


_plan: Plan | None = None
_lock = threading.Lock()


def plan() -> Plan:
    """The process's schedule, read from the environment once (the first context)."""
    global _plan
    with _lock:
        if _plan is None or _plan.pid != os.getpid():
            _plan = _from_environment()
            if _plan.record is not None:
                atexit.register(_plan.dump)
        return _plan


def _from_environment() -> Plan:
    env = os.environ
    mode, seed = parse_schedule(env.get(SCHEDULE_ENV, ""))
    replay_path = env.get(REPLAY_ENV) or None
    replay: dict[str, list[Entry]] = {}
    if replay_path is not None:
        if mode != sched.Mode.DEFAULT:
            raise InvalidValueError(
                f"{REPLAY_ENV} and {SCHEDULE_ENV}={env[SCHEDULE_ENV]!r} are exclusive: a "
                f"replay makes exactly the recorded decisions")
        mode, replay = sched.Mode.REPLAY, load_recording(replay_path)
    return Plan(mode, seed, env.get(RECORD_ENV) or None, replay)
