"""A raw client of the device node for tests that must send exactly the bytes they mean."""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kmod_emul import uapi

_tags = itertools.count(1000)


def errname(fn: Callable[[], Any]) -> str:
    """Run ``fn``; return the errno name it failed with, or '' if it succeeded."""
    try:
        fn()
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return ""


def header(cmd: int, tag: int, flags: int = 0) -> bytes:
    return bytes(uapi.accel_cmd_hdr(cmd=cmd, flags=flags, tag=tag))


class RawDev:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR)

    def write(self, raw: bytes) -> int:
        return os.pwrite(self.fd, raw, 0)

    def read(self, size: int, tag: int) -> bytes:
        return os.pread(self.fd, size, tag)

    def call(self, cmd: uapi.Command, arg: Any, tag: int | None = None) -> Any:
        tag = next(_tags) if tag is None else tag
        self.write(header(cmd.code, tag) + bytes(arg))
        if not cmd.has_reply:
            return None
        return cmd.struct.from_buffer_copy(self.read(ctypes.sizeof(cmd.struct), tag))

    def query(self) -> uapi.accel_device_info:
        return self.call(uapi.ACCEL_CMD_DEVICE_QUERY, uapi.accel_device_info())

    def ctx_create(self, flags: int = 0, major: int = uapi.ACCEL_ABI_MAJOR,
                   minor: int = uapi.ACCEL_ABI_MINOR) -> int:
        arg = uapi.accel_ctx_create(abi_major=major, abi_minor=minor, flags=flags)
        return self.call(uapi.ACCEL_CMD_CTX_CREATE, arg).ctx_id

    def noop(self, ctx_id: int) -> int:
        return self.call(uapi.ACCEL_CMD_SUBMIT_NOOP, uapi.accel_submit_noop(ctx_id=ctx_id)).seqno

    def wait(self, ctx_id: int, seqno: int, timeout_ns: int = uapi.ACCEL_WAIT_SLICE_NS,
             queue_id: int = 0) -> Any:
        return self.call(uapi.ACCEL_CMD_WAIT,
                         uapi.accel_wait(ctx_id=ctx_id, queue_id=queue_id, seqno=seqno,
                                         timeout_ns=timeout_ns))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RawDev:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
