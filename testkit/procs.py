"""Child processes: starting ones that can be interrupted, ending tenants driven through
their stdin, and asking /proc whether a process lives and what a daemon runs."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from testkit.daemon import Daemon


def _sigint_by_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interruptible() -> dict[str, Any]:
    """``subprocess.Popen`` keywords for a child that will be sent SIGINT: where this process
    ignores SIGINT (a runner started in the background by a shell without job control,
    ``make test &``, inherits SIGINT ignored), the child would inherit that and Python would
    keep it ignored -- no KeyboardInterrupt, ever. The child gets the default disposition
    back, as when run from a terminal (Python then installs its KeyboardInterrupt handler)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return {"preexec_fn": _sigint_by_default}
    return {}


def close_child(proc: subprocess.Popen[str]) -> None:
    """End a tenant driven through its stdin: EOF, then a kill past 30 s."""
    if proc.poll() is None:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (a killed child not yet reaped
    still has a /proc entry)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def firmware_children(d: Daemon) -> int:
    """How many firmware processes daemon ``d`` runs (its only children): one per device
    and partition, and none of a partition that is gone."""
    children = 0
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children += fields[0] not in ("Z", "X") and int(fields[1]) == d.pid
    return children


__all__ = ["alive", "close_child", "firmware_children", "interruptible"]
