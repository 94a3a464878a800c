"""How the firmware's threads share the host's CPUs with the tenants.

On hardware the control loop is a microcontroller of its own and the engines are the
device's; here all three are threads on the host's two CPUs. Two settings keep a busy
device from delaying a tenant's packets by a host time slice:

* the engines run at a lower priority (nice ``ENGINE_NICE``), so that they yield the CPU
  to the control loop and to the tenants' host code;
* the control loop asks for a short time slice (``sched_setattr``'s ``sched_runtime``,
  which EEVDF takes as the thread's slice from Linux 6.12 on). A thread that wakes with a
  shorter slice than the running one preempts it at once (the scheduler's PREEMPT_SHORT);
  otherwise a nice-10 engine keeps the CPU until its own slice (about 0.75 ms) is up, and
  the doorbell that woke the loop waits that long;
* a saturated control loop runs real-time (:class:`Boost`).

All are best effort: an older kernel refuses the slice (EINVAL), an unprivileged daemon
the real-time class (EPERM), and the loop runs as an ordinary thread, which only costs
latency.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable

#: The engine threads' nice value.
ENGINE_NICE = 10
#: The control loop's time slice (ns): Linux's shortest (0.1 ms).
CONTROL_SLICE_NS = 100_000
_SYS_SCHED_SETATTR = 314  # x86_64
#: ``sched_attr.sched_flags``: threads the boosted loop starts are ordinary threads
_SCHED_FLAG_RESET_ON_FORK = 0x01

#: The control loop turns real-time once every pass has taken packets from the processes'
#: own rings for this long (seconds): a flood, not one tenant's round trip, and in its
#: second half it waited for a CPU at least ``CONTENDED`` of the time...
BOOST_AFTER_S = 500e-6
CONTENDED = 0.1
#: ...and, real-time, it goes back to the fair class after each this long of its own CPU
#: time, until ``BOOST_AFTER_S`` more of busy passes turn it real-time again: in that
#: window a thread waiting for its CPU (a tenant's, its own engines') gets a fair share,
#: about a sixth of the cycle under contention, and nothing waits when none does. CPU
#: time, not time: a loop that naps between passes (an engine runs) rests in its naps.
BOOST_RUN_S = 1e-3


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr`` (include/uapi/linux/sched/types.h, SCHED_ATTR_SIZE_VER1)."""

    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64),
                ("util_min", ctypes.c_uint32), ("util_max", ctypes.c_uint32)]


def lower_engine_priority() -> None:
    """The calling engine thread yields to the control loop and the tenants."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ENGINE_NICE)
    except OSError:
        pass


def short_slice() -> None:
    """The calling thread (the control loop) preempts an engine when it wakes."""
    _setattr(_SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=os.SCHED_OTHER,
                        sched_nice=os.getpriority(os.PRIO_PROCESS, 0),
                        sched_runtime=CONTROL_SLICE_NS))


def _setattr(attr: _SchedAttr) -> bool:
    """``sched_setattr`` of the calling thread; False when the kernel refused it."""
    return ctypes.CDLL(None, use_errno=True).syscall(
        _SYS_SCHED_SETATTR, 0, ctypes.byref(attr), 0) == 0


class Boost:
    """The control loop's scheduling class: real-time while the device is saturated.

    A loop saturated by another tenant's launch flood (work in every pass) is a busy
    thread to the host, which gives it a fair share of a CPU in slices of a tick (4 ms
    here): with the host's other threads busy it ran 40-50% of the time, and a
    bystander's launch waited out the others' slices (a median of 2.2 ms against 20-50 us
    quiet: docs/containment.md, "Worst-case delay"). Fair turns inside the loop cannot
    help when the loop itself does not run. So once every pass has taken packets from
    the processes' own rings for ``BOOST_AFTER_S``, and in the second half of that time
    the loop waited for a CPU (its ``run_delay``, /proc/thread-self/schedstat) at least
    ``CONTENDED`` of it, the loop turns ``SCHED_FIFO`` (the lowest real-time priority, its
    threads started meanwhile ordinary ones): it runs whenever it has work, and after
    each ``BOOST_RUN_S`` of its CPU time it is an ordinary thread again for at least
    ``BOOST_AFTER_S`` of busy passes, so a saturated device leaves a fair share of that
    window, about a sixth of one CPU, to whatever waits for it. A loop that does not wait
    for its CPU gains nothing real-time: one tenant's training step saturating the device
    on an idle host ran ~15% slower boosted (docs/containment.md, "One tenant's step is
    not a flood"). The first pass without such packets puts it back (fair share, short
    slice). One tenant's back-to-back round trips while an engine runs count too: the
    loop naps between passes then, each nap ends at the next doorbell, and, when it waited
    for its CPU, it wakes real-time (measured faster: same place). Work the driver brought (its SUBMIT_NOOP packets on the default queues,
    control messages) does not count: each such packet is a FUSE round trip through the
    daemon, whose CPU, not the loop's, bounds that flood, and a real-time loop took it
    from the daemon and the bystanders (docs/containment.md). Best effort: without the
    privilege (CAP_SYS_NICE) it stays as it was, as the engines' nice does."""

    def __init__(self, run_delay: Callable[[], int] | None = None) -> None:
        self.allowed = True  # False once the kernel refused
        self.boosted = False
        self._busy_since = 0.0  # since when every pass had work (0: the last had none)
        self._boosted_at = 0.0  # its CPU time (time.thread_time) when it turned real-time
        #: (time.monotonic(), run_delay ns) read halfway through the busy stretch; None
        #: until then. Read there, not at the stretch's start: a lone round trip is a
        #: stretch too, and pays no system call for this.
        self._halfway: tuple[float, int] | None = None
        self._run_delay = run_delay or RunDelay()

    def working(self, now: float) -> None:
        """A pass of the loop took packets from a process's own ring (``now``:
        time.monotonic())."""
        if not self._busy_since:
            self._busy_since, self._halfway = now, None
        if not self.boosted:
            busy = now - self._busy_since
            if not self.allowed or busy < BOOST_AFTER_S / 2:
                return
            if self._halfway is None:
                self._halfway = (now, self._run_delay())
            elif busy >= BOOST_AFTER_S:
                since, delay = self._halfway
                if self._run_delay() - delay >= CONTENDED * (now - since) * 1e9:
                    self.boosted = self.allowed = _setattr(_SchedAttr(
                        size=ctypes.sizeof(_SchedAttr), sched_policy=os.SCHED_FIFO,
                        sched_flags=_SCHED_FLAG_RESET_ON_FORK, sched_priority=1))
                    self._boosted_at = time.thread_time()
                self._busy_since, self._halfway = now, None  # look again after as long
        elif time.thread_time() - self._boosted_at >= BOOST_RUN_S:
            self._unboost()
            self._busy_since, self._halfway = now, None  # fair for BOOST_AFTER_S at least

    def idle(self) -> None:
        """A pass of the loop took none: back to the host's fair share."""
        self._busy_since = 0.0
        self._unboost()

    def _unboost(self) -> None:
        if self.boosted:
            self.boosted = False
            short_slice()


class RunDelay:
    """The calling thread's time spent waiting for a CPU so far (ns): ``run_delay``, the
    second field of /proc/thread-self/schedstat, through a file kept open (~0.7 us a
    read). 0 forever where the kernel has no schedstat (the loop then never boosts)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        try:
            self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass

    def __call__(self) -> int:
        if self.fd is None:
            return 0
        return int(os.pread(self.fd, 64, 0).split()[1])
