"""One open device node and the command transactions over it.

A transaction is ``pwrite(header + struct)`` then, for commands with a reply,
``pread(size, tag)``. Tags are unique in the process, so threads sharing a channel need no
lock: the driver keys each reply by its tag. A channel remembers the pid that opened it;
used from any other process (a forked child) it raises UseAfterForkError instead of
submitting through a file the parent owns.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import itertools
import os
import time
from collections.abc import Callable
from typing import Any

from abi import faults as fault_abi
from abi import uapi
from runtime import discovery, errors, faults

_tags = itertools.count(1)


def fork_message(init_pid: int) -> str:
    return (
        f"the accel runtime was initialised in process {init_pid} before this process "
        f"({os.getpid()}) was forked from it; device state (contexts, queues, open device "
        "files) cannot be used in a forked child. Use the 'spawn' or 'forkserver' start "
        "method (multiprocessing.set_start_method('spawn')) and initialise the runtime in "
        "the child. Discovery (device_count, is_available) still works after fork."
    )


def open_error(physical: str, err: int) -> errors.AccelError:
    """Turn an open(2) failure into the exception that names its cause and fix."""
    if err == errno.ENOENT:
        return errors.NoDeviceError(
            f"{physical} does not exist under {discovery.root()} (is accel-emud serving it? "
            "see `accel-emud status`)", err)
    try:
        detail = discovery.read_attr(physical, "failure")
    except OSError:
        detail = ""
    if err == errno.EBUSY:
        try:
            owner = discovery.read_attr(physical, "exclusive_owner")
        except OSError:
            owner = "?"
        holder = f"process {owner}" if owner.isdigit() else f"a process of {owner}"
        detail = (f"{physical} is held exclusively by {holder} (another tenant); wait "
                  "for it to release the device or ask its owner")
    elif err == errno.EAGAIN:
        detail = (f"{physical} is in reset; retry when `accel-smi` shows it operational")
    elif not detail:
        detail = uapi.ERRNO_MEANING.get(err, os.strerror(err))
    return errors.from_errno(err, f"cannot open {physical}: {detail}")


class Channel:
    """A device node opened by this process; ``call`` runs one command."""

    def __init__(self, physical: str) -> None:
        self.physical = physical
        self.pid = os.getpid()
        #: the driver's id of the context made on this channel (0 before CTX_CREATE)
        self.ctx_id = 0
        #: the first DeviceLostError this channel's context met: lost is for good
        self.lost: errors.DeviceLostError | None = None
        #: called once, with that error (the runtime's Device closes what it built on it)
        self.on_lost: Callable[[errors.DeviceLostError], None] | None = None
        path = discovery.root() / uapi.DEV_DIR / physical
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise open_error(physical, exc.errno) from None

    def call(self, cmd: uapi.Command, arg: Any) -> Any:
        if os.getpid() != self.pid:
            raise errors.UseAfterForkError(fork_message(self.pid))
        if self.fd < 0:
            raise self.closed_error()
        tag = next(_tags)
        try:
            os.pwrite(self.fd, uapi.CMD_HDR.pack(cmd.code, 0, tag) + bytes(arg), 0)
            if not cmd.has_reply:
                return None
            return cmd.struct.from_buffer_copy(os.pread(self.fd, ctypes.sizeof(cmd.struct), tag))
        except OSError as exc:
            raise self.error(cmd, exc.errno) from None

    def closed_error(self) -> errors.AccelError:
        """What using this channel after its close raises: the loss that closed it, if one
        did (so that a handle kept from before names the fault), else a plain refusal."""
        if self.lost is not None:
            return copy.copy(self.lost).with_traceback(None)
        return errors.InvalidValueError(f"context on {self.physical} is closed")

    def error(self, cmd: uapi.Command, err: int, cause: str | None = None) -> errors.AccelError:
        """The exception for ``err`` answering ``cmd``; for ENODEV it names why the
        context was lost (``cause``, else the device's failure text)."""
        where = f"{cmd.name} on {self.physical}"
        record = None
        if err in (errno.ENOTCONN, errno.ECONNABORTED):  # the daemon died under the mount
            err, cause = errno.ENODEV, cause or "the driver is gone (the daemon died)"
            record = fault_abi.record(fault_abi.BY_NAME["DRIVER_GONE"], context=self.ctx_id,
                                      pid=self.pid, uid=os.getuid(), time=time.time())
        if err == errno.ENODEV:
            try:
                state = discovery.read_attr(self.physical, "state")
                failure = discovery.read_attr(self.physical, "failure")
                reason = discovery.read_attr(self.physical, "reset_reason")
            except FileNotFoundError:  # no such device any more
                state, failure, reason = "removed", "", ""
            except OSError:
                state, failure, reason = "unknown", "", ""
            record = record or faults.loss_record(self.physical, self.ctx_id)
            if record is not None and record["scope"] == "context":
                cause = cause or (f"a {record['name']} fault (code {record['code']}) lost "
                                  f"it alone: {record['message']}")
            elif state == "removed" or (record or {}).get("name") == "DEVICE_REMOVED":
                cause = cause or ("the device was removed (a partition a mode change took "
                                  "away)")
            elif state == "failed":
                cause = cause or failure or "it failed"
            else:  # reset since (by hand, or the driver's recovery from a failure)
                cause = cause or (f"it was reset ({reason})" if reason else "it was reset")
            exc = errors.from_errno(
                err, f"{where}: context lost because {cause} (device now {state}); "
                     "create a new context, or runtime.recover() for the primary one, once "
                     "the device is operational")
            assert isinstance(exc, errors.DeviceLostError)
            exc.record = faults.raised(record) if record is not None else {}
            if self.lost is None:
                self.lost = exc
                if self.on_lost is not None:
                    self.on_lost(exc)
            return exc
        if err == errno.EIO:  # at open it means a boot failure; on a command, a driver bug
            return errors.AccelError(f"{where}: the driver failed internally (see the daemon's "
                                     "log) [EIO]", err)
        return errors.from_errno(err, f"{where}: {uapi.ERRNO_MEANING.get(err, os.strerror(err))}")

    def close(self) -> None:
        if self.fd >= 0 and os.getpid() == self.pid:
            try:
                os.close(self.fd)
            except OSError:
                # ENOTCONN: the daemon died under the mount. Linux releases the descriptor
                # whatever close() returns, and the driver that would have answered is gone.
                pass
        self.fd = -1
