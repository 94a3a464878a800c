"""Fork-safe discovery: which devices this process sees, read from ``sys/`` only.

Nothing here opens a device node or creates runtime state, so ``device_count()`` and
``is_available()`` can run in a parent before it forks workers (PyTorch's rule that an
availability check must not poison a later fork). ``ACCEL_VISIBLE_DEVICES`` follows
``CUDA_VISIBLE_DEVICES``: a comma-separated list of physical indices or UUIDs (a unique
UUID prefix will do); the list order defines the runtime's indices, and an entry that
names no device (or one already listed) hides it and every entry after it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from abi import uapi


def root() -> Path:
    return Path(uapi.default_root())


def read_attr(physical: str, name: str) -> str:
    """One sysfs attribute of a physical device (``accelN``), stripped."""
    return (root() / uapi.CLASS_DIR / physical / name).read_text().strip()


def physical_devices() -> list[str]:
    """Every device the driver serves work on, ``accel0`` first: a device split into
    compute partitions is left out (its partitions, listed as devices of their own, serve
    instead; docs/partitions.md). Empty when nothing is mounted."""
    try:
        names = os.listdir(root() / uapi.CLASS_DIR)
    except OSError:
        return []
    found = [n for n in names if re.fullmatch(r"accel\d+", n) and not _partitioned(n)]
    return sorted(found, key=lambda n: int(n[5:]))


def _partitioned(name: str) -> bool:
    """True for a physical device split into partitions (a partition has no mode)."""
    try:
        return read_attr(name, "partition_mode") != "1"
    except OSError:
        return False


def _resolve(entry: str, physical: list[str]) -> str | None:
    if entry.isdigit():
        name = f"accel{int(entry)}"
        return name if name in physical else None
    matches = []
    for name in physical:
        try:
            if read_attr(name, "uuid").startswith(entry):
                matches.append(name)
        except OSError:
            continue
    return matches[0] if len(matches) == 1 else None


def visible_devices() -> list[str]:
    """Physical names in runtime-index order, after ACCEL_VISIBLE_DEVICES."""
    physical = physical_devices()
    spec = os.environ.get("ACCEL_VISIBLE_DEVICES")
    if spec is None:
        return physical
    visible: list[str] = []
    for entry in (e.strip() for e in spec.split(",")):
        name = _resolve(entry, physical) if entry else None
        if name is None or name in visible:
            break
        visible.append(name)
    return visible


def device_count() -> int:
    return len(visible_devices())


def is_available() -> bool:
    return device_count() > 0
