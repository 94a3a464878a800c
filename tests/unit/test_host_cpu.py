"""The control loop's scheduling class on the host (firmware/host_cpu.py, ``Boost``): a
loop that has had work in every pass for a while runs real-time, rests between stretches,
and goes back to the host's fair share at its first pass without work. Each case runs in a
thread of its own, whose class it changes (a thread's class is its own), and checks it
with sched_getscheduler(2)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from firmware import host_cpu
from firmware.host_cpu import BOOST_AFTER_S, BOOST_REST_S, BOOST_RUN_S, Boost

pytestmark = pytest.mark.timeout(60)

needs_privilege = pytest.mark.skipif(os.geteuid() != 0, reason="SCHED_FIFO needs root")


def policy() -> int:
    """The calling thread's scheduling class (without the reset-on-fork flag)."""
    return os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK


def in_thread(body: Callable[[], object]) -> object:
    """``body()``'s result, run in a new thread (its scheduling class dies with it)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(body()))
    t.start()
    t.join(30)
    assert out, "the thread did not finish"
    return out[0]


@needs_privilege
def test_a_saturated_loop_runs_real_time_until_a_pass_without_work() -> None:
    def body() -> tuple[int, int, int, int, bool]:
        boost, t0 = Boost(), time.monotonic()
        boost.working(t0)
        first = policy()  # one busy pass: not saturated yet
        boost.working(t0 + 2 * BOOST_AFTER_S)
        boosted = policy()
        child: list[int] = []  # a thread it starts is an ordinary one (reset on fork)
        t = threading.Thread(target=lambda: child.append(policy()))
        t.start()
        t.join()
        boost.idle()
        return first, boosted, child[0], policy(), boost.boosted

    first, boosted, child, after, still = in_thread(body)  # type: ignore[misc]
    assert (first, boosted, child, after, still) == (
        os.SCHED_OTHER, os.SCHED_FIFO, os.SCHED_OTHER, os.SCHED_OTHER, False)


@needs_privilege
def test_the_real_time_loop_rests_after_each_stretch_of_its_cpu_time() -> None:
    def body() -> tuple[float, float, float]:
        boost, t0 = Boost(), time.monotonic()
        boost.working(t0 - 2 * BOOST_AFTER_S)
        boost.working(t0)  # real-time from here
        time.sleep(4 * BOOST_RUN_S)  # time passes, but no CPU time: no rest owed
        a = time.monotonic()
        boost.working(a)
        b = time.monotonic()
        spin_until = time.thread_time() + 2 * BOOST_RUN_S
        while time.thread_time() < spin_until:  # a stretch of CPU time
            pass
        c = time.monotonic()
        boost.working(c)  # the stretch is over: a rest
        d = time.monotonic()
        boost.idle()
        return b - a, d - c, policy()

    napped, rested, after = in_thread(body)  # type: ignore[misc]
    assert napped < BOOST_REST_S <= rested
    assert after == os.SCHED_OTHER


def test_a_refused_class_is_not_asked_for_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unprivileged daemon: the kernel says EPERM once, the loop stays as it was and
    does not pay a refused system call per pass."""
    calls: list[int] = []

    def refused(attr: object) -> bool:
        calls.append(1)
        return False

    monkeypatch.setattr(host_cpu, "_setattr", refused)
    boost, t0 = Boost(), time.monotonic()
    for i in range(5):
        boost.working(t0 + 2 * i * BOOST_AFTER_S)
    boost.idle()
    boost.working(t0 + 10 * BOOST_AFTER_S)
    boost.working(t0 + 20 * BOOST_AFTER_S)
    assert (len(calls), boost.boosted, boost.allowed) == (1, False, False)
