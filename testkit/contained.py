"""The containment checks made after every attack (docs/containment.md): ``snapshot`` a
baseline before it, ``assert_contained`` after it -- are the daemon and every firmware the
same live processes, is every device operational, and did nothing leak: the driver's books
in sysfs, the daemon's and the firmwares' descriptors, /dev/shm."""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from dataclasses import dataclass

from testkit.daemon import Daemon
from testkit.procs import alive
from testkit.waiting import wait_until

#: sysfs counters that must come back to what they were once an attacker is gone
BOOKS = ("contexts", "open_files", "clients", "memory_used", "pinned_bytes",
         "host_allocations", "queues", "exclusive_owner")


def shm_names() -> set[str]:
    """The names in /dev/shm that this project's processes could have made. /dev/shm is
    the machine's: other processes come and go there meanwhile -- a test in another
    pytest worker using Python's multiprocessing (DataLoader workers, Inductor's compile
    pool, spawn queues) makes a named semaphore ``sem.mp-*`` each, and a containment check
    once failed on eleven of those. No layer of the stack (driver, firmware, runtime)
    uses multiprocessing's synchronisation, so those are left out; every other name
    counts, whoever made it."""
    return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-")}


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> Counter[str]:
    """What a process's descriptors are (``/memfd:accel-ring (deleted)``, ``pipe``,
    ``socket``...; inode numbers dropped), so that a leak names what leaked: the count
    alone said only "firmware 24 -> 25" when ring_fuzz caught one (docs/containment.md)."""
    out: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd") if pid > 0 else ():
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        out[re.sub(r":\[\d+\]$", "", target)] += 1
    return out


def fd_change(before: Counter[str], now: Counter[str]) -> str:
    """What changed between two ``fd_targets``, for a leak report; "" when nothing did."""
    gained, lost = now - before, before - now
    return ", ".join([*([f"gained {sorted(gained.elements())}"] if gained else []),
                      *([f"lost {sorted(lost.elements())}"] if lost else [])])


@dataclass
class Snapshot:
    daemon_pid: int
    fw_pids: list[int]
    daemon_fds: int
    fw_fds: list[int]
    books: list[dict[str, str]]
    shm: set[str]
    #: the firmware processes' descriptors by what they are (fd_targets; fw_fds counts them)
    fw_targets: list[Counter[str]]


def _fw_pid(d: Daemon, dev: int) -> int:
    """The device's firmware process, or -1 when none runs (the device failed)."""
    text = d.debug(dev, "fw_pid").read_text().strip()
    return int(text) if text.isdigit() else -1


def settle(d: Daemon, timeout: float = 60.0) -> None:
    """Wait out a boot-time JIT warm-up (``jit_ready`` turns 1 when it ends): while numba
    loads, the firmware's descriptor count flickers by one, and a baseline taken then is
    off by one. A device whose warm-up never shows (one that failed) is left to the checks
    that follow, as is one still warming when ``timeout`` runs out."""
    if not d.warms_at_boot:
        return
    deadline = time.monotonic() + timeout
    for i in range(d.devices):
        while time.monotonic() < deadline and d.attr(i, "state") == "operational" and (
                d.attr(i, "jit_ready") != "1"):
            time.sleep(0.02)


def snapshot(d: Daemon) -> Snapshot:
    """A baseline: the processes, descriptors, books and /dev/shm once the firmware has
    settled (see settle)."""
    settle(d)
    return _now(d)


def _now(d: Daemon) -> Snapshot:
    fw = [_fw_pid(d, i) for i in range(d.devices)]
    targets = [fd_targets(p) for p in fw]
    return Snapshot(d.pid, fw, fd_count(d.pid), [t.total() for t in targets],
                    [{k: d.attr(i, k) for k in BOOKS} for i in range(d.devices)],
                    shm_names(), targets)


def _problems(d: Daemon, before: Snapshot, kept: list[int]) -> list[str]:
    """What differs from ``before`` now (nothing: contained); a replaced process first."""
    now = _now(d)  # polled: the baseline settled already
    states = [d.attr(i, "state") for i in range(d.devices)]
    problems = []
    if (now.daemon_pid, [now.fw_pids[i] for i in kept]) != (
            before.daemon_pid, [before.fw_pids[i] for i in kept]):
        problems.append(f"processes {before.daemon_pid}/{before.fw_pids} -> "
                        f"{now.daemon_pid}/{now.fw_pids}")
    if not all(alive(p) for p in [now.daemon_pid, *now.fw_pids]):
        problems.append("a daemon or firmware process died")
    if states != ["operational"] * d.devices:
        problems.append(f"states {states}")
    if now.books != before.books:
        problems.append(f"books {before.books} -> {now.books}")
    if now.daemon_fds != before.daemon_fds or [now.fw_fds[i] for i in kept] != [
            before.fw_fds[i] for i in kept]:
        changed = [f"firmware {i} {fd_change(before.fw_targets[i], now.fw_targets[i])}"
                   for i in kept if before.fw_fds[i] != now.fw_fds[i]]
        problems.append(f"descriptors daemon {before.daemon_fds} -> {now.daemon_fds}, "
                        f"firmware {before.fw_fds} -> {now.fw_fds}"
                        + "".join(f"; {c}" for c in changed))
    if now.shm - before.shm:  # what others remove from the shared /dev/shm is theirs
        problems.append(f"/dev/shm gained {sorted(now.shm - before.shm)}")
    return problems


def assert_contained(d: Daemon, before: Snapshot, timeout: float = 30.0,
                     reset: tuple[int, ...] = ()) -> None:
    """The same daemon and firmwares live, every device is operational, and the books,
    descriptors and /dev/shm are back to ``before`` (teardown is asynchronous: the
    firmware confirms it after the attacker is gone, so this waits for it). Devices in
    ``reset`` were reset on purpose: a new firmware runs there, whose descriptors are its
    own. A replaced process fails at once: no wait brings it back."""
    kept = [i for i in range(d.devices) if i not in reset]

    def problems() -> list[str]:
        found = _problems(d, before, kept)
        if found and found[0].startswith("processes"):
            raise AssertionError("not contained: " + "; ".join(found))
        return found

    wait_until(problems, timeout, "containment (nothing left to differ from the baseline)",
               ok=lambda found: not found, interval=0.05)


__all__ = ["BOOKS", "Snapshot", "assert_contained", "fd_change", "fd_count", "fd_targets",
           "settle", "snapshot"]
