"""A raw client of the device node for tests that must send exactly the bytes they mean.

It brings what a context needs as the runtime does (``runtime._shm``): the doorbell and
event pipes and a sealed doorbell page, a sealed ring per queue, sealed memfds for host
memory and module images. ``RawDev`` talks to a mounted device node; ``OfflineDev`` is the
same client with its transactions run by the driver in this process (no mount).

Every test directory imports it by its bare name (tests/conftest.py puts tests/ on
``sys.path``); a snippet run in a fresh process puts tests/ on its own path first.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import select
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from abi import uapi, userq
from runtime._shm import sealed_memfd

if TYPE_CHECKING:  # not imported: rawdev also runs in plain client processes
    from kmod_emul.offline import OfflineDriver

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


def assert_unharmed(dev: RawDev, bystander: tuple[RawDev, int]) -> None:
    """After a refusal: the same open file still answers, the device is operational, and a
    bystander context on it (another open file) keeps completing work."""
    assert dev.query().state == uapi.DeviceState.OPERATIONAL
    other, ctx = bystander
    seqno = other.noop(ctx)
    assert other.wait_done(ctx, seqno).completed >= seqno


class RawDev:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self._client_state()

    def _client_state(self) -> None:
        self.bell_w = self.event_r = -1
        self.db: userq.SharedWords | None = None
        #: the pipe ends and pages of earlier ctx_args calls, kept open until close()
        self._retired: list[int | userq.SharedWords] = []
        self.rings: dict[int, tuple[int, userq.RingView]] = {}  # queue id -> (slot, ring)

    def write(self, raw: bytes) -> int:
        return os.pwrite(self.fd, raw, 0)

    def read(self, size: int, tag: int) -> bytes:
        return os.pread(self.fd, size, tag)

    def last_error(self) -> str:
        """Why this file's last refused command was refused (``ACCEL_LAST_ERROR_OFFSET``)."""
        return self.read(uapi.ACCEL_LAST_ERROR_MAX, uapi.ACCEL_LAST_ERROR_OFFSET).decode()

    def call(self, cmd: uapi.Command, arg: Any, tag: int | None = None) -> Any:
        tag = next(_tags) if tag is None else tag
        self.write(header(cmd.code, tag) + bytes(arg))
        if not cmd.has_reply:
            return None
        return cmd.struct.from_buffer_copy(self.read(ctypes.sizeof(cmd.struct), tag))

    def query(self) -> uapi.accel_device_info:
        return self.call(uapi.ACCEL_CMD_DEVICE_QUERY, uapi.accel_device_info())

    def ctx_args(self, flags: int = 0, major: int = uapi.ACCEL_ABI_MAJOR,
                 minor: int = uapi.ACCEL_ABI_MINOR) -> uapi.accel_ctx_create:
        """A CTX_CREATE struct naming fresh pipes and a doorbell page of this process
        (kept here: the test may wait on the event pipe)."""
        if self.db is not None:  # an earlier context's (live, or refused): closed at close()
            self._retired += [self.bell_w, self.event_r, self.db]
        db_fd = sealed_memfd("doorbell-page", userq.ACCEL_DB_PAGE_SIZE)
        bell_r, self.bell_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.event_r, event_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.db = userq.SharedWords(db_fd, userq.ACCEL_DB_PAGE_SIZE)
        self._lend = [db_fd, bell_r, event_w]
        return uapi.accel_ctx_create(abi_major=major, abi_minor=minor, flags=flags,
                                     doorbell_fd=bell_r, event_fd=event_w, db_page_fd=db_fd)

    def ctx_create(self, flags: int = 0, major: int = uapi.ACCEL_ABI_MAJOR,
                   minor: int = uapi.ACCEL_ABI_MINOR, **fields: int) -> int:
        """CTX_CREATE; ``fields``: more of ``accel_ctx_create``'s (a schedule's)."""
        arg = self.ctx_args(flags, major, minor)
        for name, value in fields.items():
            setattr(arg, name, value)
        try:
            return self.call(uapi.ACCEL_CMD_CTX_CREATE, arg).ctx_id
        finally:
            for fd in self._lend:
                os.close(fd)

    def noop(self, ctx_id: int) -> int:
        return self.call(uapi.ACCEL_CMD_SUBMIT_NOOP, uapi.accel_submit_noop(ctx_id=ctx_id)).seqno

    def wait(self, ctx_id: int, seqno: int) -> Any:
        """One WAIT: the reply once ``seqno`` completed, else OSError ETIME."""
        return self.call(uapi.ACCEL_CMD_WAIT, uapi.accel_wait(ctx_id=ctx_id, seqno=seqno))

    def wait_done(self, ctx_id: int, seqno: int, timeout: float = 10.0) -> Any:
        """WAIT until complete, sleeping on the event pipe in between."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.wait(ctx_id, seqno)
            except OSError as exc:
                if exc.errno != errno.ETIME or time.monotonic() > deadline:
                    raise
            self.sleep_event(0.1)

    def sleep_event(self, timeout: float) -> None:
        ready, _, _ = select.select([self.event_r], [], [], timeout)
        if ready:
            try:
                os.read(self.event_r, 4096)
            except BlockingIOError:
                pass

    def queue_create(self, ctx_id: int, priority: int = 0) -> int:
        fd = sealed_memfd("ring", userq.RING_FILE_SIZE)
        try:
            reply = self.call(uapi.ACCEL_CMD_QUEUE_CREATE, uapi.accel_queue_create(
                ctx_id=ctx_id, priority=priority, ring_fd=fd))
            self.rings[reply.queue_id] = (reply.doorbell, userq.RingView(fd))
        finally:
            os.close(fd)
        return reply.queue_id

    def submit(self, queue_id: int, packets: list[bytes]) -> int:
        """Write packets into a queue's ring and ring its doorbell; the last seqno."""
        slot, ring = self.rings[queue_id]
        wptr = ring.wptr
        for pkt in packets:
            ring.write_packet(wptr, pkt)
            wptr += 1
        self.publish(queue_id, wptr)
        return wptr

    def publish(self, queue_id: int, wptr: int) -> None:
        """Set a ring's write pointer (any value: tests lie with it) and knock."""
        slot, ring = self.rings[queue_id]
        ring.set(userq.RING_WPTR, wptr)
        assert self.db is not None
        self.db.set(userq.DB_SLOTS + 8 * slot, wptr)
        self.db.set(userq.DB_SEQ, self.db.get(userq.DB_SEQ) + 1)
        userq.full_barrier()
        if self.db.get(userq.DB_FW_SLEEPING):
            try:
                os.write(self.bell_w, b"\1")
            except BlockingIOError:
                pass

    def mem_alloc(self, ctx_id: int, size: int, kind: uapi.MemKind = uapi.MemKind.DEVICE
                  ) -> Any:
        fd = -1 if kind == uapi.MemKind.DEVICE else sealed_memfd("host", size)
        try:
            return self.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
                ctx_id=ctx_id, size=size, kind=kind, fd=fd))
        finally:
            if fd >= 0:
                os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for fd in (self.bell_w, self.event_r):
            if fd >= 0:
                os.close(fd)
        self.bell_w = self.event_r = -1
        for _slot, ring in self.rings.values():
            ring.close()
        self.rings.clear()
        if self.db is not None:
            self.db.close()
            self.db = None
        for obj in self._retired:
            if isinstance(obj, int):
                os.close(obj)
            else:
                obj.close()
        self._retired.clear()

    def __enter__(self) -> RawDev:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OfflineDev(RawDev):
    """The same raw client, its transactions run by the driver in this process
    (``kmod_emul.offline.OfflineDriver``: no daemon, no firmware, no mount), for the
    driver's unit tests. ``fd`` stays -1: nothing is opened."""

    def __init__(self, driver: OfflineDriver, index: int = 0) -> None:
        self.fd = -1
        self._client_state()
        self.driver = driver
        self.file = driver.open(index)

    def write(self, raw: bytes) -> int:
        return self.driver.write(self.file, raw)

    def read(self, size: int, tag: int) -> bytes:
        return self.driver.read(self.file, size, tag)

    def close(self) -> None:
        self.driver.release(self.file)
        super().close()
