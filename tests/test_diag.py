"""accel-diag against real daemons: a healthy machine passes, a broken one names the cause."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LEVEL1 = ["driver", "enumeration", "device_state", "runtime_properties", "noop"]
LEVEL2 = LEVEL1 + ["noop_stream", "multi_context"]
LEVEL3 = LEVEL2 + ["multi_process"]


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
    assert [r[0] for r in rows] == names
    assert all(r[2] == "PASS" for r in rows), proc.stdout
    assert lines[-1] == f"{len(names)} passed, 0 failed, 0 skipped: PASS"
    # The no-ops really went through both devices' firmware.
    after = [int(daemon.attr(i, "completions")) for i in (0, 1)]
    assert all(a - b >= 1000 for a, b in zip(after, before))


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
                      "runtime_properties": "skip", "noop": "skip"}
    assert doc["by_name"]["device_state"]["detail"] == (
        f"accel0: failed [ENOPKG] {d.attr(0, 'failure')}")

    proc = diag(d, "-r", "1")
    assert proc.returncode == 1
    assert any(line.startswith("| device_state ") and "| FAIL " in line
               for line in proc.stdout.splitlines())
    assert proc.stdout.splitlines()[-1] == "2 passed, 1 failed, 2 skipped: FAIL"


def test_no_daemon_fails_the_driver_test(daemon, tmp_path: Path) -> None:
    proc = diag(daemon, "-r", "1", "--json", "--root", str(tmp_path))
    assert proc.returncode == 1
    doc = results(proc)
    assert doc["by_name"]["driver"]["status"] == "fail"
    assert "accel-emud --root" in doc["by_name"]["driver"]["detail"]
    assert [t["status"] for t in doc["tests"][1:]] == ["skip"] * 4


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
    assert [t["name"] for t in doc["tests"]] == LEVEL1 + ["extra_pass"] + LEVEL2[5:] + [
        "extra_skip", "extra_fail"]
    assert doc["by_name"]["extra_skip"] | {"seconds": 0} == {
        "name": "extra_skip", "level": 2, "status": "skip", "detail": "not on this machine",
        "seconds": 0}
    assert doc["by_name"]["extra_fail"]["status"] == "fail"
    assert doc["by_name"]["extra_fail"]["detail"] == "RuntimeError: boom"
