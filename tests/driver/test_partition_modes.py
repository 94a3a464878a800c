"""Compute partitions on a real mount (docs/partitions.md): a mode change on an idle device
makes partition nodes with their own UUID, memory slice and engine share; a held device
refuses a change (EBUSY) and a bad mode is EINVAL, both changing nothing; the mode and the
UUIDs survive a daemon restart; back to mode 1 the partitions are gone and the device is
whole and usable again."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from scenario import IDLE

from testkit.daemon import Daemon

MEMORY = 256 << 20  # the harness's --memory


def set_mode(d: Daemon, dev: int, mode: str) -> None:
    (d.root / "sys/class/accel" / f"accel{dev}" / "partition_mode").write_text(mode)


def names(d: Daemon) -> list[str]:
    return sorted(os.listdir(d.root / "dev/accel"))


def write_errno(path: Path, text: str) -> int:
    with pytest.raises(OSError) as exc:
        path.write_text(text)
    return exc.value.errno


@pytest.mark.timeout(90)
def test_split_in_two_and_whole_again(make_daemon):
    d = make_daemon(devices=1)
    whole_uuid = d.attr(0, "uuid")
    assert (d.attr(0, "partition_mode"), d.attr(0, "available_partition_modes")) == ("1", "1 2 4")
    set_mode(d, 0, "2")
    assert names(d) == ["accel0", "accel1", "accel2"]
    assert d.attr(0, "partitions") == "accel1 accel2"
    uuids = {d.attr(p, "uuid") for p in (1, 2)}
    assert len(uuids) == 2 and whole_uuid not in uuids
    for k, p in enumerate((1, 2)):
        assert d.attr(p, "state") == "operational"
        assert d.attr(p, "memory_total") == str(MEMORY // 2)
        assert (d.attr(p, "package_id"), d.attr(p, "partition_id")) == ("0", str(k))
        assert (d.attr(p, "compute_engines"), d.attr(p, "copy_engines")) == ("1", "1")
        assert d.attr(p, "pci_bus_id") == f"0000:41:00.{k + 1}"
    fw_pids = {d.debug(p, "fw_pid").read_text().strip() for p in (0, 1, 2)}
    assert len(fw_pids) == 3  # a firmware process of its own each
    # the whole device's own node is not for work while split
    with pytest.raises(OSError) as exc:
        os.open(d.node(0), os.O_RDWR)
    assert exc.value.errno == errno.EBUSY

    d.stop()  # the mode and the partitions' identities outlive the daemon
    d.start()
    assert d.attr(0, "partition_mode") == "2"
    assert {d.attr(p, "uuid") for p in (1, 2)} == uuids
    assert d.attr(1, "state") == "operational"

    set_mode(d, 0, "1")
    assert names(d) == ["accel0"]
    assert not (d.root / "sys/class/accel/accel1").exists()
    assert d.attr(0, "partitions") == ""
    os.close(os.open(d.node(0), os.O_RDWR))  # whole and usable again
    d.wait_attrs(0, IDLE)


@pytest.mark.timeout(60)
def test_refusals_change_nothing(make_daemon):
    d = make_daemon(devices=1)
    mode = d.root / "sys/class/accel/accel0/partition_mode"
    for bad in ("3", "0", "x", "-2"):
        assert write_errno(mode, bad) == errno.EINVAL, bad
    fd = os.open(d.node(0), os.O_RDWR)  # a process holds the device
    try:
        assert write_errno(mode, "2") == errno.EBUSY
    finally:
        os.close(fd)
    assert d.attr(0, "partition_mode") == "1"
    assert names(d) == ["accel0"]
    set_mode(d, 0, "4")  # idle now
    assert names(d) == ["accel0", "accel1", "accel2", "accel3", "accel4"]
    assert {d.attr(p, "memory_total") for p in range(1, 5)} == {str(MEMORY // 4)}
    held = os.open(d.node(3), os.O_RDWR)  # a partition held: no change either
    try:
        assert write_errno(mode, "1") == errno.EBUSY
    finally:
        os.close(held)
    assert names(d)[-1] == "accel4"
    set_mode(d, 0, "1")
    assert names(d) == ["accel0"]
