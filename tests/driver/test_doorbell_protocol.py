"""The doorbell protocol as a raw client lives it (docs/submission.md, "Submitting"): what
the firmware needs to see a packet, and what its heartbeat does and does not rescue.

The firmware looks at a context's rings only when the context's ``DB_SEQ`` moved, and then
at the slots that moved. So a packet whose ``RING_WPTR`` was published without its doorbell
slot, or with the slot but without the ``DB_SEQ`` bump, is never seen: the heartbeat does
not rescue it (tested over 20 heartbeats). What the heartbeat rescues is only the byte a
producer owed the doorbell pipe while the firmware slept: the firmware wakes at its next
heartbeat, sees ``DB_SEQ`` moved and runs the packet. The figure is printed (``-s``), not
asserted: no timed assertions in tests.
"""

from __future__ import annotations

import time

import pytest
from rawdev import RawDev, assert_unharmed

from abi import userq

#: The firmware's heartbeat interval (firmware/main.py's default, 50 ms).
HEARTBEAT_S = 0.05
#: How long a packet that was never rung is watched: 20 heartbeats.
NEVER_S = 20 * HEARTBEAT_S


def _firmware_asleep(dev: RawDev, timeout: float = 10.0) -> None:
    assert dev.db is not None
    deadline = time.monotonic() + timeout
    while not dev.db.get(userq.DB_FW_SLEEPING):
        assert time.monotonic() < deadline, "the firmware never went to sleep"
        time.sleep(0.005)


def _completes_within(ring: userq.RingView, seqno: int, timeout: float) -> float | None:
    """Seconds until the ring's fence reaches ``seqno``, or None if it did not in time."""
    start = time.monotonic()
    while ring.completed < seqno:
        if time.monotonic() - start > timeout:
            return None
        time.sleep(0.0005)
    return time.monotonic() - start


@pytest.mark.timeout(60)
def test_a_packet_needs_its_slot_and_db_seq_and_the_heartbeat_rescues_only_the_pipe_byte(
        daemon, dev, bystander):
    ctx = dev.ctx_create()
    q = dev.queue_create(ctx)
    slot, ring = dev.rings[q]
    assert dev.db is not None
    ring.write_packet(0, userq.Nop().encode())

    # 1. RING_WPTR alone: the firmware never looks at the ring
    _firmware_asleep(dev)
    ring.set(userq.RING_WPTR, 1)
    assert _completes_within(ring, 1, NEVER_S) is None
    # 2. its doorbell slot too, but DB_SEQ not bumped: still never seen
    dev.db.set(userq.DB_SLOTS + 8 * slot, 1)
    userq.full_barrier()
    assert _completes_within(ring, 1, NEVER_S) is None
    # 3. DB_SEQ bumped while the firmware sleeps, and no byte on the doorbell pipe: the
    # next heartbeat wakes the firmware, which sees DB_SEQ moved and runs the packet
    _firmware_asleep(dev)
    dev.db.set(userq.DB_SEQ, dev.db.get(userq.DB_SEQ) + 1)
    userq.full_barrier()
    late = _completes_within(ring, 1, 10.0)
    assert late is not None, "a packet whose pipe byte was missing never completed"
    # the same with the pipe byte, for the figure's baseline, same run
    _firmware_asleep(dev)
    ring.write_packet(1, userq.Nop().encode())
    start = time.monotonic()
    dev.publish(q, 2)
    assert _completes_within(ring, 2, 10.0) is not None
    rung = time.monotonic() - start
    print(f"\nmissing pipe byte: completed after {late * 1e3:.1f} ms (heartbeat "
          f"{HEARTBEAT_S * 1e3:.0f} ms); with the byte: {rung * 1e3:.2f} ms")
    assert ring.read_fault() == (0, 0, 0, 0)
    assert_unharmed(dev, bystander)
