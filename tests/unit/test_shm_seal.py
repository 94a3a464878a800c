"""Sealing a module image against writing: the kernel's transient EBUSY is retried, and
only that (runtime/_shm.py ``seal_against_writing`` says where the busy answer comes from).

The kernel's refusal cannot be provoked on demand (it needs a page reference held by
reclaim at the right moment), so ``fcntl`` is replaced by one that refuses first and then
passes the call through to the real one: the seals checked afterwards are the kernel's."""

from __future__ import annotations

import errno
import fcntl
import os
from types import SimpleNamespace

import pytest

from abi import uapi
from runtime import _shm

pytestmark = pytest.mark.timeout(30)


def _refusing(times: int, err: int) -> tuple[SimpleNamespace, list[int]]:
    """A stand-in for the ``fcntl`` module whose F_ADD_SEALS fails ``times`` times with
    ``err``, then reaches the real call; and the list of the calls' commands it saw."""
    seen: list[int] = []

    def call(fd: int, cmd: int, arg: int = 0) -> int:
        seen.append(cmd)
        if cmd == uapi.F_ADD_SEALS and len(seen) <= times:
            raise OSError(err, os.strerror(err))
        return fcntl.fcntl(fd, cmd, arg)

    return SimpleNamespace(fcntl=call), seen


def test_a_busy_seal_is_retried_until_the_kernel_takes_it(monkeypatch) -> None:
    fake, seen = _refusing(3, errno.EBUSY)
    monkeypatch.setattr(_shm, "fcntl", fake)
    fd = _shm.sealed_memfd("module", 4096, b"\x01" * 4096)
    try:
        assert len(seen) == 4
        have = fcntl.fcntl(fd, uapi.F_GET_SEALS)
        assert have & uapi.ACCEL_SEALS_IMMUTABLE == uapi.ACCEL_SEALS_IMMUTABLE
        assert os.pread(fd, 4096, 0) == b"\x01" * 4096
    finally:
        os.close(fd)


def test_a_seal_still_busy_after_the_retry_time_raises_ebusy(monkeypatch) -> None:
    fake, seen = _refusing(10**6, errno.EBUSY)
    monkeypatch.setattr(_shm, "fcntl", fake)
    monkeypatch.setattr(_shm, "SEAL_BUSY_RETRY_S", 0.1)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as info:
        _shm.sealed_memfd("module", 4096, b"\x01" * 4096)
    assert info.value.errno == errno.EBUSY
    assert 2 <= len(seen) < 100  # retried, with pauses between
    assert set(os.listdir("/proc/self/fd")) <= before  # the memfd was closed


def test_other_refusals_are_not_retried(monkeypatch) -> None:
    fake, seen = _refusing(1, errno.EPERM)
    monkeypatch.setattr(_shm, "fcntl", fake)
    with pytest.raises(PermissionError):
        _shm.sealed_memfd("module", 4096, b"\x01" * 4096)
    assert len(seen) == 1


def test_pinned_memory_seals_without_the_write_seal() -> None:
    """Pinned memory is never sealed against writing (the device writes it), so it never
    waits on the kernel's page references at all."""
    fd = _shm.sealed_memfd("pinned", 4096)
    try:
        have = fcntl.fcntl(fd, uapi.F_GET_SEALS)
        assert have & uapi.ACCEL_SEALS_PINNED == uapi.ACCEL_SEALS_PINNED
        assert not have & uapi.F_SEAL_WRITE
    finally:
        os.close(fd)
