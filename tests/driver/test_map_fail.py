"""A MAP the firmware fails after MEM_ALLOC answered, on a real mount (debugfs ``map_fail``).

MEM_ALLOC answers once the driver has the memory; the firmware maps it afterwards and
answers only a failure. Such a failure used to be only logged, and the process met EFAULT
later with nothing saying why. Now it is a MAP_FAILED record (46) of the allocating
process, naming the allocation's address and the firmware's errno; the packet that
touches the allocation faults with EFAULT at that address; the next allocation maps; and
another tenant on the device notices nothing.
"""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
from rawdev import RawDev, assert_unharmed

from abi import faults, userq

pytestmark = pytest.mark.timeout(60)


def _records(d, ctx: int, code: int) -> list[dict]:
    return [r for r in map(json.loads, d.attr(0, "fault_log").splitlines())
            if r.get("context") == ctx and r["code"] == code]


def _memset(va: int, size: int) -> bytes:
    return userq.Memset(va, size, 7).encode()


def _fault_of(dev: RawDev, queue_id: int, timeout: float = 10.0) -> tuple[int, int, int, int]:
    _slot, ring = dev.rings[queue_id]
    deadline = time.monotonic() + timeout
    while not ring.read_fault()[0]:
        assert time.monotonic() < deadline, "the packet never faulted"
        dev.sleep_event(0.05)
    return ring.read_fault()


def test_a_failed_map_is_recorded_its_packets_fault_and_bystanders_go_on(daemon, bystander):
    d = daemon
    knob = d.debug(0, "map_fail")
    with RawDev(d.node(0)) as dev:
        ctx = dev.ctx_create()
        knob.write_text("1")
        bad = dev.mem_alloc(ctx, 1 << 20)  # answered: the MAP is the firmware's, later
        assert knob.read_text().strip() == "0"  # one MAP failed, the next ones map
        deadline = time.monotonic() + 10
        while not (recs := _records(d, ctx, 46)):
            assert time.monotonic() < deadline, "no MAP_FAILED record"
            time.sleep(0.01)
        (rec,) = recs
        kind = faults.BY_NAME["MAP_FAILED"]
        assert rec == {**rec, "name": "MAP_FAILED", "device": 0, "pid": os.getpid(),
                       "uid": os.getuid(), "address": bad.va, "errno": "ENOMEM",
                       "engine": "firmware", "scope": str(kind.scope),
                       "action": str(kind.action), "severity": str(kind.severity)}

        q = dev.queue_create(ctx)
        seqno = dev.submit(q, [_memset(bad.va, 4096)])
        assert _fault_of(dev, q) == (seqno, errno.EFAULT, userq.Op.MEMSET, bad.va)

        good = dev.mem_alloc(ctx, 1 << 20)  # the knob failed one MAP only
        q2 = dev.queue_create(ctx)
        done = dev.submit(q2, [_memset(good.va, 4096)])
        _slot, ring = dev.rings[q2]
        while ring.completed < done:
            assert not ring.read_fault()[0], ring.read_fault()
            dev.sleep_event(0.05)
        assert _records(d, ctx, 46) == [rec]  # the good one made no record
        assert_unharmed(dev, bystander)
    other, other_ctx = bystander
    assert _records(d, other_ctx, 46) == []


def test_map_fail_refuses_what_is_not_a_count(daemon):
    knob = daemon.debug(0, "map_fail")
    for value in ("-1", "1024", "yes"):
        with pytest.raises(OSError) as exc:
            knob.write_text(value)
        assert exc.value.errno == errno.EINVAL
    assert knob.read_text().strip() == "0"
