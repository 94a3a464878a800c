"""A tenant faulting in a loop while victims fault once each: no one's records are lost.

Records are evidence (docs/faults.md, "Who keeps what"): one tenant faulting 378-1,116
times a second evicted every other tenant's records from ``fault_log`` and the persistent
log, and grew the daemon's log by 6-19 MB in 30 s. Each round here: on every device a
victim (root's process) opens a watcher of its own records (``pid N``) and faults once;
then an attacker of uid 65534 faults ``ROUND`` times on a device the seed picks (a copy
from an address nothing maps: record 31, its queue lost, a new stream per fault, sixteen
in flight); then every victim's record must be in sysfs ``fault_log``, in the persistent
log and on its watcher, the device-wide records of the start (a reset of each device)
must all be there, the attacker must hold no more than ``KEEP`` of the records, and the
daemon's log may have grown by the rate limit's lines only. Bystander tenants on both
devices keep their data, and nothing leaks (``stress._common.check_round``).

A lost record counts as an escape (the attacker reached what is not its own); a log that
grew past its bound, or an attacker that could not fault, as unexpected.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from typing import Any

from abi import faults, uapi
from kmod_emul.faultlog import KEEP
from kmod_emul.ratelimit import LOG_BURST, LOG_INTERVAL_S
from stress._common import bystanders_for, check_round, timed
from stress.report import Report
from testkit import REPO
from testkit.contained import snapshot
from testkit.daemon import Daemon
from testkit.tenants import as_user, world_reachable

#: attacker faults in a full stress run
STRESS_COUNT = 20_000
#: faults of one round's attacker
ROUND = 2_000

#: Fault in a loop (argv: device, count): sixteen streams at a time each submit a copy from
#: an address nothing maps, and each fault loses its stream. Prints the faults made.
FAULT_LOOP = """
import sys, runtime
from abi import userq
dev, count = int(sys.argv[1]), int(sys.argv[2])
bad = userq.Copy(1 << 40, 1 << 40, 8)
done = 0
while done < count:
    streams = [runtime.Stream(dev) for _ in range(min(16, count - done))]
    for s in streams:
        s.submit([bad])
    for s in streams:
        try:
            s.synchronize()
        except runtime.DeviceFaultError:
            done += 1
        s.close()
print(done, flush=True)
"""

#: A victim (argv: device): a watcher of its own records, then one fault; prints its pid;
#: on a line from stdin prints what its watcher holds (JSON lines, read until EAGAIN).
VICTIM = """
import errno, json, os, sys, runtime
from abi import userq
dev = int(sys.argv[1])
fd = os.open(os.path.join(os.environ["ACCEL_EMU_ROOT"], f"dev/accel-events/accel{dev}"),
             os.O_RDWR | os.O_NONBLOCK)
os.write(fd, f"pid {os.getpid()}".encode())
s = runtime.Stream(dev)
s.submit([userq.Copy(1 << 40, 1 << 40, 8)])
try:
    s.synchronize()
except runtime.DeviceFaultError:
    pass
print(os.getpid(), flush=True)
sys.stdin.readline()
text = b""
while True:
    try:
        text += os.read(fd, 1 << 20)
    except BlockingIOError:
        break
print(json.dumps([json.loads(line) for line in text.decode().splitlines()]), flush=True)
"""


def log_lines_bound(devices: int, seconds: float) -> int:
    """The most per-fault lines ``devices`` devices may log in ``seconds``: LOG_BURST per
    window each, and one line counting what was not logged, per window begun."""
    return devices * (LOG_BURST + 1) * (int(seconds / LOG_INTERVAL_S) + 2)


def fault_lines(log_text: str) -> int:
    """The daemon's per-fault lines (kmod_emul/faultlog.py) and suppression counts in a
    stretch of its log."""
    return len(re.findall(r"accel\d+ fault \d+ |more fault records not logged", log_text))


def persisted(d: Daemon, dev: int) -> list[dict[str, Any]]:
    """The device's persistent log (STATE_DIR/faults/<uuid>.log), oldest first."""
    path = d.state_dir / "faults" / f"{d.attr(dev, 'uuid')}.log"
    return faults.from_lines(path.read_text())


class Victim:
    """A root process of device ``dev`` that faulted once, with a watcher of its records."""

    def __init__(self, d: Daemon, dev: int) -> None:
        self.dev = dev
        self.proc = d.popen_py(VICTIM, str(dev))
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.proc.kill()
            raise AssertionError(f"victim: {line!r} {self.proc.stderr.read()[-1500:]}")
        self.pid = int(line)

    def watched(self) -> list[dict[str, Any]]:
        """What its watcher holds; the process then exits."""
        self.proc.stdin.write("read\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        self.proc.wait(30)
        return json.loads(out)

    def lost(self, d: Daemon) -> list[str]:
        """Where its record is missing: sysfs fault_log, the persistent log, its watcher."""
        def mine(recs: list[dict[str, Any]]) -> bool:
            return any(r.get("pid") == self.pid and r.get("code") == 31 for r in recs)
        where = {"fault_log": d.fault_log(self.dev), "persistent log": persisted(d, self.dev),
                 "its watcher": self.watched()}
        return [f"accel{self.dev} pid {self.pid}: not in {name}"
                for name, recs in where.items() if not mine(recs)]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def attack(d: Daemon, dev: int, count: int) -> subprocess.CompletedProcess[str]:
    """The attacker, as uid 65534, faulting ``count`` times on ``dev``."""
    return subprocess.run([sys.executable, "-c", as_user(FAULT_LOOP), str(dev), str(count)],
                          env=d.env(), capture_output=True, text=True, cwd=REPO,
                          timeout=60 + count / 10)


def _round(d: Daemon, rep: Report, rng: random.Random, count: int, where: str,
           device_wide: list[dict[str, Any]]) -> None:
    victims = [Victim(d, dev) for dev in range(d.devices)]
    try:
        dev = rng.randrange(d.devices)
        log_before, t0 = len(d.log_text()), time.monotonic()
        out = attack(d, dev, count)
        seconds = time.monotonic() - t0
        made = int(out.stdout.strip() or 0) if out.returncode == 0 else 0
        rep.done["faults"] = rep.done.get("faults", 0) + made
        if made != count:
            rep.unexpected += 1
            rep.notes.append(f"{where}: the attacker made {made} faults of {count}: "
                             f"{out.stderr[-800:]}")
        for v in victims:
            lost = v.lost(d)
            rep.done["victims"] = rep.done.get("victims", 0) + 1
            rep.escapes += len(lost)
            rep.notes += [f"{where}: {what}" for what in lost]
        for i in range(d.devices):
            kept = d.fault_log(i)
            gone = [r["seq"] for r in device_wide if r["device"] == i and r not in kept]
            if gone:
                rep.escapes += 1
                rep.notes.append(f"{where}: accel{i} lost the device-wide records {gone}")
            theirs = sum(r.get("uid") == 65534 for r in kept)
            if theirs > KEEP:
                rep.unexpected += 1
                rep.notes.append(f"{where}: accel{i} keeps {theirs} of the attacker's records")
        lines = fault_lines(d.log_text()[log_before:])
        if lines > log_lines_bound(d.devices, seconds + 1):
            rep.unexpected += 1
            rep.notes.append(f"{where}: {lines} fault lines logged in {seconds:.0f} s")
    finally:
        for v in victims:
            v.close()


def run(d: Daemon, *, count: int, seed: int) -> Report:
    """``count`` faults of an attacker in rounds of ``ROUND`` against victims on every
    device of ``d``; containment checked after each round."""
    rep = Report("fault_flood")
    t0 = time.monotonic()
    if not world_reachable(d.root):
        rep.notes.append("the root is not world-reachable: no uid 65534 attacker")
        rep.hangs += 1  # not ok: nothing was tested
        return rep
    for dev in range(d.devices):  # the device-wide records no tenant may evict
        (d.root / uapi.CLASS_DIR / f"accel{dev}" / "reset").write_text("1")
        d.wait_state(dev, "operational")
    device_wide = [r for dev in range(d.devices) for r in d.fault_log(dev)
                   if r.get("uid") is None]
    rng = random.Random(seed)
    # the bystanders after the resets, which would lose theirs
    with bystanders_for(d, True, rep, t0) as everyone:
        before = timed(lambda: snapshot(d), 60)
        done, rnd = 0, 0
        while done < count and before is not None:
            n = min(ROUND, count - done)
            where = f"seed {seed} round {rnd}"
            _round(d, rep, rng, n, where, device_wide)
            done += n
            rnd += 1
            before = check_round(d, before, rep, everyone, where)
    return rep


__all__ = ["FAULT_LOOP", "ROUND", "STRESS_COUNT", "VICTIM", "Victim", "attack",
           "fault_lines", "log_lines_bound", "persisted", "run"]
