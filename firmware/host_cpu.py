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
  the doorbell that woke the loop waits that long.

Both are best effort: an older kernel refuses the slice (EINVAL) and the loop runs with
the default one, which only costs latency.
"""

from __future__ import annotations

import ctypes
import os
import threading

#: The engine threads' nice value.
ENGINE_NICE = 10
#: The control loop's time slice (ns): Linux's shortest (0.1 ms).
CONTROL_SLICE_NS = 100_000
_SYS_SCHED_SETATTR = 314  # x86_64


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
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=os.SCHED_OTHER,
                      sched_nice=os.getpriority(os.PRIO_PROCESS, 0),
                      sched_runtime=CONTROL_SLICE_NS)
    ctypes.CDLL(None, use_errno=True).syscall(_SYS_SCHED_SETATTR, 0, ctypes.byref(attr), 0)
