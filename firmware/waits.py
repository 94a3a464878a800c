"""What blocks a ring: the waits a queue's packet may hold it on, and the value writes.

``WAIT_QUEUE`` waits for another queue's fence; ``WAIT_VALUE`` (CUDA's
cuStreamWaitValue32/64, tinygrad's timeline signals, PM4's WAIT_REG_MEM) for a word of
host-pinned memory the host writes with a plain store. Either becomes the ring's
``blocked`` :class:`Wait`, which the scheduler asks on each of the control loop's passes
(``Wait.ready``): nothing is spun on and nothing blocks another queue or context. A fence
of this device moves with a completion, which wakes the loop; another device's fence and a
host's store wake nothing here, so each wait says when the loop should look again
(``poll_at_ns``): another device's fence every ``CROSS_DEVICE_POLL_NS``; a value with a
backoff, an eighth of the time waited so far, between ``VALUE_POLL_MIN_NS`` and
``VALUE_POLL_MAX_NS`` (a wait answered at once costs tens of microseconds, one that lasts a
second costs 500 looks, not a CPU). A value wait that is still unsatisfied at its deadline
faults its own queue with ETIMEDOUT (the driver records it: ``QUEUE_WAIT_TIMEOUT``).

``WRITE_VALUE`` is the other half (cuStreamWriteValue32/64): a word written once the
packets before it completed, run inline.

Both reach host-pinned memory only (``MemKind.HOST_PINNED``): the driver maps a pinned
allocation into the context that made it and into no other (host memory is never
exported, and a peer reaches device-local memory only), so a pinned mapping in the
context's address space is the context's own. Device-local and managed memory are refused
(EINVAL): the host cannot store to the first, and the second migrates under the word.
"""

from __future__ import annotations

import errno
from time import monotonic_ns
from typing import TYPE_CHECKING, Final

import numpy as np

from abi import userq
from abi.uapi import MemKind
from firmware import memory

if TYPE_CHECKING:
    from firmware.rings import Ring

#: How often the loop looks at another device's fence while a ring waits on it (ns).
CROSS_DEVICE_POLL_NS: Final = 1_000_000
#: The bounds of a value wait's backoff (ns): see the module docstring.
VALUE_POLL_MIN_NS: Final = 50_000
VALUE_POLL_MAX_NS: Final = 2_000_000
#: the word's numpy type by its width
_WORD: Final = {4: np.uint32, 8: np.uint64}


class Wait:
    """What a blocked ring waits for. ``start_ns`` is when its packet started (the
    completion's start time); ``opcode`` the packet's."""

    __slots__ = ("opcode", "start_ns")

    def __init__(self, opcode: int, start_ns: int) -> None:
        self.opcode, self.start_ns = opcode, start_ns

    def ready(self, now_ns: int) -> bool:
        """Whether the wait is over; raises :class:`memory.Fault` when it failed."""
        raise NotImplementedError

    def poll_at_ns(self, now_ns: int) -> int | None:
        """When the control loop should look again (monotonic ns), or None: an event
        that wakes the loop ends the wait."""
        raise NotImplementedError


class QueueWait(Wait):
    """WAIT_QUEUE: until queue ``other`` completed ``target``."""

    __slots__ = ("other", "target")

    def __init__(self, other: Ring, target: int, start_ns: int) -> None:
        super().__init__(userq.Op.WAIT_QUEUE, start_ns)
        self.other, self.target = other, target

    def ready(self, now_ns: int) -> bool:
        return self.other.completed >= self.target

    def poll_at_ns(self, now_ns: int) -> int | None:
        # a fence of this device moves with a completion, which wakes the loop
        return now_ns + CROSS_DEVICE_POLL_NS if self.other.fence_only else None


class ValueWait(Wait):
    """WAIT_VALUE: until ``word[0]`` (a view of the pinned word) satisfies the packet."""

    __slots__ = ("cmp", "deadline_ns", "sign", "va", "value", "word")

    def __init__(self, word: np.ndarray, pkt: userq.WaitValue, start_ns: int,
                 timeout_ns: int) -> None:
        super().__init__(userq.Op.WAIT_VALUE, start_ns)
        self.word, self.va, self.value, self.cmp = word, pkt.va, pkt.value, pkt.cmp
        self.sign = 1 << (8 * pkt.width - 1)
        self.deadline_ns = start_ns + timeout_ns

    def satisfied(self) -> bool:
        w, v = int(self.word[0]), self.value
        cmp = self.cmp
        if cmp == userq.WAIT_VALUE_GEQ:
            return (w - v) & (2 * self.sign - 1) < self.sign
        if cmp == userq.WAIT_VALUE_EQ:
            return w == v
        if cmp == userq.WAIT_VALUE_AND:
            return w & v != 0
        return ~(w | v) & (2 * self.sign - 1) != 0  # NOR

    def ready(self, now_ns: int) -> bool:
        if self.satisfied():
            return True
        if now_ns >= self.deadline_ns:
            raise memory.Fault(self.va, errno.ETIMEDOUT)
        return False

    def poll_at_ns(self, now_ns: int) -> int:
        backoff = min(max((now_ns - self.start_ns) // 8, VALUE_POLL_MIN_NS), VALUE_POLL_MAX_NS)
        return min(now_ns + backoff, self.deadline_ns)


def pinned_word(ring: Ring, va: int, value: int, width: int) -> np.ndarray:
    """A one-element view of the ``width``-byte word at ``va``, which must lie in
    host-pinned memory of ``ring``'s context, aligned, with ``value`` fitting in it.
    Raises :class:`memory.Fault`: EFAULT outside the mappings (the first bad byte), EINVAL
    for the rest (at ``va``)."""
    dtype = _WORD.get(width)
    if dtype is None or va % width or value >> (8 * width):
        raise memory.Fault(va, errno.EINVAL)
    m, off = ring.ctx.space.resolve(va, width)
    if m.kind != MemKind.HOST_PINNED:
        raise memory.Fault(va, errno.EINVAL)
    return m.data[off : off + width].view(dtype)


def wait_value(ring: Ring, pkt: userq.WaitValue, start_ns: int,
               watchdog_ns: int) -> ValueWait | None:
    """Start a WAIT_VALUE: None when already satisfied, else the ring's wait."""
    if pkt.cmp > userq.WAIT_VALUE_NOR or pkt.timeout_ns > userq.WAIT_VALUE_TIMEOUT_MAX_NS:
        raise memory.Fault(pkt.va, errno.EINVAL)
    word = pinned_word(ring, pkt.va, pkt.value, pkt.width)
    wait = ValueWait(word, pkt, start_ns, pkt.timeout_ns or watchdog_ns)
    return None if wait.satisfied() else wait


def write_value(ring: Ring, pkt: userq.WriteValue) -> None:
    """Run a WRITE_VALUE: one aligned store of the whole word."""
    pinned_word(ring, pkt.va, pkt.value, pkt.width)[0] = pkt.value
