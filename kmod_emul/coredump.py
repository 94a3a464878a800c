"""Device coredumps: what the driver saw when a device-scope fault struck (Linux's
``drivers/base/devcoredump.c``).

A firmware death or hang, a reset, any fault record whose scope is device or package
loses every context on the device; what would explain it -- which contexts were there,
what their queues held, what the firmware last said -- is gone once the device resets. So
the driver captures a dump the moment it records such a fault (``Coredump.on_record``, a
listener of the device's fault log), while the lost contexts' queues and the firmware's
log are still at hand. The dump is one JSON document:

* ``fault``: the record; ``state``, ``failure``, ``reset_count``, ``reset_reason``: the
  device's;
* ``firmware``: its pid, exit status (once it exited), version, heartbeat and the last
  lines of its log (``FirmwareProcess.log_tail``), or null when no firmware ran;
* ``contexts``: each context's id, pid, uid, exclusive flag and why it was lost, and each
  of its queues (the default queue first): id, priority, doorbell slot and, read from its
  ring, the write pointer, the packets taken, the fence (``completed``) and the first
  fault the ring holds, with the driver's last fault record naming the queue.

``sys/class/accel/accelN/devcoredump/data`` reads the dump (root's alone: it names every
tenant's processes) and empty when none is held; writing any text clears it; ``time``
says when it was taken.

A reset someone asked for (record ``origin`` ``requested``: sysfs ``reset``, ``accel-smi
-r``, an exclusive owner's DEVICE_RESET) is not a fault and is not
dumped: a routine reset must not take the one place a later firmware hang's dump needs.

One dump is held, as Linux holds one per device: a fault while one is held is not
dumped (its record is in the fault log as every record) until the held one is cleared or
``HOLD_S`` has passed. The first fault of an incident is the one to read: a firmware
death is followed at once by the reset that recovers it, whose dump must not replace it.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from abi import faults, uapi, userq
from kmod_emul.attr import Attr

if TYPE_CHECKING:
    from kmod_emul.context import Context
    from kmod_emul.device import AccelDevice

log = logging.getLogger(__name__)

#: Linux's DEVCD_TIMEOUT: a dump nobody cleared gives way to the next fault's after this.
HOLD_S = 300.0
#: The scopes whose fault records are dumped.
DUMPED_SCOPES = frozenset({str(faults.Scope.DEVICE), str(faults.Scope.PACKAGE)})


@dataclass(frozen=True)
class Dump:
    """A dump as ``data`` shows it, and when it was taken (wall-clock seconds)."""

    taken: float
    text: str


class Coredump:
    """The dump a device holds, if any: taken, shown, cleared."""

    def __init__(self, dev: AccelDevice) -> None:
        self.dev = dev
        self.held: Dump | None = None

    def on_record(self, rec: dict[str, Any]) -> None:
        """A fault was recorded: dump the device if its scope is device or package and
        no dump is held (or the held one is older than ``HOLD_S``)."""
        if rec.get("scope") not in DUMPED_SCOPES or rec.get("origin") == faults.ORIGIN_REQUESTED:
            return
        now = time.time()
        if self.held is not None and now - self.held.taken < HOLD_S:
            log.info("%s: fault %s not dumped: a dump taken at %.3f is held (write "
                     "devcoredump/data to clear it)", self.dev.name, rec.get("name"),
                     self.held.taken)
            return
        try:
            text = json.dumps(capture(self.dev, rec), indent=1)
        except Exception:  # a driver bug here must not stop the reset or failure going on
            log.exception("%s: driver bug capturing a coredump", self.dev.name)
            return
        self.held = Dump(now, text)
        log.warning("%s: devcoredump of fault %s taken (%d bytes)", self.dev.name,
                    rec.get("name"), len(text))

    def data(self) -> str:
        """``devcoredump/data``: the dump held, or nothing."""
        return self.held.text if self.held is not None else ""

    def taken(self) -> str:
        """``devcoredump/time``: when the held dump was taken (epoch seconds), or nothing."""
        return f"{self.held.taken:.3f}" if self.held is not None else ""

    def clear(self, _text: str) -> None:
        """Any write clears the dump, as Linux's ``data`` does."""
        self.held = None


def capture(dev: AccelDevice, rec: dict[str, Any]) -> dict[str, Any]:
    """The dump of ``dev`` as ``rec`` leaves it (see the module doc)."""
    return {
        "device": dev.name, "uuid": dev.identity.uuid, "pci_bus_id": dev.pci_bus_id,
        "time": round(time.time(), 6),
        "fault": rec,
        "state": dev.state.label,
        "failure": None if dev.failure is None else {
            "errno": errno.errorcode.get(dev.failure[0], str(dev.failure[0])),
            "message": dev.failure[1]},
        "reset_count": dev.reset_count, "reset_reason": dev.reset_reason,
        "firmware": _firmware(dev),
        "contexts": [_context(dev, ctx) for ctx in dev.contexts.values()],
    }


def _firmware(dev: AccelDevice) -> dict[str, Any] | None:
    fw = dev.fw
    if fw is None:
        return None
    return {
        "pid": fw.pid,
        "exit_status": fw.proc.poll() if fw.proc is not None else None,
        "version": fw.image.version if fw.image is not None else None,
        "heartbeat": fw.mbx.heartbeat[0] if fw.mbx is not None else None,
        "log_tail": list(fw.log_tail),
    }


def _context(dev: AccelDevice, ctx: Context) -> dict[str, Any]:
    default = {"id": ctx.default_queue.id, "priority": uapi.ACCEL_QUEUE_PRIORITY_LOW,
               "doorbell": userq.ACCEL_DB_DEFAULT_SLOT, "imported": False,
               "ring": _ring(ctx.default_queue)}
    queues = [default]
    for q in ctx.queues.values():
        queues.append({"id": q.id, "priority": q.priority,
                       "doorbell": None if q.imported else q.slot, "imported": q.imported,
                       "ring": None if q.fd < 0 else _mapped_ring(q.fd)})
    for q in queues:
        q["record"] = _last_record(dev, ctx.id, q["id"])
    return {"id": ctx.id, "pid": ctx.file.pid, "uid": ctx.file.uid,
            "exclusive": ctx.exclusive, "lost": ctx.lost, "allocations": len(ctx.allocations),
            "modules": len(ctx.modules), "queues": queues}


def _mapped_ring(fd: int) -> dict[str, Any]:
    """A process's ring, read through the driver's descriptor of it."""
    try:
        ring = userq.RingView(fd)
    except (OSError, ValueError) as exc:  # not mappable after all: say so, dump the rest
        return {"unreadable": str(exc) or type(exc).__name__}
    try:
        return _ring(ring)
    finally:
        ring.close()


def _ring(ring: userq.RingView) -> dict[str, Any]:
    seqno, code, opcode, addr = ring.read_fault()
    return {"wptr": ring.wptr, "rptr": ring.rptr, "completed": ring.completed,
            "fault": None if not seqno else {
                "seqno": seqno, "errno": errno.errorcode.get(code, str(code)),
                "opcode": userq.op_name(opcode), "address": addr}}


def _last_record(dev: AccelDevice, ctx_id: int, queue_id: int) -> dict[str, Any] | None:
    """The driver's last fault record naming the queue (a packet fault, an unmappable
    ring), if the log still holds one."""
    return next((r for r in reversed(dev.faults.records)
                 if r.get("context") == ctx_id and r.get("queue") == queue_id), None)


def devcoredump_attrs(dev: AccelDevice) -> dict[str, Attr]:
    """``sys/class/accel/accelN/devcoredump/*``, root's alone (the tree makes the directory
    0700): ``data``, the dump held (writing any text clears it), and ``time``, when it was
    taken; both empty while none is held."""
    return {"data": Attr(read=dev.coredump.data, write=dev.coredump.clear),
            "time": Attr(read=dev.coredump.taken)}
