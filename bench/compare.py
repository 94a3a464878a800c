"""``python -m bench.compare BASE``: this checkout's benchmarks against commit BASE's.

Why a second layer of interleaving: every row of ``python -m bench`` is already a ratio to
a baseline measured beside it, but two runs an hour apart on a shared 2-core machine still
differ by more than most code changes do. This runs BASE (checked out into a temporary git
worktree) and this checkout benchmark by benchmark in alternating order (BASE, new, new,
BASE, ...), each in its own process with its own daemon, and reports for every row the
median of each side's ratios and new/BASE: below 1 is faster than before.

Only benchmarks both sides have are compared; a row either side lacks is listed as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

from bench.suite import BENCHMARKS

REPO = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    p.add_argument("base", help="the commit to compare against (anything git rev-parse takes)")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs per side and benchmark, alternating (default 2)")
    p.add_argument("--quick", action="store_true", help="pass --quick to every run")
    p.add_argument("--only", action="append", metavar="NAME", default=[],
                   help="only benchmarks whose name contains NAME (repeatable)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    return p


def _run(tree: Path, name: str, quick: bool, out: Path) -> dict[str, float] | None:
    """One ``python -m bench --only NAME`` in ``tree``; its rows' ratios, None if it has none."""
    cmd = [sys.executable, "-m", "bench", "--only", name, "--json", str(out)]
    if quick:
        cmd.append("--quick")
    if (tree / "bench" / "report.py").exists():
        # a report of one benchmark must not replace the checkout's bench/reports/latest;
        # a base from before the report has no --report and writes none
        cmd += ["--report", str(out.with_name("report"))]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=3600, check=False)
    if not out.exists():
        print(f"    {tree.name}: {name}: no results (exit {proc.returncode})"
              f"{': ' + proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}",
              flush=True)
        return None
    rows = json.loads(out.read_text())["rows"]
    out.unlink()
    return {r["benchmark"]: r["ratio"] for r in rows}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    base = subprocess.run(["git", "rev-parse", "--verify", args.base + "^{commit}"], cwd=REPO,
                          capture_output=True, text=True, check=False).stdout.strip()
    if not base:
        print(f"bench.compare: {args.base!r} is not a commit", file=sys.stderr)
        return 1
    names = [n for n, _ in BENCHMARKS if not args.only or any(o in n for o in args.only)]
    ratios: dict[str, dict[str, list[float]]] = {}  # row -> side -> ratios
    with tempfile.TemporaryDirectory(prefix="accel-bench-compare-") as tmp:
        old = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(old), base],
                       cwd=REPO, check=True)
        try:
            sides = {"base": old, "new": REPO}
            for name in names:
                print(f"  {name}: ", end="", flush=True)
                for i in range(args.rounds):
                    order = ("base", "new") if i % 2 == 0 else ("new", "base")
                    for side in order:
                        got = _run(sides[side], name, args.quick, Path(tmp) / "run.json")
                        for row, ratio in (got or {}).items():
                            ratios.setdefault(row, {}).setdefault(side, []).append(ratio)
                        print(side[0], end="", flush=True)
                print(flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO,
                           check=False)
    body, data = [], []
    for row, by_side in ratios.items():
        med = {s: statistics.median(v) for s, v in by_side.items()}
        change = med["new"] / med["base"] if len(med) == 2 and med["base"] else None
        body.append([row, f"{med['base']:.2f}x" if "base" in med else "absent",
                     f"{med['new']:.2f}x" if "new" in med else "absent",
                     "-" if change is None else f"{change:.2f}"])
        data.append({"row": row, "ratios": by_side, "change": change})
    print(f"\nbase {base[:12]} vs this checkout; each ratio is the row's own ratio to its "
          f"in-run baseline, median of {args.rounds} alternating runs per side; "
          "change = new / base (below 1: faster).\n")
    print(tabulate(body, headers=["row", "base ratio", "new ratio", "change"],
                   colalign=("left", "right", "right", "right")))
    if args.json:
        args.json.write_text(json.dumps({"base": base, "rows": data}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
