"""Importing a client's file descriptors: the memory and pipes a process brings.

The driver never creates a file a client can write (docs/containment.md, "Client
memory"). A process brings its shared objects itself, as KFD's user queues and
``cudaHostRegister`` do: rings, pinned and managed memory and its doorbell page are memfds
it created and *sealed* against shrinking and growing (so no one can truncate them under
the device: a device access past the end of a file is a SIGBUS, the firmware's death and
every tenant's loss); module images are sealed against writing too (what the driver
checked is what the firmware runs); the doorbell and event channels are pipe ends.

A command names such a descriptor by its number in the calling process. The driver opens
it through ``/proc/PID/fd/N`` (the daemon runs as root, or as the client's user), first
with ``O_PATH``, which never reaches a filesystem's ``open`` (no FUSE request to this or
anyone's daemon), then checks what it is from its own descriptor -- ``readlink`` names a
memfd ``/memfd:...`` and a pipe ``pipe:[...]``; anything else is refused before it is
opened for real -- and only then reopens it, so the process cannot swap the descriptor
between the check and the open. The reopened memfd must be on tmpfs (not hugetlbfs, whose
pages can run out at fault time), a regular file of the right size, with the required
seals and none that would stop the device writing.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat

from abi import uapi
from kmod_emul.errors import DriverError

_TMPFS_MAGIC = 0x01021994
_libc = ctypes.CDLL(None, use_errno=True)


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_long * 15)]


def _fs_type(fd: int) -> int:
    buf = _Statfs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        return -1
    return buf.f_type


def _open_path(pid: int, fd: int, what: str) -> tuple[int, str]:
    """An O_PATH descriptor of the client's ``fd`` and what it links to."""
    if not 0 <= fd < 1 << 30:
        raise DriverError(errno.EBADF, f"{what}: {fd} is not a file descriptor")
    try:
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DriverError(errno.EBADF, f"{what}: process {pid} has no descriptor {fd}") from None
    except PermissionError:
        raise DriverError(errno.EPERM, f"{what}: the driver may not reach process {pid}'s "
                                       "descriptors (run accel-emud as root)") from None
    except OSError as exc:
        raise DriverError(errno.EBADF, f"{what}: descriptor {fd} of {pid}: {exc.strerror}") from None
    try:
        return handle, os.readlink(f"/proc/self/fd/{handle}")
    except OSError:
        os.close(handle)
        raise DriverError(errno.EBADF, f"{what}: descriptor {fd} of {pid} vanished") from None


def _reopen(handle: int, flags: int) -> int:
    try:
        return os.open(f"/proc/self/fd/{handle}", flags | os.O_CLOEXEC)
    except OSError as exc:
        raise DriverError(errno.EMEDIUMTYPE, f"cannot reopen it: {exc.strerror}") from None
    finally:
        os.close(handle)


def import_memfd(pid: int, fd: int, size: int, seals: int, what: str) -> int:
    """A descriptor of our own for the client's sealed memfd ``fd`` of at least ``size``
    bytes carrying ``seals`` (``uapi.ACCEL_SEALS_*``); the caller owns it. Raises
    DriverError: EBADF (no such descriptor), EMEDIUMTYPE (not a memfd sealed as it needs:
    the wrong kind of object), EINVAL (the right kind, too small: a value, as a size field
    too large is)."""
    handle, link = _open_path(pid, fd, what)
    if not link.startswith("/memfd:"):
        os.close(handle)
        raise DriverError(errno.EMEDIUMTYPE, f"{what}: descriptor {fd} is {link!r}, not a memfd")
    writable = not seals & uapi.F_SEAL_WRITE
    mine = _reopen(handle, os.O_RDWR if writable else os.O_RDONLY)
    try:
        st = os.fstat(mine)
        if not stat.S_ISREG(st.st_mode) or _fs_type(mine) != _TMPFS_MAGIC:
            raise DriverError(errno.EMEDIUMTYPE, f"{what}: not a tmpfs memfd")
        have = fcntl.fcntl(mine, uapi.F_GET_SEALS)
        if have & seals != seals:
            raise DriverError(errno.EMEDIUMTYPE, f"{what}: seals {have:#x} lack {seals & ~have:#x} "
                                                 f"(it needs {seals:#x})")
        if writable and have & (uapi.F_SEAL_WRITE | uapi.F_SEAL_FUTURE_WRITE):
            raise DriverError(errno.EMEDIUMTYPE, f"{what}: sealed against writing; the device "
                                                 "writes it")
        if st.st_size < size:
            raise DriverError(errno.EINVAL, f"{what}: {st.st_size} bytes, {size} needed")
    except BaseException:
        os.close(mine)
        raise
    return mine


def _access_mode(pid: int, fd: int) -> int | None:
    """``O_RDONLY``, ``O_WRONLY`` or ``O_RDWR``: how the client opened its ``fd`` (the
    ``flags`` of its /proc fdinfo); None if that cannot be read."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"flags:"):
                    return int(line.split()[1], 8) & os.O_ACCMODE
    except (OSError, ValueError, IndexError):
        pass
    return None


def import_pipe(pid: int, fd: int, write_end: bool, what: str) -> int:
    """A non-blocking descriptor of our own for the client's pipe end ``fd`` (the read
    end, or with ``write_end`` the write end); the caller owns it. Raises DriverError:
    EBADF, EMEDIUMTYPE (not a pipe), EINVAL (the pipe's other end).

    Reopening a pipe through /proc gives whichever end the driver asks for, so a client
    that named the wrong end would work by accident (writing its doorbell byte into the
    end it kept, say) until a client of another driver did not: the end is checked against
    how the client opened its descriptor, to tell it at once. The driver's own end is
    always the one it opens, whatever the client swaps in meanwhile."""
    handle, link = _open_path(pid, fd, what)
    if not link.startswith("pipe:["):
        os.close(handle)
        raise DriverError(errno.EMEDIUMTYPE, f"{what}: descriptor {fd} is {link!r}, not a pipe")
    want = os.O_WRONLY if write_end else os.O_RDONLY
    mode = _access_mode(pid, fd)
    if mode is not None and mode not in (want, os.O_RDWR):  # a FIFO opened O_RDWR is both
        os.close(handle)
        ends = {os.O_RDONLY: "read", os.O_WRONLY: "write"}
        raise DriverError(errno.EINVAL, f"{what}: descriptor {fd} is the {ends[mode]} end of its "
                                        f"pipe; the {ends[want]} end is needed")
    return _reopen(handle, want | os.O_NONBLOCK)
