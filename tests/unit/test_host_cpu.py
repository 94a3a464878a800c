"""The control loop's scheduling class on the host (firmware/host_cpu.py, ``Boost``): a
loop that has had work in every pass for a while, and waited for its CPU meanwhile, runs
real-time, is fair again between stretches, and goes back to the host's fair share at its
first pass without work; a loop saturated by one tenant on an idle host stays fair. Each
case runs in a thread of its own, whose class it changes (a thread's class is its own),
and checks it with sched_getscheduler(2). The time a loop waited for its CPU is given by a
fake in most cases (its passes' clock is given too); the last case reads the kernel's."""

from __future__ import annotations

import os
import resource
import subprocess
import threading
import time
from collections.abc import Callable

import pytest

from firmware import host_cpu
from firmware.host_cpu import BOOST_AFTER_S, BOOST_RUN_S, CONTENDED, Boost, RunDelay

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


class FakeDelay:
    """A loop's ``run_delay`` (ns): waits ``share`` of the time the passes' clock says,
    and counts how often it was read."""

    def __init__(self, share: float) -> None:
        self.share, self.now, self.reads = share, 0.0, 0

    def __call__(self) -> int:
        self.reads += 1
        return int(self.share * self.now * 1e9)


def passes(boost: Boost, delay: FakeDelay, t0: float, *offsets: float) -> None:
    """Busy passes at ``t0 + offset`` each (a thousandth later: the stretch's bounds are
    reached despite floating-point sums)."""
    for dt in offsets:
        delay.now = t0 + dt * 1.001
        boost.working(delay.now)


@needs_privilege
def test_a_saturated_loop_that_waits_for_its_cpu_runs_real_time_until_a_pass_without_work(
) -> None:
    def body() -> list[object]:
        delay = FakeDelay(share=2 * CONTENDED)
        boost, t0 = Boost(delay), time.monotonic()
        passes(boost, delay, t0, 0.0, BOOST_AFTER_S / 4)
        seen: list[object] = [policy(), delay.reads]  # a lone round trip reads nothing
        passes(boost, delay, t0, BOOST_AFTER_S / 2, 3 * BOOST_AFTER_S / 4)
        seen.append(policy())  # half the stretch: measured, not decided
        passes(boost, delay, t0, BOOST_AFTER_S)
        seen.append(policy())
        child: list[int] = []  # a thread it starts is an ordinary one (reset on fork)
        t = threading.Thread(target=lambda: child.append(policy()))
        t.start()
        t.join()
        boost.idle()
        return seen + [child[0], policy(), boost.boosted, delay.reads]

    assert in_thread(body) == [os.SCHED_OTHER, 0, os.SCHED_OTHER, os.SCHED_FIFO,
                               os.SCHED_OTHER, os.SCHED_OTHER, False, 2]


@needs_privilege
def test_a_saturated_loop_that_never_waits_for_its_cpu_stays_fair() -> None:
    """One tenant's training step on an idle host: real-time would gain nothing (it ran
    slower), so the loop stays in the fair class, looking again every stretch."""
    def body() -> list[object]:
        delay = FakeDelay(share=CONTENDED / 2)
        boost, t0 = Boost(delay), time.monotonic()
        passes(boost, delay, t0, *[i * BOOST_AFTER_S / 4 for i in range(41)])
        seen: list[object] = [policy(), delay.reads]
        delay.share = 2 * CONTENDED  # now another thread wants its CPU
        passes(boost, delay, t0, *[(40 + i) * BOOST_AFTER_S / 4 for i in range(1, 5)])
        seen.append(policy())
        boost.idle()
        return seen

    assert in_thread(body) == [os.SCHED_OTHER, 20, os.SCHED_FIFO]


@needs_privilege
def test_the_real_time_loop_is_fair_again_after_each_stretch_of_its_cpu_time() -> None:
    """After ``BOOST_RUN_S`` of CPU time the loop is an ordinary thread (a waiting thread
    gets a fair share) until a stretch of ``BOOST_AFTER_S`` more busy passes finds it
    still waiting for its CPU; it never sleeps for it (a sleep there made one tenant's
    saturated step wait while the host was idle): the thread blocks not once in that pass
    (its voluntary context switches, which a preemption by a busy host does not count)."""
    def body() -> list[object]:
        delay = FakeDelay(share=2 * CONTENDED)
        boost, t0 = Boost(delay), time.monotonic()
        passes(boost, delay, t0, 0.0, BOOST_AFTER_S / 2, BOOST_AFTER_S)  # real-time
        seen: list[object] = [policy()]
        time.sleep(4 * BOOST_RUN_S)  # time passes, but no CPU time: still real-time
        passes(boost, delay, t0, 2 * BOOST_AFTER_S)
        seen.append(policy())
        spin_until = time.thread_time() + 2 * BOOST_RUN_S
        while time.thread_time() < spin_until:  # a stretch of CPU time
            pass
        slept = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw  # blocked so far
        passes(boost, delay, t0, 3 * BOOST_AFTER_S)  # the stretch is over: fair again
        seen += [policy(), resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw == slept]
        passes(boost, delay, t0, 3.5 * BOOST_AFTER_S)
        seen.append(policy())  # not yet BOOST_AFTER_S of busy passes
        passes(boost, delay, t0, 4 * BOOST_AFTER_S)
        seen.append(policy())  # real-time again
        boost.idle()
        seen.append(policy())
        return seen

    assert in_thread(body) == [os.SCHED_FIFO, os.SCHED_FIFO, os.SCHED_OTHER, True,
                               os.SCHED_OTHER, os.SCHED_FIFO, os.SCHED_OTHER]


def test_a_refused_class_is_not_asked_for_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unprivileged daemon: the kernel says EPERM once, the loop stays as it was and
    does not pay a refused system call (nor a read of its wait) per pass."""
    calls: list[int] = []

    def refused(attr: object) -> bool:
        calls.append(1)
        return False

    monkeypatch.setattr(host_cpu, "_setattr", refused)
    delay = FakeDelay(share=2 * CONTENDED)
    boost, t0 = Boost(delay), time.monotonic()
    passes(boost, delay, t0, *[i * BOOST_AFTER_S / 2 for i in range(10)])
    boost.idle()
    passes(boost, delay, t0, 10 * BOOST_AFTER_S, 20 * BOOST_AFTER_S)
    assert (len(calls), boost.boosted, boost.allowed, delay.reads) == (1, False, False, 2)


def test_run_delay_is_the_time_a_thread_waited_for_its_cpu() -> None:
    """The kernel's figure the boost decides on: a thread spinning beside a spinning
    process, both pinned to one CPU, waits for it about half the time (at least what the
    boost asks for). The rival is a process, not a thread: two Python threads take turns
    on the GIL, and the one waiting for it is asleep, not waiting for a CPU. (Alone it
    would wait almost never, but a loaded CI host is no idle CPU: not asserted.)"""
    cpu = min(os.sched_getaffinity(0))
    rival = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        os.sched_setaffinity(rival.pid, {cpu})

        def waited_share() -> float:
            os.sched_setaffinity(0, {cpu})
            read = RunDelay()
            d0, w0 = read(), time.monotonic_ns()
            while time.monotonic_ns() - w0 < 300_000_000:
                pass
            return (read() - d0) / (time.monotonic_ns() - w0)

        shared = in_thread(waited_share)
    finally:
        rival.kill()
        rival.wait()
    assert isinstance(shared, float) and shared > 2 * CONTENDED, shared
