"""accel-diag against real daemons: a healthy machine passes, a broken one names the cause."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LEVEL1 = ["driver", "enumeration", "device_state", "runtime_properties", "noop",
          "memory_roundtrip", "stream_order"]
LEVEL2 = LEVEL1 + ["noop_stream", "multi_context", "copy_bandwidth", "events", "graph_replay",
                   "fault_isolation", "managed_migration"]
LEVEL3 = LEVEL2 + ["multi_process", "peer_copy", "multi_process_memory", "ipc"]


def diag(d, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.accel_diag", *args], capture_output=True,
                          text=True, env=env or d.env(), cwd=REPO, timeout=120)


def results(proc: subprocess.CompletedProcess[str]) -> dict:
    doc = json.loads(proc.stdout)
    doc["by_name"] = {t["name"]: t for t in doc["tests"]}
    return doc


def test_level1_passes_on_a_healthy_daemon(daemon) -> None:
    proc = diag(daemon, "-r", "1", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = results(proc)
    assert doc["level"] == 1 and doc["result"] == "pass"
    assert doc["devices"] == ["accel0", "accel1"]
    assert [t["name"] for t in doc["tests"]] == LEVEL1
    assert all(t["status"] == "pass" for t in doc["tests"]), doc["tests"]
    assert daemon.attr(1, "pci_bus_id") in doc["by_name"]["enumeration"]["detail"]


@pytest.mark.parametrize("level, names", [("2", LEVEL2), ("long", LEVEL3)])
def test_higher_levels_include_lower_ones_and_pass(daemon, level: str, names: list[str]) -> None:
    before = [int(daemon.attr(i, "completions")) for i in (0, 1)]
    proc = diag(daemon, "-r", level)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("| ")][1:]
    rows = [r for r in rows if r[0]]  # a long detail wraps onto rows of its own
    assert [r[0] for r in rows] == names
    assert all(r[2] == "PASS" for r in rows), proc.stdout
    assert lines[-1] == f"{len(names)} passed, 0 failed, 0 skipped: PASS"
    # The no-ops really went through both devices' firmware.
    after = [int(daemon.attr(i, "completions")) for i in (0, 1)]
    assert all(a - b >= 1000 for a, b in zip(after, before))


def test_level3_json_exercises_every_capability_and_leaves_nothing_behind(daemon) -> None:
    """Every test passes with a detail that shows what it checked; afterwards the devices
    hold no memory, no context and no process of the run (its workers included)."""
    faults = [int(daemon.attr(i, "managed_faults")) for i in (0, 1)]
    proc = diag(daemon, "-r", "3", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = results(proc)
    assert doc["level"] == 3 and doc["result"] == "pass"
    assert [t["name"] for t in doc["tests"]] == LEVEL3
    assert all(t["status"] == "pass" for t in doc["tests"]), doc["tests"]
    detail = {name: t["detail"] for name, t in doc["by_name"].items()}
    for dev in ("accel0", "accel1"):
        assert f"{dev} 12 MiB x2 ok, free -24 MiB then back to" in detail["memory_roundtrip"]
        assert f"{dev} ok" in detail["stream_order"]
        assert re.search(rf"{dev} H2D [\d.]+ GB/s, D2H [\d.]+ GB/s", detail["copy_bandwidth"])
        assert re.search(rf"{dev} 16 MiB memset [\d.]+ ms", detail["events"])
        assert f"{dev} 10 replays ok" in detail["graph_replay"]
        assert f"{dev} COPY EFAULT at 0x80000000000, other stream ok" in detail["fault_isolation"]
        m = re.search(rf"{dev} 16 pages, managed_faults \+(\d+)", detail["managed_migration"])
        assert m and int(m.group(1)) >= 16, detail["managed_migration"]
    assert re.fullmatch(r"8 MiB: accel0 -> accel1 ok, [\d.]+ GB/s; accel1 -> accel0 ok, "
                        r"[\d.]+ GB/s", detail["peer_copy"]), detail["peer_copy"]
    assert re.fullmatch(r"3 processes x 2 device\(s\) x 8 MiB verified, \d+ MiB more in use; "
                        r"memory_used and contexts back to accel0 0 MiB/1, accel1 0 MiB/1 "
                        r"[\d.]+ s after the workers exited", detail["multi_process_memory"]), \
        detail["multi_process_memory"]
    assert re.fullmatch(r"child pid \d+ read 4 MiB from 2 device\(s\) and its writes came back",
                        detail["ipc"]), detail["ipc"]
    for i in (0, 1):
        # The driver saw the managed pages migrate (published when the firmware idles) ...
        deadline = time.monotonic() + 5
        while int(daemon.attr(i, "managed_faults")) < faults[i] + 16:
            assert time.monotonic() < deadline, daemon.attr(i, "managed_faults")
            time.sleep(0.02)
        # ... and the run left nothing: no memory, context or process charged.
        daemon.wait_attrs(i, {"memory_used": "0", "contexts": "0",
                              "processes": "pid device_bytes", "managed_resident": "0"})


def test_one_device_skips_peer_copy_with_its_reason(make_daemon) -> None:
    d = make_daemon(devices=1)
    proc = diag(d, "-r", "3", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = results(proc)
    assert doc["devices"] == ["accel0"] and doc["result"] == "pass"
    assert [t["name"] for t in doc["tests"]] == LEVEL3
    assert {n: t["status"] for n, t in doc["by_name"].items() if t["status"] != "pass"} == {
        "peer_copy": "skip"}, doc["tests"]
    assert doc["by_name"]["peer_copy"]["detail"] == "needs 2 devices, 1 visible"
    assert "accel1" not in json.dumps(doc["tests"])
    d.wait_attrs(0, {"memory_used": "0", "contexts": "0"})


def test_a_failing_capability_names_the_cause_and_the_rest_still_run(make_daemon) -> None:
    """A per-process limit of 48 MiB leaves every test room but the 64 MiB bandwidth copy:
    that one fails with the runtime's out-of-memory message, nothing else is affected."""
    d = make_daemon(devices=1, extra=["--process-memory-limit", "48M"])
    proc = diag(d, "-r", "2", "--json")
    assert proc.returncode == 1
    doc = results(proc)
    assert doc["result"] == "fail"
    assert [t["name"] for t in doc["tests"]] == LEVEL2
    assert {n: t["status"] for n, t in doc["by_name"].items() if t["status"] != "pass"} == {
        "copy_bandwidth": "fail"}, doc["tests"]
    assert doc["by_name"]["copy_bandwidth"]["detail"].startswith(
        "OutOfMemoryError: accel out of memory. Tried to allocate 64.00 MiB.")
    d.wait_attrs(0, {"memory_used": "0", "contexts": "0"})


def test_one_device_by_index_or_visible_devices(daemon) -> None:
    doc = results(diag(daemon, "-r", "1", "--json", "-i", "1"))
    assert doc["devices"] == ["accel1"] and doc["result"] == "pass"
    doc = results(diag(daemon, "-r", "1", "--json", env=daemon.env(ACCEL_VISIBLE_DEVICES="1")))
    assert doc["devices"] == ["accel1"] and doc["result"] == "pass"
    proc = diag(daemon, "-r", "1", "-i", "5")
    assert proc.returncode == 2 and "matches no device" in proc.stderr


def test_missing_firmware_fails_device_state_and_skips_what_needs_it(make_daemon,
                                                                      tmp_path: Path) -> None:
    fw_dir = tmp_path / "no-firmware"
    fw_dir.mkdir()
    d = make_daemon(firmware_dir=fw_dir)
    proc = diag(d, "-r", "1", "--json")
    assert proc.returncode == 1
    doc = results(proc)
    assert doc["result"] == "fail"
    status = {name: t["status"] for name, t in doc["by_name"].items()}
    assert status == {"driver": "pass", "enumeration": "pass", "device_state": "fail",
                      "runtime_properties": "skip", "noop": "skip", "memory_roundtrip": "skip",
                      "stream_order": "skip"}
    assert doc["by_name"]["memory_roundtrip"]["detail"] == "needs noop, which did not pass"
    assert doc["by_name"]["device_state"]["detail"] == (
        f"accel0: failed [ENOPKG] {d.attr(0, 'failure')}")

    proc = diag(d, "-r", "1")
    assert proc.returncode == 1
    assert any(line.startswith("| device_state ") and "| FAIL " in line
               for line in proc.stdout.splitlines())
    assert proc.stdout.splitlines()[-1] == "2 passed, 1 failed, 4 skipped: FAIL"


def test_no_daemon_fails_the_driver_test(daemon, tmp_path: Path) -> None:
    proc = diag(daemon, "-r", "1", "--json", "--root", str(tmp_path))
    assert proc.returncode == 1
    doc = results(proc)
    assert doc["by_name"]["driver"]["status"] == "fail"
    assert "accel-emud --root" in doc["by_name"]["driver"]["detail"]
    assert [t["status"] for t in doc["tests"][1:]] == ["skip"] * (len(LEVEL1) - 1)


def test_a_capability_adds_tests_by_registering_them(daemon) -> None:
    code = textwrap.dedent("""
        import sys
        from tools import accel_diag as d

        @d.diag_test(1, needs=("noop",))
        def extra_pass(diag):
            return "saw " + ",".join(diag.devices)

        @d.diag_test(2)
        def extra_skip(diag):
            raise d.Skip("not on this machine")

        @d.diag_test(2)
        def extra_fail(diag):
            raise RuntimeError("boom")

        sys.exit(d.main(sys.argv[1:]))
    """)
    run = lambda level: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, "-r", level, "--json"], capture_output=True, text=True,
        env=daemon.env(), cwd=REPO, timeout=120)
    proc = run("1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = results(proc)
    assert [t["name"] for t in doc["tests"]] == LEVEL1 + ["extra_pass"]
    assert doc["by_name"]["extra_pass"]["detail"] == "saw accel0,accel1"

    proc = run("2")
    assert proc.returncode == 1
    doc = results(proc)
    assert [t["name"] for t in doc["tests"]] == LEVEL1 + ["extra_pass"] + LEVEL2[len(LEVEL1):] + [
        "extra_skip", "extra_fail"]
    assert doc["by_name"]["extra_skip"] | {"seconds": 0} == {
        "name": "extra_skip", "level": 2, "status": "skip", "detail": "not on this machine",
        "seconds": 0}
    assert doc["by_name"]["extra_fail"]["status"] == "fail"
    assert doc["by_name"]["extra_fail"]["detail"] == "RuntimeError: boom"
