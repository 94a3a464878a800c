"""The user-mode queue: what a process shares with the firmware directly.

This is the part of the contract that bypasses the driver once set up (KFD's user queues,
amdgpu's ``userq``): the ring a process writes packets into, the packets themselves, a
LAUNCH's argument records, and the doorbell page the producer rings. The runtime (the
producer and waiter), the firmware (the consumer) and the driver (the producer and waiter
of a context's default queue) all use these definitions; none declares its own.
"""

from __future__ import annotations

import enum
import mmap
import struct
import threading
from collections.abc import Sequence
from typing import Any, Final, NamedTuple, Union

from abi import kernel_lang


# --- packets -----------------------------------------------------------------------------


class Op(enum.IntEnum):
    """Packet opcodes: word 0 of a packet. Each has one layout below (``Nop`` ... ``WriteValue``)."""

    NOP = 0
    COPY = 1
    MEMSET = 2
    WAIT_QUEUE = 3
    PREFETCH = 4
    LAUNCH = 5
    WAIT_VALUE = 6
    WRITE_VALUE = 7


def op_name(opcode: int) -> str:
    """An opcode's name, for records and messages (an unknown one by its number)."""
    try:
        return Op(opcode).name
    except ValueError:
        return f"opcode {opcode}"


#: The wire layout of every packet, 64 bytes in a ring slot: u32 opcode, u32 flags (0: any
#: other value faults the packet, EINVAL), then seven u64 argument words, which each
#: opcode's layout below names (unused trailing words are 0 and ignored). Writers and
#: readers go through the typed layouts; this raw form is for the decoder and for tests
#: and fuzzers that write malformed packets on purpose (an unknown opcode, flags, words
#: out of range).
RAW_PACKET: Final = struct.Struct("<II7Q")
PACKET_SIZE: Final = RAW_PACKET.size
assert PACKET_SIZE == 64


class Nop(NamedTuple):
    """NOP: does nothing; a marker (its completion timestamp times an event)."""

    OP = Op.NOP

    def encode(self) -> bytes:
        return _encode(self)


class Copy(NamedTuple):
    """COPY ``nbytes`` from device address ``src`` to ``dst``."""

    dst: int
    src: int
    nbytes: int
    OP = Op.COPY

    def encode(self) -> bytes:
        return _encode(self)


class Memset(NamedTuple):
    """MEMSET ``nbytes`` at ``dst`` to the byte ``value`` (above 0xFF faults, EINVAL)."""

    dst: int
    nbytes: int
    value: int
    OP = Op.MEMSET

    def encode(self) -> bytes:
        return _encode(self)


class WaitQueue(NamedTuple):
    """WAIT_QUEUE: later packets of this queue wait until queue ``queue`` (of the same
    context, or imported into it) has completed ``seqno``."""

    queue: int
    seqno: int
    OP = Op.WAIT_QUEUE

    def encode(self) -> bytes:
        return _encode(self)


class Prefetch(NamedTuple):
    """PREFETCH ``nbytes`` of managed memory at ``va`` to the device (``to_device`` 1) or
    the host (0)."""

    va: int
    nbytes: int
    to_device: int
    OP = Op.PREFETCH

    def encode(self) -> bytes:
        return _encode(self)


class Launch(NamedTuple):
    """LAUNCH kernel ``handle`` (module id << 16 | kernel index) over ``grid`` blocks of
    ``block`` threads (each packed by :func:`pack_dims`) with ``shared`` dynamic shared
    bytes per block (static + dynamic within the device's limit, else EINVAL). Its
    argument block (docs/kernels.md "Launch ABI") is ``args_len`` bytes at ``args_va``;
    ``args_va`` 0 names the queue's own arena slot for the packet's seqno
    (``RING_ARGS_VA``), so the packet of a kernel's launch is the same bytes every time."""

    handle: int
    grid: int
    block: int
    shared: int
    args_va: int
    args_len: int
    OP = Op.LAUNCH

    def encode(self) -> bytes:
        return _encode(self)


#: WAIT_VALUE comparisons (``WaitValue.cmp``), CUDA's ``CU_STREAM_WAIT_VALUE_*``: the wait
#: ends once the word ``w`` at its address satisfies, against the packet's ``value`` ``v``
#: (both of the packet's width): GEQ ``(w - v) mod 2**width`` is below ``2**(width - 1)``
#: (a counter that may wrap has reached ``v``), EQ ``w == v``, AND ``w & v != 0``, NOR
#: ``~(w | v) != 0``.
WAIT_VALUE_GEQ: Final = 0
WAIT_VALUE_EQ: Final = 1
WAIT_VALUE_AND: Final = 2
WAIT_VALUE_NOR: Final = 3
#: The longest timeout a WAIT_VALUE may name (ns: a day); longer faults the packet, EINVAL.
#: 0 names the device's watchdog (the image's ``watchdog_ms``).
WAIT_VALUE_TIMEOUT_MAX_NS: Final = 86_400 * 10**9


class WaitValue(NamedTuple):
    """WAIT_VALUE (cuStreamWaitValue32/64): later packets of this queue wait until the
    ``width``-byte word (4 or 8, aligned to it) at ``va`` satisfies ``cmp`` (``WAIT_VALUE_*``)
    against ``value``. ``va`` must lie in host-pinned memory of the context: a word the
    host writes, with no system call. A wait still unsatisfied ``timeout_ns`` after it began
    (0: the device's watchdog) faults its queue with ETIMEDOUT, like a kernel the watchdog
    stopped. Faults: EFAULT outside the context's mappings; EINVAL for another kind of
    memory, a misaligned ``va``, a width, comparison, value (wider than ``width``) or
    timeout out of range."""

    va: int
    value: int
    width: int
    cmp: int
    timeout_ns: int
    OP = Op.WAIT_VALUE

    def encode(self) -> bytes:
        return _encode(self)


class WriteValue(NamedTuple):
    """WRITE_VALUE (cuStreamWriteValue32/64): write ``value`` as a ``width``-byte word (4 or
    8, aligned to it) at ``va``, host-pinned memory of the context, once the packets before
    it completed: the host (or another queue's WAIT_VALUE) sees the stream reach this
    point. Faults as WAIT_VALUE's."""

    va: int
    value: int
    width: int
    OP = Op.WRITE_VALUE

    def encode(self) -> bytes:
        return _encode(self)


Packet = Union[Nop, Copy, Memset, WaitQueue, Prefetch, Launch, WaitValue, WriteValue]
#: opcode -> its layout
LAYOUTS: Final[dict[int, type[Any]]] = {
    cls.OP: cls for cls in (Nop, Copy, Memset, WaitQueue, Prefetch, Launch, WaitValue,
                            WriteValue)}
_PADS: Final = {op: (0,) * (7 - len(cls._fields)) for op, cls in LAYOUTS.items()}
#: opcode -> (its layout, the end of its words in RAW_PACKET's unpacked tuple)
_DECODE: Final = {op: (cls, 2 + len(cls._fields)) for op, cls in LAYOUTS.items()}
#: a layout made from its words: the slice has exactly its fields, so no length check
#: (``_make`` checks it in Python, and the firmware decodes every packet it runs)
_NEW: Final = tuple.__new__


def _encode(packet: Packet) -> bytes:
    op = packet.OP
    return RAW_PACKET.pack(op, 0, *packet, *_PADS[op])


def decode(words: Sequence[int]) -> Packet:
    """The typed packet of ``words`` as ``RAW_PACKET`` unpacks them (opcode, flags, a0..a6),
    flags aside (the reader checks them); KeyError for an unknown opcode."""
    cls, end = _DECODE[words[0]]
    return _NEW(cls, words[2:end])  # type: ignore[no-any-return]


def decode_bytes(raw: bytes) -> Packet:
    """The typed packet of a packet's 64 bytes (a ring slot, a recorded submission)."""
    return decode(RAW_PACKET.unpack(raw))


# --- launch arguments ----------------------------------------------------------------------
def pack_dims(dims: tuple[int, int, int]) -> int:
    """Grid or block dimensions in one packet word (21 bits each)."""
    x, y, z = dims
    return x | (y << 21) | (z << 42)


def unpack_dims(word: int) -> tuple[int, int, int]:
    mask = (1 << 21) - 1
    return word & mask, (word >> 21) & mask, (word >> 42) & mask


#: Argument records of a launch's argument block (docs/kernels.md "Launch ABI").
ARG_SCALAR, ARG_BUFFER, ARG_SHAPE = 0, 1, 2
ARG_RECORD = struct.Struct("<IIQQ")
#: the byte offset of a record's value (a buffer record's device address) in ARG_RECORD
ARG_RECORD_VALUE_AT: Final = 8


def arg_block_struct(runs: Sequence[int]) -> struct.Struct:
    """An argument block as constant bytes around its buffers' addresses, for a launch
    repeated with only those new (a launch plan): ``runs`` are the lengths of the byte
    runs before each address and after the last; ``pack(run0, va0, run1, ..., runN)``
    gives the block, each address a u64 (a buffer record's value)."""
    return struct.Struct("<" + "sQ".join(str(n) for n in runs) + "s")
#: A scalar record with its value packed in its dtype's own format, low bytes first: the
#: same bytes as ARG_RECORD holding the value's bits, and packing a numpy scalar this way
#: costs a sixth of converting it to those bits. Launch-ABI dtype code -> its Struct.
_STRUCT_CHARS: Final = {"int8": "b", "uint8": "B", "int16": "h", "uint16": "H", "int32": "i",
                        "uint32": "I", "int64": "q", "uint64": "Q", "float32": "f",
                        "float64": "d", "bool": "?"}
ARG_SCALAR_RECORDS: Final = {code: struct.Struct(f"<II{_STRUCT_CHARS[name]}{8 - size}xQ")
                             for name, (code, size) in kernel_lang.DTYPES.items()}
#: Longest argument block a LAUNCH may name (a longer one faults the launch, EINVAL).
ACCEL_ARGS_MAX: Final = 4096


# --- the doorbell page (one per context, shared by runtime, driver and firmware) -------------
#: Byte offsets; one writer per cache line.
DB_SEQ: Final = 0  # u64, producer: bumped after every doorbell slot write
DB_FW_SLEEPING: Final = 64  # u64, firmware: 1 while asleep: write the doorbell pipe after
DB_LOST: Final = 128  # u64, driver: nonzero (an errno) once the context is lost
DB_SLOTS: Final = 4096  # u64 per queue: the ring's wptr, written by the producer
#: Slot 0 is the context's default queue (the driver's, SUBMIT_NOOP).
ACCEL_DB_DEFAULT_SLOT: Final = 0
ACCEL_DB_SLOT_COUNT: Final = 1024
ACCEL_DB_PAGE_SIZE: Final = DB_SLOTS + 8 * ACCEL_DB_SLOT_COUNT

# --- the user-mode ring (shared by runtime, driver and firmware) ----------------------------
#: Header words (byte offsets); each group on its own cache line, one writer per line.
RING_WPTR: Final = 0  # u64, producer: packets written (the last one's seqno)
RING_RPTR: Final = 64  # u64, firmware: packets taken
RING_COMPLETED: Final = 128  # u64, firmware: the fence, the last completed seqno
RING_ERROR_SEQNO: Final = 192  # u64, firmware: first faulted packet (0: none)
RING_ERROR_CODE: Final = 200  # u32 errno, then u32 opcode (one u64 word)
RING_ERROR_ADDR: Final = 208  # u64
#: u64, firmware: 1 while an engine thread runs the ring's current packet, 0 while the
#: firmware's own loop does (or nothing does). A hint for waiters only: the engines share
#: the host's CPUs, so a waiter naps while they run and spins while they do not.
RING_ON_ENGINE: Final = 256
RING_IRQ_SEQNO: Final = 320  # u64, waiter: write the event pipe when the fence reaches it
#: u64 words, producer, written before the first packet that uses them: the queue's own
#: argument arena, RING_ARGS_SLOTS blocks of RING_ARGS_SLOT_BYTES from device address
#: RING_ARGS_VA (0: none). A Launch whose args_va is 0 and whose args_len is at most
#: RING_ARGS_SLOT_BYTES takes its argument block from its seqno's slot, RING_ARGS_VA +
#: seqno % RING_ARGS_SLOTS * RING_ARGS_SLOT_BYTES: its packet is then the same bytes at
#: every launch (docs/kernels.md "Launch ABI"). With no arena, args_va 0 is address 0 (EFAULT).
RING_ARGS_VA: Final = 384
RING_ARGS_SLOTS: Final = 392
RING_ARGS_SLOT_BYTES: Final = 256
RING_HEADER_SIZE: Final = 4096
RING_SLOTS: Final = 1024
RING_PACKETS: Final = RING_HEADER_SIZE  # RING_SLOTS packets of PACKET_SIZE bytes
RING_TIMESTAMPS: Final = RING_PACKETS + RING_SLOTS * PACKET_SIZE  # u64 completion time per slot
#: u64 pairs per slot, firmware: (seqno, ns) -- how long the launch with that seqno waited
#: for its kernel to be compiled (or loaded from the JIT cache) before it ran, written
#: before its completion; a pair whose seqno is another packet's says nothing (profilers
#: show the compile as its own row, not as the kernel's time)
RING_COMPILE: Final = RING_TIMESTAMPS + RING_SLOTS * 8
RING_FILE_SIZE: Final = RING_COMPILE + RING_SLOTS * 16


_BARRIER = threading.Lock()


def full_barrier() -> None:
    """The doorbell protocol's memory barrier. A producer stores its doorbell slot and
    ``DB_SEQ``, then loads ``DB_FW_SLEEPING``; the firmware stores ``DB_FW_SLEEPING``, then
    loads ``DB_SEQ``. x86 may
    reorder a store with a later load, which could lose a wake-up, so both sides fence in
    between. From Python: acquiring a lock is a locked (atomic) instruction, a full barrier
    on x86. (A wake-up lost anyway costs at most the firmware's heartbeat interval.)"""
    _BARRIER.acquire()
    _BARRIER.release()


U64_MAX: Final = (1 << 64) - 1


class SharedWords:
    """u64 words of a mapped shared-memory object (a ring, a doorbell page).

    Every word is read and written whole, through a ``memoryview`` cast to u64: one
    aligned 8-byte load or store, which x86 never tears. (``struct.pack_into`` zeroes its
    destination before writing it, so another process could read a write pointer of 0
    mid-store; measured: the firmware then saw a ring go back 1,610 packets.) ``close``
    unmaps at once: holders must not wait for the garbage collector to give back a
    mapping (and the descriptor Python's mmap keeps)."""

    def __init__(self, fd: int, size: int) -> None:
        self.mem = mmap.mmap(fd, size)
        self.words = memoryview(self.mem).cast("Q")

    def close(self) -> None:
        self.words.release()
        self.mem.close()

    def get(self, off: int) -> int:
        return self.words[off >> 3]

    def set(self, off: int, value: int) -> None:
        self.words[off >> 3] = value & U64_MAX


class RingView(SharedWords):
    """Typed access to a mapped ring (the layout above), for every party to the ring:
    the runtime (producer and waiter), the firmware (consumer) and the driver (producer
    and waiter of a context's default queue)."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd, RING_FILE_SIZE)

    @property
    def wptr(self) -> int:
        return self.words[RING_WPTR >> 3]

    @property
    def rptr(self) -> int:
        return self.words[RING_RPTR >> 3]

    @property
    def completed(self) -> int:
        return self.words[RING_COMPLETED >> 3]

    def write_packet(self, index: int, packet: bytes) -> None:
        off = RING_PACKETS + (index % RING_SLOTS) * PACKET_SIZE
        self.mem[off : off + PACKET_SIZE] = packet

    def read_packet(self, seqno: int) -> tuple[int, ...]:
        """The raw words (``RAW_PACKET``) of packet ``seqno``'s slot, as written there."""
        return RAW_PACKET.unpack_from(self.mem, RING_PACKETS + (seqno - 1) % RING_SLOTS * PACKET_SIZE)

    def read_fault(self) -> tuple[int, int, int, int]:
        """(seqno, errno, opcode, address) of the first faulted packet; seqno 0: none.
        The seqno is read first: it is written last."""
        seqno = self.words[RING_ERROR_SEQNO >> 3]
        if not seqno:
            return 0, 0, 0, 0
        code = self.words[RING_ERROR_CODE >> 3]
        return seqno, code & 0xFFFFFFFF, code >> 32, self.words[RING_ERROR_ADDR >> 3]

    def write_fault(self, seqno: int, code: int, opcode: int, addr: int) -> None:
        """Record the first fault, seqno last (readers look at it first); an address
        beyond the 64-bit space reads as U64_MAX."""
        w = self.words
        w[RING_ERROR_CODE >> 3] = (code & 0xFFFFFFFF) | ((opcode & 0xFFFFFFFF) << 32)
        w[RING_ERROR_ADDR >> 3] = addr if 0 <= addr <= U64_MAX else U64_MAX
        w[RING_ERROR_SEQNO >> 3] = seqno & U64_MAX

    def timestamp(self, seqno: int) -> int:
        """Device time (ns) ``seqno`` completed; 0 if not yet, or if its slot was reused."""
        done = self.completed
        if not seqno or seqno > done or done - seqno >= RING_SLOTS:
            return 0
        return self.words[(RING_TIMESTAMPS >> 3) + (seqno - 1) % RING_SLOTS]

    def stamp(self, seqno: int, now_ns: int) -> None:
        self.words[(RING_TIMESTAMPS >> 3) + (seqno - 1) % RING_SLOTS] = now_ns

    def compile_ns(self, seqno: int) -> int:
        """How long launch ``seqno`` waited for its kernel's compile (ns; 0: none, or its
        slot was reused). Read it once ``seqno`` completed."""
        i = (RING_COMPILE >> 3) + (seqno - 1) % RING_SLOTS * 2
        return self.words[i + 1] if seqno and self.words[i] == seqno else 0

    def record_compile(self, seqno: int, ns: int) -> None:
        """The firmware's note of launch ``seqno``'s compile wait (the longest of the
        engines that waited), before the launch completes."""
        i = (RING_COMPILE >> 3) + (seqno - 1) % RING_SLOTS * 2
        w = self.words
        if w[i] != seqno:
            w[i + 1], w[i] = ns, seqno
        elif ns > w[i + 1]:
            w[i + 1] = ns
