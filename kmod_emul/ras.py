"""RAS (reliability, availability, serviceability): a device's error counters and bad pages.

amdgpu's RAS is the model. An error is injected through debugfs ``ras_ctrl`` (``inject
BLOCK ue|ce ADDRESS``), counted per block (``ras/BLOCK_err_count``) and recorded as a
fault (abi/faults.py); memory errors retire pages, link and thermal errors are what the
device's models of them make of them (kmod_emul/link.py, kmod_emul/thermal.py). The
bad-page table is amdgpu's
EEPROM: it persists per device UUID in ``STATE_DIR/ras/<uuid>.json`` and is loaded at
daemon start, so a page retired once stays out of service for good. The counters and the
"one correctable error seen" marks are volatile: they count this daemon's life, as
amdgpu's ``*_err_count`` count the driver's.

Memory (a page is ``uapi.ACCEL_PAGE_SIZE`` bytes, its PFN ``offset // page``):

* ``ce``: recorded (92 MEMORY_CE); a second one at the same page retires it;
* ``ue`` where nothing is allocated (or only contexts already lost, which nothing runs
  for): recorded (48 MEMORY_UE_FREE), the page retired (pending while still allocated);
* ``ue`` in memory exactly one live context can reach: that context alone is lost (94
  MEMORY_UE_CONTAINED, with its pid and context): its commands answer ENODEV, the
  firmware stops its queues; every other context goes on;
* ``ue`` in memory several contexts reach (an IPC import, a peer mapping), or memory the
  firmware may still touch for nobody live (being unmapped): recorded (95
  MEMORY_UE_UNCONTAINED) and the device reset.

Retirement: a page nothing holds is retired at once (``R``, 63 PAGE_RETIRED); a held one
is pending (``P``, 64 PAGE_RETIREMENT_PENDING): it leaves the free list when its holder
frees it, and becomes ``R`` at the device's next reset (boot). Neither is ever handed out
again (``VramAllocator.exclude``); their bytes count as neither used nor free. The table
takes ``MAX_BAD_PAGES`` retired or pending pages (amdgpu's bad-page threshold); past that
a retirement fails (``F``, 65 PAGE_RETIREMENT_FAILED) and the page stays in service.

Record and replay (docs/schedule.md, "Injected faults"): a memory, compute, copy or
firmware injection that reaches a context recording its schedule is noted in that
context's table (``_note``) at the packet the firmware says a fault would hit now; a
replay's firmware asks for the fault again when that packet comes (``replay``), and it
is injected through the same handlers, for the replaying context -- if it is confined to
that context (a ``ce``; a memory ``ue`` in memory only it holds), or the context holds the
device exclusively. Anything else is refused: counted and logged as a ``privileged``
refusal, nothing injected. A replayed fault is the process's recording, not a new
hardware error: it is recorded (origin ``replay``, with the context's pid) but neither
counted in ``*_err_count`` nor retires a page.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from abi import faults, uapi, userq
from abi import schedule as sched
from kmod_emul import thermal
from kmod_emul.attr import Attr, parse_number
from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.context import Context
    from kmod_emul.device import AccelDevice

log = logging.getLogger(__name__)

PAGE = uapi.ACCEL_PAGE_SIZE
#: Retired and pending pages the table takes (amdgpu's EEPROM threshold).
MAX_BAD_PAGES = 256
_SEVERITIES = ("ue", "ce")


class PageStatus(enum.StrEnum):
    """A bad page's state, as amdgpu's ``bad_pages`` prints it."""

    RETIRED = "R"  #: out of service
    PENDING = "P"  #: in use: out of service once freed, retired at the next reset
    FAILED = "F"  #: could not be retired (the table is full): still in service


@dataclass
class BadPage:
    pfn: int
    status: PageStatus
    cause: str  #: "ce" (a second correctable error) or "ue"
    time: float  #: when it entered the table (wall clock)


class Ras:
    """One device's RAS state: counters, the bad-page table and error injection."""

    def __init__(self, dev: AccelDevice, state_dir: Path | None) -> None:
        self.dev = dev
        self.path = state_dir / "ras" / f"{dev.identity.uuid}.json" if state_dir else None
        #: block -> severity -> errors seen
        self.counts: dict[str, dict[str, int]] = {b: dict.fromkeys(_SEVERITIES, 0)
                                                  for b in faults.BLOCKS}
        #: the table, by PFN, in the order pages entered it
        self.pages: dict[int, BadPage] = {}
        #: pages with one correctable error (a second one retires them)
        self._corrected: set[int] = set()
        self._load()

    # --- the persistent table ---------------------------------------------------------------
    def _load(self) -> None:
        """The table earlier daemons kept; its retired and pending pages leave the (still
        empty) free list at once. A table that cannot be read is logged and kept aside
        (``.corrupt``) for the operator, and the device starts with an empty one."""
        if self.path is None or not self.path.exists():
            return
        try:
            rows = json.loads(self.path.read_text())["bad_pages"]
            pages = [BadPage(int(r["pfn"]), PageStatus(r["status"]), str(r["cause"]),
                             float(r["time"])) for r in rows]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("%s: cannot read the bad-page table %s (%s); kept as .corrupt, "
                      "starting empty", self.dev.name, self.path, exc)
            with contextlib.suppress(OSError):  # else the next save replaces it (logged)
                self.path.replace(self.path.with_suffix(".corrupt"))
            return
        for page in pages:
            self.pages[page.pfn] = page
            if page.status != PageStatus.FAILED and (page.pfn + 1) * PAGE <= self.dev.memory_total:
                self.dev.memory.vram.exclude(page.pfn * PAGE)

    def _save(self) -> None:
        if self.path is None:
            return
        doc = {"uuid": self.dev.identity.uuid,
               "bad_pages": [asdict(p) for p in self.pages.values()]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            tmp.replace(self.path)
        except OSError as exc:  # a full disk must not lose the device
            log.error("%s: cannot persist the bad-page table: %s", self.dev.name, exc)

    # --- injection ------------------------------------------------------------------------------
    def inject(self, text: str) -> None:
        """debugfs ``ras_ctrl``: ``inject BLOCK ue|ce ADDRESS`` (memory: a byte offset of
        the device's memory; thermal: the degrees to heat to, 0 for the default, at most
        ``thermal.MAX_INJECT_C``; the other blocks: a 64-bit address), and for ``thermal
        ce`` an optional fifth word, the seconds the heat holds (default
        ``thermal.HOLD_S``). Malformed or out of range: EINVAL; a device that is not
        operational: the errno that says why."""
        words = text.split()
        if not 4 <= len(words) <= 5 or words[0] != "inject" or (
                len(words) == 5 and words[1:3] != ["thermal", "ce"]):
            raise DriverError(errno.EINVAL, "write 'inject BLOCK ue|ce ADDRESS' (or 'inject "
                                            f"thermal ce DEGREES SECONDS'), not "
                                            f"{text.strip()!r}")
        _, block, severity, where, *extra = words
        hold = [_parse_hold(w) for w in extra]
        if block not in faults.BLOCKS:
            raise DriverError(errno.EINVAL, f"no block {block!r}; the blocks are "
                                            f"{' '.join(faults.BLOCKS)}")
        if severity not in _SEVERITIES:
            raise DriverError(errno.EINVAL, f"severity is ue or ce, not {severity!r}")
        address = parse_number(where, f"{block} address", self._address_bound(block))
        self.dev.check_usable()
        self.counts[block][severity] += 1
        if block in sched.FAULT_BLOCKS:
            self._note_injected(block, severity, address)
        INJECT[block](self, block, severity, address, *hold)

    # --- record and replay ----------------------------------------------------------------------
    def _note_injected(self, block: str, severity: str, address: int) -> None:
        """Note an operator's injection in the table of each context recording its
        schedule that it reaches -- every one, but for a memory error only the contexts
        holding the byte, at their own device address of it -- before it takes effect
        (the effect may lose the context, or kill the firmware)."""
        value = sched.fault_value(block, severity)
        for ctx in self.dev.tenants.live_contexts():
            table = ctx.schedule_table
            where = self._own_address(ctx, address) if block == "memory" else address
            if table is None or where is None:
                continue
            queue, seqno = sched.at_of(table.get(sched.SCHED_AT))
            _note(table, sched.Entry(queue, seqno, sched.Decision.FAULT, value, where))

    def _own_address(self, ctx: Context, offset: int) -> int | None:
        """``ctx``'s device address of VRAM byte ``offset``, if it holds it."""
        backing = self.dev.memory.backing_at(offset)
        for alloc in ctx.allocations.values():
            if backing is not None and alloc.backing is backing:
                return alloc.va + offset - backing.offset
        return None

    def _own_offset(self, ctx: Context, va: int) -> int | None:
        """The VRAM offset of ``ctx``'s device address ``va``, if it is in device-local
        memory of this device that ``ctx`` holds."""
        for alloc in ctx.allocations.values():
            b = alloc.backing
            if b.kind == uapi.MemKind.DEVICE and b.owner is self.dev \
                    and alloc.va <= va < alloc.va + b.size:
                return b.offset + va - alloc.va
        return None

    def replay(self, ctx: Context, entry: sched.Entry) -> bool:
        """A replayed schedule's FAULT entry reached its packet: inject it for ``ctx``, as
        ``ras_ctrl`` would, if the context may cause it; True if injected. Refused (counted
        and logged as ``privileged``): a value that is no recorded fault, a memory address
        outside the context's own device memory, and a fault whose effect reaches beyond
        the context (an uncorrectable compute, copy or firmware error: a device reset; a
        memory one in memory another context reaches) unless the context holds the device
        exclusively, when what the reset loses is its own process's."""
        dev = self.dev
        if ctx.lost is not None or dev.removed or dev.state != uapi.DeviceState.OPERATIONAL:
            return False  # nothing left to hit: the context or the device went already
        try:
            block, severity = sched.fault_parts(entry.value)
        except ValueError:
            block = severity = ""
        where = entry.address
        if block == "memory":
            where = self._own_offset(ctx, entry.address)
            backing = dev.memory.backing_at(where) if where is not None else None
            confined = backing is not None and (
                severity == "ce" or dev.memory.holders(backing) == [ctx])
        else:
            confined = severity == "ce"
        if not block or where is None or not (confined or ctx.exclusive):
            what = (sched.fault_text(entry.value, entry.address) if block else
                    f"fault value {entry.value}")
            dev.isolation.refuse(
                "privileged", ctx.file.pid, ctx.file.uid,
                f"replayed fault '{what}' of context {ctx.id} refused: "
                + ("not in its device memory" if block and where is None else
                   "not a fault a schedule records" if not block else
                   "it reaches beyond the context, which does not hold the device "
                   "exclusively"))
            return False
        if ctx.schedule_table is not None:  # a replay that records notes it again
            _note(ctx.schedule_table, entry)
        INJECT[block](self, block, severity, where, by=ctx)
        return True

    def _address_bound(self, block: str) -> int:
        """What an injection's ADDRESS must be below: an offset of the device's memory,
        degrees the die can reach (thermal), else a 64-bit address."""
        if block == "memory":
            return self.dev.memory_total
        if block == "thermal":
            return thermal.MAX_INJECT_C + 1
        return 1 << 64

    def _memory_error(self, block: str, severity: str, offset: int, *,
                      by: Context | None = None) -> None:
        """``by``: the context whose replayed schedule injects it (abi/schedule.py): its
        record, and no page retired (no cell failed again)."""
        dev = self.dev
        pfn = offset // PAGE
        where = {"address": offset, "bank": faults.bank_of(offset, dev.memory_total),
                 **_replayed(by)}
        if severity == "ce":
            dev.report(_code("MEMORY_CE"), by, **where)
            if by is not None:
                return
            if pfn in self._corrected:
                self._retire(pfn, "ce")
            elif pfn not in self.pages:
                self._corrected.add(pfn)
            return
        backing = dev.memory.backing_at(offset)
        holders = dev.memory.holders(backing) if backing is not None else []
        if backing is None or not (holders or backing.pending):
            # nothing allocated there, or only lost contexts whose firmware let go: no
            # work can read it
            dev.report(_code("MEMORY_UE_FREE"), **where)
            self._retire(pfn, "ue")
            return
        if len(holders) == 1:
            (ctx,) = holders
            ctx.file.device.tenants.lose_context(
                ctx, f"uncorrectable memory error at {offset:#x} of {dev.name} in its "
                     "memory (fault 94 MEMORY_UE_CONTAINED)")
            dev.report(_code("MEMORY_UE_CONTAINED"), ctx, contexts=[ctx.id], **where)
            if by is None:
                self._retire(pfn, "ue")
            return
        who = f"shared by {len(holders)} contexts" if holders else "still being unmapped"
        dev.report(_code("MEMORY_UE_UNCONTAINED"), by,
                   contexts=sorted(c.id for c in holders), **where)
        if by is None:
            self._retire(pfn, "ue")
        dev.resets.request(f"uncorrectable memory error at {offset:#x} in memory {who} "
                          "(fault 95 MEMORY_UE_UNCONTAINED)")

    def _engine_error(self, block: str, severity: str, address: int, *,
                      by: Context | None = None) -> None:
        """compute and copy: the catalogue's BLOCK_CE / BLOCK_UE; an uncorrectable one
        leaves the engine's state unknown, so the device resets. ``by``: as for memory."""
        kind = faults.BY_NAME[f"{block.upper()}_{severity.upper()}"]
        self.dev.report(kind.code, by, address=address, **_replayed(by))
        if severity == "ue":
            self.dev.resets.request(f"uncorrectable {block}-engine error (fault {kind.code} "
                                   f"{kind.name})")

    def _modelled_error(self, block: str, severity: str, address: int, *hold: float) -> None:
        """link and thermal: the device's model of the block (``dev.link``,
        ``dev.thermal``: kmod_emul/link.py, kmod_emul/thermal.py) says what happens;
        ``hold``: a thermal throttle's seconds, where the operator gave them."""
        model = getattr(self.dev, block)
        (model.correctable if severity == "ce" else model.uncorrectable)(address, *hold)

    def _firmware_error(self, block: str, severity: str, address: int, *,
                        by: Context | None = None) -> None:
        """An uncorrectable error halts the firmware: it is killed, and the driver meets it
        as any firmware death (79 FIRMWARE_DIED, then its recovery resets the device).
        ``by``: as for memory."""
        kind = faults.BY_NAME[f"FIRMWARE_{severity.upper()}"]
        self.dev.report(kind.code, by, address=address, **_replayed(by))
        if severity == "ue" and self.dev.fw is not None:
            self.dev.fw.kill()

    # --- retirement -----------------------------------------------------------------------------
    def _retire(self, pfn: int, cause: str) -> None:
        """Enter a page in the table (once): retired when nothing holds it, pending while
        something does, failed when the table is full; each recorded."""
        if pfn in self.pages:
            return
        self._corrected.discard(pfn)
        if sum(p.status != PageStatus.FAILED for p in self.pages.values()) >= MAX_BAD_PAGES:
            status = PageStatus.FAILED
        elif self.dev.memory.vram.exclude(pfn * PAGE):
            status = PageStatus.RETIRED
        else:
            status = PageStatus.PENDING
        self.pages[pfn] = BadPage(pfn, status, cause, round(time.time(), 3))
        self._save()
        self._report_page(pfn, _STATUS_CODES[status])
        if status == PageStatus.RETIRED:
            self.dev.send_budget()  # managed memory may not make it resident either

    def retire_pending(self) -> None:
        """The device boots (a reset, or the daemon's start): what held a pending page
        runs no more, so its retirement is final."""
        pending = [p for p in self.pages.values() if p.status == PageStatus.PENDING]
        for page in pending:
            page.status = PageStatus.RETIRED
        if pending:
            self._save()
        for page in pending:
            self._report_page(page.pfn, _code("PAGE_RETIRED"))

    def _report_page(self, pfn: int, code: int) -> None:
        offset = pfn * PAGE
        self.dev.report(code, address=offset, bank=faults.bank_of(offset, self.dev.memory_total))

    # --- what sysfs shows -----------------------------------------------------------------------
    def bad_pages(self) -> str:
        """``bad_pages``, amdgpu's format: ``0xPFN : 0xSIZE : R|P|F``, one page a line."""
        return "\n".join(f"0x{p.pfn:08x} : 0x{PAGE:08x} : {p.status}"
                         for p in self.pages.values())

    def bad_page_details(self) -> str:
        """``ras/bad_page_details``: ``0xPFN : R|P|F : ce|ue : TIME``, what accel-smi's
        ``--query-retired-pages`` tells about each page (the cause, when it came)."""
        return "\n".join(f"0x{p.pfn:08x} : {p.status} : {p.cause} : {p.time:.3f}"
                         for p in self.pages.values())

    def err_count(self, block: str) -> str:
        return "\n".join(f"{s}: {self.counts[block][s]}" for s in _SEVERITIES)

    def retired_pages(self) -> str:
        """``retired_pages``: how many are out of service for good (``R``)."""
        return str(sum(p.status == PageStatus.RETIRED for p in self.pages.values()))


def _code(name: str) -> int:
    return faults.BY_NAME[name].code


def _replayed(by: Context | None) -> dict[str, str]:
    """A record's origin when a replayed schedule injected it."""
    return {} if by is None else {"origin": faults.ORIGIN_REPLAY}


def _note(table: userq.SharedWords, e: sched.Entry) -> None:
    """Append a fault entry to a recording context's fault region (the driver is its one
    writer): the entry, then the count that shows it; past the region's capacity only
    the count grows (the runtime reports the rest as dropped)."""
    n = table.get(sched.SCHED_FAULT_COUNT)
    if n < sched.SCHED_FAULT_CAPACITY:
        base = sched.SCHED_FAULT_ENTRIES + n * sched.SCHED_ENTRY_SIZE
        for i, w in enumerate(sched.entry_words(e)):
            table.set(base + 8 * i, w)
    table.set(sched.SCHED_FAULT_COUNT, n + 1)


def _parse_hold(text: str) -> float:
    """A thermal throttle's hold: seconds above 0, at most ``thermal.MAX_HOLD_S``."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= thermal.MAX_HOLD_S:
        raise DriverError(errno.EINVAL, f"the hold is seconds above 0, at most "
                                        f"{thermal.MAX_HOLD_S:g}, not {text!r}")
    return seconds


_STATUS_CODES: dict[PageStatus, int] = {
    PageStatus.RETIRED: _code("PAGE_RETIRED"),
    PageStatus.PENDING: _code("PAGE_RETIREMENT_PENDING"),
    PageStatus.FAILED: _code("PAGE_RETIREMENT_FAILED"),
}

#: What an injected error of each block does: ``handler(ras, block, severity, address)``
#: (and a thermal throttle's hold, where the operator gave one; ``by``, the context a
#: replayed fault is injected for, for the blocks of ``schedule.FAULT_BLOCKS``).
INJECT: dict[str, Callable[..., None]] = {
    "memory": Ras._memory_error,
    "compute": Ras._engine_error,
    "copy": Ras._engine_error,
    "link": Ras._modelled_error,
    "firmware": Ras._firmware_error,
    "thermal": Ras._modelled_error,
}
assert set(INJECT) == set(faults.BLOCKS), "a block without its injection"


def ras_attrs(dev: AccelDevice) -> dict[str, Attr]:
    """``sys/class/accel/accelN/ras/*``: per-block counters and the bad pages' details
    (``bad_pages`` and ``retired_pages`` sit beside the device's other attributes)."""
    ras = dev.ras
    attrs: dict[str, Attr] = {f"{b}_err_count": Attr(read=functools.partial(ras.err_count, b))
                              for b in faults.BLOCKS}
    attrs.update(bad_page_details=Attr(read=ras.bad_page_details))
    return attrs
