"""Bring-up as named steps with undos (kmod_emul/bringup.py, the table ``boot.BRINGUP``).

The mechanism first, in-process: order, unwind in reverse, undo errors that never mask the
original one, injection, cancellation. Then, for every step of the driver's table (taken
from the table, so a new step is covered without touching this file), a real two-device
daemon whose accel1 fails at that step: the failure is reported with its own errno and a
message naming the step, accel0 works, and accel1 holds nothing (descriptors, memfd
mappings, /dev/shm files, firmware processes) -- the same as after the teardown of a
bring-up that succeeded. Clearing the injection at runtime (debugfs ``fail_step``) and
resetting recovers accel1; setting it at runtime fails the next bring-up the same way.
"""

from __future__ import annotations

import errno
import os
import re
from collections import Counter
from dataclasses import dataclass

import pytest
import trio
from rawdev import RawDev, errname

from kmod_emul import bringup
from kmod_emul.boot import BRINGUP, STEP_NAMES
from kmod_emul.errors import DriverError
from kmod_emul.sysfs import parse_fail_step
from testkit.waiting import WaitTimeout, wait_until
from tools import accel_emud


# --- the mechanism -------------------------------------------------------------------------
class Boom(Exception):
    pass


def _table(log: list[str], fail: str = "", bad_undo: str = "", names: str = "abcd"
           ) -> list[bringup.Step[None]]:
    def do(name: str):
        async def run(_target: None) -> None:
            await trio.lowlevel.checkpoint()  # async steps are allowed
            if name == fail:
                raise Boom(name)
            log.append(f"do {name}")
        return run

    def undo(name: str):
        def run(_target: None) -> None:
            log.append(f"undo {name}")
            if name == bad_undo:
                raise OSError(errno.EBADF, f"undo {name} broke")
        return run

    return [bringup.Step(n, do(n), undo(n)) for n in names]


def test_steps_run_in_order_and_teardown_undoes_them_in_reverse_once():
    log: list[str] = []

    async def main() -> None:
        up = await bringup.bring_up(_table(log), None, "dev")
        assert log == ["do a", "do b", "do c", "do d"]
        assert await up.teardown() == []
        assert await up.teardown() == []  # idempotent: nothing is undone twice

    trio.run(main)
    assert log[4:] == ["undo d", "undo c", "undo b", "undo a"]


def test_a_failed_step_undoes_the_steps_before_it_and_raises_its_error_named():
    log: list[str] = []
    with pytest.raises(Boom) as info:
        trio.run(bringup.bring_up, _table(log, fail="c"), None, "dev")
    assert log == ["do a", "do b", "undo b", "undo a"]  # not c's undo: c made nothing
    assert bringup.failed_step(info.value) == "c"
    assert "at bring-up step c of dev" in info.value.__notes__


def test_an_undo_that_raises_neither_masks_the_error_nor_stops_the_unwind():
    log: list[str] = []
    with pytest.raises(Boom) as info:
        trio.run(bringup.bring_up, _table(log, fail="d", bad_undo="b"), None, "dev")
    assert log == ["do a", "do b", "do c", "undo c", "undo b", "undo a"]
    assert any("undo b broke" in note for note in info.value.__notes__)


def test_teardown_reports_undo_errors_and_still_runs_to_the_end():
    log: list[str] = []

    async def main() -> list[BaseException]:
        up = await bringup.bring_up(_table(log, bad_undo="c"), None, "dev")
        return await up.teardown()

    errors = trio.run(main)
    assert [str(e) for e in errors] == ["[Errno 9] undo c broke"]
    assert log[4:] == ["undo d", "undo c", "undo b", "undo a"]


def test_injection_fails_the_named_step_before_it_runs():
    log: list[str] = []
    with pytest.raises(DriverError) as info:
        trio.run(lambda: bringup.bring_up(_table(log), None, "dev", fail_at="b"))
    assert log == ["do a", "undo a"]
    assert info.value.errno == bringup.INJECTED_ERRNO == errno.ECANCELED
    assert info.value.message == ("injected failure at bring-up step b (debugfs fail_step); "
                                  "write none to fail_step and reset the device")
    with pytest.raises(ValueError, match="no bring-up step 'x'; the steps are a, b, c, d"):
        trio.run(lambda: bringup.bring_up(_table(log), None, "dev", fail_at="x"))


def test_a_cancelled_bring_up_still_undoes_what_it_did():
    log: list[str] = []

    async def hang(_target: None) -> None:
        await trio.sleep_forever()

    async def slow_undo(_target: None) -> None:
        await trio.sleep(0.01)  # shielded: the cancellation does not cut it short
        log.append("undo b")

    steps = [*_table(log, names="a"), bringup.Step("b", lambda t: log.append("do b"), slow_undo),
             bringup.Step("hang", hang)]

    async def main() -> None:
        with trio.move_on_after(0.05):
            await bringup.bring_up(steps, None, "dev")
        assert log == ["do a", "do b", "undo b", "undo a"]

    trio.run(main)


def test_the_driver_table_names_every_step_once_and_each_can_be_injected():
    assert len(set(STEP_NAMES)) == len(STEP_NAMES) == len(BRINGUP)
    assert [s.name for s in BRINGUP] == list(STEP_NAMES)
    for name in STEP_NAMES:  # what debugfs fail_step and --fail-step accept
        assert parse_fail_step(f"{name}\n") == name
    assert parse_fail_step("none") == parse_fail_step("\n") == ""
    with pytest.raises(DriverError) as info:
        parse_fail_step("nosuchstep")
    assert info.value.errno == errno.EINVAL


def test_the_daemon_option_names_a_device_and_a_step(capsys):
    args = accel_emud.parse_args(["--devices", "2", "--fail-step", "accel1:mailbox",
                                  "--fail-step", "0:image"])
    assert dict(args.fail_step) == {1: "mailbox", 0: "image"}
    assert accel_emud.parse_args([]).fail_step == []  # unset: no injection
    for bad, why in (("accel2:image", "no device accel2"),
                     ("accel1:nosuchstep", "no bring-up step 'nosuchstep'"),
                     ("mailbox", "not DEVICE:STEP")):
        with pytest.raises(SystemExit):
            accel_emud.parse_args(["--devices", "2", "--fail-step", bad])
        assert why in capsys.readouterr().err


# --- every step of a real device -------------------------------------------------------------
#: what /dev/shm may hold of this project's (the driver names its memfds so)
SHM_PREFIXES = ("accel-emu", "accel0-", "accel1-")
MAILBOX = "/memfd:accel-emu-accel1-mailbox (deleted)"


@dataclass(frozen=True)
class Footprint:
    """What a daemon holds: descriptors by kind, memfd mappings, child processes, and the
    project's files in /dev/shm."""

    fds: Counter
    memfd_maps: Counter
    children: tuple[tuple[int, str], ...]
    shm: frozenset[str]

    def diff(self, other: Footprint) -> str:
        out = []
        for name in ("fds", "memfd_maps"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: +{dict(b - a)} -{dict(a - b)}")
        if self.children != other.children:
            out.append(f"children {self.children} -> {other.children}")
        if self.shm != other.shm:
            out.append(f"/dev/shm {sorted(self.shm)} -> {sorted(other.shm)}")
        return "; ".join(out)


def _fd_kind(target: str) -> str:
    """A descriptor's kind and name, without inode numbers (pipes and sockets made again
    have new ones)."""
    return re.sub(r"\[\d+\]", "", target)


def footprint(pid: int) -> Footprint:
    fds: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds[_fd_kind(os.readlink(f"/proc/{pid}/fd/{fd}"))] += 1
        except FileNotFoundError:  # closed while listing
            pass
    maps: Counter = Counter()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.split(maxsplit=5)[5].strip() if len(line.split()) > 5 else ""
            if "memfd:" in path:
                maps[path] += 1
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # zombies too: a child not reaped is a leak (whether a
            # live one runs or sleeps at the moment says nothing)
            children.append((int(entry), "zombie" if fields[0] == "Z" else "live"))
    shm = frozenset(n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIXES))
    return Footprint(fds, maps, tuple(sorted(children)), shm)


def wait_footprint(d, want: Footprint, what: str, timeout: float = 20.0) -> None:
    """Teardown is asynchronous (the supervisor halts the firmware after the reset): wait
    until the daemon holds exactly ``want``."""
    try:
        wait_until(lambda: footprint(d.pid), timeout, what, ok=lambda now: now == want)
    except WaitTimeout:
        raise AssertionError(f"{what}: {want.diff(footprint(d.pid))}") from None


def transaction(d, dev: int) -> None:
    """A context, a no-op through the device, its completion; then all of it released."""
    with RawDev(d.node(dev)) as raw:
        ctx = raw.ctx_create()
        seqno = raw.noop(ctx)
        assert raw.wait_done(ctx, seqno).completed >= seqno
    d.wait_attrs(dev, {"contexts": "0", "open_files": "0", "memory_used": "0"})


def reset(d, dev: int) -> None:
    (d.root / f"sys/class/accel/accel{dev}/reset").write_text("1")


def assert_failed_at(d, step: str) -> None:
    assert d.attr(1, "state") == "failed"
    assert d.attr(1, "failure_code") == "ECANCELED"
    assert d.attr(1, "failure") == (f"injected failure at bring-up step {step} (debugfs "
                                    f"fail_step); write none to fail_step and reset the device")
    assert errname(lambda: os.close(os.open(d.node(1), os.O_RDWR))) == "ECANCELED"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("step", STEP_NAMES)
def test_a_failure_at_each_step_leaves_nothing_behind(make_daemon, step):
    d = make_daemon(devices=2, extra=["--fail-step", f"accel1:{step}"])
    assert_failed_at(d, step)
    done = STEP_NAMES[:STEP_NAMES.index(step)]
    log = (d.state_dir / "accel-emud.log").read_text()
    assert (f"accel1: bring-up step {step} failed (ECANCELED: injected failure at bring-up "
            f"step {step} (debugfs fail_step); write none to fail_step and reset the device); "
            f"undoing {', '.join(reversed(done)) or 'nothing'}\n") in log
    assert d.debug(1, "fail_step").read_text().strip() == step
    transaction(d, 0)  # the bystander works
    assert d.attr(0, "state") == "operational"
    failed = footprint(d.pid)
    fw0 = int(d.debug(0, "fw_pid").read_text())
    assert [pid for pid, _ in failed.children] == [fw0]  # no firmware of accel1's, live or dead

    # cleared at runtime, a reset brings accel1 up, and the measure sees what it holds
    d.debug(1, "fail_step").write_text("none")
    reset(d, 1)
    d.wait_state(1, "operational")
    transaction(d, 1)
    up = footprint(d.pid)
    fw1 = int(d.debug(1, "fw_pid").read_text())
    assert [pid for pid, _ in up.children] == sorted([fw0, fw1])
    assert up.memfd_maps - failed.memfd_maps == Counter({MAILBOX: 1})
    assert failed.fds - up.fds == Counter()
    # the mailbox (mmap keeps its own descriptor), interrupt, doorbell and log pipes, the
    # fd channel, and the process's pidfd where trio waits on one
    assert up.fds - failed.fds - Counter({"anon_inode:[pidfd]": 1}) == Counter(
        {"pipe:": 3, "socket:": 1, MAILBOX: 1})

    # the teardown of that good bring-up (held in reset) leaves what the failed one left
    d.debug(1, "reset_hold").write_text("1")
    reset(d, 1)
    wait_footprint(d, failed, f"teardown after a good bring-up vs failure at {step}")

    # injected at runtime, the next bring-up fails the same way and leaves the same
    d.debug(1, "fail_step").write_text(step)
    d.debug(1, "reset_hold").write_text("0")
    d.wait_state(1, "failed")
    assert_failed_at(d, step)
    wait_footprint(d, failed, f"second failure at {step}")
    transaction(d, 0)
    assert int(d.debug(0, "fw_pid").read_text()) == fw0  # accel0 never noticed
