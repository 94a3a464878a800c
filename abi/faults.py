"""Fault records and their catalogue: what every layer says about a fault, defined once.

A distributed job decides from a fault whether to retry a request, restart a rank or
terminate (NVIDIA's Xid catalogue and NVML recovery actions, amdgpu RAS). So every fault
the stack reports -- a queue fault the firmware found, a memory error, a firmware death, a
reset -- becomes one *record* with the same fields wherever it is read: the exception that
carries it (``DeviceFaultError.record``), ``runtime.fault_records()``, the driver's event
node and persistent log, and ``accel-smi -q -d ERRORS``.

Each record has a catalogue ``code`` (Xid-like: numbers follow NVIDIA's where the meaning is
the same, so an operator's runbook reads across). The code fixes the block, the severity,
the reset scope and the recovery action; docs/faults.md has the table this module is.

A record travels as one JSON object on one text line (:func:`to_line`), which is what the
event node streams and the log keeps.
"""

from __future__ import annotations

import enum
import errno as _errno
import json
from dataclasses import dataclass
from typing import Any, Final


class Severity(enum.StrEnum):
    """How bad, in the RAS sense (amdgpu: ce / ue; NVIDIA: contained / uncontained)."""

    #: Corrected by the hardware: nothing was lost; counted, and a trend may retire a page.
    CORRECTED = "corrected"
    #: Not corrected, but the damage is confined to the scope named (its owner is told).
    CONTAINED = "uncorrected-contained"
    #: Not corrected and not confined: every user of the device is affected.
    UNCONTAINED = "uncorrected-uncontained"
    #: The device (or its firmware) stopped; nothing on it survives.
    FATAL = "fatal"


class Scope(enum.StrEnum):
    """How far the consequence reaches (the seed's scope table; docs/faults.md)."""

    OPERATION = "operation"  #: the one call or packet; the same stream goes on
    QUEUE = "queue"  #: the stream: later work cancelled; rebuild the stream
    CONTEXT = "context"  #: one context's allocations, queues and modules
    DEVICE = "device"  #: every context on the (logical) device; the device resets
    PACKAGE = "package"  #: the package and the link domain: peers drained, then reset


class Action(enum.StrEnum):
    """What the application or the job should do (NVML's recovery-action ladder)."""

    NONE = "none"  #: carry on
    RESTART_APP = "restart-app"  #: rebuild what the scope lost (here: a stream, recover())
    RESET_DEVICE = "reset-device"  #: the device must be reset (the driver may do it itself)
    DRAIN_AND_RESET = "drain-and-reset"  #: drain the peers that share the link, then reset
    REBOOT_NODE = "reboot-node"  #: nothing short of a node reboot recovers


#: The blocks a fault is attributed to (and ``ras_ctrl`` injects into).
BLOCKS: Final = ("memory", "compute", "copy", "link", "firmware", "thermal")


@dataclass(frozen=True)
class Kind:
    """One catalogue entry."""

    code: int
    name: str
    block: str
    severity: Severity
    scope: Scope
    action: Action
    meaning: str


_C, _U, _X, _F = Severity.CORRECTED, Severity.CONTAINED, Severity.UNCONTAINED, Severity.FATAL
_KINDS = (
    Kind(13, "ILLEGAL_PACKET", "compute", _U, Scope.QUEUE, Action.RESTART_APP,
         "a packet or kernel the device refused (bad opcode, argument block, kernel image)"),
    Kind(31, "PAGE_FAULT", "memory", _U, Scope.QUEUE, Action.RESTART_APP,
         "an access outside the context's mappings (kernel or copy)"),
    Kind(43, "KERNEL_TIMEOUT", "compute", _U, Scope.QUEUE, Action.RESTART_APP,
         "a kernel ran past the watchdog and was stopped"),
    Kind(45, "QUEUE_UNMAPPABLE", "firmware", _U, Scope.QUEUE, Action.RESTART_APP,
         "the firmware could not map the queue's ring; the queue never runs"),
    Kind(47, "QUEUE_WAIT_TIMEOUT", "firmware", _U, Scope.QUEUE, Action.RESTART_APP,
         "a queue's wait for a value the host writes (WAIT_VALUE) ran past its timeout"),
    Kind(46, "MAP_FAILED", "firmware", _U, Scope.OPERATION, Action.RESTART_APP,
         "the firmware could not map an allocation MEM_ALLOC made: packets that touch it "
         "fault (EFAULT); free it and allocate again"),
    Kind(48, "MEMORY_UE_FREE", "memory", _U, Scope.OPERATION, Action.NONE,
         "an uncorrectable memory error in memory nobody held: the page is retired"),
    Kind(63, "PAGE_RETIRED", "memory", _C, Scope.OPERATION, Action.NONE,
         "a page was retired (excluded from allocation, kept across restarts)"),
    Kind(64, "PAGE_RETIREMENT_PENDING", "memory", _C, Scope.OPERATION, Action.RESET_DEVICE,
         "a page to retire is in use: it is retired at the next reset"),
    Kind(65, "PAGE_RETIREMENT_FAILED", "memory", _X, Scope.OPERATION, Action.RESET_DEVICE,
         "a page to retire could not be (the bad-page table is full): it stays in service"),
    Kind(74, "LINK_ERROR", "link", _X, Scope.PACKAGE, Action.DRAIN_AND_RESET,
         "an uncorrectable link error: peers on the link are drained, the package resets"),
    Kind(76, "LINK_DOWN", "link", _U, Scope.QUEUE, Action.RESTART_APP,
         "a peer copy met a link that is down"),
    Kind(79, "FIRMWARE_DIED", "firmware", _F, Scope.DEVICE, Action.RESET_DEVICE,
         "the firmware process exited (NVIDIA: fallen off the bus)"),
    Kind(92, "MEMORY_CE", "memory", _C, Scope.OPERATION, Action.NONE,
         "a correctable memory error; a second one at the same page retires it"),
    Kind(94, "MEMORY_UE_CONTAINED", "memory", _U, Scope.CONTEXT, Action.RESTART_APP,
         "an uncorrectable memory error in one context's memory: that context is lost"),
    Kind(95, "MEMORY_UE_UNCONTAINED", "memory", _X, Scope.DEVICE, Action.RESET_DEVICE,
         "an uncorrectable memory error in memory several contexts share: device reset"),
    Kind(119, "FIRMWARE_HANG", "firmware", _F, Scope.DEVICE, Action.RESET_DEVICE,
         "the firmware stopped heart-beating"),
    Kind(120, "DEVICE_RESET", "firmware", _F, Scope.DEVICE, Action.RESTART_APP,
         "the device was reset (requested, or the driver's recovery); its contexts are lost"),
    Kind(121, "COMPUTE_CE", "compute", _C, Scope.OPERATION, Action.NONE,
         "a correctable error in a compute engine"),
    Kind(122, "COMPUTE_UE", "compute", _X, Scope.DEVICE, Action.RESET_DEVICE,
         "an uncorrectable compute-engine error: the firmware worker is quarantined, reset"),
    Kind(123, "COPY_CE", "copy", _C, Scope.OPERATION, Action.NONE,
         "a correctable error in a copy engine"),
    Kind(124, "COPY_UE", "copy", _X, Scope.DEVICE, Action.RESET_DEVICE,
         "an uncorrectable copy-engine error: the device resets"),
    Kind(125, "LINK_CE", "link", _C, Scope.OPERATION, Action.NONE,
         "a correctable link error (the transfer was replayed)"),
    Kind(126, "FIRMWARE_CE", "firmware", _C, Scope.OPERATION, Action.NONE,
         "a correctable error in the firmware's memory"),
    Kind(127, "FIRMWARE_UE", "firmware", _F, Scope.DEVICE, Action.RESET_DEVICE,
         "an uncorrectable firmware error: the firmware halts, the device resets"),
    Kind(128, "DEVICE_REMOVED", "firmware", _F, Scope.DEVICE, Action.RESTART_APP,
         "the device was removed (a partition a mode change or its rollback took away); its "
         "contexts are lost and its open files answer ENODEV"),
    Kind(130, "DRIVER_GONE", "firmware", _F, Scope.DEVICE, Action.RESET_DEVICE,
         "the daemon serving the device died; start accel-emud again, then recover()"),
    Kind(140, "THERMAL_THROTTLE", "thermal", _C, Scope.OPERATION, Action.NONE,
         "over the slowdown temperature: clocks are throttled"),
    Kind(141, "THERMAL_SHUTDOWN", "thermal", _F, Scope.DEVICE, Action.RESET_DEVICE,
         "over the shutdown temperature: the device stopped; it serves again once reset"),
)
#: code -> its entry
CATALOGUE: Final[dict[int, Kind]] = {k.code: k for k in _KINDS}
#: name -> its entry
BY_NAME: Final[dict[str, Kind]] = {k.name: k for k in _KINDS}

#: Every field a record has, in the order a line shows them (None where it does not apply).
#: ``seq`` numbers a device's records (persisted: it goes on across daemon restarts);
#: ``contexts`` lists the contexts a context-, device- or package-scope fault lost; ``uid``
#: is the owning process's user (who may see the record); ``origin`` is None for a fault the
#: device or a tenant met, ``requested`` for a reset someone asked for (not dumped),
#: ``diag`` for a fault of a diagnostic's context (``ACCEL_CTX_DIAGNOSTIC``: provoked on
#: purpose, not counted as a tenant's), ``replay`` for one a replayed schedule injected.
FIELDS: Final = (
    "seq", "code", "name", "device", "device_uuid", "engine", "queue", "context", "pid",
    "uid", "seqno", "address", "bank", "link", "errno", "opcode", "severity", "corrected",
    "scope", "action", "contexts", "origin", "time", "message",
)

#: ``origin`` of a reset someone asked for (sysfs ``reset``, ``accel-smi -r``, DEVICE_RESET).
ORIGIN_REQUESTED: Final = "requested"
#: ``origin`` of a record of a diagnostic's context (``uapi.ACCEL_CTX_DIAGNOSTIC``).
ORIGIN_DIAG: Final = "diag"
#: ``origin`` of a fault a replayed schedule injected (``ACCEL_REPLAY``, docs/schedule.md):
#: the process's own recording asked for it, no hardware failed again.
ORIGIN_REPLAY: Final = "replay"

#: Banks device memory is interleaved over (``bank`` of a memory fault).
MEMORY_BANKS: Final = 8


def bank_of(offset: int, memory_total: int) -> int:
    """The bank holding byte ``offset`` of a device's memory (contiguous bank ranges)."""
    return min(MEMORY_BANKS - 1, offset * MEMORY_BANKS // max(1, memory_total))


def queue_fault_kind(code: int, opcode_name: str = "") -> Kind:
    """The catalogue entry of a packet (opcode ``opcode_name``) that faulted with errno
    ``code``: a timeout is a kernel's, or a WAIT_VALUE's."""
    if code == _errno.EFAULT:
        return CATALOGUE[31]
    if code in (_errno.ETIMEDOUT, _errno.ETIME):
        return CATALOGUE[47 if opcode_name == "WAIT_VALUE" else 43]
    if code == _errno.ENOLINK:
        return CATALOGUE[76]
    return CATALOGUE[13]


def engine_of(opcode_name: str) -> str:
    """The engine kind a packet runs on (the scheduler runs the rest inline)."""
    if opcode_name == "LAUNCH":
        return "compute"
    if opcode_name in ("COPY", "MEMSET", "PREFETCH"):
        return "copy"
    return "scheduler"


def record(kind: Kind, **fields: Any) -> dict[str, Any]:
    """A record of ``kind``: every field of ``FIELDS``, the catalogue's filled in,
    ``fields`` given, the rest None. Unknown fields are a bug of the caller."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise TypeError(f"not fields of a fault record: {sorted(unknown)}")
    rec: dict[str, Any] = dict.fromkeys(FIELDS)
    rec.update(code=kind.code, name=kind.name, engine=kind.block,
               severity=str(kind.severity), corrected=kind.severity == Severity.CORRECTED,
               scope=str(kind.scope), action=str(kind.action), message=kind.meaning)
    rec.update(fields)
    return rec


def to_line(rec: dict[str, Any]) -> str:
    """One record (or event) as one text line, without the newline."""
    return json.dumps(rec, separators=(",", ":"))


def from_line(line: str) -> dict[str, Any]:
    """A line of the event node or the log back as a record (or a ``dropped`` marker)."""
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError(f"not a fault record: {line!r}")
    return value


def from_lines(text: str) -> list[dict[str, Any]]:
    """Every record of a log (``fault_log``, the persistent file), oldest first; a line
    that does not parse -- the torn last line of a daemon killed mid-write -- is skipped."""
    out = []
    for line in text.splitlines():
        try:
            out.append(from_line(line))
        except ValueError:
            continue
    return out


def dropped_marker(count: int, time: float, share: int | str) -> dict[str, Any]:
    """The event a watcher reads in place of ``count`` events it was too slow for, all of
    one share: a user's (their uid), ``"device"`` (device-wide records) or ``"unowned"``
    (records of a context whose owner was gone)."""
    return {"dropped": count, "share": share, "time": time}


# --- reset scopes ----------------------------------------------------------------------------
#: The engine kinds whose reset scopes the driver reports (sysfs ``<engine>_reset_mask``).
ENGINES: Final = ("compute", "copy")


@dataclass(frozen=True)
class ResetScope:
    """A scope the stack really recovers a fault of ``engines`` at: what is reset, and
    what makes it happen."""

    scope: Scope
    engines: tuple[str, ...]
    trigger: str


#: The reset scopes implemented, narrowest first: the one table sysfs's reset masks
#: (amdgpu's ``gfx_reset_mask``, ``sdma_reset_mask``) and docs/faults.md "Reset scopes"
#: come from. A scope is listed once something resets at it (an operation's refusal
#: resets nothing, so it is not one).
RESET_SCOPES: Final = (
    ResetScope(Scope.QUEUE, ENGINES,
               "a packet of the queue faulted (its ring's fault record): later work on the "
               "queue is cancelled; the runtime rebuilds the stream"),
    ResetScope(Scope.CONTEXT, ENGINES,
               "an uncorrectable memory error in memory only that context holds (94): the "
               "firmware stops its queues, the context alone is lost; the others go on"),
    ResetScope(Scope.DEVICE, ENGINES,
               "a reset: sysfs `reset`, `accel-smi -r`, DEVICE_RESET, or the driver's "
               "recovery from a device-scope fault (a firmware death or hang, an "
               "uncontained error); every context is lost"),
    ResetScope(Scope.PACKAGE, ENGINES,
               "an uncorrectable link error (74): the peers on the link stop reaching the "
               "package (drained), then it resets (a package is one device here)"),
)


def reset_mask(engine: str) -> tuple[str, ...]:
    """The reset scopes implemented for faults of ``engine``, narrowest first."""
    return tuple(str(r.scope) for r in RESET_SCOPES if engine in r.engines)
