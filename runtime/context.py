"""Contexts and fences.

A ``Context`` is one open of a device node turned into a driver context. Each process gets
a primary context per device on first use (as CUDA's primary context); more can be made
with ``Context(device)``. Contexts of one process share the device's memory capacity,
engines and firmware; handles, fences and (later) allocations and queues belong to one
context and mean nothing in another.

A ``Fence`` is a point on a context's timeline. Waiting on it is a loop of bounded driver
waits, so Ctrl-C interrupts a waiting program and a timeout is honoured to the slice.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from typing import Any

from kmod_emul import uapi
from runtime import discovery, errors
from runtime._channel import Channel


class Context:
    """A driver context on one physical device (``accelN``)."""

    def __init__(self, physical: str, *, exclusive: bool = False) -> None:
        self.physical = physical
        self.channel = Channel(physical)
        try:
            reply = self.channel.call(
                uapi.ACCEL_CMD_CTX_CREATE,
                uapi.accel_ctx_create(
                    abi_major=uapi.ACCEL_ABI_MAJOR, abi_minor=uapi.ACCEL_ABI_MINOR,
                    flags=uapi.ACCEL_CTX_EXCLUSIVE if exclusive else 0,
                ),
            )
        except errors.DriverVersionMismatchError as exc:
            self.channel.close()
            raise errors.DriverVersionMismatchError(_abi_message(physical), exc.errno) from None
        except BaseException:
            self.channel.close()
            raise
        self.id: int = reply.ctx_id
        self.exclusive = exclusive
        self._doorbell_path = uapi.cstr(reply.doorbell_path)
        self._doorbell = -1
        self._imports: dict[tuple[str, int], int] = {}

    def __repr__(self) -> str:
        return f"<Context {self.id} on {self.physical}>"

    def query_device(self) -> uapi.accel_device_info:
        return self.channel.call(uapi.ACCEL_CMD_DEVICE_QUERY, uapi.accel_device_info())

    def submit_noop(self) -> Fence:
        """Queue a no-op on the device; the fence completes when the firmware ran it."""
        reply = self.channel.call(uapi.ACCEL_CMD_SUBMIT_NOOP,
                                  uapi.accel_submit_noop(ctx_id=self.id))
        return Fence(self, reply.seqno)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait for everything this context submitted so far."""
        self.submit_noop().wait(timeout)

    def wait_slice(self, queue_id: int, seqno: int, timeout_ns: int) -> uapi.accel_wait | None:
        """One bounded driver wait on a queue of this context (0: the default queue);
        None when the slice ended first."""
        try:
            return self.channel.call(uapi.ACCEL_CMD_WAIT, uapi.accel_wait(
                ctx_id=self.id, queue_id=queue_id, seqno=seqno, timeout_ns=timeout_ns))
        except errors.AccelTimeoutError as exc:
            if exc.errno == errno.ETIME:
                return None
            raise

    def wait_queue(self, queue_id: int, seqno: int, timeout: float | None,
                   what: str) -> uapi.accel_wait:
        """Sleep in the driver until ``seqno`` completes: a loop of bounded waits, so Ctrl-C
        lands within a slice and ``timeout`` is honoured to within one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slice_ns = uapi.ACCEL_WAIT_SLICE_NS
            if deadline is not None:
                slice_ns = max(0, min(slice_ns, int((deadline - time.monotonic()) * 1e9)))
            reply = self.wait_slice(queue_id, seqno, slice_ns)
            if reply is not None:
                return reply
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.AccelTimeoutError(f"{what}: seqno {seqno} not complete after "
                                               f"{timeout} s", errno.ETIME)

    def ring_doorbell(self) -> None:
        """Wake the firmware (it marked a ring of this context "sleeping")."""
        if self._doorbell < 0:
            self._doorbell = os.open(self._doorbell_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.write(self._doorbell, b"\1")
        except BlockingIOError:
            pass  # the FIFO is full of unread rings: the firmware is being woken already

    def import_queue(self, stream: Any) -> int:
        """The local name of another device's stream, for device-side waits (cached)."""
        key = (stream.ctx.physical, stream.queue_id)
        qid = self._imports.get(key)
        if qid is None:
            qid = self._imports[key] = self.channel.call(
                uapi.ACCEL_CMD_QUEUE_IMPORT, uapi.accel_queue_import(
                    ctx_id=self.id, peer_index=int(stream.ctx.physical[5:]),
                    peer_queue_id=stream.queue_id)).queue_id
        return qid

    def close(self) -> None:
        """Destroy the context (closing the fd does it too, even if the process dies)."""
        if self._doorbell >= 0 and os.getpid() == self.channel.pid:
            os.close(self._doorbell)
        self._doorbell = -1
        self.channel.close()

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _abi_message(physical: str) -> str:
    try:
        driver_abi = (discovery.root() / uapi.MODULE_DIR / "abi_version").read_text().strip()
    except OSError:
        driver_abi = "unknown"
    return (
        f"{physical}: the driver speaks uAPI {driver_abi} but this runtime speaks "
        f"{uapi.ACCEL_ABI_MAJOR}.{uapi.ACCEL_ABI_MINOR}; install a runtime built for the "
        "installed driver (or upgrade the driver to match this runtime)"
    )


@dataclass(frozen=True)
class Fence:
    context: Context
    seqno: int

    def query(self) -> bool:
        """True once the device has completed this fence (never blocks)."""
        return self.context.wait_slice(0, self.seqno, 0) is not None

    def wait(self, timeout: float | None = None) -> int:
        """Block until complete; return its device timestamp (ns). Raises on timeout."""
        return self.context.wait_queue(0, self.seqno, timeout,
                                       f"fence on {self.context.physical}").timestamp_ns
