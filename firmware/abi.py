"""The host-firmware ABI: mailbox layout, messages and the rings that carry them.

This is the emulator's ``vpu_boot_api.h`` + ``vpu_jsm_api.h``: the driver and the firmware
both import it; user space never sees it. The mailbox is one shared-memory region (a memfd
the driver creates and hands to the firmware process) holding:

* the boot block: magic, ABI, firmware state, boot error, boot flags, heartbeat;
* a host-to-firmware command ring and a firmware-to-host completion ring, each a
  single-producer single-consumer ring of fixed 32-byte messages;
* the boot image region, into which the driver copies the verified image.

Doorbells (host to firmware) and interrupts (firmware to host) are one byte on a pipe:
the ring carries the data, the byte only wakes the sleeper. The firmware reads EOF on its
doorbell when the driver is gone and halts, so a killed daemon leaves no firmware behind.

File descriptors (a context's pipes and doorbell page, rings, pinned memory, module
images: all the client's own, imported by the driver) travel beside the mailbox on a
socket pair, as SCM_RIGHTS (:class:`FdChannel`); the message that needs them names them
by a cookie.
"""

from __future__ import annotations

import enum
import os
import socket
import struct
from typing import Final

MAILBOX_MAGIC: Final = 0xACCE1E40
#: The mailbox ABI this file describes. Images list the range they speak.
MAILBOX_ABI: Final = 2

MAILBOX_SIZE: Final = 1 << 20
_BOOT_OFF: Final = 0
STATS_OFF: Final = 0x800
CMD_RING_OFF: Final = 0x1000
RING_SLOTS: Final = 1024
MSG_SIZE: Final = 128
CPL_RING_OFF: Final = 0x22000
IMAGE_OFF: Final = 0x50000
IMAGE_MAX: Final = MAILBOX_SIZE - IMAGE_OFF

# Boot block: magic, abi, fw_state, boot_error, boot_flags, image_len, heartbeat, hb_ns,
# fw_version[16], isa_version[16], boot_message[128]
_BOOT = struct.Struct("<IIIIIIQQ16s16s128s")
_OFF_FW_STATE: Final = 8
_OFF_HEARTBEAT: Final = 24
_OFF_VERSIONS: Final = 40
_OFF_MESSAGE: Final = 72
assert _BOOT.size == _OFF_MESSAGE + 128


class FwState(enum.IntEnum):
    RESET = 0
    BOOTING = 1
    READY = 2
    HALTED = 3
    BOOT_FAILED = 4


class BootFlag(enum.IntFlag):
    """Set by the driver before boot; debugfs fault injection uses them."""

    FAIL_BOOT = 1 << 0


class Op(enum.IntEnum):
    """Messages on the command ring (host to firmware) and the completion ring.

    Argument words ``a0..a5`` per op (host to firmware); "fds" travel on the
    :class:`FdChannel` under the cookie the message names:
      CTX_CREATE: a0 cookie; fds: doorbell pipe read end, event pipe write end, doorbell
        page memfd.
      CTX_DESTROY: -; the firmware answers CTX_DESTROY once the context's queues have
        stopped and its mappings are gone.
      MAP: a0 va, a1 size, a2 MemKind, a3 owning device index, a4 VRAM offset (device
        memory), a5 cookie (host kinds; fds: the memfd).
      UNMAP: a0 va. Answered once every packet queued before it has completed, so the
        driver reuses the memory only after the device is done with it.
      QUEUE_CREATE: a0 queue id, a1 priority, a2 doorbell slot, a3 cookie (fds: the ring).
      QUEUE_IMPORT: a0 local queue id, a1 peer device, a2 peer queue id, a3 cookie (fds:
        that queue's ring).
      QUEUE_DESTROY: a0 queue id: drained first, then forgotten.
      MODULE_LOAD: a0 module id, a1 size, a2 cookie (fds: the sealed image).
    Completions: UNMAP: a0 va. CTX_DESTROY: -. MAP / QUEUE_CREATE / QUEUE_IMPORT with a
    nonzero status (an errno): the firmware could not map it (a0 va / queue id); a queue
    it could not map is faulted by the driver, which maps the ring too.
    """

    CTX_CREATE = 2
    CTX_DESTROY = 3
    #: Fault injection: stop heart-beating and stop answering (a hung microcontroller).
    HANG = 4
    MAP = 5
    UNMAP = 6
    QUEUE_CREATE = 7
    QUEUE_DESTROY = 8
    #: a0 = bytes of this device's memory held by device-local allocations; managed pages
    #: may be resident only in what remains.
    SET_BUDGET = 10
    QUEUE_IMPORT = 11
    #: debugfs sched_hold: a0 = 1 stops the scheduler taking packets, 0 resumes it
    HOLD = 13
    #: a0 module id, a1 size, a2 cookie; the firmware validates the module itself
    MODULE_LOAD = 14
    #: a0 module id
    MODULE_UNLOAD = 15


class FdChannel:
    """Descriptors from the driver to the firmware: ``(cookie, fds)`` datagrams on a
    SOCK_SEQPACKET socket pair. The driver sends a message's descriptors just before the
    message enters the command ring, so the firmware, handling messages in order, finds
    them at the head of the socket. Cookies grow: a datagram with a smaller cookie than
    the one asked for belongs to a message the firmware dropped, and its fds are closed.
    Either side owns the descriptors it received or was handed: ``send`` closes them."""

    MAX_FDS: Final = 4
    _COOKIE = struct.Struct("<Q")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    def pair(cls) -> tuple[FdChannel, socket.socket]:
        """The driver's end, and the firmware's socket (to pass to its process)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        return cls(ours), theirs

    def send(self, cookie: int, fds: list[int]) -> bool:
        """Send and close ``fds``; False (nothing sent or closed) if the socket is full."""
        try:
            socket.send_fds(self.sock, [self._COOKIE.pack(cookie)], fds)
        except BlockingIOError:
            return False
        except OSError:  # the firmware is gone; its watchers report that
            pass
        for fd in fds:
            os.close(fd)
        return True

    def take(self, cookie: int) -> list[int]:
        """Firmware side: the descriptors sent under ``cookie`` (caller owns them).
        Raises LookupError if they are not there (a driver bug)."""
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 8, self.MAX_FDS)
            except BlockingIOError:
                raise LookupError(f"no descriptors for cookie {cookie}") from None
            got = self._COOKIE.unpack(data)[0] if len(data) == 8 else -1
            if got == cookie:
                return list(fds)
            for fd in fds:
                os.close(fd)
            if got > cookie:
                raise LookupError(f"descriptors for cookie {cookie} were skipped")

    def close(self) -> None:
        self.sock.close()


# Message: op u32, status u32, ctx u64, a0..a5 u64 (64 bytes), then a 64-byte payload.
MSG = struct.Struct("<IIQ6Q")
PAYLOAD_SIZE: Final = MSG_SIZE - MSG.size
assert PAYLOAD_SIZE == 64

# Stats block, written by the firmware, read by the driver (sysfs, MEM_INFO):
STAT_NAMES: Final = (
    "managed_resident", "managed_faults", "managed_bytes_to_device", "managed_bytes_to_host",
    "managed_evictions", "copies", "copy_bytes", "packets", "faults",
    "copy_engines_busy_peak", "preemptions", "launches", "jit_compiles", "jit_hits",
    "jit_ready",
)
_STATS = struct.Struct(f"<{len(STAT_NAMES)}Q")


class Ring:
    """Single-producer single-consumer ring of fixed-size messages in shared memory.

    Layout at ``off``: ``head`` u64 (consumer index), ``tail`` u64 (producer index), pad
    to 64 bytes, then ``slots`` messages. Indices grow forever; slot = index % slots.
    On x86-64 (TSO) writing the message before publishing the tail is enough ordering;
    each index has one writer only.
    """

    def __init__(self, buf: memoryview, off: int, slots: int = RING_SLOTS) -> None:
        self._idx = buf[off : off + 16].cast("Q")
        self._data = buf[off + 64 : off + 64 + slots * MSG_SIZE]
        self._slots = slots

    @staticmethod
    def size(slots: int = RING_SLOTS) -> int:
        return 64 + slots * MSG_SIZE

    def push(self, op: int, ctx_id: int, args: tuple[int, ...] = (), status: int = 0,
             payload: bytes = b"") -> bool:
        tail = self._idx[1]
        if tail - self._idx[0] >= self._slots:
            return False
        off = (tail % self._slots) * MSG_SIZE
        MSG.pack_into(self._data, off, op, status, ctx_id, *args, *(0,) * (6 - len(args)))
        if payload:
            self._data[off + MSG.size : off + MSG.size + len(payload)] = payload
        self._idx[1] = tail + 1
        return True

    def pop(self) -> tuple[tuple[int, ...], bytes] | None:
        """Next message as ((op, status, ctx_id, a0..a5), payload), or None when empty."""
        head = self._idx[0]
        if head == self._idx[1]:
            return None
        off = (head % self._slots) * MSG_SIZE
        msg = MSG.unpack_from(self._data, off)
        payload = bytes(self._data[off + MSG.size : off + MSG_SIZE])
        self._idx[0] = head + 1
        return msg, payload

    def pending(self) -> int:
        return self._idx[1] - self._idx[0]


assert STATS_OFF + _STATS.size <= CMD_RING_OFF
assert CMD_RING_OFF + Ring.size() <= CPL_RING_OFF
assert CPL_RING_OFF + Ring.size() <= IMAGE_OFF


class Mailbox:
    """Typed access to the shared mailbox, used the same way on both sides."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.cmd = Ring(buf, CMD_RING_OFF)
        self.cpl = Ring(buf, CPL_RING_OFF)
        # whole-word views: a reader never sees a half-written counter
        self._stats = buf[STATS_OFF : STATS_OFF + _STATS.size].cast("Q")
        self._heartbeat = buf[_OFF_HEARTBEAT : _OFF_HEARTBEAT + 16].cast("Q")

    # boot block ---------------------------------------------------------------
    def host_init(self, image: bytes, boot_flags: int) -> None:
        """Driver side, before starting the firmware: zero, stamp, load the image."""
        if len(image) > IMAGE_MAX:
            raise ValueError(f"firmware image of {len(image)} bytes exceeds {IMAGE_MAX}")
        self.buf[:IMAGE_OFF] = bytes(IMAGE_OFF)
        _BOOT.pack_into(
            self.buf, _BOOT_OFF, MAILBOX_MAGIC, MAILBOX_ABI, FwState.RESET, 0, boot_flags,
            len(image), 0, 0, b"", b"", b"",
        )
        self.buf[IMAGE_OFF : IMAGE_OFF + len(image)] = image

    def stats(self) -> dict[str, int]:
        return dict(zip(STAT_NAMES, self._stats.tolist()))

    def set_stats(self, values: dict[str, int]) -> None:
        """Word by word (``struct.pack_into`` would zero the block first, and the driver
        could read the zeros)."""
        for i, name in enumerate(STAT_NAMES):
            self._stats[i] = values[name] & 0xFFFFFFFFFFFFFFFF

    def boot_block(self) -> tuple:
        return _BOOT.unpack_from(self.buf, _BOOT_OFF)

    @property
    def boot_flags(self) -> int:
        return self.boot_block()[4]

    def image(self) -> bytes:
        return bytes(self.buf[IMAGE_OFF : IMAGE_OFF + self.boot_block()[5]])

    @property
    def fw_state(self) -> FwState:
        return FwState(struct.unpack_from("<I", self.buf, _OFF_FW_STATE)[0])

    def set_fw_state(self, state: FwState, error: int = 0, message: str = "") -> None:
        struct.pack_into("<II", self.buf, _OFF_FW_STATE, state, error)
        struct.pack_into("128s", self.buf, _OFF_MESSAGE, message.encode()[:127])

    def set_versions(self, fw_version: str, isa_version: str) -> None:
        struct.pack_into("16s16s", self.buf, _OFF_VERSIONS, fw_version.encode(),
                         isa_version.encode())

    @property
    def boot_message(self) -> str:
        raw = struct.unpack_from("128s", self.buf, _OFF_MESSAGE)[0]
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    @property
    def heartbeat(self) -> tuple[int, int]:
        """(beat count, firmware monotonic ns at that beat)."""
        return self._heartbeat[0], self._heartbeat[1]

    def beat(self, now_ns: int) -> None:
        self._heartbeat[1] = now_ns
        self._heartbeat[0] += 1
