"""``accel-diag -r LEVEL``: the bring-up suite in levels, like ``dcgmi diag -r 1|2|3``.

Level 1 (quick) answers "is this machine usable at all": the driver is loaded, every
device is enumerated with its identity and is operational, the runtime sees the same
devices sysfs does, a no-op round-trips through each device's firmware, device memory
holds what pinned and pageable copies put there (and is given back), and a stream keeps
its order. Level 2 adds load and the asynchronous features on one process: a long stream of
no-ops whose fences must retire in order, several contexts per device at once, a 64 MiB
pinned copy (its bandwidth is reported, never judged), streams joined by events, graph
replay, a faulting stream that spares the others, and managed memory migrating on device
access. Level 3 adds several processes at once (``spawn``ed, since a forked child may not
use its parent's runtime state) and more than one device: peer copies, processes whose
memory and contexts the driver must give back, and IPC memory shared with another process.

Every test uses the public runtime API only, compares the bytes it moved, and frees what it
allocated (its streams closed, its arrays freed, the allocator's cache emptied).

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
import errno
import hashlib
import json
import multiprocessing
import os
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

import runtime
from abi import uapi, userq
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
#: Memory test sizes. The round trip is larger than one 8 MiB staging chunk, so pageable
#: copies take the pipelined path; the bandwidth copy is large enough to amortise a submit.
ROUNDTRIP_BYTES = 12 << 20
ORDER_BYTES = 4 << 20            # above the 256 KiB inline limit: the copy engines run it
BANDWIDTH_BYTES = 64 << 20
EVENT_BYTES = 16 << 20           # a memset long enough that an unordered reader would see it
GRAPH_BYTES = 1 << 20
GRAPH_REPLAYS = 10
MANAGED_BYTES = 1 << 20
MANAGED_PAGE = 64 << 10          # the firmware migrates managed memory in 64 KiB pages
PEER_BYTES = 8 << 20
WORKER_BYTES = 4 << 20
#: An address no allocation of anyone's has (bits 44 and up name the device).
UNMAPPED_VA = 1 << 43
#: The firmware publishes its counters when it goes idle; teardown is asynchronous.
COUNTER_POLL_S = 2.0
TEARDOWN_POLL_S = 10.0


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
           f"{what}: {_mismatch(got, want)}")


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


def _per_device(d: Diag, one: Callable[[int, str], str]) -> str:
    """Run ``one(index, name)`` on every device under test. Once it returned, its arrays
    are gone (their blocks are back in the caching allocator), so the cache is emptied: a
    test leaves no device memory behind, pass or fail."""
    details = []
    for i, name in enumerate(d.devices):
        failure: Exception | None = None
        try:
            details.append(one(i, name))
        except Exception as exc:
            _drop_frames(exc)  # the frames hold the test's arrays: let them go first
            failure = exc
        runtime.empty_cache(i)
        if failure is not None:
            raise failure
    return "; ".join(details)


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


@diag_test(1, needs=("noop",))
def memory_roundtrip(d: Diag) -> str:
    """Device memory holds what pinned and pageable copies put there; freeing gives it back."""

    def one(i: int, name: str) -> str:
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

    return _per_device(d, one)


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


@diag_test(1, needs=("memory_roundtrip",))
def stream_order(d: Diag) -> str:
    """Work on one stream runs in order: of several memsets and copies, the last one wins."""
    values = (0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88)

    def one(i: int, name: str) -> str:
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
        return f"{name} ok"

    return f"{len(values) + 1} memsets and a copy of {_mib(ORDER_BYTES)}: " + _per_device(d, one)


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
            back = next((i for i, (a, b) in enumerate(zip(stamps, stamps[1:])) if a > b), None)
            _check(back is None, f"{name}: completion timestamps go backwards at seqno "
                                 f"{seqnos[back or 0]}: {stamps[back or 0]} then "
                                 f"{stamps[(back or 0) + 1]}")
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


@diag_test(2, needs=("memory_roundtrip",))
def copy_bandwidth(d: Diag) -> str:
    """A 64 MiB pinned copy each way moves the right bytes (GB/s reported, never judged)."""

    def one(i: int, name: str) -> str:
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
        return (f"{name} H2D {BANDWIDTH_BYTES / h2d / 1e9:.1f} GB/s, "
                f"D2H {BANDWIDTH_BYTES / d2h / 1e9:.1f} GB/s")

    return f"{_mib(BANDWIDTH_BYTES)} pinned: " + _per_device(d, one)


@diag_test(2, needs=("stream_order",))
def events(d: Diag) -> str:
    """An event joins two streams on the device; timing events measure a positive interval."""

    def one(i: int, name: str) -> str:
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

    return _per_device(d, one)


@diag_test(2, needs=("stream_order",))
def graph_replay(d: Diag) -> str:
    """A captured graph of 3 nodes (H2D, D2D, D2H) replays 10 times with fresh data."""

    def one(i: int, name: str) -> str:
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
        return f"{name} {GRAPH_REPLAYS} replays ok, {each * 1e3:.2f} ms each"

    return f"3 nodes of {_mib(GRAPH_BYTES)}: " + _per_device(d, one)


@diag_test(2, needs=("stream_order",))
def fault_isolation(d: Diag) -> str:
    """A copy from an unmapped address faults its stream only; another stream keeps working."""

    def one(i: int, name: str) -> str:
        with _streams(i, i) as (bad, good):
            a = runtime.empty(ORDER_BYTES, np.uint8, device=i, stream=good)
            out = runtime.pinned_empty(ORDER_BYTES, np.uint8, device=i)
            a.memset(0x11, stream=good)
            _sync(good)
            bad.submit([userq.accel_packet(opcode=userq.Op.COPY,
                                          a=(a.va, UNMAPPED_VA, 64, 0, 0, 0, 0))])
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
                bad.submit([userq.accel_packet(opcode=userq.Op.NOP)])
            except runtime.AccelError as exc:
                refused = exc.errno
            _check(refused == errno.ECANCELED,
                   f"{name}: new work on the faulted stream got errno {refused}, not ECANCELED")
            _sync(good)
            a.copy_to_host(out, stream=good)       # submitted after the fault was raised
            _sync(good)
            _all(out, 0x22, f"{name}: the other stream's work")
        return f"{name} {record['opcode']} {record['errno']} at {UNMAPPED_VA:#x}, other stream ok"

    return _per_device(d, one)


@diag_test(2, needs=("memory_roundtrip",))
def managed_migration(d: Diag) -> str:
    """A device copy from managed memory migrates its pages (managed_faults counts them)."""
    pages = MANAGED_BYTES // MANAGED_PAGE

    def one(i: int, name: str) -> str:
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
        return f"{name} {pages} pages, managed_faults +{after - before}"

    return f"{_mib(MANAGED_BYTES)} managed: " + _per_device(d, one)


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
        raise AssertionError(f"only {len(reports)} of {count} worker(s) reported "
                             f"within {WORKER_TIMEOUT_S:g} s") from None
    return reports


def _reap(workers: list[Any]) -> None:
    for w in workers:
        w.join(timeout=5)
        if w.is_alive():
            w.terminate()
            w.join()


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
