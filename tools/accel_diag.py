"""``accel-diag -r LEVEL``: the bring-up suite in levels, like ``dcgmi diag -r 1|2|3``.

Level 1 (quick) answers "is this machine usable at all": the driver is loaded, every
device is enumerated with its identity and is operational, the runtime sees the same
devices sysfs does, and a no-op round-trips through each device's firmware. Level 2 adds
load on one process: a long stream of no-ops whose fences must retire in order, and several
contexts per device at once. Level 3 adds several processes at once (``spawn``ed, since a
forked child may not use its parent's runtime state).

Each test is a function registered with ``@diag_test(level)``, which appends it to
``TESTS[level]``; a level runs its own tests after those of every lower level. A test
returns a one-line detail when it passes, raises ``Skip`` to skip, and fails by raising
anything else (its message is the detail). ``needs`` names tests that must have passed
first, so one root cause (say, missing firmware) is reported once, as the failure it is,
and the tests that depend on it are skipped instead of failing with the same cause. Later
capabilities (memory, kernels) add their tests the same way.

``-i`` restricts the run to some physical devices (index, UUID or unique UUID prefix, PCI
bus id, comma list); it sets ``ACCEL_VISIBLE_DEVICES`` for this process and its workers.
Without it the runtime's own view applies, ``ACCEL_VISIBLE_DEVICES`` included.

Exit status: 0 when no test failed (skips do not fail a run), 1 when any failed, 2 for a
bad command line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

import runtime
from kmod_emul import uapi
from runtime import discovery
from tools.accel_smi import Tree, UsageError, select

LEVEL_NAMES = {1: "quick", 2: "medium", 3: "long"}
FENCE_TIMEOUT_S = 5.0
#: Level 2 sizes: enough to wrap small rings and expose reordering, still well under a second.
STREAM_NOOPS = 1000
CONTEXTS_PER_DEVICE = 4
CONTEXT_NOOPS = 100
#: Level 3 sizes.
WORKER_PROCESSES = 3
WORKER_NOOPS = 200
WORKER_TIMEOUT_S = 60.0


class Skip(Exception):
    """Raised by a test that does not apply here (its message says why)."""


@dataclass(frozen=True)
class Diag:
    """What every test may look at: the tree and the devices under test."""

    tree: Tree
    #: Physical names (``accelN``) in runtime-index order: runtime device i is devices[i].
    devices: list[str]

    def attrs(self, name: str) -> dict[str, str]:
        return self.tree.device(name)


@dataclass(frozen=True)
class DiagTest:
    name: str
    level: int
    run: Callable[[Diag], str]
    needs: tuple[str, ...]
    doc: str


@dataclass(frozen=True)
class Result:
    name: str
    level: int
    status: str  # "pass", "fail" or "skip"
    detail: str
    seconds: float


TESTS: dict[int, list[DiagTest]] = {1: [], 2: [], 3: []}


def diag_test(level: int, needs: Sequence[str] = ()) -> Callable[[Callable[[Diag], str]],
                                                                 Callable[[Diag], str]]:
    """Register a test function in ``TESTS[level]`` (run order is registration order)."""

    def register(fn: Callable[[Diag], str]) -> Callable[[Diag], str]:
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        TESTS[level].append(DiagTest(fn.__name__, level, fn, tuple(needs), doc))
        return fn

    return register


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


# --- level 1 -----------------------------------------------------------------------------------
@diag_test(1)
def driver(d: Diag) -> str:
    """The driver is loaded and speaks this runtime's ABI major."""
    drv = d.tree.driver()
    _check(bool(drv), f"no driver: {d.tree.root / uapi.MODULE_DIR} is missing; start one "
                      f"with `accel-emud --root {d.tree.root}` (or set ACCEL_EMU_ROOT)")
    abi = drv.get("abi_version", "")
    _check(abi.split(".")[0] == str(uapi.ACCEL_ABI_MAJOR),
           f"driver speaks ABI {abi or '?'}, this runtime {uapi.ACCEL_ABI_MAJOR}."
           f"{uapi.ACCEL_ABI_MINOR}: install a matching runtime or driver")
    return f"accel-emud {drv.get('version', '?')} (pid {drv.get('pid', '?')}), ABI {abi}"


@diag_test(1, needs=("driver",))
def enumeration(d: Diag) -> str:
    """Every device is listed, with a unique UUID, serial and PCI bus id."""
    physical = d.tree.device_names()
    announced = d.tree.driver().get("devices", "")
    _check(announced == str(len(physical)),
           f"driver announces {announced} device(s) but {len(physical)} are in sysfs")
    _check(bool(d.devices), "no device visible"
           + (f" (ACCEL_VISIBLE_DEVICES={os.environ['ACCEL_VISIBLE_DEVICES']!r})"
              if "ACCEL_VISIBLE_DEVICES" in os.environ else ""))
    seen: dict[str, dict[str, str]] = {k: {} for k in ("uuid", "serial", "pci_bus_id")}
    for name in physical:
        a = d.attrs(name)
        for key, owners in seen.items():
            value = a.get(key, "")
            _check(bool(value), f"{name} has no {key}")
            _check(value not in owners, f"{name} and {owners.get(value)} share {key} {value}")
            owners[value] = name
    return "; ".join(f"{n} {d.attrs(n)['pci_bus_id']} {d.attrs(n)['uuid'][:14]}"
                     for n in d.devices)


@diag_test(1, needs=("enumeration",))
def device_state(d: Diag) -> str:
    """Every device under test is operational (else: why, from its failure attributes)."""
    bad = []
    for name in d.devices:
        a = d.attrs(name)
        if a.get("state") != "operational":
            code = f" [{a['failure_code']}]" if a.get("failure_code") else ""
            bad.append(f"{name}: {a.get('state')}{code} {a.get('failure', '')}".rstrip())
    _check(not bad, "; ".join(bad))
    return f"{len(d.devices)} operational"


#: DeviceProperties field -> sysfs attribute, where the names differ.
_PROP_ATTR = {"total_memory": "memory_total", "physical_index": "index"}


@diag_test(1, needs=("device_state",))
def runtime_properties(d: Diag) -> str:
    """The runtime initialises and reports what sysfs reports, device by device."""
    runtime.init()
    count = runtime.device_count()
    _check(count == len(d.devices), f"runtime sees {count} device(s), sysfs {len(d.devices)}")
    mismatches = []
    for i, name in enumerate(d.devices):
        props = asdict(runtime.get_device_properties(i))
        a = d.attrs(name)
        for field, value in props.items():
            attr = _PROP_ATTR.get(field, field)
            if field == "index" or attr not in a:
                continue  # index is the runtime's own numbering
            shown = " ".join(value) if isinstance(value, tuple) else str(value)
            if shown != a[attr]:
                mismatches.append(f"{name}.{attr}: runtime {shown!r}, sysfs {a[attr]!r}")
    _check(not mismatches, "; ".join(mismatches))
    return f"{count} device(s), properties match sysfs"


@diag_test(1, needs=("device_state",))
def noop(d: Diag) -> str:
    """A no-op submitted on a new context completes on every device."""
    times = []
    for i, name in enumerate(d.devices):
        with runtime.new_context(i) as ctx:
            start = time.monotonic()
            ctx.submit_noop().wait(timeout=FENCE_TIMEOUT_S)
            times.append(f"{name} {(time.monotonic() - start) * 1e3:.1f} ms")
    return ", ".join(times)


# --- level 2 -----------------------------------------------------------------------------------
@diag_test(2, needs=("noop",))
def noop_stream(d: Diag) -> str:
    """Many no-ops on one context: consecutive seqnos, in-order retirement, ordered timestamps."""
    rates = []
    for i, name in enumerate(d.devices):
        with runtime.new_context(i) as ctx:
            start = time.monotonic()
            fences = [ctx.submit_noop() for _ in range(STREAM_NOOPS)]
            seqnos = [f.seqno for f in fences]
            _check(seqnos == list(range(seqnos[0], seqnos[0] + STREAM_NOOPS)),
                   f"{name}: seqnos not consecutive")
            fences[-1].wait(timeout=FENCE_TIMEOUT_S)
            pending = [f.seqno for f in fences if not f.query()]
            _check(not pending, f"{name}: fence {seqnos[-1]} done before {pending[:5]}")
            stamps = [f.wait(timeout=FENCE_TIMEOUT_S) for f in fences]
            _check(all(a <= b for a, b in zip(stamps, stamps[1:])),
                   f"{name}: completion timestamps go backwards")
            rates.append(f"{name} {STREAM_NOOPS / (time.monotonic() - start):.0f}/s")
    return f"{STREAM_NOOPS} no-ops each: " + ", ".join(rates)


@diag_test(2, needs=("noop",))
def multi_context(d: Diag) -> str:
    """Several contexts per device at once, interleaved: independent timelines, all retire."""
    for i, name in enumerate(d.devices):
        before = int(d.attrs(name)["contexts"])
        contexts = [runtime.new_context(i) for _ in range(CONTEXTS_PER_DEVICE)]
        try:
            _check(len({c.id for c in contexts}) == CONTEXTS_PER_DEVICE,
                   f"{name}: context ids repeat")
            live = int(d.attrs(name)["contexts"])
            _check(live >= before + CONTEXTS_PER_DEVICE,
                   f"{name}: sysfs shows {live} contexts with {CONTEXTS_PER_DEVICE} more open")
            fences: dict[int, list[runtime.Fence]] = {c.id: [] for c in contexts}
            for _ in range(CONTEXT_NOOPS):
                for c in contexts:
                    fences[c.id].append(c.submit_noop())
            for c in contexts:
                seqnos = [f.seqno for f in fences[c.id]]
                _check(seqnos == list(range(1, CONTEXT_NOOPS + 1)),
                       f"{name}: context {c.id} seqnos {seqnos[:3]}... not its own 1..n")
                fences[c.id][-1].wait(timeout=FENCE_TIMEOUT_S)
        finally:
            for c in contexts:
                c.close()
    return (f"{CONTEXTS_PER_DEVICE} contexts x {CONTEXT_NOOPS} no-ops on each of "
            f"{len(d.devices)} device(s)")


# --- level 3 -----------------------------------------------------------------------------------
def _worker(barrier: Any, results: Any, root: str, noops: int) -> None:
    """One level-3 process: contexts on every device, wait for all peers, then no-ops."""
    report: dict[str, Any] = {"pid": os.getpid(), "clients": {}, "completed": {}, "error": None}
    try:
        contexts = [runtime.new_context(i) for i in range(runtime.device_count())]
        barrier.wait(timeout=WORKER_TIMEOUT_S)  # every worker now holds its contexts
        for c in contexts:
            report["clients"][c.physical] = int(
                (Path(root) / uapi.CLASS_DIR / c.physical / "clients").read_text())
        barrier.wait(timeout=WORKER_TIMEOUT_S)  # nobody closes before everyone has read
        fences = [[c.submit_noop() for _ in range(noops)] for c in contexts]
        for c, fs in zip(contexts, fences):
            fs[-1].wait(timeout=FENCE_TIMEOUT_S)
            report["completed"][c.physical] = fs[-1].seqno
            c.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        barrier.abort()
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


@diag_test(3, needs=("noop",))
def multi_process(d: Diag) -> str:
    """Several processes submit to every device at the same time."""
    mp = multiprocessing.get_context("spawn")
    barrier, results = mp.Barrier(WORKER_PROCESSES), mp.Queue()
    workers = [mp.Process(target=_worker, args=(barrier, results, str(d.tree.root), WORKER_NOOPS),
                          daemon=True) for _ in range(WORKER_PROCESSES)]
    for w in workers:
        w.start()
    reports = []
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        for _ in workers:
            reports.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
    except Exception:  # queue.Empty: a worker hung or died without reporting
        raise AssertionError(f"only {len(reports)} of {WORKER_PROCESSES} workers reported "
                             f"within {WORKER_TIMEOUT_S:g} s") from None
    finally:
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.terminate()
                w.join()
    errors = [f"pid {r['pid']}: {r['error']}" for r in reports if r["error"]]
    _check(not errors, "; ".join(errors))
    for r in reports:
        for name in d.devices:
            _check(r["completed"].get(name) == WORKER_NOOPS,
                   f"pid {r['pid']} completed {r['completed'].get(name)} on {name}")
    peak = min(n for r in reports for n in r["clients"].values())
    _check(peak >= WORKER_PROCESSES,
           f"sysfs showed only {peak} clients with {WORKER_PROCESSES} processes holding contexts")
    return (f"{WORKER_PROCESSES} processes x {len(d.devices)} device(s) x {WORKER_NOOPS} "
            f"no-ops, >= {peak} clients at once")


# --- running ------------------------------------------------------------------------------------
def suite(level: int) -> list[DiagTest]:
    return [t for lvl in sorted(TESTS) if lvl <= level for t in TESTS[lvl]]


def run_suite(diag: Diag, level: int) -> list[Result]:
    results: list[Result] = []
    passed: set[str] = set()
    for test in suite(level):
        missing = [n for n in test.needs if n not in passed]
        start = time.monotonic()
        if missing:
            status, detail = "skip", f"needs {', '.join(missing)}, which did not pass"
        else:
            try:
                status, detail = "pass", test.run(diag)
                passed.add(test.name)
            except Skip as exc:
                status, detail = "skip", str(exc)
            except AssertionError as exc:
                status, detail = "fail", str(exc)
            except Exception as exc:  # noqa: BLE001 - any error is this test's failure
                status, detail = "fail", f"{type(exc).__name__}: {exc}"
        results.append(Result(test.name, test.level, status, detail,
                              round(time.monotonic() - start, 3)))
    return results


def render(diag: Diag, level: int, results: list[Result], as_json: bool) -> str:
    ok = not any(r.status == "fail" for r in results)
    if as_json:
        return json.dumps({
            "level": level, "root": str(diag.tree.root), "devices": diag.devices,
            "result": "pass" if ok else "fail", "tests": [asdict(r) for r in results],
        }, indent=2)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skip")}
    rows = [[r.name, r.level, r.status.upper(), r.detail] for r in results]
    table = tabulate(rows, headers=["Test", "Level", "Result", "Detail"], tablefmt="psql",
                     maxcolwidths=[None, None, None, 80], disable_numparse=True,
                     break_on_hyphens=False)
    tested = ", ".join(diag.devices) or "no devices"
    return (f"accel-diag -r {level} ({LEVEL_NAMES[level]}) on {tested}"
            f"\n{table}\n{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} "
            f"skipped: {'PASS' if ok else 'FAIL'}")


def _level(text: str) -> int:
    by_name = {v: k for k, v in LEVEL_NAMES.items()}
    if text in by_name:
        return by_name[text]
    if text.isdigit() and int(text) in LEVEL_NAMES:
        return int(text)
    raise argparse.ArgumentTypeError(
        f"level must be 1, 2 or 3 (or quick, medium, long), not {text!r}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accel-diag", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-r", "--run", type=_level, required=True, metavar="LEVEL",
                   help="1 (quick), 2 (medium) or 3 (long); each includes the lower levels")
    p.add_argument("-i", "--id", metavar="ID", default=None, help="device(s) to test")
    p.add_argument("--json", action="store_true", help="machine-readable results")
    p.add_argument("--root", type=Path, default=None,
                   help="mount root (default: $ACCEL_EMU_ROOT or the per-user default)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.root is not None:
        os.environ["ACCEL_EMU_ROOT"] = str(args.root)  # the runtime and workers read it
    tree = Tree(Path(uapi.default_root()))
    if args.id is not None:
        try:
            chosen = select(tree, args.id)
        except UsageError as exc:
            print(f"accel-diag: {exc}", file=sys.stderr)
            return 2
        os.environ["ACCEL_VISIBLE_DEVICES"] = ",".join(n[5:] for n in chosen)
    diag = Diag(tree, discovery.visible_devices())
    results = run_suite(diag, args.run)
    print(render(diag, args.run, results, args.json))
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
