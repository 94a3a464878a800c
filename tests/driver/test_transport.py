"""The command transaction protocol, whatever the command: the header, sizes, tags and
replies, threads sharing a file, random bytes. Each bad-input test also checks that
nothing else was harmed: the same open file still answers, and a bystander context on the
same device keeps completing work. (Each command's own bad inputs: test_cmd_*.py.)
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rawdev import assert_unharmed, errname, header

from abi import uapi, userq
from tools.sysfs_tree import fdinfo


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


@pytest.mark.timeout(60)
def test_last_error_gives_a_raw_client_the_reason(daemon, dev, bystander):
    """The driver's reason for a refusal reaches the client that was refused: a read at
    ACCEL_LAST_ERROR_OFFSET (no context needed: CTX_CREATE's own refusals come before
    there is one), kept until the next refusal, never another file's; its context's
    fdinfo block shows the same line to the operator."""
    assert dev.last_error() == ""  # nothing refused yet
    arg = dev.ctx_args()
    small = os.memfd_create("small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(small, 64)
    fcntl.fcntl(small, uapi.F_ADD_SEALS, uapi.ACCEL_SEALS_PINNED)
    arg.db_page_fd = small
    try:
        assert errname(lambda: dev.call(uapi.ACCEL_CMD_CTX_CREATE, arg)) == "EINVAL"
    finally:
        for fd in (*dev._lend, small):
            os.close(fd)
    want = (f"CTX_CREATE EINVAL: doorbell page: 64 bytes, {userq.ACCEL_DB_PAGE_SIZE} "
            "needed\n")
    assert dev.last_error() == want
    assert dev.read(10, uapi.ACCEL_LAST_ERROR_OFFSET) == want[:10].encode()  # cut to the read
    ctx = dev.ctx_create()  # a success keeps the reason: it is the last *refused* command's
    assert dev.last_error() == want
    assert errname(lambda: dev.write(b"\x01\x02\x03")) == "EINVAL"
    assert dev.last_error().startswith("write EINVAL: short write: 3 bytes")
    assert bystander[0].last_error() == ""  # per open file
    blocks = {b["drm-client-id"]: b for b in fdinfo(daemon.attr(0, "fdinfo"))}
    assert blocks[ctx]["accel-last-error"] == dev.last_error().strip()
    assert "accel-last-error" not in blocks[bystander[1]]
    assert_unharmed(dev, bystander)
