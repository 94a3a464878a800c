"""A context's schedule: how the firmware orders its work, and the decision table the
process shares with the firmware to record or replay that order (docs/schedule.md).

A process asks for a schedule in ``CTX_CREATE`` (``accel_ctx_create.schedule``, ``seed``
and ``schedule_fd``). The default schedule is the firmware's usual one. An adversarial
one delays packets and reorders the context's queues, seeded, within the contract (a
correct program's results never change); a replayed one applies exactly the decisions a
table lists. With ``SCHED_RECORD`` the firmware appends every decision it applied to the
table, so the process can save it and replay it later.

The table is the process's sealed memfd of ``SCHED_FILE_SIZE`` bytes (one writer at a
time: the process before ``CTX_CREATE``, the firmware after it):

| offset | word | writer |
| --- | --- | --- |
| 0 | ``SCHED_COUNT``: entries in the table | process (replay), then firmware (record) |
| 8 | ``SCHED_DROPPED``: decisions not recorded, the table being full | firmware |
| 64 | ``SCHED_ENTRIES``: ``SCHED_CAPACITY`` entries of ``SCHED_ENTRY_SIZE`` bytes | |

An entry is four u64 words: the queue's index in its context (the order the firmware
learned of the context's queues, the driver's default queue first: 0) in the low 32 bits
of word 0 and the decision's kind (``Decision``) in the high 32; word 1 the packet's
seqno; word 2 the value; word 3 zero. Seqnos are per queue and count from 1; a
``RANK`` at seqno 0 is the queue's rank from its start.
"""

from __future__ import annotations

import enum
from typing import Final, NamedTuple


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


class Entry(NamedTuple):
    queue: int
    seqno: int
    kind: Decision
    value: int


SCHED_COUNT: Final = 0
SCHED_DROPPED: Final = 8
SCHED_ENTRIES: Final = 64
SCHED_ENTRY_SIZE: Final = 32
SCHED_FILE_SIZE: Final = 512 * 1024
SCHED_CAPACITY: Final = (SCHED_FILE_SIZE - SCHED_ENTRIES) // SCHED_ENTRY_SIZE


def entry_words(e: Entry) -> tuple[int, int, int, int]:
    """An entry as its four table words."""
    return (e.queue & 0xFFFF_FFFF) | (int(e.kind) << 32), e.seqno, e.value, 0


def entry_of(words: tuple[int, int, int, int] | list[int]) -> Entry:
    """An entry from its four table words; ValueError for a kind no table may hold."""
    return Entry(words[0] & 0xFFFF_FFFF, words[1], Decision(words[0] >> 32), words[2])
