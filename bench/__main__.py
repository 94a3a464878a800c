"""``python -m bench [--quick] [--json PATH] [--report DIR] [--only NAME ...] [--check]``."""

from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
from pathlib import Path

from bench.core import Env, Failure, Row, environment, table, write_json
from bench.report import DEFAULT_DIR, write_report
from bench.suite import BENCHMARKS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark accel-emu; every figure is a ratio against a baseline "
                    "measured side by side in the same run.")
    p.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    p.add_argument("--report", type=Path, metavar="DIR", default=DEFAULT_DIR,
                   help="write report.md, results.json and one plot per benchmark group "
                        "here (default: bench/reports/latest)")
    p.add_argument("--only", action="append", metavar="NAME", default=[],
                   help="run only benchmarks whose name contains NAME (repeatable)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--check", action="store_true",
                   help="exit 2 when a row misses its goal (default: report only)")
    p.add_argument("--no-pin", action="store_true",
                   help="leave client and servers where the scheduler puts them (noisier: a "
                        "round trip between two CPUs costs 30-45 us more on these VMs)")
    p.add_argument("--keep-workdir", action="store_true",
                   help="keep the temporary directory (daemon and echo fs logs)")
    return p


def _terminate(signum: int, frame: object) -> None:
    # Turn SIGTERM/SIGHUP into an exception so that every `finally` stops its servers.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name, fn in BENCHMARKS:
            summary = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
            print(f"{name}: {summary}")
        return 0
    selected = [(n, fn) for n, fn in BENCHMARKS
                if not args.only or any(o in n for o in args.only)]
    if not selected:
        print(f"bench: nothing matches {args.only}", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)

    meta = environment()
    meta["quick"] = args.quick
    print(f"accel-emu benchmarks ({'quick' if args.quick else 'full'} run) on {meta['host']}, "
          f"{meta['cpus']} CPUs, load {', '.join(f'{x:.2f}' for x in meta['loadavg'])}, "
          f"commit {meta['commit'][:12]}{' (dirty)' if meta['dirty'] else ''}", flush=True)
    groups: dict[str, list[Row]] = {}
    failures: list[Failure] = []
    meta["pinned"] = not args.no_pin
    env = Env(args.quick, keep_workdir=args.keep_workdir, pin=not args.no_pin)
    t_start = time.monotonic()
    interrupted = True
    try:
        for name, fn in selected:
            t0 = time.monotonic()
            print(f"  {name} ...", end="", flush=True)
            try:
                got = fn(env)
            except Exception as exc:
                failures.append(Failure(name, "".join(traceback.format_exception(exc))))
                print(f" FAILED: {exc!r}", flush=True)
                continue
            groups[name] = got
            print(f" {time.monotonic() - t0:.1f} s", flush=True)
        interrupted = False
    finally:
        if interrupted:
            print("\nbench: interrupted; stopping the servers it started", file=sys.stderr,
                  flush=True)
        problems = env.close()
        if interrupted:
            for p in problems:
                print(f"bench: cleanup: {p}", file=sys.stderr)
    meta["duration_s"] = time.monotonic() - t_start
    meta["cleanup_problems"] = problems
    rows = [r for got in groups.values() for r in got]

    print()
    if rows:
        print(table(rows))
        print()
        print("  Ratio: measured median / baseline median, measured side by side in this run "
              "in alternating blocks; 'rounds IQR': middle half of the ratios of single "
              "rounds (adjacent blocks), a noise gauge.")
        if not args.no_pin:
            print("  Timed loops pin the client and the server's FUSE thread to one CPU per "
                  "round, alternating CPUs (--no-pin: leave placement to the scheduler).")
        for r in rows:
            if r.note:
                print(f"  {r.benchmark}: {r.note}")
    for f in failures:
        print(f"\nbenchmark {f.benchmark} failed:\n{f.error}", file=sys.stderr)
    for p in problems:
        print(f"bench: cleanup: {p}", file=sys.stderr)
    if args.keep_workdir:
        print(f"  work directory kept: {env.workdir}")
    if args.json:
        write_json(args.json, meta, rows, failures)
        print(f"  results written to {args.json}")
    write_report(args.report, meta, groups, failures)
    print(f"  report written to {args.report / 'report.md'}")
    if failures or problems:
        return 1
    if args.check and any(r.met is False for r in rows):
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
