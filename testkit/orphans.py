"""Daemons a killed test run left mounted, found and stopped by the next run.

A test daemon runs in its own session (``accel-emud`` detaches, as an operator's would),
so when the runner itself is killed -- ``timeout`` ending a hung ``make test``, a CI job
cancelled, ^C twice -- no fixture teardown runs and the daemon keeps its mount, its
engines and its memory. Every test process therefore *claims* its base temporary
directory (an ``accel-owner`` file naming its pid and that pid's start time), and at its
start *sweeps*: an accel-emud mount under the user's pytest temporaries whose claiming
process is gone is stopped. A mount whose owner still runs is another live run's (helpers
and CI jobs share machines) and is left alone; so is one with no claim at all (a run of
code older than this file, or a root someone made by hand).
"""

from __future__ import annotations

import os
from pathlib import Path

from kmod_emul import daemon as kdaemon

OWNER_FILE = "accel-owner"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): a pid
    reused by a later process has another, so a claim never outlives its process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def claim(basetemp: Path, pid: int | None = None) -> None:
    """Mark ``basetemp`` (and every daemon root under it) as owned by ``pid`` (this
    process by default) for as long as that process runs."""
    pid = os.getpid() if pid is None else pid
    (basetemp / OWNER_FILE).write_text(f"{pid} {_start_time(pid)}\n")


def owner_alive(claim_file: Path) -> bool:
    """Whether the process that wrote ``claim_file`` still runs (and is not a zombie)."""
    try:
        pid_text, started = claim_file.read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return True  # unreadable or half-written: not ours to judge
    return kdaemon.pid_alive(pid) and _start_time(pid) == started


def _claim_for(mountpoint: Path, top: Path) -> Path | None:
    for parent in mountpoint.parents:
        if parent == top or top not in parent.parents:
            return None
        if (parent / OWNER_FILE).is_file():
            return parent / OWNER_FILE
    return None


def sweep(top: Path) -> list[Path]:
    """Stop every accel-emud mounted under ``top`` whose claiming process is gone; the
    roots stopped, for the caller to say so."""
    stopped = []
    for root in (m.root for m in kdaemon.accel_mounts() if top in m.root.parents):
        claim_file = _claim_for(root, top)
        if claim_file is not None and not owner_alive(claim_file):
            kdaemon.stop(root)
            stopped.append(root)
    return stopped


__all__ = ["OWNER_FILE", "claim", "owner_alive", "sweep"]
