"""Which replayed faults the driver injects (docs/schedule.md, "Injected faults"), through
raw CTX_CREATEs whose replay table holds one FAULT entry, at the default queue's first
packet: a device-scope fault (``compute ue``: a device reset) is injected for a context
that holds the device exclusively -- the device resets, the record names the context and
has origin ``replay`` -- and refused for one that does not: counted and logged as a
``privileged`` refusal, nothing injected, its packet completes, a bystander context on
the device keeps working. A corrected fault is injected for any context."""

from __future__ import annotations

import errno
import os

import pytest
from rawdev import RawDev, assert_unharmed

from abi import schedule, uapi
from runtime._shm import sealed_memfd

pytestmark = pytest.mark.timeout(120)


def replay_table(fault: str) -> int:
    """A sealed schedule table listing one FAULT entry, at packet 1 of queue 0."""
    value, address = schedule.parse_fault_text(fault)
    fd = sealed_memfd("schedule", schedule.SCHED_FILE_SIZE)
    entry = schedule.Entry(0, 1, schedule.Decision.FAULT, value, address)
    os.pwrite(fd, b"".join(w.to_bytes(8, "little") for w in schedule.entry_words(entry)),
              schedule.SCHED_ENTRIES)
    os.pwrite(fd, (1).to_bytes(8, "little"), schedule.SCHED_COUNT)
    return fd


def replaying_context(dev: RawDev, fault: str, flags: int = 0) -> int:
    table = replay_table(fault)
    try:
        return dev.ctx_create(flags, schedule=schedule.Mode.REPLAY, schedule_fd=table)
    finally:
        os.close(table)


def test_a_device_scope_fault_is_replayed_for_the_exclusive_owner(make_daemon):
    d = make_daemon(devices=1)
    with RawDev(d.node(0)) as dev:
        ctx = replaying_context(dev, "compute ue 0x7", uapi.ACCEL_CTX_EXCLUSIVE)
        seqno = dev.noop(ctx)
        with pytest.raises(OSError) as lost:
            dev.wait_done(ctx, seqno)
        assert lost.value.errno == errno.ENODEV
    d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
    records = [(r["code"], r["origin"], r["pid"], r["context"], r["address"])
               for r in d.fault_log(0)]
    assert records[0] == (122, "replay", os.getpid(), ctx, 7)
    assert records[1][0] == 120
    assert d.attr(0, "isolation/privileged") == "0"
    assert d.attr(0, "ras/compute_err_count") == "ue: 0\nce: 0"  # no hardware error


def test_a_device_scope_fault_is_refused_for_a_shared_device(make_daemon):
    d = make_daemon(devices=1)
    with RawDev(d.node(0)) as other, RawDev(d.node(0)) as dev:
        bystander = (other, other.ctx_create())
        ctx = replaying_context(dev, "compute ue 0x7")
        seqno = dev.noop(ctx)
        assert dev.wait_done(ctx, seqno).completed >= seqno  # skipped: the packet ran
        assert_unharmed(dev, bystander)
    assert d.fault_log(0) == []
    assert d.attr(0, "reset_count") == "0"
    assert d.attr(0, "isolation/privileged") == "1"
    assert (f"replayed fault 'compute ue 0x7' of context {ctx} refused: it reaches beyond "
            "the context, which does not hold the device exclusively (EPERM)") in d.log_text()


def test_a_corrected_fault_is_replayed_for_any_context(make_daemon):
    """A ``ce`` loses nothing: it is injected for a context on a shared device, recorded
    as the context's, and its packet runs on."""
    d = make_daemon(devices=1)
    with RawDev(d.node(0)) as other, RawDev(d.node(0)) as dev:
        bystander = (other, other.ctx_create())
        ctx = replaying_context(dev, "copy ce 0x10")
        seqno = dev.noop(ctx)
        assert dev.wait_done(ctx, seqno).completed >= seqno
        assert_unharmed(dev, bystander)
    (record,) = d.fault_log(0)
    assert (record["code"], record["origin"], record["pid"], record["context"],
            record["scope"]) == (123, "replay", os.getpid(), ctx, "operation")
    assert d.attr(0, "ras/copy_err_count") == "ue: 0\nce: 0"
    assert (d.attr(0, "reset_count"), d.attr(0, "isolation/privileged")) == ("0", "0")
