"""``accel-diag -r LEVEL`` or ``-r TEST[,TEST]``: the bring-up suite, like ``dcgmi diag``.

Level 1 (quick) answers "is this machine usable at all": the driver is loaded, every
device is enumerated with its identity and is operational, the runtime sees the same
devices sysfs does, a no-op round-trips through each device's firmware (its latency judged
against a host pipe round trip), device memory holds what pinned and pageable copies put
there (and is given back), and a stream keeps its order. Level 2 adds load and the
asynchronous features on one process: a long stream of no-ops whose fences must retire in
order, several contexts per device at once, a 64 MiB pinned copy (its bandwidth judged
against a host memcpy), streams joined by events, graph replay, a faulting stream that
spares the others, managed memory migrating on device access, the kernel library checked
against numpy, the JIT cache (the same source twice: one compile, then a hit) and a GEMM on
the matrix unit. Level 3 adds several processes at once (``spawn``ed, since a forked child
may not use its parent's runtime state) and more than one device: peer copies, processes
whose memory and contexts the driver must give back, IPC memory shared with another
process; a few seconds of back-to-back kernel launches with an exact result; and memory
patterns (walking ones, address-in-address, random) over a large allocation.

Every test uses the public runtime API only, compares what it moved or computed, and frees
what it allocated (its streams closed, its arrays freed, the allocator's cache emptied).

Each test is a function registered with ``@diag_test(level)``, which appends it to
``TESTS[level]``; a level runs its own tests after those of every lower level, and
``-r TEST`` runs the named tests after those they need. A test of the whole machine is
``fn(diag)``; a ``per_device`` one is ``fn(diag, index, name)``, run once per device with
a result of its own. A test returns a one-line detail (or an ``Outcome`` with figures)
when it passes, raises ``Skip`` to skip, and fails by raising anything else (its message
is the detail; a ``Failure`` carries its reason code). ``needs`` names tests that must
have passed first -- on the same device, for a per-device need -- so one root cause (say,
a device whose bring-up failed) is reported once, as the failure it is, and only the tests
that depend on it are skipped (``dependency-failed``), the other devices' still running.

A figure is judged against a host baseline measured just before it in the same process:
past its threshold the test is Warn (shown, with a reason code, but the run still exits 0).
docs/diag.md has the thresholds, the reason codes and the ``--json`` schema.

``-i`` restricts the run to some physical devices (index, UUID or unique UUID prefix, PCI
bus id, comma list); it sets ``ACCEL_VISIBLE_DEVICES`` for this process and its workers.
Without it the runtime's own view applies, ``ACCEL_VISIBLE_DEVICES`` included.

Exit status: 0 when no test failed (warns and skips do not fail a run), 1 when any failed,
2 for a bad command line (an unknown test name among them).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tabulate import tabulate
from tqdm import tqdm

import runtime
from abi import uapi, userq
from runtime import discovery
from tools.sysfs_tree import Tree, UsageError, select

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
#: Memory test sizes. The round trip is larger than one 8 MiB staging chunk, so pageable
#: copies take the pipelined path; the bandwidth copy is large enough to amortise a submit.
ROUNDTRIP_BYTES = 12 << 20
ORDER_BYTES = 4 << 20            # above the 256 KiB inline limit: the copy engines run it
BANDWIDTH_BYTES = 64 << 20
#: Warn when a pinned copy moves less than this share of a host memcpy's GB/s. The copy
#: engines copy between shared mappings in the firmware process, so a healthy copy runs at
#: a good fraction of memcpy (docs/diag.md gives the figures seen).
COPY_WARN_BELOW = 0.1
EVENT_BYTES = 16 << 20           # a memset long enough that an unordered reader would see it
GRAPH_BYTES = 1 << 20
GRAPH_REPLAYS = 10
MANAGED_BYTES = 1 << 20
MANAGED_PAGE = 64 << 10          # the firmware migrates managed memory in 64 KiB pages
PEER_BYTES = 8 << 20
WORKER_BYTES = 4 << 20
#: An address no allocation of anyone's has (bits 44 and up name the device).
UNMAPPED_VA = 1 << 43
#: The environment that makes this process's contexts a diagnostic's (docs/contract.md):
#: the faults fault_isolation provokes are then recorded with origin "diag" and not counted
#: as a tenant's, as dcgmi diag leaves no XIDs. Only root may ask; run as another user, the
#: diagnostic's faults count as that user's.
DIAGNOSTIC_ENV = "ACCEL_DIAGNOSTIC"
#: The firmware publishes its counters when it goes idle; teardown is asynchronous.
COUNTER_POLL_S = 2.0
TEARDOWN_POLL_S = 10.0


#: Reason codes: short, stable identifiers a script can match on (docs/diag.md lists them).
REASONS = {
    "ok": "passed, every figure within its threshold",
    "bandwidth-low": "passed, but a bandwidth is below its share of the host baseline",
    "latency-high": "passed, but a latency is above its multiple of the host baseline",
    "mismatch": "data read back differs from what was written or computed",
    "check-failed": "a property the test checks does not hold",
    "device-failed": "the device is not operational",
    "error": "the test raised an unexpected error",
    "dependency-failed": "skipped: a test it needs did not pass (on this device)",
    "not-applicable": "skipped: the test does not apply here",
}


class Skip(Exception):
    """Raised by a test that does not apply here (its message says why)."""

    reason = "not-applicable"


class Failure(AssertionError):
    """A failed check, with the reason code the result reports."""

    def __init__(self, message: str, reason: str = "check-failed") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Figure:
    """A measured number beside a host baseline measured just before it, in this run.

    The ratio ``value / baseline`` is judged, never the value alone: the machines are shared
    and noisy, and a baseline taken side by side sees the same noise. ``warn_below`` (for
    rates) or ``warn_above`` (for times) is the ratio past which the result is Warn."""

    name: str
    value: float
    unit: str
    baseline_name: str
    baseline: float
    warn_below: float | None = None
    warn_above: float | None = None
    reason: str = "ok"  # the reason code reported when the ratio is past its threshold

    @property
    def ratio(self) -> float:
        return self.value / self.baseline if self.baseline else float("inf")

    @property
    def warns(self) -> bool:
        return ((self.warn_below is not None and self.ratio < self.warn_below)
                or (self.warn_above is not None and self.ratio > self.warn_above))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": round(self.value, 4), "unit": self.unit,
                "baseline": {"name": self.baseline_name, "value": round(self.baseline, 4),
                             "unit": self.unit},
                "ratio": round(self.ratio, 4), "warn_below": self.warn_below,
                "warn_above": self.warn_above}

    def text(self) -> str:
        limit = (f">= {self.warn_below:g}x" if self.warn_below is not None
                 else f"<= {self.warn_above:g}x")
        return (f"{self.name} {self.value:.3g} {self.unit} = {self.ratio:.3g}x "
                f"{self.baseline_name} ({limit} expected)")


@dataclass(frozen=True)
class Outcome:
    """What a passing test returns when it measured something: its detail and figures."""

    detail: str
    figures: tuple[Figure, ...] = ()


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
    #: ``run(diag)``, or ``run(diag, index, name)`` once per device when ``per_device``.
    run: Callable[..., str | Outcome]
    needs: tuple[str, ...]
    doc: str
    per_device: bool = False


@dataclass(frozen=True)
class Result:
    name: str
    level: int
    device: str | None  # None: a test of the whole machine
    result: str  # "pass", "fail", "warn" or "skip"
    reason: str  # one of REASONS
    detail: str
    seconds: float
    figures: tuple[Figure, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level, "device": self.device,
                "result": self.result, "reason": self.reason, "detail": self.detail,
                "seconds": self.seconds, "figures": [f.to_json() for f in self.figures]}


TESTS: dict[int, list[DiagTest]] = {1: [], 2: [], 3: []}


def diag_test(level: int, needs: Sequence[str] = (), per_device: bool = False
              ) -> Callable[[Callable[..., str | Outcome]], Callable[..., str | Outcome]]:
    """Register a test function in ``TESTS[level]`` (run order is registration order).

    A ``per_device`` test runs once per device, so a broken device fails (and skips the
    dependents of) only its own results while the healthy ones carry on."""

    def register(fn: Callable[..., str | Outcome]) -> Callable[..., str | Outcome]:
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        TESTS[level].append(DiagTest(fn.__name__, level, fn, tuple(needs), doc, per_device))
        return fn

    return register


def _check(ok: bool, message: str, reason: str = "check-failed") -> None:
    if not ok:
        raise Failure(message, reason)


def _attr(d: Diag, name: str, key: str) -> str:
    """One sysfs attribute of ``name``, read now (not the whole directory)."""
    return (d.tree.class_dir / name / key).read_text().strip()


def _poll(read: Callable[[], Any], ok: Callable[[Any], bool], timeout: float) -> Any:
    """Read until ``ok(value)`` or ``timeout`` seconds passed; return the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if ok(value) or time.monotonic() >= deadline:
            return value
        time.sleep(0.02)


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` bytes that differ from seed to seed and from place to place, made fast."""
    words = np.arange(seed << 32, (seed << 32) + (nbytes + 7) // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)  # wraps modulo 2**64: a cheap hash
    return words.view(np.uint8)[:nbytes]


def _mismatch(got: np.ndarray, want: np.ndarray) -> str:
    """Where two byte arrays differ first, for a failure message."""
    got, want = got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    bad = np.flatnonzero(got != want)
    if not len(bad):
        return "no difference"
    i = int(bad[0])
    return (f"{len(bad)} of {len(want)} bytes differ, first at offset {i}: "
            f"{int(got[i]):#04x} instead of {int(want[i]):#04x}")


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    _check(np.array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)),
           f"{what}: {_mismatch(got, want)}", "mismatch")


def _all(got: np.ndarray, value: int, what: str) -> None:
    _same(got, np.full(got.nbytes, value, np.uint8), what)


def _sync(*streams: runtime.Stream) -> None:
    for s in streams:
        s.synchronize(timeout=FENCE_TIMEOUT_S)


@contextmanager
def _streams(*devices: int) -> Iterator[list[runtime.Stream]]:
    """New streams on ``devices`` (runtime indices), closed at the end, pass or fail."""
    made: list[runtime.Stream] = []
    try:
        for i in devices:
            made.append(runtime.Stream(i))
        yield made
    finally:
        for s in made:
            s.close()


def _drop_frames(exc: BaseException | None) -> None:
    """Forget an exception's tracebacks (and its causes'), so the locals they hold are freed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g} MiB"


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


@diag_test(1, needs=("enumeration",), per_device=True)
def device_state(d: Diag, i: int, name: str) -> str:
    """The device is operational (else: why, from its failure attributes)."""
    a = d.attrs(name)
    code = f" [{a['failure_code']}]" if a.get("failure_code") else ""
    _check(a.get("state") == "operational",
           f"{name}: {a.get('state')}{code} {a.get('failure', '')}".rstrip(), "device-failed")
    return f"{name} operational"


#: DeviceProperties field -> sysfs attribute, where the names differ.
_PROP_ATTR = {"total_memory": "memory_total", "physical_index": "index"}


@diag_test(1, needs=("device_state",), per_device=True)
def runtime_properties(d: Diag, i: int, name: str) -> str:
    """The runtime initialises and reports what sysfs reports for the device."""
    runtime.init()
    count = runtime.device_count()
    _check(count == len(d.devices), f"runtime sees {count} device(s), sysfs {len(d.devices)}")
    props, a = asdict(runtime.get_device_properties(i)), d.attrs(name)
    mismatches = []
    for field, value in props.items():
        attr = _PROP_ATTR.get(field, field)
        if field == "index" or attr not in a:
            continue  # index is the runtime's own numbering
        shown = " ".join(value) if isinstance(value, tuple) else str(value)
        if shown != a[attr]:
            mismatches.append(f"{name}.{attr}: runtime {shown!r}, sysfs {a[attr]!r}")
    _check(not mismatches, "; ".join(mismatches))
    return f"{name} properties match sysfs"


#: Round trips timed for the no-op latency and for its baseline.
LATENCY_ROUNDS = 50
#: Warn when a no-op's round trip takes more than this many host pipe round trips. A no-op
#: is two FUSE transactions plus the firmware's doorbell and interrupt: 60-70 pipe round
#: trips on a healthy, idle machine, and more on a loaded one (docs/diag.md).
NOOP_WARN_ABOVE = 250.0

_ECHO = "import os\nwhile (b := os.read(0, 1)):\n    os.write(1, b)\n"


def _pipe_round_trip_s(rounds: int) -> float:
    """Median seconds for one byte to go to another process over a pipe and come back: the
    host's own cost of waking a process and being woken, the no-op latency's baseline."""
    child = subprocess.Popen([sys.executable, "-c", _ECHO], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, bufsize=0)
    assert child.stdin is not None and child.stdout is not None
    try:
        times = []
        for _ in range(rounds + 5):  # the first few wake a cold child
            start = time.perf_counter()
            child.stdin.write(b"x")
            child.stdout.read(1)
            times.append(time.perf_counter() - start)
        return float(np.median(times[5:]))
    finally:
        child.stdin.close()
        child.wait(timeout=5)


@diag_test(1, needs=("device_state",), per_device=True)
def noop(d: Diag, i: int, name: str) -> Outcome:
    """A no-op on a new context completes; its round trip is judged against a host pipe's."""
    baseline = _pipe_round_trip_s(LATENCY_ROUNDS)
    with runtime.new_context(i) as ctx:
        ctx.submit_noop().wait(timeout=FENCE_TIMEOUT_S)  # the first one opens the queue
        times = []
        for _ in range(LATENCY_ROUNDS):
            start = time.perf_counter()
            ctx.submit_noop().wait(timeout=FENCE_TIMEOUT_S)
            times.append(time.perf_counter() - start)
    fig = Figure("no-op round trip", float(np.median(times)) * 1e6, "us",
                 "host pipe round trip", baseline * 1e6, warn_above=NOOP_WARN_ABOVE,
                 reason="latency-high")
    return Outcome(f"{name} {fig.text()}", (fig,))


@diag_test(1, needs=("noop",), per_device=True)
def memory_roundtrip(d: Diag, i: int, name: str) -> str:
    """Device memory holds what pinned and pageable copies put there; freeing gives it back."""
    runtime.empty_cache(i)  # measure from a process that holds nothing on the device
    free0, total = runtime.mem_get_info(i)
    x, y = _pattern(ROUNDTRIP_BYTES, 2 * i + 1), _pattern(ROUNDTRIP_BYTES, 2 * i + 2)
    used = _roundtrip(i, name, x, y)
    free1 = runtime.mem_get_info(i)[0]
    _check(free0 - free1 >= 2 * ROUNDTRIP_BYTES,
           f"{name}: mem_get_info free went {free0} -> {free1} with "
           f"{2 * ROUNDTRIP_BYTES} bytes allocated")
    del used
    runtime.empty_cache(i)
    free2 = _poll(lambda: runtime.mem_get_info(i)[0], lambda f: f >= free0, COUNTER_POLL_S)
    _check(free2 >= free0, f"{name}: mem_get_info free {free0} before, {free2} after "
                           "freeing everything and empty_cache()")
    return (f"{name} {_mib(ROUNDTRIP_BYTES)} x2 ok, free {(free1 - free0) >> 20:+d} MiB "
            f"then back to {free2 >> 20}/{total >> 20} MiB")


def _roundtrip(i: int, name: str, x: np.ndarray, y: np.ndarray) -> list[runtime.DeviceArray]:
    """H2D and D2H of ``x`` through pinned memory and of ``y`` through pageable memory;
    returns the device arrays, still allocated (the caller measures, then frees them)."""
    with _streams(i) as (s,):
        a = runtime.empty(x.nbytes, np.uint8, device=i, stream=s)
        b = runtime.empty(y.nbytes, np.uint8, device=i, stream=s)
        pin_in = runtime.pinned_empty(x.nbytes, np.uint8, device=i)
        pin_out = runtime.pinned_empty(x.nbytes, np.uint8, device=i)
        pin_in[:] = x
        a.copy_from_host(pin_in, stream=s)
        a.copy_to_host(pin_out, stream=s)          # asynchronous: pinned, on a stream
        b.copy_from_host(y.copy(), stream=s)       # pageable: staged through pinned buffers
        _sync(s)
        _same(pin_out, x, f"{name}: pinned H2D then D2H")
        page_out = np.zeros(y.nbytes, np.uint8)
        b.copy_to_host(page_out, stream=s)         # pageable: returns once the data arrived
        _same(page_out, y, f"{name}: pageable H2D then D2H")
        return [a, b]


@diag_test(1, needs=("memory_roundtrip",), per_device=True)
def stream_order(d: Diag, i: int, name: str) -> str:
    """Work on one stream runs in order: of several memsets and copies, the last one wins."""
    values = (0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88)

    with _streams(i) as (s,):
        a = runtime.empty(ORDER_BYTES, np.uint8, device=i, stream=s)
        b = runtime.empty(ORDER_BYTES, np.uint8, device=i, stream=s)
        out = runtime.pinned_empty(ORDER_BYTES, np.uint8, device=i)
        b.memset(0xEE, stream=s)
        for v in values:                       # a: 0x11, 0x22, ..., 0x88
            a.memset(v, stream=s)
        b.copy_(a, stream=s)                   # b: 0x88, only if it ran after all of them
        a.memset(0x99, stream=s)               # and did not overtake this one
        b.copy_to_host(out, stream=s)
        _sync(s)
        _all(out, values[-1], f"{name}: after {len(values)} memsets and a copy")
        a.copy_to_host(out, stream=s)
        _sync(s)
        _all(out, 0x99, f"{name}: the last memset")
    return f"{len(values) + 1} memsets and a copy of {_mib(ORDER_BYTES)}: {name} ok"


# --- level 2 -----------------------------------------------------------------------------------
@diag_test(2, needs=("noop",), per_device=True)
def noop_stream(d: Diag, i: int, name: str) -> str:
    """Many no-ops on one context: consecutive seqnos, in-order retirement, ordered timestamps."""
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
        back = next((k for k, (a, b) in enumerate(zip(stamps, stamps[1:])) if a > b), None)
        _check(back is None, f"{name}: completion timestamps go backwards at seqno "
                             f"{seqnos[back or 0]}: {stamps[back or 0]} then "
                             f"{stamps[(back or 0) + 1]}")
        rate = STREAM_NOOPS / (time.monotonic() - start)
    return f"{STREAM_NOOPS} no-ops: {name} {rate:.0f}/s"


@diag_test(2, needs=("noop",), per_device=True)
def multi_context(d: Diag, i: int, name: str) -> str:
    """Several contexts on the device at once, interleaved: independent timelines, all retire."""
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
    return f"{CONTEXTS_PER_DEVICE} contexts x {CONTEXT_NOOPS} no-ops on {name}"


@diag_test(2, needs=("memory_roundtrip",), per_device=True)
def copy_bandwidth(d: Diag, i: int, name: str) -> Outcome:
    """A 64 MiB pinned copy each way moves the right bytes; its GB/s is judged against memcpy."""
    with _streams(i) as (s,):
        a = runtime.empty(BANDWIDTH_BYTES, np.uint8, device=i, stream=s)
        src = runtime.pinned_empty(BANDWIDTH_BYTES, np.uint8, device=i)
        dst = runtime.pinned_empty(BANDWIDTH_BYTES, np.uint8, device=i)
        src[:] = _pattern(BANDWIDTH_BYTES, 100 + i)
        # One untimed copy each way first: the firmware's first touch of a mapping
        # costs page faults, which would halve the first copy's figure.
        a.copy_from_host(src, stream=s)
        a.copy_to_host(dst, stream=s)
        a.memset(0, stream=s)                  # so the timed copies must move the bytes
        _sync(s)
        memcpy = _memcpy_gbps(src, dst)           # the baseline, measured just before
        dst[:] = 0
        start = time.perf_counter()
        a.copy_from_host(src, stream=s)
        _sync(s)
        h2d = time.perf_counter() - start
        start = time.perf_counter()
        a.copy_to_host(dst, stream=s)
        _sync(s)
        d2h = time.perf_counter() - start
        _same(dst, src, f"{name}: {_mib(BANDWIDTH_BYTES)} pinned H2D then D2H")
    figs = tuple(Figure(f"{way} bandwidth", BANDWIDTH_BYTES / secs / 1e9, "GB/s",
                        "host memcpy", memcpy, warn_below=COPY_WARN_BELOW,
                        reason="bandwidth-low") for way, secs in (("H2D", h2d), ("D2H", d2h)))
    return Outcome(f"{_mib(BANDWIDTH_BYTES)} pinned: {name} H2D {figs[0].value:.1f} GB/s, "
                   f"D2H {figs[1].value:.1f} GB/s; " + "; ".join(f.text() for f in figs), figs)


def _memcpy_gbps(src: np.ndarray, dst: np.ndarray) -> float:
    """GB/s of a host memcpy from ``src`` to ``dst`` (the best of three, after a warm-up):
    what this host's memory does right now, the baseline of the device copies."""
    np.copyto(dst, src)
    best = min(_timed_s(lambda: np.copyto(dst, src)) for _ in range(3))
    return src.nbytes / best / 1e9


def _timed_s(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@diag_test(2, needs=("stream_order",), per_device=True)
def events(d: Diag, i: int, name: str) -> str:
    """An event joins two streams on the device; timing events measure a positive interval."""
    with _streams(i, i) as (s1, s2):
        a = runtime.empty(EVENT_BYTES, np.uint8, device=i, stream=s1)
        b = runtime.empty(EVENT_BYTES, np.uint8, device=i, stream=s2)
        out = runtime.pinned_empty(EVENT_BYTES, np.uint8, device=i)
        a.memset(0, stream=s1)
        b.memset(0, stream=s2)
        _sync(s1, s2)
        start, end = runtime.Event(enable_timing=True), runtime.Event(enable_timing=True)
        start.record(s1)
        a.memset(0x5A, stream=s1)
        end.record(s1)
        s2.wait_event(end)                     # the device holds s2 back, not the host
        b.copy_(a, stream=s2)
        a.record_stream(s2)
        b.copy_to_host(out, stream=s2)
        _sync(s2)
        _check(end.query(), f"{name}: s2 completed before the event it waited for")
        _all(out, 0x5A, f"{name}: s2 read s1's memset")
        ms = start.elapsed_time(end)
        _check(ms > 0, f"{name}: elapsed_time over a {_mib(EVENT_BYTES)} memset is {ms} ms")
    return f"{name} {_mib(EVENT_BYTES)} memset {ms:.2f} ms"


@diag_test(2, needs=("stream_order",), per_device=True)
def graph_replay(d: Diag, i: int, name: str) -> str:
    """A captured graph of 3 nodes (H2D, D2D, D2H) replays 10 times with fresh data."""
    with _streams(i) as (s,):
        src = runtime.pinned_empty(GRAPH_BYTES, np.uint8, device=i)
        dst = runtime.pinned_empty(GRAPH_BYTES, np.uint8, device=i)
        a = runtime.empty(GRAPH_BYTES, np.uint8, device=i, stream=s)
        b = runtime.empty(GRAPH_BYTES, np.uint8, device=i, stream=s)
        src[:] = 0xFF
        dst[:] = 0
        g = runtime.Graph()
        with runtime.graph(g, s):
            a.copy_from_host(src, stream=s)
            b.copy_(a, stream=s)
            b.copy_to_host(dst, stream=s)
        _check(len(g) == 3, f"{name}: captured {len(g)} nodes, not 3")
        _sync(s)
        _check(not dst.any(), f"{name}: the capture ran work instead of recording it")
        start = time.perf_counter()
        for k in range(GRAPH_REPLAYS):
            src[:] = _pattern(GRAPH_BYTES, 200 + k)
            g.replay()
            _sync(s)
            _same(dst, src, f"{name}: replay {k + 1}")
        each = (time.perf_counter() - start) / GRAPH_REPLAYS
        del g
    return (f"3 nodes of {_mib(GRAPH_BYTES)}: {name} {GRAPH_REPLAYS} replays ok, "
            f"{each * 1e3:.2f} ms each")


@diag_test(2, needs=("stream_order",), per_device=True)
def fault_isolation(d: Diag, i: int, name: str) -> str:
    """A copy from an unmapped address faults its stream only; another stream keeps working.
    Run as root the fault is the diagnostic's: recorded with origin "diag", left out of
    the device's tenant fault counter (``faults``)."""
    diagnostic = os.environ.get(DIAGNOSTIC_ENV) == "1"
    with _streams(i, i) as (bad, good):
        a = runtime.empty(ORDER_BYTES, np.uint8, device=i, stream=good)
        out = runtime.pinned_empty(ORDER_BYTES, np.uint8, device=i)
        a.memset(0x11, stream=good)
        _sync(good)
        bad.submit([userq.Copy(a.va, UNMAPPED_VA, 64)])
        a.memset(0x22, stream=good)            # queued after the bad packet, elsewhere
        record: dict[str, Any] = {}
        try:
            bad.synchronize(timeout=FENCE_TIMEOUT_S)
        except runtime.DeviceFaultError as exc:
            record = exc.record
        _check(bool(record), f"{name}: a COPY from {UNMAPPED_VA:#x} did not fault")
        want = {"opcode": "COPY", "errno": "EFAULT", "address": UNMAPPED_VA, "seqno": 1}
        got = {k: record.get(k) for k in want}
        _check(got == want, f"{name}: fault record {got}, expected {want}")
        refused = None
        try:
            bad.submit([userq.Nop()])
        except runtime.AccelError as exc:
            refused = exc.errno
        _check(refused == errno.ECANCELED,
               f"{name}: new work on the faulted stream got errno {refused}, not ECANCELED")
        _sync(good)
        a.copy_to_host(out, stream=good)       # submitted after the fault was raised
        _sync(good)
        _all(out, 0x22, f"{name}: the other stream's work")
    # the counter is not checked here: another tenant may fault meanwhile
    if diagnostic:
        _check(record.get("origin") == "diag", f"{name}: the diagnostic's fault record has "
               f"origin {record.get('origin')!r}, not 'diag'")
    how = "diagnostic, not counted" if diagnostic else "counted as this user's: not root"
    return (f"{name} {record['opcode']} {record['errno']} at {UNMAPPED_VA:#x} ({how}), "
            "other stream ok")


@diag_test(2, needs=("memory_roundtrip",), per_device=True)
def managed_migration(d: Diag, i: int, name: str) -> str:
    """A device copy from managed memory migrates its pages (managed_faults counts them)."""
    pages = MANAGED_BYTES // MANAGED_PAGE

    faults = lambda: int(_attr(d, name, "managed_faults"))  # noqa: E731
    before = faults()
    with _streams(i) as (s,):
        m = runtime.managed_empty(MANAGED_BYTES, np.uint8, device=i)
        a = runtime.empty(MANAGED_BYTES, np.uint8, device=i, stream=s)
        out = runtime.pinned_empty(MANAGED_BYTES, np.uint8, device=i)
        m[:] = _pattern(MANAGED_BYTES, 300 + i)
        a.copy_from_host(m, stream=s)          # the device reads managed pages: faults
        a.copy_to_host(out, stream=s)
        _sync(s)
        _same(out, m, f"{name}: managed -> device -> pinned")
        after = _poll(faults, lambda n: n >= before + pages, COUNTER_POLL_S)
        _check(after >= before + pages,
               f"{name}: managed_faults went {before} -> {after} after the device read "
               f"{pages} fresh managed pages (waited {COUNTER_POLL_S:g} s)")
        m[:] = _pattern(MANAGED_BYTES, 400 + i)  # the host writes the resident pages
        a.copy_from_host(m, stream=s)
        a.copy_to_host(out, stream=s)
        _sync(s)
        _same(out, m, f"{name}: host writes after migration")
    return (f"{_mib(MANAGED_BYTES)} managed: {name} {pages} pages, "
            f"managed_faults +{after - before}")


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
    try:
        reports = _collect(results, len(workers))
    finally:
        _reap(workers)
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


@diag_test(3, needs=("events",))
def peer_copy(d: Diag) -> str:
    """With peer access enabled, each device copies from the next one's memory."""
    n = len(d.devices)
    if n < 2:
        raise Skip(f"needs 2 devices, {n} visible")
    details = []
    for i in range(n):
        j = (i + 1) % n                            # device j pulls from device i
        failure: Exception | None = None
        try:
            details.append(_peer_pull(d, i, j))
        except Exception as exc:
            _drop_frames(exc)
            failure = exc
        runtime.empty_cache(i)
        runtime.empty_cache(j)
        if failure is not None:
            raise failure
    return f"{_mib(PEER_BYTES)}: " + "; ".join(details)


def _peer_pull(d: Diag, i: int, j: int) -> str:
    src_name, dst_name = d.devices[i], d.devices[j]
    runtime.enable_peer_access(i, device=j)
    x = _pattern(PEER_BYTES, 500 + i)
    with _streams(i, j) as (si, sj):
        a = runtime.empty(PEER_BYTES, np.uint8, device=i, stream=si)
        b = runtime.empty(PEER_BYTES, np.uint8, device=j, stream=sj)
        pin = runtime.pinned_empty(PEER_BYTES, np.uint8, device=i)
        out = runtime.pinned_empty(PEER_BYTES, np.uint8, device=j)
        pin[:] = x
        b.memset(0, stream=sj)
        a.copy_from_host(pin, stream=si)
        uploaded = runtime.Event()
        uploaded.record(si)
        sj.wait_event(uploaded)                    # a device-side wait across devices
        start, end = runtime.Event(enable_timing=True), runtime.Event(enable_timing=True)
        start.record(sj)
        b.copy_(a, stream=sj)                      # the peer copy
        end.record(sj)
        a.record_stream(sj)
        b.copy_to_host(out, stream=sj)
        _sync(sj, si)
        _same(out, x, f"{src_name} -> {dst_name} peer copy")
        ms = start.elapsed_time(end)
    rate = f", {PEER_BYTES / ms / 1e6:.1f} GB/s" if ms > 0 else ""
    return f"{src_name} -> {dst_name} ok{rate}"


def _memory_view(d: Diag) -> dict[str, tuple[int, int, dict[int, int]]]:
    """(memory_used, contexts, {pid: device bytes}) of every device under test, now."""
    view = {}
    for n in d.devices:
        rows = [line.split() for line in _attr(d, n, "processes").splitlines()[1:]]
        view[n] = (int(_attr(d, n, "memory_used")), int(_attr(d, n, "contexts")),
                   {int(pid): int(nbytes) for pid, nbytes in rows})
    return view


def _settled_view(d: Diag) -> dict[str, tuple[int, int, dict[int, int]]]:
    """The view once two reads 0.1 s apart agree: an earlier test's processes may still be
    in their (asynchronous) teardown, which must not count as this test's."""
    deadline = time.monotonic() + TEARDOWN_POLL_S
    view = _memory_view(d)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        view, last = _memory_view(d), view
        if view == last:
            break
    return view


def _memory_worker(barrier: Any, results: Any, seed: int, nbytes: int, free: bool) -> None:
    """One multi_process_memory process: upload, copy on the device, read back, compare on
    every device; hold the memory while the parent looks; then free it (``free``) or just
    exit and leave it to the driver's teardown."""
    report: dict[str, Any] = {"pid": os.getpid(), "verified": {}, "error": None}
    try:
        held = []
        for i in range(runtime.device_count()):
            name = runtime.primary_context(i).physical
            x = _pattern(nbytes, seed * 16 + i)
            a = runtime.to_device(x, device=i)
            b = runtime.empty(nbytes, np.uint8, device=i)
            b.copy_(a)                             # the default stream: after the upload
            _same(b.copy_to_host(), x, f"pid {os.getpid()} on {name}")
            report["verified"][name] = nbytes
            held += [a, b]
        barrier.wait(timeout=WORKER_TIMEOUT_S)    # everyone holds its memory: parent reads
        barrier.wait(timeout=WORKER_TIMEOUT_S)    # the parent has read
        if free:
            del held, a, b
            for i in range(runtime.device_count()):
                runtime.empty_cache(i)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        barrier.abort()
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


@diag_test(3, needs=("memory_roundtrip",))
def multi_process_memory(d: Diag) -> str:
    """Several processes allocate, copy and verify at once; the driver gives everything back."""
    before = _settled_view(d)
    mp = multiprocessing.get_context("spawn")
    barrier, results = mp.Barrier(WORKER_PROCESSES + 1), mp.Queue()
    workers = [mp.Process(target=_memory_worker, daemon=True,
                          args=(barrier, results, 600 + k, WORKER_BYTES, k == 0))
               for k in range(WORKER_PROCESSES)]
    for w in workers:
        w.start()
    during: dict[str, tuple[int, int, dict[int, int]]] = {}
    try:
        try:
            barrier.wait(timeout=WORKER_TIMEOUT_S)  # every worker holds its memory
            during = _memory_view(d)
            barrier.wait(timeout=WORKER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            pass  # a worker failed: its report says why
        reports = _collect(results, len(workers))
    finally:
        _reap(workers)
    errors = [f"pid {r['pid']}: {r['error']}" for r in reports if r["error"]]
    _check(not errors, "; ".join(errors))
    pids = [r["pid"] for r in reports]
    for name in d.devices:
        used, contexts, holders = during[name]
        for r in reports:
            _check(r["verified"].get(name) == WORKER_BYTES,
                   f"pid {r['pid']} did not verify its copies on {name}")
        short = [f"{pid} {holders.get(pid, 0)}" for pid in pids
                 if holders.get(pid, 0) < 2 * WORKER_BYTES]
        _check(not short, f"{name}: sys/.../processes charges {', '.join(short)} bytes to "
                          f"workers holding {2 * WORKER_BYTES} each")
        _check(used - before[name][0] >= WORKER_PROCESSES * 2 * WORKER_BYTES,
               f"{name}: memory_used grew by {used - before[name][0]} bytes with "
               f"{WORKER_PROCESSES} processes holding {2 * WORKER_BYTES} each")
        _check(contexts >= before[name][1] + WORKER_PROCESSES,
               f"{name}: {contexts} contexts with {WORKER_PROCESSES} more processes, "
               f"{before[name][1]} before")

    def back(view: dict[str, tuple[int, int, dict[int, int]]]) -> bool:
        return all(view[n][:2] == before[n][:2] and not set(pids) & set(view[n][2])
                   for n in d.devices)

    start = time.monotonic()
    after = _poll(lambda: _memory_view(d), back, TEARDOWN_POLL_S)
    _check(back(after), f"not given back within {TEARDOWN_POLL_S:g} s: " + "; ".join(
        f"{n} memory_used {after[n][0]} (was {before[n][0]}), contexts {after[n][1]} "
        f"(was {before[n][1]}), workers still charged: "
        f"{sorted(set(pids) & set(after[n][2])) or 'none'}" for n in d.devices))
    waited = time.monotonic() - start
    peak = max(during[n][0] - before[n][0] for n in d.devices)
    baseline = ", ".join(f"{n} {before[n][0] >> 20} MiB/{before[n][1]}" for n in d.devices)
    return (f"{WORKER_PROCESSES} processes x {len(d.devices)} device(s) x "
            f"{_mib(2 * WORKER_BYTES)} verified, {peak >> 20} MiB more in use; memory_used and "
            f"contexts back to {baseline} {waited:.2f} s after the workers exited")


def _ipc_worker(handles: list[Any], digests: list[str], fill: int, results: Any) -> None:
    """The ipc child: open each handle, read and check the bytes, then overwrite them."""
    report: dict[str, Any] = {"pid": os.getpid(), "read": [], "error": None}
    try:
        for h, digest in zip(handles, digests):
            b = runtime.open_ipc_handle(h)
            got = hashlib.sha256(b.copy_to_host().tobytes()).hexdigest()
            _check(got == digest, f"pid {os.getpid()}: imported {h.device_uuid[:14]} "
                                  f"reads sha256 {got[:12]}, exporter wrote {digest[:12]}")
            s = runtime.current_stream(b.device)
            b.memset(fill, stream=s)
            _sync(s)
            report["read"].append(h.device_uuid)
            del b
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        report["error"] = f"{type(exc).__name__}: {exc}"
    results.put(report)


@diag_test(3, needs=("memory_roundtrip",))
def ipc(d: Diag) -> str:
    """Another process opens an IPC handle, reads the exporter's bytes and writes its own."""
    fill = 0xC3
    exported, handles, digests = [], [], []
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    try:
        for i in range(len(d.devices)):
            exported.append(_export(i))
            handles.append(exported[-1][0].ipc_handle())
            digests.append(hashlib.sha256(exported[-1][1].tobytes()).hexdigest())
        child = mp.Process(target=_ipc_worker, args=(handles, digests, fill, results),
                           daemon=True)
        child.start()
        try:
            (report,) = _collect(results, 1)
        finally:
            _reap([child])
        _check(report["error"] is None, str(report["error"]))
        for k, name in enumerate(d.devices):
            _all(exported[k][0].copy_to_host(), fill,
                 f"{name}: the child's memset, seen by the exporter")
    finally:
        del exported
        for i in range(len(d.devices)):
            runtime.empty_cache(i)
    return (f"child pid {report['pid']} read {_mib(WORKER_BYTES)} from "
            f"{len(report['read'])} device(s) and its writes came back")


def _export(i: int) -> tuple[runtime.DeviceArray, np.ndarray]:
    x = _pattern(WORKER_BYTES, 700 + i)
    a = runtime.to_device(x, device=i)
    runtime.current_stream(i).synchronize(timeout=FENCE_TIMEOUT_S)
    return a, x


def _collect(results: Any, count: int) -> list[dict[str, Any]]:
    """``count`` worker reports, or an error naming how many arrived in time."""
    reports: list[dict[str, Any]] = []
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        for _ in range(count):
            reports.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
    except Exception:  # queue.Empty: a worker hung or died without reporting
        raise Failure(f"only {len(reports)} of {count} worker(s) reported "
                      f"within {WORKER_TIMEOUT_S:g} s") from None
    return reports


def _reap(workers: list[Any]) -> None:
    for w in workers:
        w.join(timeout=5)
        if w.is_alive():
            w.terminate()
            w.join()


# --- kernels (levels 2 and 3) ------------------------------------------------------------------
#: Kernel suite sizes: small, and not multiples of the block sizes, so the bounds checks run.
KERNEL_N = 10_000
GEMM_N = 40
SOFTMAX_SHAPE = (64, 33)
MMA_SHAPE = (200, 96, 160)  # m, k, n: partial 128x128 tiles on both edges
#: The JIT probe launches more threads than the firmware runs inline, so its launches go
#: through the engine's JIT cache and its counters.
JIT_PROBE_GRID = 128
JIT_PROBE_SOURCE = """
def diag_jit_probe(out):
    i = global_id(0)
    if i < out.size:
        out[i] = {value}.0
"""
#: Level 3: seconds of back-to-back launches, and the launches queued between two syncs.
STRESS_S = 3.0
STRESS_N = 1 << 20
STRESS_BATCH = 20
#: Level 3: the memory pattern test's allocation (at most half of what is free).
PATTERN_BYTES = 256 << 20


def _close(got: np.ndarray, want: np.ndarray, what: str, rtol: float = 1e-5) -> None:
    """Fail as a mismatch, naming the first differing index, unless ``got`` is close to
    ``want`` (float results: the device may round differently from numpy)."""
    bad = np.flatnonzero(~np.isclose(got, want, rtol=rtol, atol=1e-6))
    if len(bad):
        k = int(bad[0])
        raise Failure(f"{what}: {len(bad)} of {want.size} values differ, first at index "
                      f"{np.unravel_index(k, want.shape)}: {got.flat[k]!r} instead of "
                      f"{want.flat[k]!r}", "mismatch")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _kernel_cases(lib: runtime.Module, i: int) -> Iterator[tuple[str, Callable[[], np.ndarray],
                                                                 np.ndarray, float]]:
    """(kernel, run it and return its result, numpy's result, rtol) for each library kernel."""
    rng = np.random.default_rng(800 + i)
    n, g = KERNEL_N, (KERNEL_N + 255) // 256
    x, y = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    dx, dy = runtime.to_device(x, device=i), runtime.to_device(y, device=i)
    out = runtime.empty(n, np.float32, device=i)

    def launched(fn: Callable[[], object], result: runtime.DeviceArray) -> Callable[[], np.ndarray]:
        return lambda: (fn(), result.copy_to_host())[1]

    yield "fill", launched(lambda: lib.fill[g, 256](out, np.float32(2.5)), out), \
        np.full(n, 2.5, np.float32), 0.0
    yield "copy", launched(lambda: lib.copy[g, 256](out, dx), out), x, 0.0
    yield "saxpy", launched(lambda: lib.saxpy[g, 256](np.float32(3), dx, dy, out), out), \
        3 * x + y, 1e-6
    x64 = x.astype(np.float64)
    dx64, total = runtime.to_device(x64, device=i), runtime.to_device(np.zeros(1), device=i)
    yield "reduce_sum", launched(lambda: lib.reduce_sum[8, 256](dx64, total), total), \
        np.array([x64.sum()]), 1e-9
    m = GEMM_N
    a, b = rng.random((m, m), dtype=np.float32), rng.random((m, m), dtype=np.float32)
    da, db = runtime.to_device(a, device=i), runtime.to_device(b, device=i)
    dc = runtime.empty((m, m), np.float32, device=i)
    tiles = ((m + 15) // 16, (m + 15) // 16)
    yield "gemm", launched(lambda: lib.gemm[tiles, (16, 16)](da, db, dc, m), dc), a @ b, 1e-4
    rows, cols = SOFTMAX_SHAPE
    sx = rng.standard_normal(SOFTMAX_SHAPE).astype(np.float32)
    dsx, dso = runtime.to_device(sx, device=i), runtime.empty(SOFTMAX_SHAPE, np.float32, device=i)
    yield "softmax_rows", launched(lambda: lib.softmax_rows[(rows + 63) // 64, 64](
        dsx, dso, rows, cols), dso), _softmax(sx), 1e-5


@diag_test(2, needs=("stream_order",), per_device=True)
def kernels(d: Diag, i: int, name: str) -> str:
    """The kernel library (fill, copy, saxpy, reduce_sum, gemm, softmax_rows) matches numpy."""
    from runtime import kernel_lib

    lib = runtime.compile(kernel_lib.SOURCE, device=i)
    done = []
    for kernel, run, want, rtol in _kernel_cases(lib, i):
        _close(run(), want, f"{name}: {kernel}", rtol)
        done.append(kernel)
    return f"{name} {', '.join(done)} match numpy"


def _jit_counters(d: Diag, name: str) -> tuple[int, int]:
    return int(_attr(d, name, "jit_compiles") or 0), int(_attr(d, name, "jit_hits") or 0)


def _probe(source: str, i: int, value: int, what: str) -> None:
    """Compile ``source`` as a new module, launch its probe kernel and check what it wrote."""
    mod = runtime.compile(source, device=i)
    out = runtime.empty(JIT_PROBE_GRID * 256, np.float32, device=i)
    mod.diag_jit_probe[JIT_PROBE_GRID, 256](out)
    _close(out.copy_to_host(), np.full(out.size, value, np.float32), what)


@diag_test(2, needs=("kernels",), per_device=True)
def jit_cache(d: Diag, i: int, name: str) -> str:
    """The same source compiled twice is built once: the second launch is a JIT-cache hit."""
    value = int.from_bytes(os.urandom(2)) + 1  # a kernel no cache has seen
    source = JIT_PROBE_SOURCE.format(value=value)
    compiles0, hits0 = _jit_counters(d, name)
    _probe(source, i, value, f"{name}: first probe")
    # the firmware publishes its counters when it goes idle
    compiles1, hits1 = _poll(lambda: _jit_counters(d, name), lambda c: c[0] > compiles0,
                             COUNTER_POLL_S)
    _check(compiles1 > compiles0, f"{name}: jit_compiles stayed {compiles0} for a kernel "
                                  "never compiled before")
    _probe(source, i, value, f"{name}: second probe")
    compiles2, hits2 = _poll(lambda: _jit_counters(d, name), lambda c: c[1] > hits1,
                             COUNTER_POLL_S)
    _check(hits2 > hits1 and compiles2 == compiles1,
           f"{name}: the second compile of the same source moved jit_compiles "
           f"{compiles1} -> {compiles2} and jit_hits {hits1} -> {hits2} (a hit expected)")
    return (f"{name} jit_compiles {compiles0} -> {compiles1} -> {compiles2}, "
            f"jit_hits {hits0} -> {hits1} -> {hits2}")


@diag_test(2, needs=("kernels",), per_device=True)
def matrix_unit(d: Diag, i: int, name: str) -> str:
    """A GEMM through the library's matmul (the matrix unit, mma) matches numpy."""
    from runtime import kernel_lib

    if "matrix" not in runtime.get_device_properties(i).capabilities:
        raise Skip(f"{name} has no matrix unit")
    m, k, n = MMA_SHAPE
    rng = np.random.default_rng(900 + i)
    a, b = rng.random((m, k), dtype=np.float32), rng.random((k, n), dtype=np.float32)
    lib = runtime.compile(kernel_lib.SOURCE, device=i)
    da, db = runtime.to_device(a, device=i), runtime.to_device(b, device=i)
    dc = runtime.empty((m, n), np.float32, device=i)
    lib.matmul[((n + 127) // 128, (m + 127) // 128), 32](da, db, dc)
    _close(dc.copy_to_host(), a @ b, f"{name}: matmul {m}x{k} @ {k}x{n}", 1e-3)
    return f"{name} matmul {m}x{k} @ {k}x{n} matches numpy"


@diag_test(3, needs=("kernels",), per_device=True)
def compute_stress(d: Diag, i: int, name: str) -> str:
    """Saxpy launches back to back for a few seconds; the accumulated result is exact."""
    from runtime import kernel_lib

    lib = runtime.compile(kernel_lib.SOURCE, device=i)
    x = (np.arange(STRESS_N) % 7).astype(np.float32)   # small integers: sums stay exact
    dx, acc = runtime.to_device(x, device=i), runtime.to_device(np.zeros_like(x), device=i)
    stream = runtime.current_stream(i)
    launches, start = 0, time.monotonic()
    while time.monotonic() - start < STRESS_S:
        for _ in range(STRESS_BATCH):
            lib.saxpy[STRESS_N // 256, 256](np.float32(1), dx, acc, acc)
        launches += STRESS_BATCH
        stream.synchronize(timeout=FENCE_TIMEOUT_S * STRESS_BATCH)
    secs = time.monotonic() - start
    _close(acc.copy_to_host(), launches * x, f"{name}: after {launches} launches", 0.0)
    return (f"{name} {launches} saxpy launches of {STRESS_N} in {secs:.1f} s "
            f"({launches * STRESS_N / secs / 1e6:.0f} M elements/s), result exact")


def _patterns(nbytes: int, va: int, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """The memory test's patterns as uint64 words: each bit set alone in turn, each word's
    own device address (catches aliased or swapped addresses), and random words."""
    idx = np.arange(nbytes // 8, dtype=np.uint64)
    yield "walking ones", np.uint64(1) << (idx % np.uint64(64))
    yield "address-in-address", np.uint64(va) + idx * np.uint64(8)
    yield "random", np.random.default_rng(seed).integers(0, 2**63, nbytes // 8, np.uint64)


@diag_test(3, needs=("memory_roundtrip",), per_device=True)
def memory_pattern(d: Diag, i: int, name: str) -> str:
    """Walking ones, address-in-address and random words over a large allocation read back."""
    nbytes = min(PATTERN_BYTES, runtime.mem_get_info(i)[0] // 2) // 8 * 8
    with _streams(i) as (s,):
        a = runtime.empty(nbytes, np.uint8, device=i, stream=s)
        pin_in = runtime.pinned_empty(nbytes, np.uint8, device=i)
        pin_out = runtime.pinned_empty(nbytes, np.uint8, device=i)
        done = []
        for pattern, words in _patterns(nbytes, a.va, 1000 + i):
            pin_in[:] = words.view(np.uint8)
            pin_out[:] = ~pin_in                   # a copy that did not happen shows
            a.copy_from_host(pin_in, stream=s)
            a.copy_to_host(pin_out, stream=s)
            _sync(s)
            _same(pin_out, pin_in, f"{name}: {pattern} at device address {a.va:#x}")
            done.append(pattern)
    return f"{name} {_mib(nbytes)}: {', '.join(done)} ok"


# --- running ------------------------------------------------------------------------------------
def all_tests() -> list[DiagTest]:
    return [t for lvl in sorted(TESTS) for t in TESTS[lvl]]


def suite(level: int) -> list[DiagTest]:
    return [t for t in all_tests() if t.level <= level]


def named(names: Sequence[str]) -> list[DiagTest]:
    """The named tests and, before them, every test they need (transitively), in run
    order: a test whose prerequisites were never run would only be skipped."""
    by_name = {t.name: t for t in all_tests()}
    wanted: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += by_name[name].needs
    return [t for t in all_tests() if t.name in wanted]


def _missing(test: DiagTest, device: str | None, passed: set[tuple[str, str | None]],
             diag: Diag) -> list[str]:
    """The needs of ``test`` on ``device`` that did not pass: a per-device need counts on
    the same device only (on every device, for a test of the whole machine)."""
    per_device = {t.name for t in all_tests() if t.per_device}
    missing = []
    for need in test.needs:
        if need not in per_device:
            on: list[str | None] = [None]
        else:
            on = [device] if device is not None else list(diag.devices)
        if any((need, dev) not in passed for dev in on):
            missing.append(need)
    return missing


def _targets(test: DiagTest, diag: Diag) -> list[tuple[int, str | None]]:
    return list(enumerate(diag.devices)) if test.per_device else [(-1, None)]


def _execute(test: DiagTest, diag: Diag, i: int, device: str | None, free: bool
             ) -> tuple[str, str, str, tuple[Figure, ...]]:
    """Run one test (on one device): (result, reason, detail, figures). A per-device test's
    arrays are gone once it returned, so with ``free`` the device's allocator cache is
    emptied after it: a test leaves no device memory behind, pass or fail. (Not on a device
    that is not known operational: opening it there would only raise.)"""
    try:
        out = test.run(diag, i, device) if test.per_device else test.run(diag)
        out = out if isinstance(out, Outcome) else Outcome(out)
        warned = [f for f in out.figures if f.warns]
        if warned:
            return "warn", warned[0].reason, out.detail, out.figures
        return "pass", "ok", out.detail, out.figures
    except Skip as exc:
        return "skip", exc.reason, str(exc), ()
    except Failure as exc:
        _drop_frames(exc)  # the frames hold the test's arrays: let them go first
        return "fail", exc.reason, str(exc), ()
    except Exception as exc:  # noqa: BLE001 - any error is this test's failure
        _drop_frames(exc)
        return "fail", "error", f"{type(exc).__name__}: {exc}", ()
    finally:
        if free:
            runtime.empty_cache(i)


def run_suite(diag: Diag, tests: Sequence[DiagTest], progress: bool = False) -> list[Result]:
    """Run ``tests`` in order, each once per device when per-device, skipping those whose
    needs did not pass; ``progress`` shows a bar on stderr while it runs."""
    results: list[Result] = []
    passed: set[tuple[str, str | None]] = set()
    steps = [(t, i, dev) for t in tests for i, dev in _targets(t, diag)]
    with tqdm(total=len(steps), file=sys.stderr, disable=not progress, leave=False,
              unit="test") as bar:
        for test, i, dev in steps:
            bar.set_description(f"{test.name}{' on ' + dev if dev else ''}")
            start = time.monotonic()
            missing = _missing(test, dev, passed, diag)
            if missing:
                outcome = ("skip", "dependency-failed",
                           f"needs {', '.join(missing)}, which did not pass", ())
            else:
                free = test.per_device and ("device_state", dev) in passed
                outcome = _execute(test, diag, i, dev, free)
            if outcome[0] in ("pass", "warn"):
                passed.add((test.name, dev))
            results.append(Result(test.name, test.level, dev, outcome[0], outcome[1],
                                  outcome[2], round(time.monotonic() - start, 3), outcome[3]))
            bar.update(1)
    return results


#: The JSON document's schema version (docs/diag.md); bumped when a field changes meaning.
JSON_VERSION = 1
STATUSES = ("pass", "warn", "fail", "skip")


def overall(results: Sequence[Result]) -> str:
    """fail if any test failed, else warn if any warned, else pass."""
    got = {r.result for r in results}
    return "fail" if "fail" in got else "warn" if "warn" in got else "pass"


def render(diag: Diag, spec: str, level: int | None, results: list[Result],
           as_json: bool) -> str:
    verdict = overall(results)
    counts = {s: sum(r.result == s for r in results) for s in STATUSES}
    if as_json:
        return json.dumps({
            "version": JSON_VERSION, "run": spec, "level": level, "root": str(diag.tree.root),
            "devices": diag.devices, "result": verdict, "counts": counts,
            "tests": [r.to_json() for r in results],
        }, indent=2)
    rows = [[r.name, r.level, r.device or "-", r.result.upper(), r.reason, r.detail]
            for r in results]
    table = tabulate(rows, headers=["Test", "Level", "Device", "Result", "Reason", "Detail"],
                     tablefmt="psql", maxcolwidths=[None, None, None, None, None, 70],
                     disable_numparse=True, break_on_hyphens=False)
    tested = ", ".join(diag.devices) or "no devices"
    what = f"{spec} ({LEVEL_NAMES[level]})" if level else spec
    return (f"accel-diag -r {what} on {tested}\n{table}\n{counts['pass']} passed, "
            f"{counts['warn']} warned, {counts['fail']} failed, {counts['skip']} skipped: "
            f"{verdict.upper()}")


def listing() -> str:
    """``--list``: every test with its level, scope, needs and one-line description, then
    the reason codes a result may carry."""
    rows = [[t.name, t.level, "device" if t.per_device else "machine",
             ", ".join(t.needs) or "-", t.doc] for t in all_tests()]
    table = tabulate(rows, headers=["Test", "Level", "Runs per", "Needs", "Description"],
                     tablefmt="simple", maxcolwidths=[None, None, None, 30, 70])
    legend = "\n".join(f"  {code:<18} {meaning}" for code, meaning in REASONS.items())
    return f"{table}\n\nReason codes:\n{legend}"


def _level(text: str) -> int | None:
    by_name = {v: k for k, v in LEVEL_NAMES.items()}
    if text in by_name:
        return by_name[text]
    if text.isdigit():
        return int(text)
    return None


def selection(spec: str) -> tuple[int | None, list[DiagTest]]:
    """``-r``'s argument: a level (1-3, quick/medium/long) or test names, comma-separated.
    Raises UsageError naming what is wrong and what there is to choose from."""
    level = _level(spec)
    if level is not None:
        if level not in LEVEL_NAMES:
            raise UsageError(f"level must be 1, 2 or 3 (or quick, medium, long), not {spec!r}")
        return level, suite(level)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = [t.name for t in all_tests()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"no test named {', '.join(unknown) or repr(spec)}; the tests are: "
                         f"{' '.join(known)} (or a level: 1, 2, 3)")
    return None, named(names)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accel-diag", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-r", "--run", metavar="LEVEL|TEST[,TEST...]",
                   help="1 (quick), 2 (medium) or 3 (long), each including the lower levels; "
                        "or test names (with the tests they need)")
    p.add_argument("--list", action="store_true", help="list every test and exit")
    p.add_argument("-i", "--id", metavar="ID", default=None, help="device(s) to test")
    p.add_argument("--json", action="store_true", help="machine-readable results")
    p.add_argument("--root", type=Path, default=None,
                   help="mount root (default: $ACCEL_EMU_ROOT or the per-user default)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    if args.run is None:
        p.error("-r LEVEL or -r TEST is required (--list shows the tests)")
    try:
        level, tests = selection(args.run)
    except UsageError as exc:
        print(f"accel-diag: {exc}", file=sys.stderr)
        return 2
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
    if os.geteuid() == 0:  # our contexts and our workers' are a diagnostic's (root's alone)
        os.environ[DIAGNOSTIC_ENV] = "1"
    diag = Diag(tree, discovery.visible_devices())
    progress = not args.json and sys.stderr.isatty()
    results = run_suite(diag, tests, progress)
    print(render(diag, args.run, level, results, args.json))
    return 1 if overall(results) == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
