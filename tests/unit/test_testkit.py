"""The test kit's own reporting: a descriptor leak names what leaked, not only how many,
and a wait that runs out names what it waited for and what it last saw."""

from __future__ import annotations

import os

import pytest

from testkit.contained import fd_change, fd_targets
from testkit.waiting import WaitTimeout, wait_until

pytestmark = pytest.mark.timeout(30)


def test_a_leaked_descriptor_is_named_by_what_it_is() -> None:
    before = fd_targets(os.getpid())
    memfd = os.memfd_create("accel-leak-probe")
    r, w = os.pipe()
    try:
        after = fd_targets(os.getpid())
    finally:
        for fd in (memfd, r, w):
            os.close(fd)
    assert fd_change(before, after) == \
        "gained ['/memfd:accel-leak-probe (deleted)', 'pipe', 'pipe']"
    assert fd_change(after, before) == "lost ['/memfd:accel-leak-probe (deleted)', 'pipe', 'pipe']"
    assert fd_change(before, fd_targets(os.getpid())) == ""  # closed again: no change


def test_a_wait_returns_the_value_that_met_it() -> None:
    seen = iter(range(10))
    assert wait_until(lambda: next(seen), 5, "three", ok=lambda n: n >= 3, interval=0) == 3
    assert wait_until(lambda: "x", 0, "a truthy value") == "x"  # met at once: no wait


def test_a_wait_that_runs_out_says_what_it_awaited_and_last_saw() -> None:
    with pytest.raises(WaitTimeout) as exc:
        wait_until(lambda: {"state": "resetting"}, 0.05, "accel0 to be operational",
                   interval=0.01, ok=lambda now: now["state"] == "operational")
    assert str(exc.value) == ("timed out after 0.05 s waiting for accel0 to be operational; "
                              "last seen: {'state': 'resetting'}")
    assert isinstance(exc.value, AssertionError)  # a test failure, not an error


def test_a_wait_looks_once_more_after_its_deadline() -> None:
    """A probe that turns true during the last sleep is not reported as a timeout (on a
    loaded machine that sleep can outlast the deadline)."""
    calls = []
    assert wait_until(lambda: calls.append(1) or len(calls) == 2, 0.2, "the second look",
                      interval=1)  # the sleep after the first look ends past the deadline
