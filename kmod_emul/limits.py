"""What one device lets each tenant hold: the limits the driver enforces.

Every limit a device advertises is enforced, with an errno that says which kind it is:
``ENOSPC`` when a device-wide table is full (contexts, queues or pinned memory of all
processes together), ``EDQUOT`` when one process or context is over its share. The shares
are smaller than the tables, so one tenant cannot take a whole table from the others
(docs/containment.md has the figures and why). They are reported by DEVICE_QUERY and as
``sys/class/accel/accelN/limits/*``, next to the current use (``.../usage/*``).

The operator may set any of them (``accel-emud start --limit NAME=VALUE``, as MPS takes
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``): a share up to its table, a table down from what the
image and the descriptors allow (never up: the descriptors would not be there). In-flight
work is bounded per queue (``max_queue_depth``: packets the firmware admits past what it
has taken; the runtime waits for room, the firmware takes no more), so one process has at
most ``(max_queues_per_process + 1) * max_queue_depth`` packets in flight on a device.

Descriptors bound two of them: every queue and every pinned allocation costs the firmware
one descriptor (its mapping), and every queue one in the daemon, so the device-wide
tables are cut to fit the process's descriptor limit (raised to its hard limit at start).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from abi import userq
from kmod_emul.errors import DriverError

#: Descriptors kept free for everything else (sockets, numba, logs, the mount).
_FD_RESERVE = 512
#: Each context costs the firmware and the daemon this many descriptors (pipes, pages).
_FDS_PER_CONTEXT = 3


def raise_fd_limit() -> int:
    """Raise this process's descriptor limit to its hard limit (children inherit it);
    return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Limits:
    max_contexts: int
    max_contexts_per_process: int
    max_queues: int
    max_queues_per_process: int
    max_queues_per_context: int
    max_modules_per_context: int
    max_module_bytes_per_context: int
    max_module_bytes_per_process: int
    max_module_bytes: int
    max_pinned_bytes: int
    max_pinned_bytes_per_process: int
    max_host_allocations: int
    max_host_allocations_per_process: int
    max_queue_depth: int = userq.RING_SLOTS

    @classmethod
    def for_device(cls, config: dict[str, Any], devices: int, fd_limit: int,
                   overrides: Mapping[str, int] | None = None) -> Limits:
        """The image's tables (``max_contexts``, ``max_queues``), the driver's shares, all
        cut to the descriptors there are (the daemon serves ``devices`` devices), then the
        operator's ``overrides`` (``with_overrides``)."""
        return cls._defaults(config, devices, fd_limit).with_overrides(overrides or {})

    @classmethod
    def _defaults(cls, config: dict[str, Any], devices: int, fd_limit: int) -> Limits:
        max_contexts = int(config["max_contexts"])
        want_queues = int(config.get("max_queues", 4096))
        want_host = int(config.get("max_host_allocations", 8192))
        budget = max(64, fd_limit - _FD_RESERVE - _FDS_PER_CONTEXT * max_contexts * devices)
        # the daemon keeps one descriptor per queue of every device; each firmware one
        # per queue and per pinned allocation of its own device
        max_queues = max(16, min(want_queues, budget // max(1, devices), budget // 2))
        max_host = max(16, min(want_host, budget - max_queues))
        ram = physical_memory()
        return cls(
            max_contexts=max_contexts,
            max_contexts_per_process=max(1, min(16, max_contexts // 2)),
            max_queues=max_queues,
            max_queues_per_process=max(1, max_queues // 4),
            max_queues_per_context=max(1, min(QUEUE_SLOTS, max_queues // 4)),
            max_modules_per_context=256,
            max_module_bytes_per_context=64 << 20,
            max_module_bytes_per_process=256 << 20,
            max_module_bytes=1 << 30,
            max_pinned_bytes=ram,
            max_pinned_bytes_per_process=ram // 2,
            max_host_allocations=max_host,
            max_host_allocations_per_process=max(1, max_host // 4),
        )

    def with_overrides(self, overrides: Mapping[str, int]) -> Limits:
        """These limits with the operator's values: each a positive integer, a table no
        larger than it is here, a share no larger than its table nor than the structure
        that holds it (LimitError says which). A share the operator left alone follows its
        table down."""
        for name, value in overrides.items():
            if name not in self.__dataclass_fields__:
                raise LimitError(f"no limit {name!r}; the limits are {' '.join(LIMIT_NAMES)}")
            if value < 1:
                raise LimitError(f"{name} must be at least 1, not {value}")
            if name in TABLES and value > getattr(self, name):
                raise LimitError(f"{name} {value} is more than this device can hold "
                                 f"({getattr(self, name)})")
            if name in STRUCTURES and value > STRUCTURES[name][0]:
                bound, what = STRUCTURES[name]
                raise LimitError(f"{name} {value} is more than {what} ({bound})")
        new = dataclasses.replace(self, **overrides)
        for share, table in SHARES.items():  # in order: a share may be another's table
            if getattr(new, share) <= getattr(new, table):
                continue
            if share in overrides:
                raise LimitError(f"{share} {getattr(new, share)} exceeds {table} "
                                 f"{getattr(new, table)}")
            new = dataclasses.replace(new, **{share: getattr(new, table)})  # follows it down
        return new


#: Every limit's name, as ``--limit`` and ``sys/class/accel/accelN/limits/`` spell it.
LIMIT_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Limits))
#: The limits no operator can raise: device-wide tables cut to the descriptors, and the
#: ring's own size.
TABLES = frozenset({"max_contexts", "max_queues", "max_host_allocations", "max_pinned_bytes",
                    "max_module_bytes", "max_queue_depth"})
#: Doorbell slots a context's queues can take: the page's slot 0 is its default queue's.
QUEUE_SLOTS = userq.ACCEL_DB_SLOT_COUNT - 1
#: Shares a structure bounds, whatever their table: (the bound, the structure). A larger
#: value would be accepted and then fail where the structure runs out.
STRUCTURES = {"max_queues_per_context": (QUEUE_SLOTS, "a context's doorbell slots")}
#: Each tenant's share and the table it is a part of.
SHARES = {
    "max_contexts_per_process": "max_contexts",
    "max_queues_per_process": "max_queues",
    "max_queues_per_context": "max_queues_per_process",
    "max_pinned_bytes_per_process": "max_pinned_bytes",
    "max_host_allocations_per_process": "max_host_allocations",
    "max_module_bytes_per_process": "max_module_bytes",
    "max_module_bytes_per_context": "max_module_bytes_per_process",
}


class LimitError(ValueError):
    """An operator's limit that cannot be (``--limit``): unknown, not positive, or larger
    than what it is a share of or what holds it."""


def check(used: int, more: int, limit: int, what: str, *, device_wide: bool) -> None:
    """Refuse ``more`` on top of ``used`` past ``limit``: ENOSPC for a device-wide table,
    EDQUOT for a tenant's share."""
    if used + more > limit:
        raise DriverError(errno.ENOSPC if device_wide else errno.EDQUOT,
                          f"{what}: {used} in use + {more} > limit {limit}")
