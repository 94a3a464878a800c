"""Another user against the event nodes: watchers past its shares, reads in flight from many
threads, bad filters; a bystander's driver round trip must stay bounded all along.

8 watchers and 400 threads in pread(2), as uid 65534, held every one of the daemon's FUSE
request tasks, and a bystander's DEVICE_QUERY took 1-2 s instead of 0.1 ms (docs/faults.md,
"The event node"). Each round here: ``ATTACKERS`` processes of uid 65534 open as many
watchers as they may on every device (past the process's or the user's share: EDQUOT), half
of them non-blocking, then run ``THREADS`` threads each for ``SECONDS``: blocking reads of
random sizes (a read shorter than the next event: EINVAL), preads (ESPIPE), filters good and
bad (``pid ²``, 4,301 digits, bytes that are not UTF-8: EINVAL), non-blocking reads
(EAGAIN), polls. Root injects device-wide events (``ras_ctrl``: ``compute ce``, counted and
recorded, nothing else) so that reads return and blocked readers come back for more.

Meanwhile a root bystander times its DEVICE_QUERY round trips (``round_trips``): none may
take a second and their median stays under ``SLOWDOWN`` times the quiet one measured just
before the round; and root opens a watcher on every device (its reserve) and reads the
events injected. Every answer the attackers get must be one of ``ALLOWED`` (anything else,
EIO above all, is unexpected), and the daemon's log must name no driver bug. Then the
containment checks (``stress._common.check_round``) with a bystander on each device.

Operations that return at once are paced by a millisecond or two: a request flood as such is
any file's (a loop reading a sysfs attribute is one too); what is tested here is what the
event node lets a tenant hold.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from abi import uapi
from stress._common import bystanders_for, check_round, timed
from stress.report import Report
from testkit import REPO
from testkit.contained import snapshot
from testkit.daemon import Daemon
from testkit.tenants import as_user, world_reachable

#: rounds in a full stress run
STRESS_COUNT = 30
#: attacker processes per round (two reach the user's share of watchers, the third none)
ATTACKERS = 3
#: threads per attacker process, and how long a round's attack lasts
THREADS = 150
SECONDS = 8.0
#: a flooded median round trip may be this many times the quiet one
SLOWDOWN = 10
#: root injects a device-wide event on every device this often during an attack
INJECT_EVERY_S = 0.05
#: what each operation of an attacker may answer
ALLOWED = {
    "open": {"ok", "EDQUOT", "ENOSPC"},
    "read": {"ok", "EAGAIN", "EINVAL", "EBUSY", "EDQUOT", "ENOSPC"},
    "pread": {"ESPIPE"},
    "filter": {"ok", "EINVAL"},
    "poll": {"ok"},
}

#: The attacker (argv: JSON of seed, seconds, threads, devices). Prints "ready" once its
#: threads run, then, at the end, a JSON count of "<operation> <answer>".
ATTACKER = """
import collections, errno, json, os, random, select, sys, threading, time
P = json.loads(sys.argv[1])
root = os.environ["ACCEL_EMU_ROOT"]
counts = collections.Counter()
lock = threading.Lock()
def note(what, fn):
    try:
        fn()
        got = "ok"
    except OSError as exc:
        got = errno.errorcode.get(exc.errno, str(exc.errno))
    with lock:
        counts[f"{what} {got}"] += 1
    return got
fds = []
for dev in range(P["devices"]):
    node = f"{root}/dev/accel-events/accel{dev}"
    for i in range(12):  # past the process's share of 8
        flags = os.O_RDWR | (os.O_NONBLOCK if i % 2 else 0)
        note("open", lambda: fds.append((os.open(node, flags), bool(i % 2))))
FILTERS = ["pid \\u00b2", "pid \\u0663", "pid " + "9" * 4301, "pid -1", "pid", "pid all",
           "pid 1 2", "uid 0", "pid 4194304", "pid all"]
RAW = [b"\\xff\\xfe pid", b"pid \\x00", b""]
end = time.monotonic() + P["seconds"]
def worker(seed):
    r = random.Random(seed)
    while fds and time.monotonic() < end:
        fd, nonblocking = r.choice(fds)
        op = r.random()
        if op < 0.3:  # blocking: waits for an event (a short size: EINVAL once one is there)
            got = note("read", lambda: os.read(fd, r.choice([1, 64, 65536])))
        elif op < 0.55:
            got = note("pread", lambda: os.pread(fd, 4096, r.randrange(1 << 20)))
        elif op < 0.8:
            text = r.choice(FILTERS).encode() if r.random() < 0.8 else r.choice(RAW)
            got = note("filter", lambda: os.write(fd, text or b"\\n"))
        else:
            got = note("poll", lambda: select.select([fd], [], [], 0.05))
        if not nonblocking or got != "ok":
            time.sleep(r.uniform(0.0005, 0.002))
threads = [threading.Thread(target=worker, args=(P["seed"] * 1000 + i,), daemon=True)
           for i in range(P["threads"])]
for t in threads:
    t.start()
print("ready", flush=True)
time.sleep(max(0.0, end - time.monotonic()))
with lock:
    print(json.dumps(counts), flush=True)
os._exit(0)
"""


def round_trip(fd: int, tag: int) -> float:
    """One DEVICE_QUERY on the device node ``fd`` (as ``rawdev.RawDev.query``): seconds."""
    t0 = time.perf_counter()
    os.pwrite(fd, bytes(uapi.accel_cmd_hdr(cmd=uapi.ACCEL_CMD_DEVICE_QUERY.code, tag=tag))
              + bytes(uapi.accel_device_info()), 0)
    os.pread(fd, ctypes.sizeof(uapi.accel_device_info), tag)
    return time.perf_counter() - t0


def round_trips(d: Daemon, dev: int, count: int, until: float = 0.0) -> list[float]:
    """A bystander's DEVICE_QUERY round trips on ``dev`` (seconds): ``count`` of them, and
    on until ``until`` (a monotonic time) if that is later."""
    fd = os.open(d.node(dev), os.O_RDWR)
    try:
        out: list[float] = []
        while len(out) < count or time.monotonic() < until:
            out.append(round_trip(fd, 1000 + len(out)))
        return out
    finally:
        os.close(fd)


def slowdown(quiet: list[float], flooded: list[float]) -> str | None:
    """What is wrong with ``flooded`` against ``quiet``, or None: a round trip of a second
    or more, or a median past SLOWDOWN times the quiet one."""
    q, f = statistics.median(quiet), statistics.median(flooded)
    if max(flooded) >= 1.0 or f >= SLOWDOWN * q:
        return (f"round trips: quiet median {q * 1e3:.3f} ms, flooded median {f * 1e3:.3f} "
                f"ms, max {max(flooded) * 1e3:.1f} ms")
    return None


def _start(d: Daemon, seed: int, threads: int, seconds: float) -> subprocess.Popen[str]:
    params = {"seed": seed, "seconds": seconds, "threads": threads, "devices": d.devices}
    proc = subprocess.Popen([sys.executable, "-c", as_user(ATTACKER), json.dumps(params)],
                            env=d.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise AssertionError(f"attacker did not start: {proc.communicate()[1][-1500:]}")
    return proc


def _inject(d: Daemon) -> None:
    """A device-wide event on every device: a corrected compute error, counted only."""
    for dev in range(d.devices):
        (d.root / uapi.DEBUG_DIR / f"accel{dev}" / "ras_ctrl").write_text("inject compute ce 0")


def _roots_watchers(d: Daemon, rep: Report, where: str) -> list[int]:
    fds = []
    for dev in range(d.devices):
        try:
            fds.append(os.open(d.root / uapi.EVENTS_DIR / f"accel{dev}",
                               os.O_RDONLY | os.O_NONBLOCK))
        except OSError as exc:
            rep.unexpected += 1
            rep.notes.append(f"{where}: root could not watch accel{dev}: {exc}")
    return fds


def _round(d: Daemon, rep: Report, seed: int, where: str, threads: int,
           seconds: float) -> None:
    log_before = len(d.log_text())
    quiet = round_trips(d, 0, 200)
    attackers: list[subprocess.Popen[str]] = []
    roots: list[int] = []
    try:
        for i in range(ATTACKERS):
            attackers.append(_start(d, seed * ATTACKERS + i, threads, seconds))
        roots = _roots_watchers(d, rep, where)
        end = time.monotonic() + seconds * 0.75
        flooded: list[float] = []
        injected = 0.0
        while time.monotonic() < end:
            if time.monotonic() - injected >= INJECT_EVERY_S:
                _inject(d)
                injected = time.monotonic()
            flooded += round_trips(d, 0, 20)
        rep.done["round trips"] = rep.done.get("round trips", 0) + len(quiet) + len(flooded)
        if (problem := slowdown(quiet, flooded)) is not None:
            rep.unexpected += 1
            rep.notes.append(f"{where}: {problem}")
        for fd in roots:
            try:
                os.read(fd, 1 << 20)
            except OSError as exc:  # the injections are device-wide: root sees them
                rep.unexpected += 1
                rep.notes.append(f"{where}: root's watcher: {exc}")
        for proc in attackers:
            try:
                out, err = proc.communicate(timeout=seconds + 60)
            except subprocess.TimeoutExpired:
                rep.hangs += 1
                rep.notes.append(f"{where}: an attacker did not exit")
                proc.kill()
                out, err = proc.communicate(timeout=60)
            _count(rep, where, json.loads(out.splitlines()[-1]) if out.strip() else {}, err)
    finally:
        for fd in roots:
            os.close(fd)
        for proc in attackers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if "driver bug" in d.log_text()[log_before:]:
        rep.unexpected += 1
        rep.notes.append(f"{where}: the daemon logged a driver bug")


def _count(rep: Report, where: str, counts: dict[str, int], stderr: str) -> None:
    if not counts:
        rep.unexpected += 1
        rep.notes.append(f"{where}: an attacker reported nothing: {stderr[-800:]}")
    for key, n in counts.items():
        what, answer = key.split(" ", 1)
        rep.done[what] = rep.done.get(what, 0) + n
        if answer != "ok":
            rep.errnos[answer] = rep.errnos.get(answer, 0) + n
        if answer not in ALLOWED[what]:
            rep.unexpected += n
            rep.notes.append(f"{where}: {what} answered {answer} ({n} times)")


def run(d: Daemon, *, count: int, seed: int, threads: int = THREADS,
        seconds: float = SECONDS) -> Report:
    """``count`` rounds of attackers against the event nodes of ``d``; containment checked
    after each."""
    rep = Report("events_flood")
    t0 = time.monotonic()
    if not world_reachable(d.root):
        rep.notes.append("the root is not world-reachable: no uid 65534 attacker")
        rep.hangs += 1  # not ok: nothing was tested
        return rep
    with bystanders_for(d, True, rep, t0) as everyone:
        before = timed(lambda: snapshot(d), 60)
        rnd = 0
        while rnd < count and before is not None:
            where = f"seed {seed} round {rnd}"
            _round(d, rep, seed * 1000 + rnd, where, threads, seconds)
            rnd += 1
            before = check_round(d, before, rep, everyone, where)
        rep.done["rounds"] = rnd
    return rep


__all__ = ["ALLOWED", "ATTACKER", "SLOWDOWN", "STRESS_COUNT", "round_trip", "round_trips",
           "run", "slowdown"]
