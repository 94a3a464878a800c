"""A context's schedule: how the firmware orders its work, and the decision table the
process shares with the firmware to record or replay that order (docs/schedule.md).

A process asks for a schedule in ``CTX_CREATE`` (``accel_ctx_create.schedule``, ``seed``
and ``schedule_fd``). The default schedule is the firmware's usual one. An adversarial
one delays packets and reorders the context's queues, seeded, within the contract (a
correct program's results never change); a replayed one applies exactly the decisions a
table lists. With ``SCHED_RECORD`` the firmware appends every decision it applied to the
table, so the process can save it and replay it later.

The table is the process's sealed memfd of ``SCHED_FILE_SIZE`` bytes. Each region has one
writer at a time: the process before ``CTX_CREATE``, then the firmware (decisions, the
position) or the driver (injected faults):

| offset | word | writer |
| --- | --- | --- |
| 0 | ``SCHED_COUNT``: entries in the table | process (replay), then firmware (record) |
| 8 | ``SCHED_DROPPED``: decisions not recorded, the table being full | firmware |
| 16 | ``SCHED_AT``: where a fault coming now would hit (``at_word``) | firmware (record) |
| 24 | ``SCHED_FAULT_COUNT``: faults recorded (past ``SCHED_FAULT_CAPACITY``: dropped) | driver (record) |
| 64 | ``SCHED_ENTRIES``: ``SCHED_CAPACITY`` entries of ``SCHED_ENTRY_SIZE`` bytes | |
| ``SCHED_FAULT_ENTRIES`` | ``SCHED_FAULT_CAPACITY`` fault entries | driver (record) |

An entry is four u64 words: the queue's index in its context (the order the firmware
learned of the context's queues, the driver's default queue first: 0) in the low 32 bits
of word 0 and the decision's kind (``Decision``) in the high 32; word 1 the packet's
seqno; word 2 the value; word 3 the address of a ``FAULT`` (zero otherwise). Seqnos are
per queue and count from 1; a ``RANK`` at seqno 0 is the queue's rank from its start.

Injected faults (ABI 2.5): while a context records, an operator's ``ras_ctrl`` injection
that reaches it (kmod_emul/ras.py) is noted by the driver in the fault region, at the
packet ``SCHED_AT`` names, as a ``FAULT`` entry: value ``fault_value(block, severity)``,
address the injection's (for ``memory``: the context's own device address of the byte, so
a replay lands in its own memory wherever the allocator put it). A replay lists its
``FAULT`` entries among the others; the firmware asks the driver to inject each one when
its packet is reached, and the driver injects it only if it is confined to the replaying
context (docs/schedule.md, "Injected faults").
"""

from __future__ import annotations

import enum
from typing import Final, NamedTuple

from abi import faults


class Mode(enum.IntEnum):
    """``accel_ctx_create.schedule``'s low 16 bits: which schedule the context gets."""

    DEFAULT = 0
    #: seeded adversarial decisions (``accel_ctx_create.seed``)
    ADVERSARIAL = 1
    #: the decisions the table lists, and no others
    REPLAY = 2


#: ``accel_ctx_create.schedule``: append every decision applied to the table
SCHED_RECORD: Final = 1 << 16
SCHED_MODE_MASK: Final = 0xFFFF
SCHED_FLAGS_MASK: Final = SCHED_MODE_MASK | SCHED_RECORD


class Decision(enum.IntEnum):
    """An entry's kind."""

    #: the packet starts no sooner than ``value`` microseconds after the firmware first
    #: could have started it (an event's marker: it completes that much later)
    DELAY = 1
    #: from this packet on, the queue's rank among its context's queues is ``value``
    #: (lower goes first when several could run: PCT's priority)
    RANK = 2
    #: the packet was the ``value``-th of its context to start (from 0): a replay starts
    #: the packets it lists in the order of their values, each once every listed packet
    #: before it has started
    ORDER = 3
    #: an injected fault came while the packet was the context's next (or running): a
    #: replay injects it again there; ``value`` is ``fault_value(block, severity)`` and
    #: the entry's ``address`` the injection's
    FAULT = 4


class Entry(NamedTuple):
    queue: int
    seqno: int
    kind: Decision
    value: int
    address: int = 0  #: a FAULT's (word 3)


SCHED_COUNT: Final = 0
SCHED_DROPPED: Final = 8
SCHED_AT: Final = 16
SCHED_FAULT_COUNT: Final = 24
SCHED_ENTRIES: Final = 64
SCHED_ENTRY_SIZE: Final = 32
SCHED_FILE_SIZE: Final = 512 * 1024
#: faults the driver records for one context (an operator's injections are few)
SCHED_FAULT_CAPACITY: Final = 64
SCHED_FAULT_ENTRIES: Final = SCHED_FILE_SIZE - SCHED_FAULT_CAPACITY * SCHED_ENTRY_SIZE
SCHED_CAPACITY: Final = (SCHED_FAULT_ENTRIES - SCHED_ENTRIES) // SCHED_ENTRY_SIZE

#: The blocks whose injections are recorded and replayed: their effect reaches a context
#: through the device it runs on. (``link`` and ``thermal`` are the package's and the
#: die's models, whose effect is not a context's packet: not recorded.)
FAULT_BLOCKS: Final = ("memory", "compute", "copy", "firmware")
FAULT_SEVERITIES: Final = ("ue", "ce")
assert set(FAULT_BLOCKS) <= set(faults.BLOCKS), "a recorded fault of no block"
#: ``SCHED_AT``'s seqno bits (the queue index sits above them)
_AT_SEQNO_BITS: Final = 40


def entry_words(e: Entry) -> tuple[int, int, int, int]:
    """An entry as its four table words."""
    return (e.queue & 0xFFFF_FFFF) | (int(e.kind) << 32), e.seqno, e.value, e.address


def entry_of(words: tuple[int, int, int, int] | list[int]) -> Entry:
    """An entry from its four table words; ValueError for a kind no table may hold, or a
    FAULT whose value is no fault (``fault_parts``)."""
    kind = Decision(words[0] >> 32)
    if kind == Decision.FAULT:
        fault_parts(words[2])
        return Entry(words[0] & 0xFFFF_FFFF, words[1], kind, words[2], words[3])
    return Entry(words[0] & 0xFFFF_FFFF, words[1], kind, words[2])


def fault_value(block: str, severity: str) -> int:
    """A FAULT entry's value: the block's place in ``FAULT_BLOCKS`` times 2, plus 1 for
    ``ce`` (ValueError for a block or severity not recorded)."""
    return FAULT_BLOCKS.index(block) * 2 + FAULT_SEVERITIES.index(severity)


def fault_parts(value: int) -> tuple[str, str]:
    """A FAULT value's block and severity; ValueError for a value no fault has."""
    if not 0 <= value < 2 * len(FAULT_BLOCKS):
        raise ValueError(f"no fault has the value {value}")
    return FAULT_BLOCKS[value // 2], FAULT_SEVERITIES[value % 2]


def fault_text(value: int, address: int) -> str:
    """A FAULT as a recording shows it: what an operator writes after ``inject``
    (``BLOCK ue|ce ADDRESS``, the address in hex)."""
    block, severity = fault_parts(value)
    return f"{block} {severity} {address:#x}"


def parse_fault_text(text: str) -> tuple[int, int]:
    """``fault_text``'s value and address back; ValueError for anything else (the
    address: hex ``0x...`` or decimal, below 2**64)."""
    words = text.split(" ") if isinstance(text, str) else []
    if len(words) != 3 or words[0] not in FAULT_BLOCKS or words[1] not in FAULT_SEVERITIES:
        raise ValueError(f"a fault is 'BLOCK ue|ce ADDRESS' with BLOCK one of "
                         f"{' '.join(FAULT_BLOCKS)}, not {text!r}")
    where = words[2]
    digits = where[2:] if where.startswith("0x") else where
    base = 16 if where.startswith("0x") else 10
    if not digits or not all(c in "0123456789abcdef"[:base] for c in digits.lower()) \
            or len(digits) > 20 or int(digits, base) >= 1 << 64:
        raise ValueError(f"a fault's address is hex (0x...) or decimal below 2**64, not {where!r}")
    return fault_value(words[0], words[1]), int(digits, base)


def at_word(queue: int, seqno: int) -> int:
    """``SCHED_AT`` naming packet ``seqno`` of queue ``queue`` (one word: the driver reads
    it while the firmware writes it, and a word is never torn)."""
    return (queue << _AT_SEQNO_BITS) | min(seqno, (1 << _AT_SEQNO_BITS) - 1)


def at_of(word: int) -> tuple[int, int]:
    """``SCHED_AT``'s queue index and seqno (at least 1: a word never written names the
    context's first packet)."""
    return (word >> _AT_SEQNO_BITS) & 0xFFFF_FFFF, max(1, word & ((1 << _AT_SEQNO_BITS) - 1))
