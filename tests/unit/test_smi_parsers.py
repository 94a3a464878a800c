"""accel-smi's parsers of the attributes the driver is gaining (``fdinfo``, ``power``,
``utilization``), in this process: no mount has them yet, so the text they will hold is
given here in the format they are specified to have (docs/tools.md); the tests on real
mounts (tests/tools/test_smi_habits.py) check the N/A side and take over once the files
exist."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from tools.accel_smi import _xml_add
from tools.sysfs_tree import fdinfo, number, processes, typed

FDINFO = ("pid: 41\ndrm-client-id: 3\ndrm-engine-compute: 1500000 ns\n"
          "drm-engine-copy: 20 ns\ndrm-memory-vram: 4096 KiB\n\n"
          "pid: 42\ndrm-client-id: 4\ndrm-engine-compute: 0 ns\n"
          "drm-engine-copy: 0 ns\ndrm-memory-vram: 0 KiB\n")


def test_fdinfo_blocks_become_typed_records() -> None:
    assert fdinfo(FDINFO) == [
        {"pid": 41, "drm-client-id": 3, "drm-engine-compute": 1500000, "drm-engine-copy": 20,
         "drm-memory-vram": 4096},
        {"pid": 42, "drm-client-id": 4, "drm-engine-compute": 0, "drm-engine-copy": 0,
         "drm-memory-vram": 0}]
    assert typed("fdinfo", FDINFO) == fdinfo(FDINFO)
    assert fdinfo("") == []  # no context this viewer may see: an empty list, not null


@pytest.mark.parametrize("name, text, value", [
    ("power", "87.5", 87.5), ("power_limit", "300", 300.0), ("utilization", "42", 42),
    ("utilization_copy", "", None),
])
def test_new_numbers_are_typed(name: str, text: str, value: float | None) -> None:
    assert typed(name, text) == value and type(typed(name, text)) is type(value)


def test_number_is_none_for_na() -> None:
    assert [number(v) for v in ("87.5", "3", "", None, "hot")] == [87.5, 3, None, None, None]


def test_processes_rows() -> None:
    assert processes("pid device_bytes\n7 4096\n9 0") == [
        {"pid": 7, "used_memory": 4096}, {"pid": 9, "used_memory": 0}]
    assert processes("pid device_bytes") == []


def test_fdinfo_records_are_valid_xml() -> None:
    dev = ET.Element("device")
    _xml_add(dev, "fdinfo", fdinfo(FDINFO))
    _xml_add(dev, "power", None)
    back = ET.fromstring(ET.tostring(dev))
    assert [c.findtext("drm-engine-compute") for c in back.find("fdinfo")] == ["1500000", "0"]
    assert back.findtext("power") == "N/A"
