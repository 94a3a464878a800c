"""The harness: result rows, the shared environment, interleaved timing and the report.

Every figure is a ratio against a baseline measured side by side in the same run: the
machines are shared and noisy, so absolute numbers from different runs do not compare,
while two cases measured in alternating blocks see the same noise.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from bench.procs import REPO, AccelDaemon, EchoServer, mounts_under


@dataclass
class Row:
    """One line of the report: a measured figure, its baseline and the goal on their ratio."""

    benchmark: str
    value: float
    baseline: str
    baseline_value: float
    unit: str = "us"
    #: The ratio must be at most this; None: informational (no goal yet).
    goal: float | None = None
    #: Middle half (25th-75th percentile) of the per-round ratios: how much noise moved it.
    spread: tuple[float, float] | None = None
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.value / self.baseline_value if self.baseline_value else math.inf

    @property
    def met(self) -> bool | None:
        return None if self.goal is None else self.ratio <= self.goal

    @property
    def goal_text(self) -> str:
        """The goal as the console table and the report show it."""
        return "-" if self.goal is None else f"<= {self.goal:g}x"

    @property
    def met_text(self) -> str:
        """``yes``, ``NO`` (capitals: a miss must stand out), or ``-`` without a goal."""
        return "-" if self.met is None else ("yes" if self.met else "NO")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ratio=self.ratio, met=self.met)
        return out


@dataclass
class Failure:
    benchmark: str
    error: str


# --- timing ------------------------------------------------------------------------------


@dataclass
class Samples:
    """Per-call durations (ns) of one case, and the median of each of its blocks."""

    name: str
    ns: list[int] = field(default_factory=list)
    block_medians: list[float] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        return statistics.median(self.ns) / 1e3

    def percentile_us(self, p: float) -> float:
        ordered = sorted(self.ns)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] / 1e3

    def summary(self) -> dict[str, Any]:
        return {"n": len(self.ns), "median_us": self.median_us,
                "p10_us": self.percentile_us(10), "p90_us": self.percentile_us(90),
                "p99_us": self.percentile_us(99), "min_us": min(self.ns) / 1e3,
                "block_medians_us": [round(m / 1e3, 2) for m in self.block_medians]}


def interleave(cases: dict[str, Callable[[], object]], *, block: int, rounds: int,
               warmup: int, pin: list[int] | None = None) -> dict[str, Samples]:
    """Time each case call by call, alternating blocks of ``block`` calls between the cases
    for ``rounds`` rounds (ABC, CBA, ABC, ... so that no case always follows another).

    ``pin``: server thread ids to place on this process's CPU. Each round pins this process
    and them to one CPU, the next round to the next CPU. On these VMs a FUSE round trip
    between two CPUs costs 30-45 us more than on one (each wake-up of a halted vCPU is an
    IPI through the hypervisor), and the scheduler splits or joins client and server at
    random for seconds at a time; that, not the code, is most of the noise when unpinned.
    Pinned, every case of a round sees the same placement, and rounds cover every CPU.
    """
    samples = {name: Samples(name) for name in cases}
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    order = list(cases)
    clock = time.perf_counter_ns
    placement = Placement(pin) if pin is not None else None
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            if placement is not None:
                placement.pin_round(r)
            for name in order if r % 2 == 0 else reversed(order):
                fn, out = cases[name], samples[name]
                times = []
                for _ in range(block):
                    t0 = clock()
                    fn()
                    times.append(clock() - t0)
                out.ns.extend(times)
                out.block_medians.append(statistics.median(times))
    finally:
        if gc_was_enabled:
            gc.enable()
        if placement is not None:
            placement.restore()
    return samples


class Placement:
    """Pins this process and some server threads to one CPU per round, and ``apart``
    threads (bench/floods.py: the firmware's control loops) to the other CPUs; restores
    after."""

    def __init__(self, tids: list[int], apart: list[int] | None = None) -> None:
        self.cpus = sorted(os.sched_getaffinity(0))
        self.apart = set(apart or [])
        self.saved: dict[int, set[int]] = {}
        for tid in [0, *tids, *self.apart]:
            try:
                self.saved[tid] = os.sched_getaffinity(tid)
            except OSError:
                pass  # gone or not ours: leave it where it is

    def pin_round(self, r: int) -> None:
        cpu = {self.cpus[r % len(self.cpus)]}
        others = set(self.cpus) - cpu or cpu
        for tid in self.saved:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, others if tid in self.apart else cpu)

    def restore(self) -> None:
        for tid, cpus in self.saved.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


def round_ratios(measured: Samples, baseline: Samples) -> list[float]:
    """Ratio of block medians, round by round (the two blocks of a round are adjacent)."""
    return [m / b for m, b in zip(measured.block_medians, baseline.block_medians) if b]


def middle_half(values: list[float]) -> tuple[float, float]:
    """25th and 75th percentile: how far noise moved a ratio, ignoring a stray round."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (math.nan, math.nan)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def timed_row(benchmark: str, measured: Samples, baseline_name: str, baseline: Samples, *,
              goal: float | None, note: str = "", **details: Any) -> Row:
    """A row comparing the medians of two interleaved cases, per call, in microseconds."""
    ratios = round_ratios(measured, baseline)
    return Row(benchmark, measured.median_us, baseline_name, baseline.median_us, "us", goal,
               middle_half(ratios), note,
               {"measured": measured.summary(), "baseline": baseline.summary(),
                "round_ratios": [round(r, 3) for r in ratios], **details})


# --- the environment the benchmarks share --------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How long to measure: ``--quick`` keeps every figure but takes fewer samples."""

    block: int
    rounds: int
    warmup: int
    starts: int

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        return cls(block=200, rounds=6, warmup=100, starts=2) if quick else \
            cls(block=1000, rounds=12, warmup=500, starts=6)


class Env:
    """One run's temporary directory and servers. Everything started is stopped by close()."""

    def __init__(self, quick: bool, keep_workdir: bool = False, pin: bool = True) -> None:
        self.quick = quick
        #: Pin client and server threads to one CPU per round (see ``interleave``).
        self.pin = pin
        self.sizes = Sizes.of(quick)
        self.workdir = Path(tempfile.mkdtemp(prefix="accel-bench-"))
        self.keep_workdir = keep_workdir
        self._servers: list[AccelDaemon | EchoServer] = []
        self._accel: AccelDaemon | None = None
        self._echo: EchoServer | None = None
        self._names = 0

    def _base(self, kind: str) -> Path:
        self._names += 1
        return self.workdir / f"{kind}{self._names}"

    def new_accel(self, devices: int = 2, firmware_dir: Path | None = None) -> AccelDaemon:
        """A private daemon (not yet started); stopped at close() at the latest."""
        d = AccelDaemon(self._base("accel"), devices, firmware_dir=firmware_dir)
        self._servers.append(d)
        return d

    def new_echo(self) -> EchoServer:
        e = EchoServer(self._base("echo"))
        self._servers.append(e)
        return e

    @property
    def accel(self) -> AccelDaemon:
        """The shared 2-device daemon, started on first use."""
        if self._accel is None:
            d = self.new_accel(2)
            d.start()
            self._accel = d
        return self._accel

    @property
    def echo(self) -> EchoServer:
        """The shared echo filesystem, started on first use."""
        if self._echo is None:
            e = self.new_echo()
            e.start()
            self._echo = e
        return self._echo

    def pinned(self, *servers: AccelDaemon | EchoServer) -> list[int] | None:
        """The thread ids ``interleave(pin=...)`` should place with us (None: no pinning).

        The serving thread of each: the daemon's and the echo fs's main thread (trio runs
        the FUSE loop there). accel-emud's firmware processes stay where the scheduler puts
        them, as they would for any client."""
        if not self.pin:
            return None
        tids = []
        for s in servers:
            pid = s.pid if isinstance(s, AccelDaemon) else (s.proc.pid if s.proc else None)
            if pid is not None:
                tids.append(pid)
        return tids

    @contextlib.contextmanager
    def accel_root_env(self) -> Iterator[None]:
        """Point this process's runtime at the shared daemon (ACCEL_EMU_ROOT) for a while."""
        old = os.environ.get("ACCEL_EMU_ROOT")
        os.environ["ACCEL_EMU_ROOT"] = str(self.accel.root)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("ACCEL_EMU_ROOT", None)
            else:
                os.environ["ACCEL_EMU_ROOT"] = old

    def close(self) -> list[str]:
        """Stop every server (newest first); return what could not be cleaned up."""
        problems = []
        for server in reversed(self._servers):
            try:
                server.stop()
            except Exception as exc:  # keep stopping the others
                problems.append(f"stopping {server.root}: {exc!r}")
        self._servers.clear()
        self._accel = self._echo = None
        left = mounts_under(self.workdir)
        problems += [f"mount left at {mp} ({src})" for src, mp in left]
        if not left and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return problems


# --- the registry -------------------------------------------------------------------------

Benchmark = Callable[[Env], list[Row]]


# --- the report -------------------------------------------------------------------------


def fmt_value(value: float, unit: str) -> str:
    """A figure as the console table and the report show it."""
    if unit == "us":
        return f"{value:,.1f} us"
    if unit == "ms":
        return f"{value:,.1f} ms"
    return f"{value:,.3g} {unit}"


def table(rows: list[Row]) -> str:
    body = []
    for r in rows:
        spread = f"{r.spread[0]:.2f}-{r.spread[1]:.2f}" if r.spread else "-"
        body.append([r.benchmark, fmt_value(r.value, r.unit), r.baseline,
                     fmt_value(r.baseline_value, r.unit), f"{r.ratio:.2f}x", spread,
                     r.goal_text, r.met_text])
    return tabulate(body, headers=["benchmark", "measured", "baseline", "baseline value",
                                   "ratio", "rounds IQR", "goal", "met?"],
                    colalign=("left", "right", "left", "right", "right", "right", "left",
                              "left"))


def environment() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "commit": commit,
        "dirty": dirty,
    }


def write_json(path: Path, meta: dict[str, Any], rows: list[Row],
               failures: list[Failure]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": [r.to_json() for r in rows],
            "failures": [asdict(f) for f in failures]}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
