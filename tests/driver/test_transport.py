"""The command transaction protocol: every command, and every bad input with its errno.

Each bad-input test also checks that nothing else was harmed: the same open file still
answers, and a bystander context on the same device keeps completing work.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rawdev import RawDev, errname, header

from abi import uapi

HDR = ctypes.sizeof(uapi.accel_cmd_hdr)


@pytest.fixture
def dev(daemon) -> Iterator[RawDev]:
    with RawDev(daemon.node(0)) as d:
        yield d


@pytest.fixture
def bystander(daemon) -> Iterator[tuple[RawDev, int]]:
    """Another context on the same device, which bad input elsewhere must not disturb."""
    with RawDev(daemon.node(0)) as d:
        yield d, d.ctx_create()


def assert_unharmed(dev: RawDev, bystander: tuple[RawDev, int]) -> None:
    assert dev.query().state == uapi.DeviceState.OPERATIONAL
    other, ctx = bystander
    seqno = other.noop(ctx)
    assert other.wait_done(ctx, seqno).completed >= seqno


def test_version_and_query(daemon, dev):
    v = dev.call(uapi.ACCEL_CMD_GET_VERSION, uapi.accel_version())
    assert (v.abi_major, v.abi_minor) == (uapi.ACCEL_ABI_MAJOR, uapi.ACCEL_ABI_MINOR)
    assert uapi.cstr(v.driver_version) == daemon.attr(0, "driver_version")
    info = dev.query()
    assert info.index == 0
    assert uapi.cstr(info.uuid) == daemon.attr(0, "uuid")
    assert uapi.cstr(info.serial) == daemon.attr(0, "serial")
    assert info.memory_total == 256 << 20
    assert uapi.DeviceState(info.state) == uapi.DeviceState.OPERATIONAL
    assert info.capabilities & uapi.Cap.NOOP


def test_context_lifecycle_and_noop(daemon, dev):
    before = int(daemon.attr(0, "contexts"))
    ctx = dev.ctx_create()
    assert int(daemon.attr(0, "contexts")) == before + 1
    seqnos = [dev.noop(ctx) for _ in range(10)]
    assert seqnos == list(range(1, 11))
    done = dev.wait_done(ctx, 10)
    assert done.completed == 10 and done.timestamp_ns > 0
    dev.call(uapi.ACCEL_CMD_CTX_DESTROY, uapi.accel_ctx_destroy(ctx_id=ctx))
    assert int(daemon.attr(0, "contexts")) == before
    assert errname(lambda: dev.noop(ctx)) == "EBADFD"
    assert dev.ctx_create() > ctx  # the open file may create a new one; ids never reuse


def test_several_contexts_in_one_process(daemon):
    with RawDev(daemon.node(0)) as a, RawDev(daemon.node(0)) as b:
        ca, cb = a.ctx_create(), b.ctx_create()
        assert ca != cb
        assert a.noop(ca) == 1 and a.noop(ca) == 2
        assert b.noop(cb) == 1  # timelines are per context
        assert a.wait_done(ca, 2).completed == 2 and b.wait_done(cb, 1).completed == 1


@pytest.mark.parametrize(
    "payload, expected",
    [
        (b"", ""),  # a zero-length write never reaches the driver: the VFS returns 0
        (b"\x01\x02\x03", "EINVAL"),  # shorter than the header
        (header(uapi.ACCEL_CMD_DEVICE_QUERY.code, 1)[:-1], "EINVAL"),  # short header
        (header(uapi.ACCEL_CMD_DEVICE_QUERY.code, 1) + b"\0" * 10, "EINVAL"),  # short struct
        (header(uapi.ACCEL_CMD_DEVICE_QUERY.code, 1)
         + bytes(uapi.accel_device_info()) + b"\0", "EINVAL"),  # oversized
        (header(uapi.ACCEL_CMD_GET_VERSION.code, 1) + bytes(64 << 10), "EINVAL"),  # huge
        (b"\xde\xad\xbe\xef" * 16, "ENOTTY"),  # garbage
        (header(0xC0106199, 1) + bytes(16), "ENOTTY"),  # right type, unknown number
        (header(0xC0107299, 1) + bytes(16), "ENOTTY"),  # another driver's type
        (header(uapi.ACCEL_CMD_GET_VERSION.code ^ (1 << 16), 1)
         + bytes(uapi.accel_version()), "EINVAL"),  # known number, wrong struct size
        (header(uapi.ACCEL_CMD_GET_VERSION.code, 1, flags=1)
         + bytes(uapi.accel_version()), "EINVAL"),  # header flags must be 0
        (header(uapi.ACCEL_CMD_GET_VERSION.code, uapi.ACCEL_TAG_LIMIT)
         + bytes(uapi.accel_version()), "EINVAL"),  # tag not a valid offset
    ],
    ids=["empty-is-noop", "tiny", "short-header", "short-struct", "oversized", "huge", "garbage",
         "unknown-nr", "foreign-type", "wrong-size", "hdr-flags", "tag-limit"],
)
def test_malformed_writes(dev, bystander, payload, expected):
    assert errname(lambda: dev.write(payload)) == expected
    assert_unharmed(dev, bystander)


def test_nonzero_reserved_fields_and_flags(dev, bystander):
    ctx = dev.ctx_create()
    bad_reserved = uapi.accel_version()
    bad_reserved.reserved[2] = 7
    assert errname(lambda: dev.call(uapi.ACCEL_CMD_GET_VERSION, bad_reserved)) == "EINVAL"
    bad_pad = uapi.accel_submit_noop(ctx_id=ctx, pad=1)
    assert errname(lambda: dev.call(uapi.ACCEL_CMD_SUBMIT_NOOP, bad_pad)) == "EINVAL"
    bad_flags = uapi.accel_submit_noop(ctx_id=ctx, flags=4)
    assert errname(lambda: dev.call(uapi.ACCEL_CMD_SUBMIT_NOOP, bad_flags)) == "EINVAL"
    with RawDev(dev_path(dev)) as other:
        assert errname(lambda: other.ctx_create(flags=0x80)) == "EINVAL"
    assert dev.noop(ctx) == 1  # none of the refused submissions consumed a seqno
    assert_unharmed(dev, bystander)


def dev_path(dev: RawDev) -> str:
    return os.readlink(f"/proc/self/fd/{dev.fd}")


def test_reads_without_or_with_wrong_reply(dev, bystander):
    assert errname(lambda: dev.read(4096, 12345)) == "ENOMSG"  # nothing pending
    size = ctypes.sizeof(uapi.accel_version)
    dev.write(header(uapi.ACCEL_CMD_GET_VERSION.code, 77) + bytes(uapi.accel_version()))
    assert errname(lambda: dev.read(size - 1, 77)) == "EINVAL"  # too small: reply kept
    assert errname(lambda: dev.read(size, 78)) == "ENOMSG"  # another tag
    assert len(dev.read(size, 77)) == size
    assert errname(lambda: dev.read(size, 77)) == "ENOMSG"  # a reply is read once
    assert_unharmed(dev, bystander)


def test_duplicate_tag_and_too_many_unread_replies(dev, bystander):
    req = bytes(uapi.accel_version())
    code = uapi.ACCEL_CMD_GET_VERSION.code
    dev.write(header(code, 5) + req)
    assert errname(lambda: dev.write(header(code, 5) + req)) == "EEXIST"
    for tag in range(100, 100 + uapi.ACCEL_MAX_PENDING_REPLIES - 1):
        dev.write(header(code, tag) + req)
    assert errname(lambda: dev.write(header(code, 99999) + req)) == "EBUSY"
    dev.read(4096, 5)  # draining one makes room again
    dev.write(header(code, 99999) + req)
    for tag in [*range(100, 100 + uapi.ACCEL_MAX_PENDING_REPLIES - 1), 99999]:
        assert len(dev.read(4096, tag)) == len(req)
    assert_unharmed(dev, bystander)


def test_context_state_errors(daemon, dev, bystander):
    assert errname(lambda: dev.noop(1)) == "EBADFD"  # no context yet
    ctx = dev.ctx_create()
    assert errname(lambda: dev.ctx_create()) == "EEXIST"  # one open = one context
    assert errname(lambda: dev.wait(ctx, 5)) == "EINVAL"  # never submitted
    other, other_ctx = bystander
    # A handle that belongs to another context is refused, and the other is untouched.
    assert errname(lambda: dev.noop(other_ctx)) == "ENOENT"
    assert errname(lambda: dev.wait(other_ctx, 0)) == "ENOENT"
    destroy = uapi.accel_ctx_destroy(ctx_id=other_ctx)
    assert errname(lambda: dev.call(uapi.ACCEL_CMD_CTX_DESTROY, destroy)) == "ENOENT"
    assert_unharmed(dev, bystander)


def test_abi_major_mismatch_is_eproto(dev, bystander):
    assert errname(lambda: dev.ctx_create(major=uapi.ACCEL_ABI_MAJOR + 1)) == "EPROTO"
    assert errname(lambda: dev.ctx_create(minor=uapi.ACCEL_ABI_MINOR + 1)) == "EPROTO"
    assert dev.ctx_create() > 0  # the refusal left the file usable
    assert_unharmed(dev, bystander)


def test_many_threads_share_one_fd(daemon, dev, bystander):
    """Concurrent transactions on one fd: every thread gets its own replies."""
    ctx = dev.ctx_create()
    lock = threading.Lock()
    seen: list[int] = []
    failures: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            mine = []
            for _ in range(60):
                assert dev.query().index == 0
                mine.append(dev.noop(ctx))
            assert mine == sorted(mine)
            assert dev.wait_done(ctx, mine[-1]).completed >= mine[-1]
            with lock:
                seen.extend(mine)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert sorted(seen) == list(range(1, 8 * 60 + 1))  # no seqno lost or given twice
    assert_unharmed(dev, bystander)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=0, max_size=400))
def test_random_bytes_never_harm_the_driver(dev, bystander, payload):
    err = errname(lambda: dev.write(payload))
    assert err in ("", "EINVAL", "ENOTTY", "EBADFD", "EEXIST", "ENOENT", "EPROTO")
    assert_unharmed(dev, bystander)


def test_debugfs_contexts_lists_live_contexts(daemon, dev):
    """Regression: rendering this table once crashed the daemon (a field had moved)."""
    ctx = dev.ctx_create()
    rows = daemon.debug(0, "contexts").read_text().splitlines()
    assert rows[0].split() == ["id", "pid", "uid", "exclusive", "queues", "allocations", "state"]
    mine = [r.split() for r in rows[1:] if r.split()[0] == str(ctx)]
    assert mine == [[str(ctx), str(os.getpid()), str(os.getuid()), "0", "1", "0", "live"]]
    assert dev.query().state == uapi.DeviceState.OPERATIONAL  # and the daemon still serves
