"""A fuzzer of the attribute tree's writes: every writable file under ``sys/`` (sysfs and
debugfs, found by walking the tree, so an attribute added later is fuzzed too), written
with malformed values as root and as uid 65534.

Each round is a client process (:mod:`stress._common`, under its watchdog) seeded from
the run's seed and the round; odd rounds write as uid 65534 where the daemon's root is
world-reachable (the client drops its effective uid and gid after walking the tree as
root, as ``testkit.tenants.as_user`` drops its uid: quick, and the driver sees the writer's
uid, which is what it checks). Every answer is counted by errno:

* as root, a malformed value must be refused with EINVAL -- never EIO, never accepted --
  and the few harmless valid values the fuzzer also writes (``VALID``: each a default,
  so writing it changes nothing) must succeed;
* as uid 65534, every write must be refused with EACCES (one that succeeds is an escape).

Malformed values come from ``NEVER`` (what no attribute takes: non-ASCII, control
characters, more than a page -- kmod_emul/attr.py refuses them before any attribute's
parser runs), ``MALFORMED`` (ASCII values each attribute's own parser refuses: numbers
out of range, names that are none), random bytes with something non-printable in them,
non-ASCII digits put into a value, and pages of digits. Valid writes with big effects --
``reset``, ``fw_hang``, ``partition_mode``, ``ras_ctrl`` injections, ``devcoredump/data``
(any text clears the dump) -- are never made, so the containment checks after each round
can compare the same daemon and firmware processes. The parent also reads the daemon's
log at the end: a "driver bug" (a traceback answered with EIO) is counted as unexpected.

``python -m stress --only knob_fuzz``; the CI run is tests/contain/test_fuzz_knobs.py.
"""

from __future__ import annotations

import errno
import os
import random
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from stress._common import Progress, client_args, fuzz_rounds, write_result
from stress.report import Report
from testkit.tenants import NOBODY, world_reachable

#: writes in a full stress run (``python -m stress``)
STRESS_COUNT = 20_000
#: writes per client process
ROUND = 1_000
#: a write that blocks this long is a hang
HANG_S = 30.0
#: a page, the most an attribute takes (kmod_emul/attr.py ATTR_SIZE)
PAGE = 4096

#: Values no attribute takes.
NEVER: tuple[bytes, ...] = (
    "\u00b2".encode(),  # '²': str.isdigit() is true of it, int() refuses it
    "\u0663".encode(),  # Arabic-Indic 3: int() takes it
    "\uff11".encode(),  # a fullwidth 1
    b"\xff\xfe",  # not UTF-8
    b"1\x00",
    b"\x1b[2J",
    b"0" * (PAGE + 1),
    b"1" * 5000,  # past int()'s 4,300 digits, and past a page
)
_BOOL = (b"2", b"-1", b"0x1", b"01", b"1 1", b"true", b"9" * 400)
_HUGE = b"9" * 400
#: ASCII values each attribute's own parser refuses, by attribute name. (No empty value:
#: a write(2) of nothing never reaches a filesystem.)
MALFORMED: dict[str, tuple[bytes, ...]] = {
    "reset": (b"0", *_BOOL),
    "fw_hang": (b"0", *_BOOL),
    "fw_boot_fail": _BOOL,
    "reset_hold": _BOOL,
    "sched_hold": _BOOL,
    "fail_step": (b"nosuchstep", b"none none", _HUGE),
    "recovery": (b"automatic", b"auto manual", _HUGE),
    "map_fail": (b"-1", b"0x1", b"1024", b"1 1", b"true", _HUGE),
    "partition_mode": (b"0", b"3", b"8", b"-1", b"0x2", b"2 2", _HUGE),
    "partition_fail_step": (b"0", b"4:mailbox", b"0:nosuchstep", b"x:mailbox",
                            _HUGE + b":mailbox"),
    "ras_ctrl": (
        b"inject thermal ce " + _HUGE,  # finding: the thermal model's float overflowed
        b"inject thermal ue 201",
        b"inject compute ue 0x1" + b"0" * 16,
        b"inject memory ue " + _HUGE,
        b"inject firmware ue 18446744073709551616",
        b"inject link ue -1",
        b"inject memory ce 0x",
        b"inject",
    ),
    "data": (),  # devcoredump: any text clears the dump, so only NEVER is malformed
}
#: Valid values that change nothing (each attribute's default), written as root.
VALID: dict[str, bytes] = {"fw_boot_fail": b"0", "fail_step": b"none", "reset_hold": b"0",
                           "sched_hold": b"0", "partition_fail_step": b"none", "map_fail": b"0"}
_BLOCKS = (b"memory", b"compute", b"copy", b"link", b"firmware", b"thermal")
_NON_ASCII = "\u00b2\u0663\uff11\u00e9\u200b\U0001d7d7"


def run(d, *, count: int, seed: int, bystanders: Any = True, round_size: int = ROUND,
        hang_s: float = HANG_S) -> Report:
    """Write ``count`` values to daemon ``d``'s attributes; see the module doc.
    ``bystanders``: True starts one per device, or pass running ones, or None."""
    rep = Report("knob_fuzz")
    log_start = len(d.log_text())
    fuzz_rounds(d, rep, module=__name__, count=count, seed=seed, round_size=round_size,
                unit="writes", bystanders=bystanders, hang_s=hang_s,
                options={"other": int(world_reachable(d.root))})
    bugs = d.log_text()[log_start:].count("driver bug")
    if bugs:
        rep.unexpected += bugs
        rep.notes.append(f"the daemon logged {bugs} driver bug(s) (tracebacks)")
    return rep


def writable_attrs(root: Path) -> list[Path]:
    """Every attribute file under ``root/sys`` someone may open for writing (mode 0200:
    root; the driver refuses everyone else), walked as root."""
    found = []
    for dirpath, _, files in os.walk(root / "sys"):
        found += [Path(dirpath, f) for f in files if os.stat(Path(dirpath, f)).st_mode & 0o200]
    return sorted(found)


def write(path: Path, value: bytes) -> str:
    """Write ``value`` to an attribute in one write(2): "ok" or the errno's name."""
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, value)
        finally:
            os.close(fd)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return "ok"


def malformed(rng: random.Random, name: str) -> bytes:
    """A value attribute ``name`` must refuse with EINVAL."""
    own = MALFORMED.get(name, ())
    kind = rng.randrange(5)
    if kind == 0 or (kind == 3 and name not in MALFORMED):
        return rng.choice([*NEVER, *own])
    if kind == 1:  # random bytes, one of them surely not printable ASCII
        raw = bytearray(rng.randbytes(rng.randrange(1, 64)))
        raw[rng.randrange(len(raw))] = rng.choice([0, 1, 0x1b, 0x7f, 0x80, 0xc2, 0xff])
        return bytes(raw)
    if kind == 2:  # a non-ASCII character put into a value that is otherwise plausible
        base = rng.choice([*own, *VALID.values(), b"1", b"0"]).decode("ascii")
        at = rng.randrange(len(base) + 1)
        return (base[:at] + rng.choice(_NON_ASCII) + base[at:]).encode()
    if kind == 3 and name != "data":  # a number past 64 bits: out of every range
        huge = b"%d" % rng.choice([10 ** rng.randrange(20, 4000), 2**64 + rng.randrange(1 << 20)])
        if name == "ras_ctrl":
            return b"inject %s %s %s" % (rng.choice(_BLOCKS), rng.choice((b"ue", b"ce")), huge)
        return huge + b":mailbox" if name == "partition_fail_step" else huge
    length = rng.randrange(PAGE + 1, 3 * PAGE)  # past a page
    return bytes(rng.choice(b"0123456789 abcxyz") for _ in range(length))


@contextmanager
def other_user(uid: int) -> Iterator[None]:
    """Write as ``uid`` (effective uid and gid, no groups): what the driver checks."""
    os.setgroups([])
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def client(argv: list[str]) -> None:
    progress_path, result_path, opts = client_args(argv)
    progress = Progress(progress_path)
    seed, rnd, count = int(opts["seed"]), int(opts["round"]), int(opts["count"])
    rng = random.Random(f"knobs/{seed}/{rnd}")
    targets = writable_attrs(Path(os.environ["ACCEL_EMU_ROOT"]))
    as_other = bool(int(opts.get("other", "0"))) and rnd % 2 == 1
    who = "uid65534" if as_other else "root"
    done: Counter[str] = Counter()
    errnos: Counter[str] = Counter()
    result: dict[str, Any] = {"done": done, "errnos": errnos, "escapes": 0, "unexpected": 0,
                              "notes": []}
    with other_user(NOBODY) if as_other else nullcontext():
        for _ in range(count):
            path = rng.choice(targets)
            valid = not as_other and path.name in VALID and rng.random() < 0.1
            value = VALID[path.name] if valid else malformed(rng, path.name)
            progress.step(f"{who} write {path} {value[:80]!r}")
            got = write(path, value)
            done[f"writes_{who}"] += 1
            if got != "ok":
                errnos[got] += 1
            want = "EACCES" if as_other else "ok" if valid else "EINVAL"
            if got == want:
                continue
            if as_other and got == "ok":
                result["escapes"] += 1
            else:
                result["unexpected"] += 1
            if len(result["notes"]) < 20:
                result["notes"].append(f"{who} wrote {value[:80]!r} ({len(value)} bytes) to "
                                       f"{path}: {got}, not {want}")
    write_result(result_path, result)


if __name__ == "__main__":
    client(sys.argv[1:])
