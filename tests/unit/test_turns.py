"""The order device-node requests start in (kmod_emul/turns.py), in this process: no mount.

A pipe stands for /dev/fuse (one byte per request the kernel queued and the daemon has not
read) and a reader task takes one request per scheduler round, as pyfuse3's loop does; each
request is a task that takes its turn and records its start. Every process that sends one
has opened a device node first (``Turns.opened``), as on a mount. The same order on a real mount,
under another user's threads: tests/contain/test_contain_qos.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import trio

from kmod_emul.turns import Turns

pytestmark = pytest.mark.timeout(60)


def _serve(queued: list[int]) -> list[int]:
    """The processes of ``queued`` (the kernel's order) in the order their requests start."""
    started: list[int] = []

    async def main() -> None:
        fuse_r, fuse_w = os.pipe()
        unread = list(queued)
        reading = trio.Lock()
        turns = Turns()
        turns.watch(fuse_r)
        for pid in set(queued):
            turns.opened(pid)

        async def worker() -> None:
            """One of pyfuse3's tasks: a request read, then handled in the same step."""
            async with reading:
                await trio.lowlevel.checkpoint()  # a round: the loop polls /dev/fuse
                os.read(fuse_r, 1)
                pid = unread.pop(0)
            if not turns.start_now(pid):  # as the daemon's AccelFS.read/write do
                await turns.take(pid)
            started.append(pid)

        try:
            os.write(fuse_w, bytes(len(queued)))
            async with trio.open_nursery() as nursery:
                for _ in queued:
                    nursery.start_soon(worker)
        finally:
            os.close(fuse_r)
            os.close(fuse_w)

    trio.run(main)
    return started


def test_a_request_queued_behind_a_flood_starts_after_at_most_two_of_it():
    started = _serve([1] * 32 + [2])
    assert started.index(2) <= 2, started
    assert sorted(started) == sorted([1] * 32 + [2])


def test_two_floods_alternate_once_both_are_read():
    started = _serve([1] * 10 + [2] * 10)
    after_first = started[started.index(2) - 1:]
    assert after_first[:10] == [1, 2] * 5, started


def test_one_process_keeps_the_order_its_requests_were_read_in():
    order: list[tuple[int, int]] = []

    async def request(turns: Turns, pid: int, n: int) -> None:
        await turns.take(pid)
        order.append((pid, n))

    async def main() -> None:
        turns = Turns()
        async with trio.open_nursery() as nursery:
            for n in range(20):
                nursery.start_soon(request, turns, n % 3, n)
                await trio.lowlevel.checkpoint()

    trio.run(main)
    for pid in range(3):
        mine = [n for p, n in order if p == pid]
        assert mine == sorted(mine)


def test_a_waiting_request_cancelled_leaves_the_line():
    started: list[str] = []

    async def request(turns: Turns, name: str) -> None:
        await turns.take(1)
        started.append(name)

    async def main() -> None:
        fuse_r, fuse_w = os.pipe()
        try:
            os.write(fuse_w, b"\0")  # a request never read: the later ones wait a while
            turns = Turns()
            turns.watch(fuse_r)
            turns.opened(1)
            turns.opened(2)  # the unread request's
            async with trio.open_nursery() as nursery:
                for name in ("first", "second"):
                    nursery.start_soon(request, turns, name)
                    await trio.lowlevel.checkpoint()
                doomed = trio.CancelScope()

                async def cancelled() -> None:
                    with doomed:
                        await request(turns, "cancelled")

                nursery.start_soon(cancelled)
                await trio.lowlevel.checkpoint()
                assert started == ["first"]  # the second and the doomed one wait
                doomed.cancel()
                nursery.start_soon(request, turns, "last")
        finally:
            os.close(fuse_r)
            os.close(fuse_w)

    trio.run(main)
    assert started == ["first", "second", "last"]


@pytest.fixture
def watched() -> Iterator[tuple[Turns, int]]:
    """Turns watching a pipe that stands for /dev/fuse, and the pipe's write end: a byte
    written there is a request queued and not read yet."""
    fuse_r, fuse_w = os.pipe()
    turns = Turns()
    turns.watch(fuse_r)
    try:
        yield turns, fuse_w
    finally:
        os.close(fuse_r)
        os.close(fuse_w)


def test_the_quiet_path_starts_at_once_and_changes_nothing_when_it_cannot(
        watched: tuple[Turns, int]) -> None:
    """``start_now``, the daemon's call before ``take``: with nothing unread one process's
    requests start without a scheduler round; with another request unread a tag ahead of
    ``V`` must wait (False, nothing started), one not ahead of it still starts."""
    turns, fuse_w = watched
    turns.opened(1)
    turns.opened(2)
    assert turns.start_now(1) and turns.start_now(1)
    os.write(fuse_w, b"\0")  # another process's request, queued and not read yet
    assert not turns.start_now(1)
    assert turns.render() == "1 1\n2 1"
    assert turns.start_now(2)
    assert turns.render() == "1 1\n2 1\n3 2"


def test_one_process_alone_never_waits_for_what_is_unread(
        watched: tuple[Turns, int]) -> None:
    """While one process alone has device nodes open nothing unread can come before its
    requests (another process's would need an open of its own, which the daemon has
    answered): ``start_now`` starts them without looking; once a second process opens,
    an unread request makes them wait again, and once it closed they no longer do."""
    turns, fuse_w = watched
    turns.opened(1)
    turns.opened(1)
    os.write(fuse_w, b"\0")  # unread: one of process 1's own, or no device node's
    assert turns.start_now(1) and turns.start_now(1)
    turns.opened(2)
    assert not turns.start_now(1)
    turns.closed(2)
    turns.closed(1)
    assert turns.start_now(1)
    assert turns.render() == "1 1\n2 1\n3 1"
