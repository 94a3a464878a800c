"""``torch.accel.memory_summary``: torch.cuda's text table of the caching allocator's
statistics, drawn from ``memory_stats`` (the runtime allocator's counters under torch's
keys). torch.cuda's own function reads ``torch.cuda.memory_stats`` by its module name, so
it cannot be pointed at this device: this is its layout, with accel's names."""

from __future__ import annotations

from collections.abc import Callable, Mapping

WIDTH = 75

#: (stats key, row title, formatter), as torch.cuda's table orders them
_POOLED: list[tuple[str, str, str]] = [
    ("allocated_bytes", "Allocated memory", "size"),
    ("active_bytes", "Active memory", "size"),
    ("requested_bytes", "Requested memory", "size"),
    ("reserved_bytes", "Reserved memory", "size"),
    ("inactive_split_bytes", "Non-releasable memory", "size"),
    ("allocation", "Allocations", "count"),
    ("active", "Active allocs", "count"),
    ("segment", "Reserved segments", "count"),
    ("inactive_split", "Non-releasable allocs", "count"),
]
_OVERSIZE = [("oversize_allocations", "Oversize allocations"),
             ("oversize_segments", "Oversize segments")]


def _format_size(size: int, scale: float) -> str:
    """``size`` in the unit that suits ``scale`` (the row's first value), as torch's."""
    prefix = "B  "
    for new_prefix in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if scale < 768 * 1024:
            break
        prefix, size, scale = new_prefix, size // 1024, scale / 1024
    return f"{size:6d} {prefix}"


def _format_count(count: int, scale: float) -> str:
    prefix = " "
    for new_prefix in ("K", "M"):
        if scale < 750 * 1000:
            break
        prefix, count, scale = new_prefix, count // 1000, scale / 1000
    return f"{count:7d} {prefix} "


_FORMATS: dict[str, Callable[[int, float], str]] = {"size": _format_size,
                                                    "count": _format_count}


def _row(title: str, stats: Mapping[str, int], prefix: str,
         scales: tuple[int, ...] | None, fmt: Callable[[int, float], str]) -> str:
    values = [stats.get(prefix + m, 0) for m in ("current", "peak", "allocated", "freed")]
    scales = scales or tuple(values)
    cells = " | ".join(fmt(v, s) for v, s in zip(values, scales))
    return f" {title:<21} | {cells} "


def memory_summary(stats: Mapping[str, int], device: int, abbreviated: bool = False) -> str:
    """The table for ``stats`` (``memory_stats(device)``); without the per-pool rows when
    ``abbreviated``."""
    lines = ["=" * WIDTH,
             f" {'':16} PyTorch accel memory summary, device ID {device:<16d} ",
             "-" * WIDTH,
             f"  {'':8} accel OOMs: {stats.get('num_ooms', 0):<12d} | {'':6} "
             f"device alloc retries: {stats.get('num_alloc_retries', 0):<6d}  ",
             "=" * WIDTH,
             "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    for key, title, kind in _POOLED:
        lines.append("-" * WIDTH)
        fmt = _FORMATS[kind]
        first = tuple(stats.get(f"{key}.all.{m}", 0)
                      for m in ("current", "peak", "allocated", "freed"))
        lines.append(_row(title, stats, f"{key}.all.", first, fmt))
        if not abbreviated:
            lines.append(_row("      from large pool", stats, f"{key}.large_pool.", first, fmt))
            lines.append(_row("      from small pool", stats, f"{key}.small_pool.", first, fmt))
    for key, title in _OVERSIZE:
        lines.append("-" * WIDTH)
        lines.append(_row(title, stats, f"{key}.", None, _format_count))
    lines.append("=" * WIDTH)
    return "|" + "|\n|".join(lines) + "|\n"
