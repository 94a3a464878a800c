"""accel-smi against real daemons: what it prints must be what sysfs says.

The tool runs as a subprocess, as a user would run it. Read-only queries use the shared
daemon; resets and broken devices get private ones. Every failure state a bring-up can end
in (ENOPKG, ENOEXEC, EIO, ENODEV, in_reset) must be visible with the driver's own text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rawdev import RawDev

from abi import uapi
from abi.fwimage import IMAGE_NAME
from firmware.image import IMAGE_DIR
from testkit import REPO
from tools.accel_smi import OPTIONAL_ATTRS
from scenario import KERNEL_FAULT_PRELUDE

#: Changes between two reads on a healthy device; never compared by value.
VOLATILE = {"heartbeat", "temperature", "utilization", "utilization_copy", "power"}  # move with load
#: The default table's columns, and where the state is among them
TABLE_HEADERS = ["Idx", "Name", "UUID", "Bus-Id", "Firmware", "Memory-Usage", "Temp", "Pwr",
                 "Util", "Ctx", "State"]
STATE = TABLE_HEADERS.index("State")


def smi(d, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.accel_smi", *args], capture_output=True,
                          text=True, env=env or d.env(), cwd=REPO, timeout=60)


def readable_attrs(d, dev: int) -> dict[str, str]:
    """Every readable sysfs attribute of accel<dev> (``limits/max_queues`` for those of a
    subdirectory), read directly."""
    path = d.root / uapi.CLASS_DIR / f"accel{dev}"
    return {str(p.relative_to(path)): p.read_text().strip() for p in sorted(path.rglob("*"))
            if p.is_file() and p.stat().st_mode & 0o444}


def table(out: str) -> tuple[list[str], list[list[str]], list[str]]:
    """(header line, device table rows as cells (column names first), lines after that
    table and before the Processes section)."""
    lines = out.split("\n\nProcesses:\n")[0].splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in lines if line.startswith("| ")]
    last_border = max(i for i, line in enumerate(lines) if line.startswith("+-"))
    return lines[0], rows, lines[last_border + 1:]


def write_debug(d, name: str, value: str, dev: int = 0) -> None:
    d.debug(dev, name).write_text(value)


# --- read-only views on the shared daemon ------------------------------------------------------
def test_table_lists_every_device_as_sysfs_has_it(daemon) -> None:
    proc = smi(daemon)
    assert proc.returncode == 0, proc.stderr
    header, rows, after = table(proc.stdout)
    module = daemon.root / uapi.MODULE_DIR
    assert f"Driver Version: {(module / 'version').read_text().strip()}" in header
    assert f"ABI Version: {(module / 'abi_version').read_text().strip()}" in header
    assert rows[0] == TABLE_HEADERS
    assert len(rows) == 3 and after == []
    for dev, row in enumerate(rows[1:]):
        a = readable_attrs(daemon, dev)
        assert a["uuid"].startswith(row[2]) and len(row[2]) == 14  # ACCEL- + 8 hex digits
        temp, power, util = row[6:9]  # they move with load (driver/test_activity.py)
        assert temp.endswith("C") and power.endswith("W") and util.endswith("%")
        assert row[:6] + row[9:] == [str(dev), a["name"], a["uuid"][:14], a["pci_bus_id"],
                                     a["firmware_version"], "0MiB / 256MiB", a["contexts"],
                                     "operational"]


def test_list_is_one_line_per_device_with_full_uuid(daemon) -> None:
    proc = smi(daemon, "-L")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"accel {i}: Accel-Emu A1 (UUID: {daemon.attr(i, 'uuid')})" for i in (0, 1)]


def test_query_one_device_shows_every_attribute_of_it_only(daemon) -> None:
    proc = smi(daemon, "-q", "-i", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert daemon.attr(1, "uuid") in out and daemon.attr(0, "uuid") not in out
    assert f"accel 1 ({daemon.attr(1, 'pci_bus_id')})" in out and "accel 0 " not in out
    assert "Attached Devices                  : 2" in out
    for section in ("Identity", "Versions", "State", "Memory", "Compute", "Clients"):
        assert f"\n    {section}\n" in out
    values = query_values(out)
    attrs = readable_attrs(daemon, 1)
    del attrs["fault_log"]  # shown as the Errors table (test_errors_section_...)
    missing = {k: "" for k in OPTIONAL_ATTRS if k not in attrs}  # N/A, not left out
    assert set(values) == set(attrs) | set(missing)  # every attribute, nothing invented
    attrs.update(missing)
    for key, value in attrs.items():
        if key in VOLATILE:
            continue
        if key.startswith("memory_"):
            assert values[key] == f"{int(value) >> 20} MiB ({value} bytes)"
        elif key == "processes":  # named, in MiB (test_query_names_the_processes)
            assert value == "pid device_bytes" and values[key] == "None"
        elif key == "devcoredump/data":  # a held dump is summarised, not printed
            held = values[key].startswith(f"held, {len(value)} bytes")
            assert held if value else values[key] == "N/A"
        else:
            assert values[key] == (value or "N/A"), key


def query_values(out: str) -> dict[str, str]:
    """``-q``'s ``key : value`` lines; a value of several lines (a counter pair, a page
    table) continues on lines indented to its column."""
    values: dict[str, str] = {}
    section = key = ""
    for line in out.splitlines():
        if line.startswith(" " * 4) and not line.startswith(" " * 8):
            section = line.strip()
        elif line.startswith(" " * 9) and section != "Errors":
            values[key] += "\n" + line.strip()
        elif line.startswith(" " * 8) and section != "Errors":  # the log is a table
            key, _, value = line.strip().partition(":")
            key = key.strip()
            values[key] = value.strip()
    return values


def test_query_selects_by_uuid_prefix(daemon) -> None:
    uuid = daemon.attr(1, "uuid")
    proc = smi(daemon, "-L", "-i", uuid[:14])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"accel 1: Accel-Emu A1 (UUID: {uuid})"]


def test_json_has_every_attribute_typed(daemon) -> None:
    proc = smi(daemon, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    module = daemon.root / uapi.MODULE_DIR
    assert doc["driver"] == {
        "version": (module / "version").read_text().strip(),
        "abi_version": (module / "abi_version").read_text().strip(),
        "devices": 2, "pid": daemon.pid}
    assert len(doc["devices"]) == 2
    for dev, obj in enumerate(doc["devices"]):
        attrs = readable_attrs(daemon, dev)
        assert set(obj) == set(attrs) | set(OPTIONAL_ATTRS)
        assert all(obj[k] is None for k in OPTIONAL_ATTRS if k not in attrs)
        for key, value in attrs.items():
            if key in VOLATILE:
                continue
            got = obj[key]
            if key == "fault_log":
                assert got == [json.loads(line) for line in value.splitlines()]
            elif key == "devcoredump/data":
                assert got == (json.loads(value) if value else None)
            elif key.startswith("ras/") and key.endswith("_err_count"):
                assert got == {"ue": 0, "ce": 0}, key
            elif key in ("bad_pages", "ras/bad_page_details"):
                assert got == [], key
            elif key == "capabilities":
                assert got == value.split()
            elif key == "processes":
                assert value == "pid device_bytes" and got == []
            elif key == "fdinfo":  # no client holds a context: no block
                assert value == "" and got == []
            elif value == "" and key not in ("failure", "failure_code", "reset_reason",
                                             "last_failure"):
                assert got is None, key
            elif key in ("last_reset", "last_failure_time"):
                assert got == float(value), key
            else:
                assert str(got) == value, key
        assert isinstance(obj["memory_total"], int) and isinstance(obj["index"], int)
        assert isinstance(obj["serial"], str) and obj["state"] == "operational"
        assert obj["failure"] == "" and obj["failure_code"] == ""


def test_csv_query_with_and_without_header(daemon) -> None:
    fields = "uuid,index,memory.total,memory.used,utilization,state,pci_bus_id,serial"
    proc = smi(daemon, f"--query-device={fields}", "--format=csv")
    assert proc.returncode == 0, proc.stderr
    util = [f"{daemon.attr(i, 'utilization')} %" if (daemon.root / uapi.CLASS_DIR /
            f"accel{i}/utilization").exists() else "N/A" for i in (0, 1)]  # N/A: no unit
    rows = [
        f"{daemon.attr(i, 'uuid')}, {i}, 256 MiB, 0 MiB, {util[i]}, operational, "
        f"{daemon.attr(i, 'pci_bus_id')}, {daemon.attr(i, 'serial')}" for i in (0, 1)]
    header = ("uuid, index, memory.total [MiB], memory.used [MiB], utilization [%], state, "
              "pci_bus_id, serial")
    assert proc.stdout.splitlines() == [header, *rows]

    proc = smi(daemon, "--query-device", "name,driver_version,firmware_version",
               "--format=csv,noheader,nounits", "-i", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"Accel-Emu A1, {daemon.attr(0, 'driver_version')}, {daemon.attr(0, 'firmware_version')}"]

    proc = smi(daemon, "--query-device=index,memory.total", "--format=csv,noheader")
    assert proc.stdout.splitlines() == ["0, 256 MiB", "1, 256 MiB"]


def test_unknown_field_lists_valid_ones(daemon) -> None:
    proc = smi(daemon, "--query-device=index,fan.colour", "--format=csv")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "unknown field 'fan.colour'" in proc.stderr
    for field in ("index", "name", "uuid", "memory.total", "utilization", "state"):
        assert field in proc.stderr.split("valid fields:")[1]


@pytest.mark.parametrize("args", [["-i", "7"], ["-q", "-i", "ACCEL-nope"], ["-i", "0,9"]])
def test_invalid_device_is_a_usage_error(daemon, args: list[str]) -> None:
    proc = smi(daemon, *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "matches no device (device indices: 0, 1" in proc.stderr


def test_reset_needs_a_device(daemon) -> None:
    proc = smi(daemon, "-r")
    assert proc.returncode == 2
    assert "-r needs -i" in proc.stderr
    assert daemon.attr(0, "reset_count") == daemon.attr(1, "reset_count") == "0"


@pytest.mark.parametrize("how", ["env", "flag"])
def test_no_devices(daemon, tmp_path: Path, how: str) -> None:
    env = daemon.env(ACCEL_EMU_ROOT=str(tmp_path))
    args = ["--root", str(tmp_path)] if how == "flag" else []
    if how == "flag":
        env = daemon.env()  # the flag must win over a root that does serve devices
    proc = smi(daemon, *args, env=env)
    assert proc.returncode == 6
    assert proc.stdout == "No devices were found\n"
    assert str(tmp_path) in proc.stderr


def test_queries_never_open_a_device_node(daemon) -> None:
    """Audit every open() the tool (and the exporter, which reads through it) makes:
    sysfs files only, never dev/accel/*."""
    code = textwrap.dedent("""
        import json, os, sys
        from pathlib import Path
        opened = []
        sys.addaudithook(lambda e, a: opened.append(str(a[0])) if e == "open" else None)
        from tools.accel_smi import Tree, run, run_monitor
        from tools.accel_exporter import device_metrics
        for argv in ([], ["-L"], ["-q"], ["--json"], ["-x"], ["--version"],
                     ["--query-device=index,uuid,state,memory.used", "--format=csv"],
                     ["--query-compute-apps"]):
            assert run(argv)[0] == 0, argv
        for argv in (["dmon", "-c", "1"], ["pmon", "-c", "1"]):
            assert run_monitor(argv, lambda line: None)[0] == 0, argv
        assert device_metrics(Tree(Path(os.environ["ACCEL_EMU_ROOT"])))
        print(json.dumps(opened))
    """)
    before = [daemon.attr(i, "open_files") for i in (0, 1)]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=daemon.env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    opened = json.loads(proc.stdout)
    root = str(daemon.root)
    under_root = [p for p in opened if p.startswith(root)]
    assert any("/sys/class/accel/accel1/uuid" in p for p in under_root)
    assert [p for p in under_root if not p.startswith(f"{root}/sys/")] == []
    assert [daemon.attr(i, "open_files") for i in (0, 1)] == before


# --- reset and broken devices on private daemons ------------------------------------------------
def test_reset_ends_operational_and_counts(make_daemon) -> None:
    d = make_daemon(devices=1)
    proc = smi(d, "-r", "-i", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["accel 0: reset complete, operational (reset_count 1)"]
    assert d.attr(0, "state") == "operational"
    assert d.attr(0, "reset_count") == "1"


def test_missing_firmware_is_shown_and_reset_recovers_once_installed(make_daemon,
                                                                     tmp_path: Path) -> None:
    fw_dir = tmp_path / "no-firmware"
    fw_dir.mkdir()
    d = make_daemon(firmware_dir=fw_dir)
    failure = d.attr(0, "failure")
    assert failure.startswith("firmware image accel-emu-a1.fw not found")

    proc = smi(d)
    assert proc.returncode == 15  # printed all the same; the status is the health gate
    assert proc.stderr == "accel-smi: not operational: accel 0 (failed)\n"
    _, rows, after = table(proc.stdout)
    assert rows[1][STATE] == "failed (ENOPKG)" and rows[1][4] == "N/A"
    assert after == [f"accel 0: failed [ENOPKG]: {failure}"]

    proc = smi(d, "--query-device=index,state,failure_code", "--format=csv,noheader")
    assert proc.stdout == "0, failed, ENOPKG\n"
    assert "        failure_code              : ENOPKG" in smi(d, "-q").stdout
    assert json.loads(smi(d, "--json").stdout)["devices"][0]["failure"] == failure

    proc = smi(d, "-r", "-i", "0")  # still missing: the reset ends failed again
    assert proc.returncode == 1
    assert proc.stderr.startswith("accel-smi: accel 0: reset ended failed [ENOPKG]: firmware "
                                  "image accel-emu-a1.fw not found")

    (fw_dir / IMAGE_NAME).write_bytes((IMAGE_DIR / IMAGE_NAME).read_bytes())
    proc = smi(d, "-r", "-i", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "accel 0: reset complete, operational (reset_count 2)\n"
    assert table(smi(d).stdout)[1][1][STATE] == "operational"


def test_corrupt_firmware_is_shown(make_daemon, firmware_copy: Path) -> None:
    image = firmware_copy / IMAGE_NAME
    raw = bytearray(image.read_bytes())
    raw[-1] ^= 0xFF
    image.write_bytes(bytes(raw))
    d = make_daemon(firmware_dir=firmware_copy)
    proc = smi(d)
    _, rows, after = table(proc.stdout)
    assert rows[1][STATE] == "failed (ENOEXEC)"
    assert after == [f"accel 0: failed [ENOEXEC]: {d.attr(0, 'failure')}"]
    assert f"firmware image {image} is corrupt" in after[0]


def test_boot_failure_lost_device_and_reset_in_progress_are_shown(make_daemon) -> None:
    d = make_daemon(devices=1, extra=["--heartbeat-timeout", "0.5", "--recovery", "manual"])

    # Boot failure (EIO): the injected knob makes the next boot fail; -r reports it.
    write_debug(d, "fw_boot_fail", "1")
    proc = smi(d, "-r", "-i", "0")
    assert proc.returncode == 1
    assert "reset ended failed [EIO]: firmware failed to boot" in proc.stderr
    _, rows, after = table(smi(d).stdout)
    assert rows[1][STATE] == "failed (EIO)"
    assert after == [f"accel 0: failed [EIO]: {d.attr(0, 'failure')}"]
    write_debug(d, "fw_boot_fail", "0")
    assert smi(d, "-r", "-i", "0").returncode == 0

    # Lost device (ENODEV): a hung firmware stops heart-beating.
    write_debug(d, "fw_hang", "1")
    d.wait_state(0, "failed", timeout=10)
    _, rows, after = table(smi(d).stdout)
    assert rows[1][STATE] == "failed (ENODEV)"
    assert after == [f"accel 0: failed [ENODEV]: {d.attr(0, 'failure')}"]
    assert "heart-beating" in after[0]

    # In reset: held by the debug knob; a reset clears the old failure.
    write_debug(d, "reset_hold", "1")
    try:
        (d.root / uapi.CLASS_DIR / "accel0" / "reset").write_text("1")
        d.wait_state(0, "in_reset")
        _, rows, after = table(smi(d).stdout)
        assert rows[1][STATE] == "in_reset"
        assert d.attr(0, "failure") == ""
        assert after == ["accel 0: in_reset: resetting; usable again once its state is "
                         "operational"]
        proc = smi(d, "-r", "-i", "0", "--reset-timeout", "0.3")
        assert proc.returncode == 1
        assert "reset did not finish within 0.3 s (state in_reset" in proc.stderr
    finally:
        write_debug(d, "reset_hold", "0")
    d.wait_state(0, "operational")
    assert d.attr(0, "failure") == ""
    assert table(smi(d).stdout)[2] == []


def test_every_query_mode_is_a_health_gate(make_daemon) -> None:
    """Exit 15 while a selected device is not operational, in every query mode, with the
    output still printed; 0 for the healthy one alone, and again once it is back."""
    d = make_daemon(devices=2, extra=["--heartbeat-timeout", "0.5", "--recovery", "manual"])
    write_debug(d, "fw_hang", "1", dev=1)
    d.wait_state(1, "failed", timeout=10)
    modes = ([], ["-L"], ["-q"], ["--json"], ["--query-device=index,state"])
    for mode in modes:
        proc = smi(d, *mode)
        assert proc.returncode == 15, mode
        assert proc.stderr == "accel-smi: not operational: accel 1 (failed)\n", mode
        assert proc.stdout, mode
        assert smi(d, *mode, "-i", "0").returncode == 0, mode
    assert smi(d, "-r", "-i", "1").returncode == 0
    assert [smi(d, *mode).returncode for mode in modes] == [0] * len(modes)


def test_reset_refuses_a_device_in_use_unless_forced(make_daemon) -> None:
    d = make_daemon(devices=2)
    holder = d.popen_py("import sys, numpy as np, runtime\n"
                        "x = runtime.to_device(np.ones(1024, np.float32))\n"
                        "print('holding', flush=True)\nsys.stdin.readline()\n")
    try:
        assert holder.stdout.readline().strip() == "holding"
        proc = smi(d, "-r", "-i", "0")
        assert proc.returncode == 19
        assert proc.stderr == (f"accel-smi: accel 0 is in use by 1 process (pids {holder.pid}): "
                               "stop them first, or pass --force (they lose their contexts)\n")
        assert d.attr(0, "reset_count") == "0"  # refused: nothing happened
        assert smi(d, "-r", "-i", "1").returncode == 0  # the other device is not in use
        proc = smi(d, "-r", "-i", "0", "--force")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "accel 0: reset complete, operational (reset_count 1)\n"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert smi(d, "--force").returncode == 2  # --force goes with -r


def test_a_recovered_failure_stays_visible(make_daemon) -> None:
    """After the driver recovered a device from a firmware death (recovery auto), the
    device is healthy (exit 0) and -q / --json still say what failed, and why and when it
    was reset."""
    d = make_daemon(devices=1)
    os.kill(int(d.debug(0, "fw_pid").read_text()), signal.SIGKILL)
    d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
    proc = smi(d, "-q")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = lines.index("    State") + 1
    state = lines[start:start + next(i for i, line in enumerate(lines[start:])
                                     if not line.startswith("        "))]
    assert [line.split(":")[0].strip() for line in state] == [
        "state", "failure", "failure_code", "reset_count", "reset_reason", "last_reset",
        "last_failure", "last_failure_time", "heartbeat"]
    failure = "firmware process exited unexpectedly (status -9)"
    assert f"        reset_reason              : recovery from: {failure}" in state
    assert f"        last_failure              : ENODEV {failure}" in state
    doc = json.loads(smi(d, "--json").stdout)["devices"][0]
    assert doc["last_failure"] == f"ENODEV {failure}" and doc["failure"] == ""
    assert isinstance(doc["last_reset"], float) and doc["last_reset"] >= doc["last_failure_time"]
    assert abs(doc["last_reset"] - time.time()) < 60


FAULTING = KERNEL_FAULT_PRELUDE + """
print(exc.record["context"], exc.record["queue"])
"""


def test_errors_section_and_json_show_every_fault_record(make_daemon) -> None:
    d = make_daemon(devices=2)
    proc = smi(d, "-q", "-d", "ERRORS", "-i", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n    Errors\n")[1].split() == ["None"]
    out = d.run_py(FAULTING)
    assert out.returncode == 0, out.stderr
    ctx, queue = out.stdout.split()
    (d.root / "sys/class/accel/accel0/reset").write_text("1")
    d.wait_state(0, "operational")
    proc = smi(d, "-q", "-d", "errors,state", "-i", "0")
    assert proc.returncode == 0, proc.stderr
    sections = [line.strip() for line in proc.stdout.splitlines()
                if line.startswith("    ") and not line.startswith("        ")]
    assert sections == ["State", "Errors"]
    rows = proc.stdout.split("\n    Errors\n")[1].splitlines()
    assert rows[0].split()[:7] == ["seq", "time", "code", "name", "severity", "scope", "action"]
    first, second = (r.split() for r in rows[1:])
    assert first[0] == "1" and first[3:9] == ["31", "PAGE_FAULT", "uncorrected-contained",
                                              "queue", "restart-app", first[8]]
    assert first[9:13] == [ctx, "compute", queue, first[12]] and first[12].startswith("0x")
    assert second[3:8] == ["120", "DEVICE_RESET", "fatal", "device", "restart-app"]
    assert (first[-1], second[-1]) == ("-", "requested")  # origin: a fault, an asked reset
    doc = json.loads(smi(d, "--json", "-i", "0").stdout)["devices"][0]["fault_log"]
    assert [(r["seq"], r["code"]) for r in doc] == [(1, 31), (2, 120)]
    assert smi(d, "--json", "-i", "1").returncode == 0  # the other device has none
    assert json.loads(smi(d, "--json", "-i", "1").stdout)["devices"][0]["fault_log"] == []


@pytest.mark.parametrize("args, message", [
    (["-q", "-d", "NOPE"], "-d: no section 'NOPE'"),
    (["-d", "ERRORS"], "-d goes with -q"),
])
def test_display_errors_are_usage_errors(daemon, args: list[str], message: str) -> None:
    proc = smi(daemon, *args)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_retired_pages_ecc_and_page_retirement_views(make_daemon) -> None:
    """Two bad pages (one retired, one pending under a raw client's context) as every mode
    shows them; a forced reset makes the pending one retired."""
    d = make_daemon(devices=2)
    uuid = d.attr(0, "uuid")
    inject = d.debug(0, "ras_ctrl")
    inject.write_text("inject memory ce 0x100000")
    inject.write_text("inject memory ce 0x100008")  # the same page, again: retired
    with RawDev(d.node(0)) as raw:
        ctx = raw.ctx_create()
        raw.mem_alloc(ctx, 1 << 16)
        row = d.debug(0, "vram_mm").read_text().splitlines()[1]
        held = int(row.split()[0], 16)
        inject.write_text(f"inject memory ue {held:#x}")  # its context is lost; pending
        proc = smi(d, "--query-retired-pages", "-i", "0")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == [
            "gpu_uuid, retired_pages.address, retired_pages.cause, retired_pages.status",
            f"{uuid}, 0x0000000000100000, Multiple Single Bit ECC, retired",
            f"{uuid}, 0x{held:016x}, Double Bit ECC, pending"]
        proc = smi(d, "--query-retired-pages=index,gpu_bus_id,retired_pages.status",
                   "--format=csv,noheader")
        assert proc.stdout.splitlines() == [f"0, {d.attr(0, 'pci_bus_id')}, retired",
                                            f"0, {d.attr(0, 'pci_bus_id')}, pending"]
        bad = smi(d, "--query-retired-pages=retired_pages.colour")
        assert bad.returncode == 2 and "unknown field 'retired_pages.colour'" in bad.stderr
        proc = smi(d, "-q", "-d", "PAGE_RETIREMENT,ECC", "-i", "0")
        assert proc.returncode == 0, proc.stderr
        sections = [line.strip() for line in proc.stdout.splitlines()
                    if line.startswith("    ") and not line.startswith("        ")]
        assert sections == ["ECC", "Retired Pages"]
        values = query_values(proc.stdout)
        assert values["retired_pages"] == "1"
        assert values["bad_pages"] == ("0x00000100 : 0x00001000 : R\n"
                                       f"0x{held >> 12:08x} : 0x00001000 : P")
        assert values["ras/memory_err_count"] == "ue: 1\nce: 2"
        assert values["ras/compute_err_count"] == "ue: 0\nce: 0"
        doc = json.loads(smi(d, "--json", "-i", "0").stdout)["devices"][0]
        assert doc["bad_pages"] == [{"pfn": 0x100, "size": 4096, "status": "R"},
                                    {"pfn": held >> 12, "size": 4096, "status": "P"}]
        assert [(p["cause"], p["status"]) for p in doc["ras/bad_page_details"]] == [
            ("ce", "R"), ("ue", "P")]
        assert doc["ras/memory_err_count"] == {"ue": 1, "ce": 2}
        assert doc["retired_pages"] == 1 and doc["memory_reserved"] == 4096
        assert doc["memory_used"] + doc["memory_free"] + doc["memory_reserved"] == 256 << 20
        free = smi(d, "--query-device=memory.free", "--format=csv,noheader,nounits", "-i", "0")
        assert free.stdout.strip() == str(round(doc["memory_free"] / (1 << 20)))
        assert smi(d, "-r", "-i", "0").returncode == 19  # the raw client holds it
        assert smi(d, "-r", "-i", "0", "--force").returncode == 0
    proc = smi(d, "--query-retired-pages=retired_pages.status", "--format=csv,noheader")
    assert proc.stdout.splitlines() == ["retired", "retired"]
    assert smi(d, "--query-retired-pages", "-i", "1").stdout.splitlines() == [
        "gpu_uuid, retired_pages.address, retired_pages.cause, retired_pages.status"]


def test_partition_shows_sets_and_refuses(make_daemon) -> None:
    d = make_daemon(devices=1)
    shown = smi(d, "partition", "-i", "0")
    assert (shown.returncode, shown.stdout) == (0, "accel 0: partition mode 1 (available: 1 2 4)\n")
    split = smi(d, "partition", "-i", "0", "--mode", "2")
    assert split.returncode == 0, split.stderr
    lines = split.stdout.splitlines()
    assert lines[0] == "accel 0: partition mode 2 (available: 1 2 4)"
    for k, line in enumerate(lines[1:]):
        assert line == (f"  partition {k}: accel {k + 1}  {d.attr(k + 1, 'uuid')}  128 MiB  "
                        "1 compute / 1 copy engines  operational")
    assert len(lines) == 3
    bad = smi(d, "partition", "-i", "0", "--mode", "3")
    assert (bad.returncode, bad.stderr) == (2, "accel-smi: --mode 3: accel 0 offers modes 1 2 4\n")
    child = smi(d, "partition", "-i", "1")
    assert (child.returncode, child.stderr) == (
        2, "accel-smi: accel 1 is a partition; partition its device (accel 0)\n")
    fd = os.open(d.node(2), os.O_RDWR)
    try:
        busy = smi(d, "partition", "-i", "0", "--mode", "1")
    finally:
        os.close(fd)
    assert busy.returncode == 19 and "in use" in busy.stderr
    whole = smi(d, "partition", "-i", d.attr(0, "uuid"), "--mode", "1")
    assert (whole.returncode, whole.stdout) == (0, "accel 0: partition mode 1 (available: 1 2 4)\n")
    assert smi(d, "-L").stdout.count("\n") == 1  # accel 0 alone again
