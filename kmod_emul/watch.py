"""The watchers of a serving device: its firmware's exit, its heartbeat, a reset request.

Each runs while the device serves (``AccelDevice.serve``) and ends serving by cancelling
``scope``: a firmware that exits or stops heart-beating while the device is operational
fails it (``Resets.fail_running``: its contexts lost, the fault recorded, then with
``recovery`` auto a reset); a requested reset just ends serving, and the supervisor
boots again.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from abi import faults, uapi

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice


async def watch_exit(dev: AccelDevice, scope: trio.CancelScope) -> None:
    assert dev.fw is not None
    status = await dev.fw.proc.wait()
    if dev.state == uapi.DeviceState.OPERATIONAL:
        dev.resets.fail_running(errno.ENODEV,
                                f"firmware process exited unexpectedly (status {status})",
                                faults.BY_NAME["FIRMWARE_DIED"].code)
    scope.cancel()


#: Where the host's process table is (tests point it at a tree of their own).
PROC = Path("/proc")


class Starvation:
    """How long the host kept a process's threads waiting for a CPU while they could run:
    the run-queue delay the scheduler accounts per thread (``/proc/PID/task/TID/schedstat``,
    second field, ns). The firmware is a process on the host's CPUs, so a missed beat
    proves a hang only if the firmware had the CPU to beat: on a 2-CPU machine with a
    test suite and compiles beside it, its control loop (or the thread holding its GIL)
    waited 2 s in the run queue and the device was failed as hung although nothing was
    wrong. Like the kernel's soft-lockup detector, which does not count the time a
    virtual machine's vCPU was not scheduled (steal time), the watchdog does not count
    this time.

    ``sample`` adds the largest increase of any one thread since the last sample (the
    threads wait side by side, so their sum would count one wait several times), at most
    the wall time that passed; a thread that exits loses only its last interval."""

    def __init__(self, pid: int) -> None:
        self.tasks = PROC / str(pid) / "task"
        self._seen: dict[str, int] = {}
        self.total_s = 0.0

    def _delays(self) -> dict[str, int]:
        out = {}
        try:
            for task in self.tasks.iterdir():
                try:
                    out[task.name] = int((task / "schedstat").read_text().split()[1])
                except (OSError, ValueError, IndexError):
                    continue  # the thread exited, or no schedstats: nothing to count
        except OSError:
            pass
        return out

    def sample(self, interval_s: float) -> float:
        """Add what the process's threads waited since the last sample; the total."""
        now = self._delays()
        grew = max((ns - self._seen[t] for t, ns in now.items() if t in self._seen),
                   default=0)
        self._seen = now
        self.total_s += min(max(grew, 0) / 1e9, interval_s)
        return self.total_s


#: A firmware that stops beating is failed after at most this many heartbeat timeouts
#: of wall time, however starved: a hang that spins on a starved CPU is caught too.
MAX_STARVED_TIMEOUTS = 5


async def watch_heartbeat(dev: AccelDevice, scope: trio.CancelScope) -> None:
    """Fail the device when its firmware has not beaten for ``heartbeat_timeout_s`` of the
    time it could run (``Starvation``), or for ``MAX_STARVED_TIMEOUTS`` times that of wall
    time."""
    assert dev.fw is not None
    mbx = dev.fw.mbx
    starved = Starvation(dev.fw.pid)
    timeout = dev.heartbeat_timeout_s
    last = mbx.heartbeat[0]
    last_change = then = trio.current_time()
    starved_at_change = starved.sample(0.0)
    while True:
        await trio.sleep(min(0.1, timeout / 4))
        beat = mbx.heartbeat[0]
        now = trio.current_time()
        total, then = starved.sample(now - then), now
        if beat != last:
            last, last_change, starved_at_change = beat, now, total
            continue
        silent = now - last_change
        if silent - (total - starved_at_change) > timeout or \
                silent > MAX_STARVED_TIMEOUTS * timeout:
            dev.resets.fail_running(
                errno.ENODEV,
                f"firmware stopped heart-beating (none for {silent:.1f} s, "
                f"{total - starved_at_change:.1f} s of it waiting for a CPU)"
                + ("" if dev.recovery == "auto" else "; reset the device"),
                faults.BY_NAME["FIRMWARE_HANG"].code,
            )
            scope.cancel()
            return


async def watch_reset(dev: AccelDevice, scope: trio.CancelScope) -> None:
    await dev.resets.requested.wait()
    scope.cancel()
