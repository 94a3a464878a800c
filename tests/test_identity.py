"""Identity: what each device reports, stable across restarts, and ACCEL_VISIBLE_DEVICES."""

from __future__ import annotations

import json
import re

import pytest

IDENTITY_ATTRS = {
    "index": r"\d+",
    "name": r"Accel-Emu A1",
    "uuid": r"ACCEL-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}",
    "serial": r"\d{13}",
    "pci_bus_id": r"0000:[0-9a-f]{2}:00\.0",
    "numa_node": r"\d+",
    "package_id": r"\d+",
    "partition_id": r"\d+",
    "fabric_endpoint": r"fabric0:port\d+",
    "driver_version": r"\d+\.\d+\.\d+",
    "firmware_version": r"\d+\.\d+\.\d+",
    "isa_version": r"\d+\.\d+",
    "isa_stepping": r"A1",
    "capabilities": r"noop( \w+)+",
    "memory_total": str(256 << 20),
    "state": "operational",
}


@pytest.mark.parametrize("dev", [0, 1])
def test_every_identity_attribute(daemon, dev):
    for name, pattern in IDENTITY_ATTRS.items():
        assert re.fullmatch(pattern, daemon.attr(dev, name)), name
    assert daemon.attr(dev, "index") == str(dev)


def test_devices_are_distinct(daemon):
    for name in ("uuid", "serial", "pci_bus_id", "fabric_endpoint"):
        assert daemon.attr(0, name) != daemon.attr(1, name), name


def test_properties_match_sysfs(daemon):
    out = daemon.run_py("""
        import dataclasses, json, runtime
        print(json.dumps([dataclasses.asdict(runtime.get_device_properties(i)) for i in range(2)]))
    """)
    props = json.loads(out.stdout)
    for i, p in enumerate(props):
        assert p["index"] == i and p["physical_index"] == i
        for name in ("uuid", "serial", "pci_bus_id", "fabric_endpoint", "firmware_version",
                     "isa_version", "isa_stepping", "state", "name"):
            assert p[name] == daemon.attr(i, name), name
        assert p["total_memory"] == int(daemon.attr(i, "memory_total"))
        assert " ".join(p["capabilities"]) == daemon.attr(i, "capabilities")


def test_identity_is_stable_across_restarts(make_daemon):
    d = make_daemon(devices=2)
    before = [(d.attr(i, "uuid"), d.attr(i, "serial")) for i in range(2)]
    d.stop()
    d.devices = 3
    d.start()
    after = [(d.attr(i, "uuid"), d.attr(i, "serial")) for i in range(3)]
    assert after[:2] == before  # the same physical slots keep their identity
    assert after[2] not in before  # a new slot gets a new one


@pytest.mark.parametrize("spec, expected", [
    (None, [0, 1]),
    ("1", [1]),
    ("1,0", [1, 0]),
    ("0,7,1", [0]),  # an invalid entry hides itself and everything after it
    ("1,1", [1]),  # so does a repeat
    ("", []),
])
def test_visible_devices_by_index(daemon, spec, expected):
    env = {} if spec is None else {"ACCEL_VISIBLE_DEVICES": spec}
    out = daemon.run_py("""
        import runtime
        n = runtime.device_count()
        print(" ".join(str(runtime.get_device_properties(i).physical_index) for i in range(n)))
    """, **env)
    assert out.returncode == 0, out.stderr
    assert [int(x) for x in out.stdout.split()] == expected


def test_visible_devices_by_uuid_and_prefix(daemon):
    uuid1 = daemon.attr(1, "uuid")
    out = daemon.run_py("""
        import runtime
        print(runtime.device_count(), runtime.get_device_properties(0).uuid)
    """, ACCEL_VISIBLE_DEVICES=f"{uuid1[:14]}")
    assert out.stdout.split() == ["1", uuid1], out.stderr
