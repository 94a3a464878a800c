"""The host-firmware ABI: mailbox layout, messages and the rings that carry them.

This is the emulator's ``vpu_boot_api.h`` + ``vpu_jsm_api.h``: the driver and the firmware
both import it; user space never sees it. The mailbox is one shared-memory region (a memfd
the driver creates and hands to the firmware process) holding:

* the boot block: magic, ABI, firmware state, boot error, boot flags, heartbeat;
* a host-to-firmware command ring and a firmware-to-host completion ring, each a
  single-producer single-consumer ring of fixed 128-byte messages;
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

import ctypes
import enum
import os
import socket
import struct
from typing import Final

from abi._struct import Struct

MAILBOX_MAGIC: Final = 0xACCE1E40
#: The mailbox ABI this file describes. Images list the range they speak. 5: QUEUE_CREATE
#: carries the queue's depth. 6: engine busy time in the stats block, and the context
#: table (each context's engine time). 7: CTX_LOST (the firmware learns a context's loss
#: from the driver, never from the process's doorbell page). 8: the live table (CTX_CREATE
#: names the context's entry; the driver clears it when the context is lost).
MAILBOX_ABI: Final = 8

MAILBOX_SIZE: Final = 1 << 20
_BOOT_OFF: Final = 0
STATS_OFF: Final = 0x800
CMD_RING_OFF: Final = 0x1000
RING_SLOTS: Final = 1024
MSG_SIZE: Final = 128
CPL_RING_OFF: Final = 0x22000
CTX_STATS_OFF: Final = 0x48000
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

    Each message's payload is one struct (``COMMANDS`` and ``COMPLETIONS`` below say which);
    descriptors travel on the :class:`FdChannel` under the ``cookie`` the payload names.
    """

    CTX_CREATE = 2
    CTX_DESTROY = 3
    #: Fault injection: stop heart-beating and stop answering (a hung microcontroller).
    HANG = 4
    MAP = 5
    UNMAP = 6
    QUEUE_CREATE = 7
    QUEUE_DESTROY = 8
    SET_BUDGET = 10
    QUEUE_IMPORT = 11
    #: debugfs sched_hold
    HOLD = 13
    MODULE_LOAD = 14
    MODULE_UNLOAD = 15
    #: firmware to host only: a packet faulted (status: its errno)
    FAULT = 16
    #: a device became unreachable over the link, or reachable again (answered once
    #: applied: the driver drains on it)
    LINK = 17
    #: the driver lost the context (a reset or a failure): take nothing more from its rings
    CTX_LOST = 18
    #: firmware to host: a replayed schedule reached a FAULT entry (inject it); host to
    #: firmware: done (or refused), the context's packets may start again
    FAULT_REPLAY = 19


# --- message payloads: one struct per message ---------------------------------------------
# Host to firmware. A field ``cookie`` names the descriptors sent with the message (0: none).
class fw_ctx_create(Struct):
    """A context: fds doorbell pipe read end, event pipe write end, doorbell page memfd,
    and its schedule's decision table when ``schedule`` records or replays;
    ``live_slot``, its entry in the live table (``LIVE_OFF``); ``schedule`` and ``seed``
    as the process asked (abi/schedule.py; 0 and 0, the default schedule, is the message
    a firmware before schedules knew)."""

    _fields_ = [("cookie", ctypes.c_uint64), ("live_slot", ctypes.c_uint64),
                ("schedule", ctypes.c_uint64), ("seed", ctypes.c_uint64)]


class fw_ctx_destroy(Struct):
    """Stop the context's queues (nothing more starts from its rings once the firmware
    took this) and forget it; answered (CTX_DESTROY) once stopped and its mappings are
    gone."""

    _fields_ = [("reserved", ctypes.c_uint64 * 2)]


class fw_ctx_lost(Struct):
    """The context is lost (its device is being reset, or failed): start nothing more from
    its rings. Sent before the driver writes the doorbell page's "lost" word (for the
    process, which may write that word too: the firmware never reads it) and before the
    context's commands answer ENODEV. A context lost alone (a fault of context scope) is
    sent CTX_DESTROY instead, which stops it the same way. Not answered."""

    _fields_ = [("reserved", ctypes.c_uint64 * 2)]


class fw_fault_replayed(Struct):
    """The driver's answer to a context's FAULT_REPLAY: ``applied`` 1 if it injected the
    fault, 0 if it refused it (beyond what the context may cause itself). The firmware
    starts nothing of the context's between the two."""

    _fields_ = [("applied", ctypes.c_uint64), ("reserved", ctypes.c_uint64)]


class fw_hang(Struct):
    """Fault injection (debugfs): stop heart-beating and answering."""

    _fields_ = [("reserved", ctypes.c_uint64 * 2)]


class fw_map(Struct):
    """Map ``size`` bytes at ``va``: device memory at ``offset`` of device ``owner``'s
    VRAM, or (host kinds) the memfd sent under ``cookie``. Answered only on failure."""

    _fields_ = [
        ("va", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("kind", ctypes.c_uint32),  # uapi.MemKind
        ("owner", ctypes.c_uint32),  # the device whose memory it is
        ("offset", ctypes.c_uint64),  # device memory: the VRAM offset
        ("cookie", ctypes.c_uint64),  # host kinds: the memfd
        ("reserved", ctypes.c_uint64 * 2),
    ]


class fw_unmap(Struct):
    """Unmap ``va`` once every packet queued before this message has completed; answered
    then, so the driver reuses the memory only after the device is done with it."""

    _fields_ = [("va", ctypes.c_uint64), ("reserved", ctypes.c_uint64 * 2)]


class fw_queue_create(Struct):
    """A user-mode queue: the ring memfd sent under ``cookie``, its doorbell slot, and its
    depth: how many packets past what it has taken the firmware admits (the driver's
    ``max_queue_depth``, at most ``userq.RING_SLOTS``)."""

    _fields_ = [
        ("queue_id", ctypes.c_uint64),
        ("priority", ctypes.c_uint32),  # uapi.ACCEL_QUEUE_PRIORITY_*
        ("doorbell_slot", ctypes.c_uint32),
        ("cookie", ctypes.c_uint64),
        ("depth", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64),
    ]


class fw_queue_destroy(Struct):
    """Drain the queue, then forget it."""

    _fields_ = [("queue_id", ctypes.c_uint64), ("reserved", ctypes.c_uint64 * 2)]


class fw_set_budget(Struct):
    """Bytes of this device's memory held by device-local allocations; managed pages may
    be resident only in what remains."""

    _fields_ = [("device_bytes", ctypes.c_uint64), ("reserved", ctypes.c_uint64 * 2)]


class fw_queue_import(Struct):
    """Another device's queue, waitable here as ``queue_id``: its ring memfd under
    ``cookie`` (the firmware reads only its fence)."""

    _fields_ = [
        ("queue_id", ctypes.c_uint64),
        ("peer_index", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("peer_queue_id", ctypes.c_uint64),
        ("cookie", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 2),
    ]


class fw_hold(Struct):
    """debugfs sched_hold: ``hold`` 1 stops the scheduler taking packets, 0 resumes it."""

    _fields_ = [("hold", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("reserved", ctypes.c_uint64 * 2)]


class fw_module_load(Struct):
    """A module: the first ``size`` bytes of the sealed image sent under ``cookie``; the
    firmware validates it itself."""

    _fields_ = [
        ("module_id", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("cookie", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 2),
    ]


class fw_module_unload(Struct):
    _fields_ = [("module_id", ctypes.c_uint64), ("reserved", ctypes.c_uint64 * 2)]


# Firmware to host. The message's status is 0, or (MAP, QUEUE_*) the errno of a failure.
class fw_map_done(Struct):
    """MAP failed (status): packets touching ``va`` fault with EFAULT."""

    _fields_ = [("va", ctypes.c_uint64), ("reserved", ctypes.c_uint64 * 2)]


class fw_unmap_done(Struct):
    """The device is done with ``va``: the memory may be reused."""

    _fields_ = [("va", ctypes.c_uint64), ("reserved", ctypes.c_uint64 * 2)]


class fw_ctx_destroy_done(Struct):
    """The context stopped and holds nothing any more."""

    _fields_ = [("reserved", ctypes.c_uint64 * 2)]


class fw_queue_done(Struct):
    """QUEUE_CREATE / QUEUE_IMPORT failed (status): the firmware could not map the ring;
    the driver faults the queue."""

    _fields_ = [("queue_id", ctypes.c_uint64), ("reserved", ctypes.c_uint64 * 2)]


class fw_fault(Struct):
    """A packet of queue ``queue_id`` faulted with errno ``status`` (the driver records it;
    its process reads the same from its ring). Sent once per faulted ring, after the
    ring's fault record is written."""

    _fields_ = [
        ("queue_id", ctypes.c_uint64),
        ("seqno", ctypes.c_uint64),
        ("address", ctypes.c_uint64),
        ("opcode", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 2),
    ]


class fw_fault_replay(Struct):
    """A replayed schedule's FAULT entry was reached (abi/schedule.py): its ``value``
    (``fault_value``) and ``address``, the queue index and seqno it names. The driver
    injects it as ``ras_ctrl`` would, if the context may cause it, and answers
    (FAULT_REPLAY, ``fw_fault_replayed``)."""

    _fields_ = [
        ("queue", ctypes.c_uint64),
        ("seqno", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("address", ctypes.c_uint64),
    ]


class fw_link(Struct):
    """Device ``device`` is reachable over the link (``up`` 1) or not (0): copies that
    touch its memory fail with ENOLINK from now on. Answered (LINK) once applied, so the
    driver knows no new packet of this firmware reaches that device."""

    _fields_ = [
        ("device", ctypes.c_uint32),
        ("up", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 2),
    ]


#: Host to firmware: each op's payload struct. The firmware handles every op of this table
#: (a handler missing is a boot failure).
COMMANDS: Final[dict[Op, type[Struct]]] = {
    Op.CTX_CREATE: fw_ctx_create, Op.CTX_DESTROY: fw_ctx_destroy, Op.HANG: fw_hang,
    Op.MAP: fw_map, Op.UNMAP: fw_unmap, Op.QUEUE_CREATE: fw_queue_create,
    Op.QUEUE_DESTROY: fw_queue_destroy, Op.SET_BUDGET: fw_set_budget,
    Op.QUEUE_IMPORT: fw_queue_import, Op.HOLD: fw_hold, Op.MODULE_LOAD: fw_module_load,
    Op.MODULE_UNLOAD: fw_module_unload, Op.LINK: fw_link, Op.CTX_LOST: fw_ctx_lost,
    Op.FAULT_REPLAY: fw_fault_replayed,
}
#: The op a payload struct travels as (host to firmware).
OP_OF: Final[dict[type[Struct], Op]] = {cls: op for op, cls in COMMANDS.items()}
#: Firmware to host: each op's payload struct. The driver handles every op of this table.
COMPLETIONS: Final[dict[Op, type[Struct]]] = {
    Op.MAP: fw_map_done, Op.UNMAP: fw_unmap_done, Op.CTX_DESTROY: fw_ctx_destroy_done,
    Op.QUEUE_CREATE: fw_queue_done, Op.QUEUE_IMPORT: fw_queue_done, Op.FAULT: fw_fault,
    Op.LINK: fw_link, Op.FAULT_REPLAY: fw_fault_replay,
}


class MessageError(ValueError):
    """A message that is not in its table, or whose reserved bytes are not zero."""


def decode(table: dict[Op, type[Struct]], op: int, payload: bytes) -> Struct:
    """The payload of message ``op`` as its struct; MessageError when ``op`` is not in
    ``table`` or any reserved byte (``pad*``, ``reserved*`` and everything after the
    struct) is set -- a receiver never guesses at a message it does not know."""
    cls = table.get(op)  # type: ignore[call-overload]
    if cls is None:
        raise MessageError(f"unknown message {op}")
    size = ctypes.sizeof(cls)
    if not cls.reserved_clear(payload) or any(payload[size:]):
        raise MessageError(f"{Op(op).name}: reserved bytes set")
    return cls.from_buffer_copy(payload[:size])


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


#: A message: op u32, status u32, ctx u64, then its payload struct (zero-padded).
MSG_HEADER = struct.Struct("<IIQ")
PAYLOAD_SIZE: Final = MSG_SIZE - MSG_HEADER.size
assert all(ctypes.sizeof(c) <= PAYLOAD_SIZE for c in (*COMMANDS.values(), *COMPLETIONS.values()))

# Stats block, written by the firmware, read by the driver (sysfs, MEM_INFO):
STAT_NAMES: Final = (
    "managed_resident", "managed_faults", "managed_bytes_to_device", "managed_bytes_to_host",
    "managed_evictions", "copies", "copy_bytes", "packets", "faults",
    "copy_engines_busy_peak", "preemptions", "launches", "jit_compiles", "jit_hits",
    "jit_ready",
    # engine time, summed over the engines of each kind: nanoseconds spent running
    # packets, on the engines and inline on the control loop (utilization, DRM fdinfo)
    "compute_busy_ns", "copy_busy_ns",
)
_STATS = struct.Struct(f"<{len(STAT_NAMES)}Q")
_STAT_INDEX: Final = {name: i for i, name in enumerate(STAT_NAMES)}

#: The context table, written by the firmware, read by the driver (DRM fdinfo): one entry
#: per live context, ``(ctx_id, compute_ns, copy_ns, reserved)``; ctx_id 0 is a free
#: entry. A context past the table's size has no entry (its time counts in the totals).
CTX_STATS_SLOTS: Final = 256
CTX_STATS_WORDS: Final = 4

#: The live table, written by the driver alone, read by the firmware: entry ``live_slot``
#: (from CTX_CREATE) holds the context's id while the driver counts it live, and 0 from
#: the moment it is lost or destroyed, before the process can learn of it. The firmware
#: starts no packet of a context whose entry does not hold its id, so a loss takes effect
#: at once however many control messages queue before its CTX_LOST / CTX_DESTROY (the
#: mailbox is drained ``MAILBOX_BATCH`` at a time). The process cannot write it: its own
#: doorbell page's "lost" word is only a copy for it. A device's live contexts are at most
#: ``max_contexts``, which the driver bounds by the table's size.
LIVE_OFF: Final = 0x4A000
LIVE_SLOTS: Final = 2048
ENGINE_KINDS: Final = ("compute", "copy")


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

    def push(self, op: int, ctx_id: int, payload: Struct, status: int = 0) -> bool:
        """Write one message; False (nothing written) when the ring is full."""
        tail = self._idx[1]
        if tail - self._idx[0] >= self._slots:
            return False
        off = (tail % self._slots) * MSG_SIZE
        body = bytes(payload)
        MSG_HEADER.pack_into(self._data, off, op, status, ctx_id)
        start = off + MSG_HEADER.size
        self._data[start : off + MSG_SIZE] = body + bytes(PAYLOAD_SIZE - len(body))
        self._idx[1] = tail + 1
        return True

    def pop(self) -> tuple[int, int, int, bytes] | None:
        """Next message as (op, status, ctx_id, payload bytes), or None when empty (the
        receiver decodes the payload with :func:`decode`)."""
        head = self._idx[0]
        if head == self._idx[1]:
            return None
        off = (head % self._slots) * MSG_SIZE
        op, status, ctx_id = MSG_HEADER.unpack_from(self._data, off)
        payload = bytes(self._data[off + MSG_HEADER.size : off + MSG_SIZE])
        self._idx[0] = head + 1
        return op, status, ctx_id, payload

    def pending(self) -> int:
        return self._idx[1] - self._idx[0]

    def release(self) -> None:
        """Drop the ring's views of the shared memory (it is unusable from here on)."""
        self._idx.release()
        self._data.release()


assert STATS_OFF + _STATS.size <= CMD_RING_OFF
assert CMD_RING_OFF + Ring.size() <= CPL_RING_OFF
assert CPL_RING_OFF + Ring.size() <= CTX_STATS_OFF
assert CTX_STATS_OFF + CTX_STATS_SLOTS * CTX_STATS_WORDS * 8 <= LIVE_OFF
assert LIVE_OFF + LIVE_SLOTS * 8 <= IMAGE_OFF


class Mailbox:
    """Typed access to the shared mailbox, used the same way on both sides."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.cmd = Ring(buf, CMD_RING_OFF)
        self.cpl = Ring(buf, CPL_RING_OFF)
        # whole-word views: a reader never sees a half-written counter
        self._stats = buf[STATS_OFF : STATS_OFF + _STATS.size].cast("Q")
        self._ctx_stats = buf[CTX_STATS_OFF : CTX_STATS_OFF
                              + CTX_STATS_SLOTS * CTX_STATS_WORDS * 8].cast("Q")
        self._heartbeat = buf[_OFF_HEARTBEAT : _OFF_HEARTBEAT + 16].cast("Q")
        #: the live table (``LIVE_OFF``), whole words
        self.live = buf[LIVE_OFF : LIVE_OFF + LIVE_SLOTS * 8].cast("Q")

    def release(self) -> None:
        """Drop every view of the shared memory, the one given included, so that its owner
        can unmap it now rather than when the garbage collector runs (``mmap.close``
        refuses while a view exists). The mailbox is unusable from here on."""
        self.cmd.release()
        self.cpl.release()
        self._stats.release()
        self._ctx_stats.release()
        self._heartbeat.release()
        self.live.release()
        self.buf.release()

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

    def stat(self, name: str) -> int:
        """One counter of ``STAT_NAMES``: a word read, where ``stats()`` builds the dict of
        all (2.5 us, on every DEVICE_QUERY's ``memory_used``)."""
        return self._stats[_STAT_INDEX[name]]

    def set_stats(self, values: dict[str, int]) -> None:
        """Word by word (``struct.pack_into`` would zero the block first, and the driver
        could read the zeros)."""
        for i, name in enumerate(STAT_NAMES):
            self._stats[i] = values[name] & 0xFFFFFFFFFFFFFFFF

    def set_ctx_stats(self, slot: int, ctx_id: int, engine_ns: tuple[int, int]) -> None:
        """Firmware side: entry ``slot`` is context ``ctx_id``'s, with its engine time per
        ``ENGINE_KINDS``; ``ctx_id`` 0 frees it. The times are written before the id, so
        a reader that finds the id finds that context's times (or a later, larger one)."""
        base = slot * CTX_STATS_WORDS
        if ctx_id == 0:
            self._ctx_stats[base] = 0
            return
        if self._ctx_stats[base] != ctx_id:
            self._ctx_stats[base] = 0  # not another context's times under this id
        for i, ns in enumerate(engine_ns, 1):
            self._ctx_stats[base + i] = ns & 0xFFFFFFFFFFFFFFFF
        self._ctx_stats[base] = ctx_id

    def ctx_stats(self) -> dict[int, dict[str, int]]:
        """Driver side: each context's engine time by kind, as the firmware last wrote it."""
        words = self._ctx_stats.tolist()
        out = {}
        for base in range(0, len(words), CTX_STATS_WORDS):
            if words[base]:
                out[words[base]] = dict(zip(ENGINE_KINDS, words[base + 1 : base + 3]))
        return out

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
