"""``Profile.key_averages()``: totals and averages per name, as torch.profiler's table.

A host call's row counts its host time and the device time of the packets it queued (by
correlation); each device event name (a kernel, ``Memcpy HtoD``, ...) has a row of its
own with device time only, so a kernel's time shows both under ``Kernel.launch`` and
under its name.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tabulate import tabulate

if TYPE_CHECKING:
    from runtime.profiler import Profile

#: what ``table(sort_by=...)`` takes; the numbers sort largest first
SORT_KEYS = ("name", "calls", "host_total", "host_avg", "device_total", "device_avg")
#: torch.profiler's names for the same columns, so that a torch user's
#: ``table(sort_by="cuda_time_total")`` works here too (the CPU is our host)
TORCH_SORT_KEYS = {
    "count": "calls", "cpu_time_total": "host_total", "self_cpu_time_total": "host_total",
    "cpu_time": "host_avg", "device_time_total": "device_total",
    "self_device_time_total": "device_total", "cuda_time_total": "device_total",
    "self_cuda_time_total": "device_total", "device_time": "device_avg",
    "cuda_time": "device_avg",
}


@dataclass(slots=True)
class KeyAverage:
    """One row: ``host`` is False for a device event name (it has no host time)."""

    name: str
    host: bool
    calls: int = 0
    host_total_ns: int = 0
    device_total_ns: int = 0

    @property
    def host_avg_ns(self) -> float:
        return self.host_total_ns / self.calls if self.calls else 0.0

    @property
    def device_avg_ns(self) -> float:
        return self.device_total_ns / self.calls if self.calls else 0.0


def _fmt(ns: float) -> str:
    """As torch prints times: microseconds, milliseconds past 1 ms, seconds past 1 s."""
    if ns >= 1e9:
        return f"{ns / 1e9:.3f}s"
    if ns >= 1e6:
        return f"{ns / 1e6:.3f}ms"
    return f"{ns / 1e3:.3f}us"


class KeyAverages(list[KeyAverage]):
    """The rows; ``table()`` renders them."""

    @classmethod
    def of(cls, p: Profile) -> KeyAverages:
        device_by_call: defaultdict[int, int] = defaultdict(int)
        rows: dict[tuple[str, bool], KeyAverage] = {}
        for d in p.device_events:
            if d.cat != "kernel_compile":  # a compile wait is its own row, not the call's
                device_by_call[d.correlation] += d.end_ns - d.start_ns
            row = rows.setdefault((d.name, False), KeyAverage(d.name, False))
            row.calls += 1
            row.device_total_ns += d.end_ns - d.start_ns
        for h in p.host_events:
            row = rows.setdefault((h.name, True), KeyAverage(h.name, True))
            row.calls += 1
            row.host_total_ns += h.end_ns - h.start_ns
            row.device_total_ns += device_by_call[h.correlation]
        return cls(rows.values())

    def table(self, sort_by: str = "device_total", row_limit: int | None = None) -> str:
        """A text table sorted by one of :data:`SORT_KEYS` or torch's name for it
        (:data:`TORCH_SORT_KEYS`; ``name`` alphabetically, the rest largest first), at
        most ``row_limit`` rows."""
        sort_by = TORCH_SORT_KEYS.get(sort_by, sort_by)
        if sort_by not in SORT_KEYS:
            raise ValueError(f"sort_by={sort_by!r}: one of {', '.join(SORT_KEYS)}")
        if sort_by == "name":
            rows = sorted(self, key=lambda r: r.name)
        else:
            attr = sort_by if sort_by == "calls" else f"{sort_by}_ns"
            rows = sorted(self, key=lambda r: getattr(r, attr), reverse=True)
        body = [[r.name, r.calls,
                 _fmt(r.host_total_ns) if r.host else "", _fmt(r.host_avg_ns) if r.host else "",
                 _fmt(r.device_total_ns), _fmt(r.device_avg_ns)]
                for r in rows[:row_limit]]
        return tabulate(body, headers=["Name", "Calls", "Host total", "Host avg",
                                       "Device total", "Device avg"],
                        colalign=("left", "right", "right", "right", "right", "right"))
