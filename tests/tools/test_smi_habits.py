"""accel-smi's nvidia-smi habits against real daemons: ``--query-gpu``, ``-x``, JSON errors,
the Processes table and ``--query-compute-apps``, ``-l``, ``dmon``/``pmon``, ``--version``,
strict option combinations and a reader that closes the pipe early.

Attributes the driver may not have yet (``utilization``, ``power``, ``fdinfo``...) are
expected as N/A where their file is missing and as the file says where it exists.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_smi import REPO, query_values, smi

from abi import faults, uapi
from testkit.procs import interruptible

pytestmark = pytest.mark.timeout(120)

HOLDER = ("import sys, numpy as np, runtime\n"
          "x = runtime.to_device(np.ones(1 << 20, np.float32))\n"
          "print('holding', flush=True)\nsys.stdin.readline()\n")


def attr_or_none(d, dev: int, name: str) -> str | None:
    """The attribute's text, None where this driver has no such file."""
    path = d.root / uapi.CLASS_DIR / f"accel{dev}" / name
    return path.read_text().strip() if path.exists() else None


def popen_smi(d, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tools.accel_smi", *args], env=d.env(),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **interruptible())  # it is sent SIGINT


def test_query_gpu_is_query_device(daemon) -> None:
    fields = "index,uuid,memory.total,state"
    gpu = smi(daemon, f"--query-gpu={fields}", "--format=csv,nounits")
    dev = smi(daemon, f"--query-device={fields}", "--format=csv,nounits")
    assert gpu.returncode == dev.returncode == 0, gpu.stderr
    assert gpu.stdout == dev.stdout == (
        "index, uuid, memory.total [MiB], state\n"
        + "".join(f"{i}, {daemon.attr(i, 'uuid')}, 256, operational\n" for i in (0, 1)))


def test_a_valid_nvidia_smi_field_the_device_lacks_is_not_supported(daemon) -> None:
    """A script ported from nvidia-smi keeps working: fields accel-smi does not model are
    answered ``[Not Supported]`` (as nvidia-smi does for a device without them); only a
    name nvidia-smi does not know either is refused."""
    fields = "index,fan.speed,clocks.max.sm,ecc.errors.uncorrected.volatile.total"
    proc = smi(daemon, f"--query-gpu={fields}", "--format=csv,noheader")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{i}, [Not Supported], [Not Supported], "
                                        "[Not Supported]" for i in (0, 1)]
    bad = smi(daemon, "--query-gpu=index,fan.colour", "--format=csv")
    assert bad.returncode == 2 and "unknown field 'fan.colour'" in bad.stderr
    # names of the list once written from memory that no nvidia-smi prints: refused,
    # as nvidia-smi refuses them; names of recent drivers' lists are known
    for wrong in ("clocks.max.video", "ecc.errors.corrected.volatile.texture_shm"):
        bad = smi(daemon, f"--query-gpu=index,{wrong}", "--format=csv")
        assert bad.returncode == 2 and f"unknown field {wrong!r}" in bad.stderr
    recent = smi(daemon, "--query-gpu=index,gpu_recovery_action,remapped_rows.histogram.max",
                 "--format=csv,noheader")
    assert recent.stdout.splitlines() == [f"{i}, [Not Supported], [Not Supported]"
                                          for i in (0, 1)], recent.stderr


@pytest.mark.parametrize("args, message", [
    (["--format=csv"], "--format goes with --query-device/--query-gpu"),
    (["-L", "--json"], "argument --json: not allowed with argument -L/--list-devices"),
    (["-x", "--json"], "-x goes alone or with -q, not with --json"),
    (["-x", "-L"], "-x goes alone or with -q, not with -L"),
    (["-l", "1", "-r", "-i", "0"], "-l repeats a query; it does not go with -r"),
    (["-l", "0"], "-l 0: the period is a number of seconds above 0"),
    (["--version", "-q"], "argument -q/--query: not allowed with argument --version"),
    (["--query-gpu=index", "--query-compute-apps"], "not allowed with argument"),
    (["-q", "-x", "-d", "MEMORY"], "-d goes with -q (without -x"),
])
def test_stray_combinations_are_usage_errors(daemon, args: list[str], message: str) -> None:
    proc = smi(daemon, *args)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"accel-smi: {message}") or message in proc.stderr
    if "--json" in args:
        assert json.loads(proc.stdout)["error"]["exit_code"] == 2
    else:
        assert proc.stdout == ""


def test_json_errors_are_json(daemon, tmp_path: Path) -> None:
    proc = smi(daemon, "--json", "--root", str(tmp_path))
    assert proc.returncode == 6
    assert json.loads(proc.stdout) == {"error": {
        "message": f"No devices were found: no accel-emud serves {tmp_path}", "exit_code": 6}}
    proc = smi(daemon, "--json", "-i", "9")
    assert proc.returncode == 2
    error = json.loads(proc.stdout)["error"]
    assert error["exit_code"] == 2
    assert error["message"].startswith("-i '9' matches no device (device indices: 0, 1")
    proc = smi(daemon, "--json", "-L")
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["error"] == {
        "message": "argument -L/--list-devices: not allowed with argument --json",
        "exit_code": 2}


def test_display_sections_are_complete(daemon) -> None:
    proc = smi(daemon, "-q", "-i", "0", "-d",
               "MEMORY,UTILIZATION,ECC,TEMPERATURE,POWER,CLOCK,PIDS,PAGE_RETIREMENT,ERRORS")
    assert proc.returncode == 0, proc.stderr
    sections = [line.strip() for line in proc.stdout.splitlines()
                if line.startswith("    ") and not line.startswith("        ")]
    assert sections == ["Memory", "Clients", "Utilization", "Engines", "Temperature", "Power",
                        "Clocks", "ECC", "Retired Pages", "Errors"]
    values = query_values(proc.stdout)
    for name in ("utilization", "utilization_copy", "power", "power_limit", "fdinfo"):
        assert values[name] == (attr_or_none(daemon, 0, name) or "N/A"), name
    assert values["processes"] == "None"  # no process holds memory (named when one does)
    assert values["clock"] == daemon.attr(0, "clock")


def test_xml_parses_back_to_what_sysfs_says(daemon) -> None:
    proc = smi(daemon, "-q", "-x")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("<?xml version='1.0' encoding='utf-8'?>\n<accel_smi_log>")
    log = ET.fromstring(proc.stdout)
    assert log.tag == "accel_smi_log"
    module = daemon.root / uapi.MODULE_DIR
    assert log.findtext("driver/version") == (module / "version").read_text().strip()
    assert log.findtext("attached_devices") == "2"
    devices = log.findall("device")
    assert [(e.get("id"), e.get("index")) for e in devices] == [("accel0", "0"), ("accel1", "1")]
    for dev, elem in enumerate(devices):
        for name in ("uuid", "name", "pci_bus_id", "memory_total", "state", "reset_count",
                     "limits/max_queues", "isolation/total"):
            assert elem.findtext(name) == daemon.attr(dev, name), name
        for block in faults.BLOCKS:
            counts = elem.find(f"ras/{block}_err_count")
            assert [(c.tag, c.text) for c in counts] == [("ue", "0"), ("ce", "0")]
        for name in ("utilization", "power", "power_limit"):
            assert elem.findtext(name) == (attr_or_none(daemon, dev, name) or "N/A"), name
        assert list(elem.find("processes")) == []
        assert [c.text for c in elem.find("capabilities")] == \
            daemon.attr(dev, "capabilities").split()
    assert ET.fromstring(smi(daemon, "-x", "-i", "1").stdout).find("device").get("id") == "accel1"


def test_processes_table_compute_apps_json_and_pmon(make_daemon) -> None:
    d = make_daemon(devices=2)
    holder = d.popen_py(HOLDER)
    try:
        assert holder.stdout.readline().strip() == "holding"
        pid = holder.pid
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        used = int(d.attr(0, "processes").splitlines()[1].split()[1])
        mib = round(used / (1 << 20))

        proc = smi(d)
        assert proc.returncode == 0, proc.stderr
        bottom = proc.stdout.split("\n\nProcesses:\n")[1].splitlines()
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in bottom
                if line.startswith("| ")]
        assert rows == [["Idx", "PID", "Process name", "Used Memory"],
                        ["0", str(pid), comm, f"{mib}MiB"]]

        fields = "pid,process_name,used_memory,gpu_uuid,gpu_bus_id"
        proc = smi(d, f"--query-compute-apps={fields}", "--format=csv")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == [
            "pid, process_name, used_memory [MiB], gpu_uuid, gpu_bus_id",
            f"{pid}, {comm}, {mib} MiB, {d.attr(0, 'uuid')}, {d.attr(0, 'pci_bus_id')}"]
        proc = smi(d, "--query-compute-apps", "--format=csv,noheader,nounits", "-i", "1")
        assert (proc.returncode, proc.stdout) == (0, "")
        proc = smi(d, "--query-compute-apps=pid,colour")
        assert proc.returncode == 2 and "unknown field 'colour' in --query-compute-apps" \
            in proc.stderr

        proc = smi(d, "-q", "-d", "PIDS", "-i", "0")  # named, as nvidia-smi -q does
        assert f"processes                 : {pid} {comm} {mib} MiB" in proc.stdout, proc.stdout

        doc = json.loads(smi(d, "--json").stdout)
        assert doc["devices"][0]["processes"] == [{"pid": pid, "used_memory": used}]
        assert doc["devices"][1]["processes"] == []

        proc = smi(d, "pmon", "-c", "2", "-d", "0.2")
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert [line.split() for line in lines[:2]] == [
            ["#", "idx", "pid", "type", "sm", "mem", "command"],
            ["#", "Idx", "#", "C/G", "%", "MiB", "name"]]
        busy = "-"  # the first sample has no busy time to compare with
        sample = [["0", str(pid), "C", busy, str(mib), comm], ["1", "-", "-", "-", "-", "-"]]
        got = [line.split() for line in lines[2:]]
        assert got[:2] == sample and len(got) == 4
        if attr_or_none(d, 0, "fdinfo") is None:  # no busy time without fdinfo
            assert got[2:] == sample
        else:
            assert got[2][:3] == ["0", str(pid), "C"] and got[2][3].isdigit()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_dmon_prints_count_samples(daemon) -> None:
    proc = smi(daemon, "dmon", "-c", "2", "-d", "0.2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split() for line in lines[:2]] == [
        ["#", "idx", "pwr", "temp", "sm", "copy", "mem", "fb", "pclk", "state"],
        ["#", "Idx", "W", "C", "%", "%", "%", "MiB", "MHz"]]
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["0", "1", "0", "1"]
    for row in rows:
        dev = int(row[0])
        power, util = attr_or_none(daemon, dev, "power"), attr_or_none(daemon, dev, "utilization")
        assert row[1] == ("-" if power is None else str(round(float(power))))
        assert row[3] == ("-" if util is None else util)
        assert row[2].isdigit() and row[5:] == ["0", "0", daemon.attr(dev, "clock"),
                                                 "operational"]
    assert smi(daemon, "dmon", "-c", "0").returncode == 2


def test_loop_repeats_until_sigint(daemon) -> None:
    proc = popen_smi(daemon, "--query-gpu=index,state", "--format=csv", "-l", "0.2")
    lines: list[str] = []
    try:
        while len(lines) < 1 + 2 * 3:  # the header once, then three rounds of two rows
            lines.append(proc.stdout.readline().rstrip("\n"))
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and err == ""
    assert lines == ["index, state"] + ["0, operational", "1, operational"] * 3
    assert "index, state" not in out  # later rounds print no header


def test_version_names_tool_driver_and_firmware(daemon, tmp_path: Path) -> None:
    proc = smi(daemon, "--version")
    assert proc.returncode == 0, proc.stderr
    module = daemon.root / uapi.MODULE_DIR
    assert proc.stdout.splitlines() == [
        "accel-smi version       : 0.1.0",
        f"Driver version          : {(module / 'version').read_text().strip()}",
        f"ABI version             : {(module / 'abi_version').read_text().strip()}",
        *(f"accel {i} firmware        : {daemon.attr(i, 'firmware_version')}" for i in (0, 1))]
    proc = smi(daemon, "--version", "-i", "1")
    assert proc.returncode == 0 and proc.stdout.splitlines()[3:] == [
        f"accel 1 firmware        : {daemon.attr(1, 'firmware_version')}"]
    proc = smi(daemon, "--version", "--root", str(tmp_path))
    assert proc.returncode == 6
    assert proc.stdout.splitlines()[1:] == ["Driver version          : N/A",
                                            "ABI version             : N/A"]


def test_a_closed_pipe_ends_it_quietly(daemon) -> None:
    proc = popen_smi(daemon, "-q", "-l", "0.1")  # a loop: some write finds the pipe closed
    first = proc.stdout.readline()
    proc.stdout.close()
    start = time.monotonic()
    err = proc.stderr.read()
    proc.wait(timeout=30)
    assert first.startswith("Driver Version")
    assert proc.returncode == 141 and err == "", err
    assert time.monotonic() - start < 30
    once = popen_smi(daemon, "-q")  # closed before the tool writes at all
    once.stdout.close()
    err = once.stderr.read()
    once.wait(timeout=30)
    assert once.returncode in (0, 141) and "Traceback" not in err and "Error" not in err, err
