"""accel-diag against real daemons: a healthy machine passes, a broken one names the cause."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import termios
import textwrap
import threading
from pathlib import Path

import pytest

from testkit import REPO
from testkit.waiting import wait_until

LEVEL1 = ["driver", "enumeration", "device_state", "runtime_properties", "noop",
          "memory_roundtrip", "stream_order"]
LEVEL2 = LEVEL1 + ["noop_stream", "multi_context", "copy_bandwidth", "events", "graph_replay",
                   "fault_isolation", "managed_migration", "kernels", "jit_cache", "matrix_unit"]
LEVEL3 = LEVEL2 + ["multi_process", "peer_copy", "multi_process_memory", "ipc",
                   "compute_stress", "memory_pattern"]
#: Tests of the whole machine; every other test runs once per device.
MACHINE = {"driver", "enumeration", "multi_process", "peer_copy", "multi_process_memory", "ipc"}
OK = ("pass", "warn")  # a warn is a passed test whose figure is off its baseline
TEST_KEYS = {"name", "level", "device", "result", "reason", "detail", "seconds", "figures"}


def diag(d, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.accel_diag", *args], capture_output=True,
                          text=True, env=env or d.env(), cwd=REPO, timeout=120)


def expand(names: list[str], devices: list[str]) -> list[tuple[str, str | None]]:
    """(test, device) in run order: a per-device test once per device."""
    return [(n, None) if n in MACHINE else (n, dev) for n in names
            for dev in ([None] if n in MACHINE else devices)]


def results(proc: subprocess.CompletedProcess[str]) -> dict:
    doc = json.loads(proc.stdout)
    assert doc["version"] == 1
    assert all(set(t) == TEST_KEYS for t in doc["tests"]), doc["tests"]
    doc["by"] = {(t["name"], t["device"]): t for t in doc["tests"]}
    doc["order"] = [(t["name"], t["device"]) for t in doc["tests"]]
    return doc


def detail(doc: dict, name: str) -> str:
    """The details of every result of ``name`` (all its devices), joined."""
    return "; ".join(t["detail"] for t in doc["tests"] if t["name"] == name)


def text_rows(stdout: str) -> list[list[str]]:
    """The rows of the human table (a long detail wraps onto rows of its own: dropped)."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines()
            if line.startswith("| ")][1:]
    return [r for r in rows if r[0]]


@pytest.mark.timeout(60)
def test_level1_passes_on_a_healthy_daemon(daemon) -> None:
    proc = diag(daemon, "-r", "1", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = results(proc)
    assert doc["level"] == 1 and doc["run"] == "1" and doc["result"] in OK
    assert doc["devices"] == ["accel0", "accel1"]
    assert doc["order"] == expand(LEVEL1, ["accel0", "accel1"])
    assert all(t["result"] in OK for t in doc["tests"]), doc["tests"]
    assert all(t["reason"] == "ok" for t in doc["tests"] if t["result"] == "pass")
    assert daemon.attr(1, "pci_bus_id") in detail(doc, "enumeration")
    assert proc.stderr == ""  # no progress display in --json mode, nor when piped


@pytest.mark.timeout(120)
def test_level2_text_includes_level1_and_runs_the_kernels(daemon) -> None:
    before = [int(daemon.attr(i, "completions")) for i in (0, 1)]
    proc = diag(daemon, "-r", "medium")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = text_rows(proc.stdout)
    assert [(r[0], None if r[2] == "-" else r[2]) for r in rows] == expand(
        LEVEL2, ["accel0", "accel1"])
    assert all(r[3] in ("PASS", "WARN") for r in rows), proc.stdout
    assert all(r[3] == "PASS" for r in rows if r[0] in ("kernels", "jit_cache", "matrix_unit"))
    assert re.fullmatch(r"\d+ passed, \d+ warned, 0 failed, 0 skipped: (PASS|WARN)",
                        proc.stdout.splitlines()[-1]), proc.stdout.splitlines()[-1]
    assert proc.stderr == ""
    # The no-ops really went through both devices' firmware.
    after = [int(daemon.attr(i, "completions")) for i in (0, 1)]
    assert all(a - b >= 1000 for a, b in zip(after, before))


@pytest.mark.timeout(200)
def test_level3_json_exercises_every_capability_and_leaves_nothing_behind(daemon) -> None:
    """Every test passes with a detail that shows what it checked; afterwards the devices
    hold no memory, no context and no process of the run (its workers included)."""
    faults = [int(daemon.attr(i, "managed_faults")) for i in (0, 1)]
    proc = diag(daemon, "-r", "3", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = results(proc)
    assert doc["level"] == 3 and doc["result"] in OK
    assert doc["order"] == expand(LEVEL3, ["accel0", "accel1"])
    assert all(t["result"] in OK for t in doc["tests"]), doc["tests"]
    for dev in ("accel0", "accel1"):
        by = {name: t["detail"] for (name, d), t in doc["by"].items() if d in (dev, None)}
        assert f"{dev} 12 MiB x2 ok, free -24 MiB then back to" in by["memory_roundtrip"]
        assert f"{dev} ok" in by["stream_order"]
        assert re.search(rf"{dev} H2D [\d.]+ GB/s, D2H [\d.]+ GB/s", by["copy_bandwidth"])
        assert re.search(rf"{dev} 16 MiB memset [\d.]+ ms", by["events"])
        assert f"{dev} 10 replays ok" in by["graph_replay"]
        assert (f"{dev} COPY EFAULT at 0x80000000000 (diagnostic, not counted), other "
                "stream ok") in by["fault_isolation"]
        m = re.search(rf"{dev} 16 pages, managed_faults \+(\d+)", by["managed_migration"])
        assert m and int(m.group(1)) >= 16, by["managed_migration"]
        assert by["kernels"] == (f"{dev} fill, copy, saxpy, reduce_sum, gemm, softmax_rows "
                                 "match numpy")
        m = re.fullmatch(rf"{dev} jit_compiles (\d+) -> (\d+) -> (\d+), "
                         rf"jit_hits (\d+) -> (\d+) -> (\d+)", by["jit_cache"])
        assert m, by["jit_cache"]
        c0, c1, c2, _, h1, h2 = map(int, m.groups())
        assert c1 > c0 and c2 == c1 and h2 > h1
        assert by["matrix_unit"] == f"{dev} matmul 200x96 @ 96x160 matches numpy"
        assert re.fullmatch(rf"{dev} \d+ saxpy launches of 1048576 in [\d.]+ s \(\d+ M "
                            r"elements/s\), result exact", by["compute_stress"]), \
            by["compute_stress"]
        assert by["memory_pattern"] == (f"{dev} 128 MiB: walking ones, address-in-address, "
                                        "random ok")
    assert re.fullmatch(r"8 MiB: accel0 -> accel1 ok, [\d.]+ GB/s; accel1 -> accel0 ok, "
                        r"[\d.]+ GB/s", detail(doc, "peer_copy")), detail(doc, "peer_copy")
    assert re.fullmatch(r"3 processes x 2 device\(s\) x 8 MiB verified, \d+ MiB more in use; "
                        r"memory_used and contexts back to accel0 0 MiB/1, accel1 0 MiB/1 "
                        r"[\d.]+ s after the workers exited", detail(doc, "multi_process_memory"))
    assert re.fullmatch(r"child pid \d+ read 4 MiB from 2 device\(s\) and its writes came back",
                        detail(doc, "ipc")), detail(doc, "ipc")
    for i in (0, 1):
        # The driver saw the managed pages migrate (published when the firmware idles) ...
        wait_until(lambda: int(daemon.attr(i, "managed_faults")), 30,
                   f"accel{i}'s managed_faults to pass {faults[i] + 16}",
                   ok=lambda now: now >= faults[i] + 16)
        # ... and the run left nothing: no memory, context or process charged.
        daemon.wait_attrs(i, {"memory_used": "0", "contexts": "0",
                              "processes": "pid device_bytes", "managed_resident": "0"})


@pytest.mark.timeout(60)
def test_one_device_skips_peer_copy_as_not_applicable(make_daemon) -> None:
    d = make_daemon(devices=1)
    proc = diag(d, "-r", "peer_copy", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = results(proc)
    assert doc["devices"] == ["accel0"] and doc["result"] in OK
    assert doc["run"] == "peer_copy" and doc["level"] is None
    # the named test and what it needs, in run order
    assert [n for n, _ in doc["order"]] == ["driver", "enumeration", "device_state", "noop",
                                           "memory_roundtrip", "stream_order", "events",
                                           "peer_copy"]
    peer = doc["by"][("peer_copy", None)]
    assert (peer["result"], peer["reason"], peer["detail"]) == (
        "skip", "not-applicable", "needs 2 devices, 1 visible")
    assert "accel1" not in json.dumps(doc["tests"])
    d.wait_attrs(0, {"memory_used": "0", "contexts": "0"})


@pytest.mark.timeout(120)
def test_a_failing_capability_names_the_cause_and_the_rest_still_run(make_daemon) -> None:
    """A per-process limit of 48 MiB leaves every test room but the 64 MiB bandwidth copy:
    that one fails with the runtime's out-of-memory message, nothing else is affected."""
    d = make_daemon(devices=1, extra=["--process-memory-limit", "48M"])
    proc = diag(d, "-r", "2", "--json")
    assert proc.returncode == 1
    doc = results(proc)
    assert doc["result"] == "fail"
    assert doc["order"] == expand(LEVEL2, ["accel0"])
    assert {n: t["result"] for (n, _), t in doc["by"].items() if t["result"] not in OK} == {
        "copy_bandwidth": "fail"}, doc["tests"]
    failed = doc["by"][("copy_bandwidth", "accel0")]
    assert failed["reason"] == "error" and failed["figures"] == []
    assert failed["detail"].startswith(
        "OutOfMemoryError: accel out of memory. Tried to allocate 64.00 MiB.")
    d.wait_attrs(0, {"memory_used": "0", "contexts": "0"})


@pytest.mark.timeout(90)
def test_a_failed_device_skips_only_its_own_dependent_tests(make_daemon) -> None:
    """accel1 fails its bring-up (an injected mailbox failure): its device_state fails as
    device-failed and everything on it that needs that skips as dependency-failed, while
    accel0 runs and passes every test; a test of the whole machine that needs every device
    skips too."""
    d = make_daemon(devices=2, extra=["--fail-step", "accel1:mailbox"])
    proc = diag(d, "-r", "1", "--json")
    assert proc.returncode == 1
    doc = results(proc)
    assert doc["result"] == "fail" and doc["order"] == expand(LEVEL1, ["accel0", "accel1"])
    got = {key: (t["result"], t["reason"]) for key, t in doc["by"].items()}
    assert got.pop(("device_state", "accel1")) == ("fail", "device-failed")
    assert doc["by"][("device_state", "accel1")]["detail"] == (
        f"accel1: failed [ECANCELED] {d.attr(1, 'failure')}")
    for name in LEVEL1[3:]:
        assert got.pop((name, "accel1")) == ("skip", "dependency-failed")
        assert got.pop((name, "accel0"))[0] in OK
    assert all(r in OK for r, _ in got.values()), got
    assert doc["by"][("memory_roundtrip", "accel1")]["detail"] == "needs noop, which did not pass"
    assert doc["counts"]["fail"] == 1 and doc["counts"]["skip"] == len(LEVEL1) - 3

    doc = results(diag(d, "-r", "stream_order,peer_copy", "--json"))
    peer = doc["by"][("peer_copy", None)]
    assert (peer["result"], peer["reason"]) == ("skip", "dependency-failed")
    assert peer["detail"] == "needs events, which did not pass"
    assert doc["by"][("stream_order", "accel0")]["result"] == "pass"


@pytest.mark.timeout(60)
def test_list_names_every_test_with_its_level_and_description() -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.accel_diag", "--list"],
                          capture_output=True, text=True, cwd=REPO, timeout=30)
    assert proc.returncode == 0, proc.stderr
    tests, _, legend = proc.stdout.partition("\n\nReason codes:\n")
    rows = [line.split(None, 4) for line in tests.splitlines()[2:]
            if not line.startswith(" ")]  # a wrapped description continues indented
    assert [r[0] for r in rows] == LEVEL1 + LEVEL2[len(LEVEL1):] + LEVEL3[len(LEVEL2):]
    levels = {r[0]: int(r[1]) for r in rows}
    assert all(levels[n] == 1 for n in LEVEL1) and all(levels[n] == 3 for n in LEVEL3[-6:])
    assert {r[0] for r in rows if r[2] == "machine"} == MACHINE
    assert all(len(r) == 5 and r[4].strip() for r in rows), rows
    assert [line.split()[0] for line in legend.splitlines()] == [
        "ok", "bandwidth-low", "latency-high", "mismatch", "check-failed", "device-failed",
        "error", "dependency-failed", "not-applicable"]


@pytest.mark.timeout(60)
def test_unknown_names_exit_2_with_the_list_of_names() -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.accel_diag", "-r", "noop,nosuch"],
                          capture_output=True, text=True, cwd=REPO, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("accel-diag: no test named nosuch; the tests are: driver ")
    assert all(name in proc.stderr.split() for name in LEVEL3)
    proc = subprocess.run([sys.executable, "-m", "tools.accel_diag", "-r", "4"],
                          capture_output=True, text=True, cwd=REPO, timeout=30)
    assert proc.returncode == 2 and "level must be 1, 2 or 3" in proc.stderr


_THRESHOLDS = textwrap.dedent("""
    import sys
    from tools import accel_diag as d

    d.NOOP_WARN_ABOVE = 1.0     # no no-op is as fast as a pipe round trip
    d.COPY_WARN_BELOW = 100.0   # nor a device copy 100 times as fast as memcpy
    sys.exit(d.main(sys.argv[1:]))
""")


@pytest.mark.timeout(60)
def test_a_figure_past_its_threshold_warns_without_failing_the_run(daemon) -> None:
    """With thresholds no device can meet, the figures warn with their reason codes, and
    the run still exits 0 (Warn is shown, never a failure)."""
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-c", _THRESHOLDS, "-r", "copy_bandwidth", *args], capture_output=True,
        text=True, env=daemon.env(), cwd=REPO, timeout=60)
    proc = run("--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = results(proc)
    assert doc["result"] == "warn" and doc["counts"]["fail"] == 0
    for dev in ("accel0", "accel1"):
        noop = doc["by"][("noop", dev)]
        assert (noop["result"], noop["reason"]) == ("warn", "latency-high")
        (fig,) = noop["figures"]
        assert fig["name"] == "no-op round trip" and fig["unit"] == "us"
        assert fig["baseline"]["name"] == "host pipe round trip" and fig["baseline"]["value"] > 0
        assert fig["ratio"] == pytest.approx(fig["value"] / fig["baseline"]["value"], rel=1e-3)
        assert fig["warn_above"] == 1.0 and fig["warn_below"] is None and fig["ratio"] > 1
        copy = doc["by"][("copy_bandwidth", dev)]
        assert (copy["result"], copy["reason"]) == ("warn", "bandwidth-low")
        assert [f["name"] for f in copy["figures"]] == ["H2D bandwidth", "D2H bandwidth"]
        assert all(f["unit"] == "GB/s" and f["baseline"]["name"] == "host memcpy"
                   and f["warn_below"] == 100.0 for f in copy["figures"])
        # the bytes were still checked: a warn is a passed test
        assert doc["by"][("memory_roundtrip", dev)]["result"] == "pass"
    proc = run()
    assert proc.returncode == 0
    rows = text_rows(proc.stdout)
    assert {(r[0], r[3], r[4]) for r in rows if r[0] in ("noop", "copy_bandwidth")} == {
        ("noop", "WARN", "latency-high"), ("copy_bandwidth", "WARN", "bandwidth-low")}
    assert proc.stdout.splitlines()[-1].endswith(": WARN")


@pytest.mark.timeout(60)
def test_progress_is_shown_only_on_a_terminal(daemon) -> None:
    """stderr a terminal: a progress bar naming the running test; piped: nothing."""
    master, slave = os.openpty()
    # a new pty is 0 columns wide, where tqdm draws nothing: give it a terminal's size
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    shown: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(master, shown), daemon=True)
    reader.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "tools.accel_diag", "-r", "noop"],
                              stdout=subprocess.PIPE, stderr=slave, text=True,
                              env=daemon.env(), cwd=REPO, timeout=60)
    finally:
        os.close(slave)
        reader.join(timeout=5)
        os.close(master)
    assert proc.returncode == 0, proc.stdout
    text = b"".join(shown).decode(errors="replace")
    assert "noop on accel1" in text and "test/s" in text, text
    assert "test/s" not in proc.stdout


def _drain(fd: int, into: list[bytes]) -> None:
    """Collect what is written to a pty until its other end is closed (EIO)."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        into.append(chunk)


@pytest.mark.timeout(60)
def test_one_device_by_index_or_visible_devices(daemon) -> None:
    doc = results(diag(daemon, "-r", "1", "--json", "-i", "1"))
    assert doc["devices"] == ["accel1"] and doc["result"] in OK
    doc = results(diag(daemon, "-r", "1", "--json", env=daemon.env(ACCEL_VISIBLE_DEVICES="1")))
    assert doc["devices"] == ["accel1"] and doc["result"] in OK
    proc = diag(daemon, "-r", "1", "-i", "5")
    assert proc.returncode == 2 and "matches no device" in proc.stderr


@pytest.mark.timeout(60)
def test_missing_firmware_fails_device_state_and_skips_what_needs_it(make_daemon,
                                                                      tmp_path: Path) -> None:
    fw_dir = tmp_path / "no-firmware"
    fw_dir.mkdir()
    d = make_daemon(firmware_dir=fw_dir)
    proc = diag(d, "-r", "1", "--json")
    assert proc.returncode == 1
    doc = results(proc)
    assert doc["result"] == "fail"
    got = {name: (t["result"], t["reason"]) for (name, _), t in doc["by"].items()}
    skipped = ("skip", "dependency-failed")
    assert got == {"driver": ("pass", "ok"), "enumeration": ("pass", "ok"),
                   "device_state": ("fail", "device-failed"), "runtime_properties": skipped,
                   "noop": skipped, "memory_roundtrip": skipped, "stream_order": skipped}
    assert doc["by"][("memory_roundtrip", "accel0")]["detail"] == "needs noop, which did not pass"
    assert doc["by"][("device_state", "accel0")]["detail"] == (
        f"accel0: failed [ENOPKG] {d.attr(0, 'failure')}")

    proc = diag(d, "-r", "1")
    assert proc.returncode == 1
    assert ["device_state", "1", "accel0", "FAIL", "device-failed"] in [
        r[:5] for r in text_rows(proc.stdout)]
    assert proc.stdout.splitlines()[-1] == "2 passed, 0 warned, 1 failed, 4 skipped: FAIL"


@pytest.mark.timeout(60)
def test_no_daemon_fails_the_driver_test(daemon, tmp_path: Path) -> None:
    proc = diag(daemon, "-r", "1", "--json", "--root", str(tmp_path))
    assert proc.returncode == 1
    doc = results(proc)
    driver = doc["by"][("driver", None)]
    assert (driver["result"], driver["reason"]) == ("fail", "check-failed")
    assert "accel-emud --root" in driver["detail"]
    assert [(t["result"], t["reason"]) for t in doc["tests"][1:]] == [
        ("skip", "dependency-failed")]  # no device is seen: nothing runs per device


@pytest.mark.timeout(60)
def test_a_capability_adds_tests_by_registering_them(daemon) -> None:
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from tools import accel_diag as d

        @d.diag_test(1, needs=("noop",))
        def extra_pass(diag):
            return "saw " + ",".join(diag.devices)

        @d.diag_test(2, per_device=True)
        def extra_skip(diag, index, name):
            raise d.Skip("not on " + name)

        @d.diag_test(2)
        def extra_fail(diag):
            raise RuntimeError("boom")

        @d.diag_test(2)
        def extra_mismatch(diag):
            want = np.arange(64, dtype=np.uint8)
            got = want.copy()
            got[40] ^= 0x10  # one flipped bit, as a bad memory cell would give
            d._same(got, want, "pattern")

        sys.exit(d.main(sys.argv[1:]))
    """)
    run = lambda spec: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, "-r", spec, "--json"], capture_output=True, text=True,
        env=daemon.env(), cwd=REPO, timeout=120)
    proc = run("1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = results(proc)
    assert [n for n, _ in doc["order"]][-1] == "extra_pass"
    assert doc["by"][("extra_pass", None)]["detail"] == "saw accel0,accel1"

    proc = run("extra_skip,extra_fail,extra_mismatch")
    assert proc.returncode == 1
    doc = results(proc)
    assert doc["order"] == [("extra_skip", "accel0"), ("extra_skip", "accel1"),
                            ("extra_fail", None), ("extra_mismatch", None)]
    assert doc["by"][("extra_skip", "accel1")] | {"seconds": 0} == {
        "name": "extra_skip", "level": 2, "device": "accel1", "result": "skip",
        "reason": "not-applicable", "detail": "not on accel1", "seconds": 0, "figures": []}
    fail = doc["by"][("extra_fail", None)]
    assert (fail["result"], fail["reason"], fail["detail"]) == (
        "fail", "error", "RuntimeError: boom")
    bad = doc["by"][("extra_mismatch", None)]
    assert (bad["result"], bad["reason"], bad["detail"]) == (
        "fail", "mismatch",
        "pattern: 1 of 64 bytes differ, first at offset 40: 0x38 instead of 0x28")
