"""The memory and pipes a process brings to the driver (docs/containment.md).

The driver creates no file a process can write: rings, pinned and managed memory, the
doorbell page and module images are memfds of this process, *sealed* so that nobody --
this process included -- can shrink or grow them while the device maps them (module images
are sealed against writing as well: what the driver checked is what the firmware runs). A
command names such a descriptor; the driver imports it, and this process may close its own
descriptor afterwards (a mapping keeps the memory).

Such memory is shared with the device and, through an IPC export, with chosen processes;
never by path. Yet another process of the same user could open it through
``/proc/PID/fd/N`` (and read or write it through ``/proc/PID/mem``): Linux guards both with
its ptrace check, which a same-uid process passes while the process is *dumpable*.
:func:`keep_private` makes the process non-dumpable before its first context brings the
driver anything, so those paths answer EACCES to everyone without CAP_SYS_PTRACE (root
keeps it: the flag cannot refuse root). The costs: no core dumps, and a debugger of the
same user cannot attach (root's can). ``ACCEL_ALLOW_PTRACE=1`` keeps the process dumpable,
with the exposure; a daemon run as the client's user (not root) needs it, as it imports
the client's descriptors through that same check. A forked child inherits the flag; exec
clears it (the runtime sets it again in the new program).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import time

from abi import uapi

#: The environment variable that keeps the process dumpable when it is "1".
ALLOW_PTRACE_ENV = "ACCEL_ALLOW_PTRACE"
#: prctl(2)'s option (linux/prctl.h)
_PR_SET_DUMPABLE = 4
#: True once this process (or the one it was forked from) went through keep_private
_private = False


def keep_private() -> None:
    """Make this process non-dumpable, unless ACCEL_ALLOW_PTRACE=1 (once per program):
    what the process shares with the device is then out of reach of its user's other
    processes (the module docstring says why, and at what cost)."""
    global _private
    if _private:
        return
    if os.environ.get(ALLOW_PTRACE_ENV) != "1":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_DUMPABLE, 0): {os.strerror(err)}")
    _private = True


def sealed_memfd(name: str, size: int, data: bytes | None = None) -> int:
    """A memfd of ``size`` bytes sealed with ``ACCEL_SEALS_PINNED``, or with ``data``
    written into it and sealed with ``ACCEL_SEALS_IMMUTABLE``; the caller owns it."""
    fd = os.memfd_create(f"accel-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if data is None:
            fcntl.fcntl(fd, uapi.F_ADD_SEALS, uapi.ACCEL_SEALS_PINNED)
        else:
            os.pwrite(fd, data, 0)
            seal_against_writing(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: How long :func:`seal_against_writing` retries a seal the kernel refused as busy
SEAL_BUSY_RETRY_S = 2.0


def seal_against_writing(fd: int) -> None:
    """Add ``ACCEL_SEALS_IMMUTABLE`` to ``fd``, retrying while the kernel answers EBUSY.

    F_SEAL_WRITE is the one seal that waits for the file's pages to lose their transient
    references (mm/memfd.c ``memfd_wait_for_pins``): it gives up with EBUSY after about
    150 ms if some page is still held. No one of ours holds them (the file was never
    mapped); the kernel can, for a moment: memory reclaim and DAMON's ``pageout`` scheme
    isolate pages to inspect them, and under load that moment can outlast the kernel's wait
    (one fresh-clone test run saw EBUSY loading a 1 MiB module image, just after a test
    had filled the device with 63 MiB of modules; the driver has no EBUSY on the path of
    MODULE_LOAD and MODULE_UNLOAD, the seal does). The busy answer is therefore
    transient by construction, and is retried for ``SEAL_BUSY_RETRY_S`` before it is raised."""
    deadline = time.monotonic() + SEAL_BUSY_RETRY_S
    pause = 0.005
    while True:
        try:
            fcntl.fcntl(fd, uapi.F_ADD_SEALS, uapi.ACCEL_SEALS_IMMUTABLE)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def map_memfd(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of a memfd shared (a zero-size mapping is not possible: one byte
    then stands in, as the driver rounds sizes to pages anyway)."""
    return mmap.mmap(fd, max(size, 1))
