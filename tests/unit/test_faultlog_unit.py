"""The fault log and its watchers in this process (kmod_emul/faultlog.py): no daemon.

What the mount cannot replay deterministically is checked here: the daemon-wide bound on
waiting reads (it takes more users than a test has, and root's own reads come and go
between slices), a second read of one watcher while the first waits (read(2) is
serialised by the kernel and pread(2) refused, so only this process can send one), and
the shares of the kept records past MAX_RECORDS. tests/contain/test_contain_events.py
replays the attacks on a real mount.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import trio
import trio.testing

from abi import faults
from kmod_emul import faultlog
from kmod_emul.errors import DriverError
from kmod_emul.faultlog import (
    KEEP,
    MAX_RECORDS,
    MAX_WAITING_READS,
    MAX_WAITING_READS_PER_UID,
    ROOT_WAITING_READS,
    WATCH_QUEUE,
    WATCH_TOTAL,
    FaultLog,
    Watcher,
)

pytestmark = pytest.mark.timeout(60)

PAGE_FAULT = faults.BY_NAME["PAGE_FAULT"].code
RESET = faults.BY_NAME["DEVICE_RESET"].code


def _errno(fn) -> int:
    with pytest.raises(DriverError) as exc:
        fn()
    return exc.value.errno


def test_a_flood_of_one_user_evicts_only_its_own_records(tmp_path: Path):
    log = FaultLog(0, "uuid-0", tmp_path)
    victim = log.report(PAGE_FAULT, pid=10, uid=0, context=1)
    reset = log.report(RESET, contexts=[1])
    for _ in range(3 * KEEP):
        log.report(PAGE_FAULT, pid=20, uid=65534, context=2)
    kept = log.records
    assert victim in kept and reset in kept
    assert sum(r["uid"] == 65534 for r in kept) == KEEP
    assert [r["seq"] for r in kept] == sorted(r["seq"] for r in kept)
    # the persistent log, read back by the next daemon, keeps the same
    again = FaultLog(0, "uuid-0", tmp_path)
    assert victim in again.records and reset in again.records
    assert again.seq == log.seq


def test_past_max_records_the_largest_share_gives_way():
    log = FaultLog(0, "uuid-0", None)
    users = MAX_RECORDS // KEEP
    for uid in range(1, users + 1):  # every share full: MAX_RECORDS kept
        for _ in range(KEEP):
            log.report(PAGE_FAULT, pid=uid, uid=uid, context=uid)
    mine = log.report(PAGE_FAULT, pid=1000, uid=1000, context=1000)
    kept = log.records
    assert len(kept) == MAX_RECORDS and mine in kept
    # the oldest record of a largest share went, no whole share
    assert {r["uid"] for r in kept} == {*range(1, users + 1), 1000}


def test_a_record_whose_owner_is_gone_is_roots_and_kept_apart():
    """A context destroyed before the firmware's report of its fault came: the record has
    its context but no owner. Neither device-wide (every user would read it, and its flood
    would evict the device-wide records) nor anyone's: root's."""
    log = FaultLog(0, "uuid-0", None)
    reset = log.report(RESET, contexts=[])
    for _ in range(2 * KEEP):
        log.report(PAGE_FAULT, context=7)
    assert reset in log.records
    assert [r["code"] for r in faults.from_lines(log.render(65534))] == [RESET]
    assert len(faults.from_lines(log.render(0))) == KEEP + 1


@pytest.mark.parametrize("text", ["pid \u00b2", "pid \u0663", "pid " + "9" * 5000,
                                  "pid " + "1" * (faultlog.PID_DIGITS + 1), "pid -1",
                                  "pid 1 2", "uid 0", ""])
def test_a_bad_filter_is_einval(text: str):
    w = Watcher(FaultLog(0, "uuid-0", None), 65534, 1, True)
    assert _errno(lambda: w.configure(text)) == errno.EINVAL
    assert w.pid is None
    w.configure("pid " + "9" * faultlog.PID_DIGITS)
    assert w.pid == int("9" * faultlog.PID_DIGITS)


def _read_all(w: Watcher) -> list[dict]:
    async def read() -> list[dict]:
        return faults.from_lines((await w.read(1 << 24)).decode())
    return trio.run(read)


def test_a_flood_drops_only_its_own_share_of_a_slow_watchers_events():
    """Root's unfiltered watcher, not reading while one tenant floods: a bystander's record
    in the middle of the flood, and a device-wide one after it, are still read, in order;
    the flood's excess is one marker naming its share. (With one queue of 256 for every
    share, the bystander's record was dropped with the flood's.)"""
    log = FaultLog(0, "uuid-0", None)
    root, tenant = log.watch(0, 1, True), log.watch(65534, 2, True)
    for i in range(3 * WATCH_QUEUE):
        log.report(PAGE_FAULT, pid=20, uid=65534, context=2)
        if i == WATCH_QUEUE + 5:
            bystander = log.report(PAGE_FAULT, pid=30, uid=1000, context=3)
    reset = log.report(RESET, contexts=[2, 3])
    got = _read_all(root)
    flood = [r for r in got if r.get("uid") == 65534]
    assert len(flood) == WATCH_QUEUE and bystander in got and got[-1] == reset
    (marker,) = [r for r in got if "dropped" in r]
    assert (marker["dropped"], marker["share"]) == (2 * WATCH_QUEUE, 65534)
    # the marker stands where the dropped events were: after the flood's kept ones,
    # before the bystander's record that came after the drops began
    assert got.index(flood[-1]) < got.index(marker) < got.index(bystander)
    mine = _read_all(tenant)  # the tenant's own watcher: its share, and the device-wide
    assert mine[-1] == reset and bystander not in mine
    # read out, the share has room again: new events queue, and a later drop is a new
    # marker after them
    for _ in range(WATCH_QUEUE + 3):
        log.report(PAGE_FAULT, pid=20, uid=65534, context=2)
    again = _read_all(root)
    assert len(again) == WATCH_QUEUE + 1 and again[-1]["dropped"] == 3


def test_a_watchers_queue_is_bounded_in_all():
    log = FaultLog(0, "uuid-0", None)
    root = log.watch(0, 1, True)
    users = WATCH_TOTAL // WATCH_QUEUE
    for uid in range(1, users + 2):  # one share more than the total holds
        for _ in range(WATCH_QUEUE):
            log.report(PAGE_FAULT, pid=uid, uid=uid, context=uid)
    got = _read_all(root)
    assert len([r for r in got if "dropped" not in r]) == WATCH_TOTAL
    assert [(r["dropped"], r["share"]) for r in got if "dropped" in r] == \
        [(WATCH_QUEUE, users + 1)]


def test_a_read_shorter_than_the_next_event_is_einval_and_keeps_it():
    log = FaultLog(0, "uuid-0", None)
    w = log.watch(0, 1, True)
    rec = log.report(PAGE_FAULT, pid=1, uid=0, context=1)
    line = (faults.to_line(rec) + "\n").encode()

    async def reads() -> None:
        with pytest.raises(DriverError) as exc:
            await w.read(len(line) - 1)
        assert exc.value.errno == errno.EINVAL
        assert await w.read(len(line)) == line

    trio.run(reads)


def test_waiting_reads_are_bounded_per_watcher_per_user_and_in_all():
    """Each bound's errno, and root's reserve: a user's 17th waiting read EDQUOT, the
    non-root reads past MAX_WAITING_READS - ROOT_WAITING_READS ENOSPC, root's up to
    MAX_WAITING_READS, a second read of one watcher EBUSY. All answered at once."""
    log = FaultLog(0, "uuid-0", None)
    answers: dict[str, int] = {}

    def watcher(uid: int) -> Watcher:
        w = Watcher(log, uid, uid, False)
        log.watchers.add(w)
        return w

    async def read(nursery: trio.Nursery, w: Watcher, name: str) -> None:
        async def one() -> None:
            try:
                await w.read(65536)
            except DriverError as exc:
                answers[name] = exc.errno
        nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()

    async def scenario() -> None:
        with trio.move_on_after(faultlog.READ_SLICE_S / 2):  # all before a slice ends
            async with trio.open_nursery() as nursery:
                first = watcher(65534)
                await read(nursery, first, "first")
                await read(nursery, first, "same watcher")
                for i in range(MAX_WAITING_READS_PER_UID - 1):
                    await read(nursery, watcher(65534), f"own {i}")
                await read(nursery, watcher(65534), "over the user's share")
                users = (MAX_WAITING_READS - ROOT_WAITING_READS) // MAX_WAITING_READS_PER_UID
                for uid in range(1000, 1000 + users - 1):
                    for i in range(MAX_WAITING_READS_PER_UID):
                        await read(nursery, watcher(uid), f"{uid} {i}")
                await read(nursery, watcher(5000), "past the users' part")
                for i in range(ROOT_WAITING_READS):
                    await read(nursery, watcher(0), f"root {i}")
                await read(nursery, watcher(0), "past the table")
                assert faultlog.WAITING.by_uid.total() == MAX_WAITING_READS
                await trio.sleep_forever()

    trio.run(scenario)
    assert answers == {"same watcher": errno.EBUSY, "over the user's share": errno.EDQUOT,
                       "past the users' part": errno.ENOSPC, "past the table": errno.ENOSPC}
    assert not faultlog.WAITING.by_uid  # every slot came back


def test_the_persistent_log_is_cut_to_the_shares_kept(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch):
    """Past its size the persistent log is rewritten with the records kept, so a flood
    cuts only its own there too; a cut is not redone until the file has doubled."""
    monkeypatch.setattr(faultlog, "LOG_MAX_BYTES", 64 << 10)
    log = FaultLog(0, "uuid-0", tmp_path)
    victim = log.report(PAGE_FAULT, pid=10, uid=0, context=1)
    for _ in range(4 * KEEP):
        log.report(PAGE_FAULT, pid=20, uid=65534, context=2)
    on_disk = faults.from_lines(log.path.read_text())
    assert victim in on_disk
    assert log.path.stat().st_size <= max(64 << 10, 2 * (KEEP + 1) * 600)
    assert FaultLog(0, "uuid-0", tmp_path).records == log.records
