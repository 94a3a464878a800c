"""The driver's sysfs tree as data: what ``accel-smi``, ``accel-diag`` and ``accel-exporter``
read, parsed one way for all three so that they never disagree about a value.

Every read is of the one-value attribute files under ``ROOT/sys``; nothing here opens a
device node (an open is a driver client: docs/tools.md). Values come back as the text the
driver wrote; ``typed`` and the parsers below turn them into what JSON and Prometheus want.
"""

from __future__ import annotations

import ctypes
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from abi import uapi

#: Attributes that are text even when they look like numbers (a serial is not a count).
_TEXT_ATTRS = frozenset(
    name for name, ctype, *_ in uapi.accel_device_info._fields_
    if issubclass(ctype, ctypes.Array) and not name.startswith("reserved")
) | {"state", "failure", "failure_code", "reset_reason", "last_failure"}

#: Decimals: wall-clock times (seconds since the epoch, with milliseconds) and watts.
_FLOAT_ATTRS = frozenset({"last_reset", "last_failure_time", "power", "power_limit"})

#: The bad-page tables (kmod_emul/ras.py): one page a line, columns joined by " : ".
_PAGE_TABLES: dict[str, tuple[str, ...]] = {
    "bad_pages": ("pfn", "size", "status"),  # amdgpu's format
    "ras/bad_page_details": ("pfn", "status", "cause", "time"),
}


class UsageError(Exception):
    """A bad command line that argparse cannot see (exit 2)."""


@dataclass(frozen=True)
class Tree:
    """The sysfs part of one mount root."""

    root: Path

    @property
    def class_dir(self) -> Path:
        return self.root / uapi.CLASS_DIR

    def device_names(self) -> list[str]:
        """``accel0``, ``accel1``, ... in index order; empty when nothing is served."""
        try:
            names = os.listdir(self.class_dir)
        except OSError:
            return []
        found = [n for n in names if n.startswith("accel") and n[5:].isdigit()]
        return sorted(found, key=lambda n: int(n[5:]))

    def driver(self) -> dict[str, str]:
        return _read_dir(self.root / uapi.MODULE_DIR)

    def device(self, name: str) -> dict[str, str]:
        return _read_dir(self.class_dir / name)

    def attr(self, name: str, key: str, default: str = "") -> str:
        """One attribute of device ``name`` (``default`` if it cannot be read): one file,
        where ``device`` reads them all."""
        try:
            return (self.class_dir / name / key).read_text().strip()
        except OSError:
            return default


def _read_dir(path: Path, prefix: str = "") -> dict[str, str]:
    """Every readable attribute in ``path``, those of subdirectories (``limits/``) as
    ``dir/name``; write-only ones (``reset``) are skipped unopened."""
    values: dict[str, str] = {}
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return values
    for name in names:
        try:
            mode = os.stat(path / name).st_mode
            if stat.S_ISDIR(mode):
                values.update(_read_dir(path / name, f"{prefix}{name}/"))
            elif mode & 0o444:
                values[prefix + name] = (path / name).read_text().strip()
        except OSError:
            continue  # vanished or unreadable mid-scan: report what could be read
    return values


def typed(name: str, value: str) -> Any:
    """An attribute as JSON wants it: ints as ints, watts and times as floats, the
    capabilities, page tables, processes and fdinfo as lists, '' as null."""
    if name == "capabilities":
        return value.split()
    if name in _PAGE_TABLES:
        return page_rows(name, value)
    if name == "processes":
        return processes(value)
    if name == "fdinfo":
        return fdinfo(value)
    if name.endswith("_err_count"):  # "ue: N" and "ce: N" lines
        return {k: int(n) for k, _, n in (line.partition(": ") for line in value.splitlines())}
    if name in _TEXT_ATTRS:
        return value
    if value == "":
        return None
    if name in _FLOAT_ATTRS:
        return float(value)
    try:
        return int(value)
    except ValueError:
        return value


def number(value: str | None) -> int | float | None:
    """A numeric attribute (``87.5`` watts, ``42`` percent); None where it is absent or
    not a number, which every output shows as N/A."""
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            return None


def processes(value: str) -> list[dict[str, int]]:
    """The ``processes`` attribute (a ``pid device_bytes`` header, then one row per
    process this user may see) as ``{"pid", "used_memory"}`` records, as nvidia-smi's
    process list names them."""
    rows = []
    for line in value.splitlines()[1:]:
        pid, _, used = line.partition(" ")
        if pid.isdigit() and used.strip().isdigit():
            rows.append({"pid": int(pid), "used_memory": int(used)})
    return rows


def fdinfo(value: str) -> list[dict[str, int | str]]:
    """The ``fdinfo`` attribute (DRM fdinfo-style blocks of ``key: value`` lines, one per
    open context, separated by blank lines) as records; a value's number without its
    unit (``ns``, ``KiB``, which the key's meaning fixes), text kept as text."""
    blocks = []
    for block in value.split("\n\n"):
        record: dict[str, int | str] = {}
        for line in block.splitlines():
            key, sep, raw = line.partition(":")
            if sep:
                first = raw.split()[0] if raw.split() else ""
                record[key.strip()] = int(first) if first.isdigit() else raw.strip()
        if record:
            blocks.append(record)
    return blocks


def process_name(pid: int) -> str:
    """A process's command name, from ``/proc/PID/comm`` (N/A once it has exited or where
    this user may not read it), as nvidia-smi's process table names them."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "N/A"
    except OSError:
        return "N/A"


def page_rows(name: str, value: str) -> list[dict[str, Any]]:
    """A bad-page table as rows: PFNs and sizes as ints, times as floats."""
    rows = []
    for line in value.splitlines():
        row: dict[str, Any] = dict(zip(_PAGE_TABLES[name], (c.strip() for c in line.split(" : "))))
        for key in ("pfn", "size"):
            if key in row:
                row[key] = int(row[key], 16)
        if "time" in row:
            row["time"] = float(row["time"])
        rows.append(row)
    return rows


def select(tree: Tree, spec: str | None) -> list[str]:
    """The devices ``-i`` names, by index, UUID (or unique prefix) or PCI bus id."""
    names = tree.device_names()
    if spec is None:
        return names
    chosen: list[str] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.isdigit():
            matches = [f"accel{int(entry)}"] if f"accel{int(entry)}" in names else []
        elif entry:
            ids = {n: tree.device(n) for n in names}
            matches = [n for n, a in ids.items()
                       if a.get("uuid", "").startswith(entry) or a.get("pci_bus_id") == entry]
        else:
            matches = []
        if len(matches) != 1:
            known = ", ".join(n[5:] for n in names) or "none"
            why = "matches several devices" if matches else "matches no device"
            raise UsageError(f"-i {entry!r} {why} (device indices: {known}; a UUID, a unique "
                             "UUID prefix or a PCI bus id also works)")
        if matches[0] not in chosen:
            chosen.append(matches[0])
    return chosen
