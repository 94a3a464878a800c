"""Refusals of what another tenant holds: answered with EPERM or EACCES, counted, logged.

Handles (contexts, queues, allocations, modules) are device-wide numbers, so a process can
name one that another open file holds, by mistake or on purpose. DRM answers a handle of
another file as if it did not exist; we tell the two apart, as the tenant model asks: a
number nobody holds is ENOENT, one that another open file's context holds is EPERM (and
says no more than that: not whose), and each such attempt is counted in
``sys/class/accel/accelN/isolation/<kind>`` and logged, so an operator sees a tenant
probing the others. Attribute files only root may write or read (``reset``, debugfs,
``devcoredump/``) answer another user EACCES and count as ``privileged``; an IPC import
whose token is wrong counts as ``export``.

What the kernel refuses before the driver hears of it (another process opening a
tenant's ring or memory through ``/proc/PID/fd``, which the runtime's non-dumpable flag
stops) cannot be counted here; docs/containment.md says which is which.

The log is rate-limited as ``dev_warn_ratelimited`` is (kmod_emul/ratelimit.py): at most
``LOG_BURST`` lines per ``LOG_INTERVAL_S`` per device, then one line saying how many were
not logged.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kmod_emul.attr import Attr
from kmod_emul.errors import DriverError
from kmod_emul.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from kmod_emul.context import Context, OpenFile

log = logging.getLogger(__name__)

#: What an attempt reached for; one counter file each.
KINDS: tuple[str, ...] = ("context", "queue", "allocation", "module", "export", "peer",
                          "privileged")


class Isolation:
    """One device's refusals of other tenants' resources: counts and the rate-limited log."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts = dict.fromkeys(KINDS, 0)
        self._log = RateLimitedLog(log, name, "refusals")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def refuse(self, kind: str, pid: int, uid: int, what: str,
               code: int = errno.EPERM) -> DriverError:
        """Count and log one attempt; the error to raise for it."""
        self.counts[kind] += 1
        self._log.log(logging.WARNING, "%s: refused pid %s uid %s: %s (%s)", self.name, pid,
                      uid, what, errno.errorcode[code])
        return DriverError(code, what)


def foreign_or_unknown(asker: OpenFile, kind: str, ident: int, held: Iterable[Context],
                       what: str) -> DriverError:
    """The error for ``asker`` naming ``ident`` (a ``kind`` handle) that it does not hold:
    EPERM, counted on its device, if a context of another file in ``held`` holds it, else
    ENOENT (``what``)."""
    for ctx in held:
        if ctx.file is not asker and ident in _handles(ctx, kind):
            return asker.device.isolation.refuse(kind, asker.pid, asker.uid,
                                                 f"{kind} {ident} belongs to another context")
    return DriverError(errno.ENOENT, what)


def _handles(ctx: Context, kind: str) -> Iterable[int]:
    if kind == "context":
        return (ctx.id,)
    if kind == "queue":
        return ctx.queues
    if kind == "allocation":
        return ctx.allocations
    if kind == "module":
        return ctx.modules
    raise ValueError(kind)


def isolation_attrs(iso: Isolation) -> dict[str, Attr]:
    """``sys/class/accel/accelN/isolation/*``: the refusals of each kind, and ``total``."""
    attrs = {kind: Attr(read=functools.partial(lambda k: str(iso.counts[k]), kind))
             for kind in KINDS}
    attrs["total"] = Attr(read=lambda: str(iso.total))
    return attrs
