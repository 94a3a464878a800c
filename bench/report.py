"""The report folder every ``python -m bench`` run writes (default ``bench/reports/latest/``).

``report.md`` has one table of every row (figure, baseline, ratio, goal, met) under the
run's date, host and commit, so a run can be read and compared without copying tables by
hand; ``results.json`` is the same data as ``--json`` writes; and each benchmark group gets
``<group>.png``, a bar chart of its rows' ratios with each row's goal drawn across its bar.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.core import Failure, Row, fmt_value, write_json

DEFAULT_DIR = Path(__file__).resolve().parent / "reports" / "latest"
#: Bar colours: goal met, goal missed, no goal (informational).
COLOURS = {True: "#4c9a2a", False: "#c0392b", None: "#8c8c8c"}


def write_report(folder: Path, meta: dict[str, Any], groups: dict[str, list[Row]],
                 failures: Sequence[Failure]) -> list[Path]:
    """Write report.md, results.json and one PNG per group into ``folder``; return the
    paths written. Plots of an earlier run are removed first, so every PNG there belongs
    to this run's table."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    plots = [plot_group(folder / f"{group}.png", group, rows)
             for group, rows in groups.items() if rows]
    rows = [r for group_rows in groups.values() for r in group_rows]
    write_json(folder / "results.json", meta, rows, list(failures))
    md = folder / "report.md"
    md.write_text(markdown(meta, groups, failures, [p.name for p in plots]))
    return [md, folder / "results.json", *plots]


def markdown(meta: dict[str, Any], groups: dict[str, list[Row]], failures: Sequence[Failure],
             plots: Sequence[str]) -> str:
    """The report's text: the run's identity, the table of every row, the failures, the
    plots (by file name, relative to the report)."""
    commit = meta.get("commit", "")[:12] or "unknown"
    commit += " (dirty)" if meta.get("dirty") else ""
    lines = [
        "# accel-emu benchmark report", "",
        f"- date: {meta.get('time', '?')}",
        f"- host: {meta.get('host', '?')} ({meta.get('cpus', '?')} CPUs, load "
        f"{', '.join(f'{x:.2f}' for x in meta.get('loadavg', ()))})",
        f"- commit: {commit}",
        f"- run: {'quick' if meta.get('quick') else 'full'}", "",
        "Ratio: measured / baseline, both measured side by side in this run; the goal is "
        "the most the ratio may be. Met: yes, NO, or - where a row has no goal yet.", "",
        "| group | benchmark | figure | baseline | baseline value | ratio | goal | met |",
        "| --- | --- | ---: | --- | ---: | ---: | --- | --- |",
    ]
    for group, rows in groups.items():
        for r in rows:
            lines.append(f"| {group} | {_escape(r.benchmark)} | {fmt_value(r.value, r.unit)} | "
                         f"{_escape(r.baseline)} | {fmt_value(r.baseline_value, r.unit)} | "
                         f"{r.ratio:.3g}x | {r.goal_text} | {r.met_text} |")
    for f in failures:
        lines += ["", f"**{f.benchmark} failed:** `{f.error.strip().splitlines()[-1]}`"]
    if plots:
        lines += ["", "## Plots", "",
                  "One per group: each row's ratio as a bar (green: goal met, red: missed, "
                  "grey: no goal), its goal as a black line across the bar, and a dotted "
                  "line at 1x (as fast as the baseline)."]
        lines += [f"\n![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    """A table cell's text: a ``|`` would end the cell."""
    return text.replace("|", "\\|")


def plot_group(path: Path, group: str, rows: Sequence[Row]) -> Path:
    """A horizontal bar chart of the group's ratios with each goal marked; a log scale
    when the ratios span more than two decades (a 10,000x row beside a 1.1x one)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    labels = [r.benchmark for r in rows]
    ratios = [r.ratio for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.4))
    try:
        ys = range(len(rows))
        ax.barh(list(ys), ratios, color=[COLOURS[r.met] for r in rows])
        for y, r in zip(ys, rows):
            if r.goal is not None:
                ax.vlines(r.goal, y - 0.45, y + 0.45, colors="black", linewidth=2)
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)  # as fast as the baseline
        ax.set_yticks(list(ys), labels=labels, fontsize=8)
        ax.invert_yaxis()  # the table's order, top to bottom
        positive = [x for x in ratios + [r.goal for r in rows if r.goal] if x and x > 0]
        if positive and max(positive) / min(positive) > 100:
            ax.set_xscale("log")
        ax.set_xlabel("ratio to the baseline measured in the same run (goal: at most the line)")
        ax.set_title(group)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
    finally:
        plt.close(fig)
    return path
