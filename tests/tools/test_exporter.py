"""accel-exporter against a real daemon: what /metrics says must be what sysfs says, and
SIGTERM must stop it cleanly (exit 0, the port closed); per-process series only when the
operator asks (--per-process); idle and half-sent connections hold no thread and keep no
scrape out, and are closed after the connection timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families
from scenario import KERNEL_FAULT_PRELUDE
from test_smi import REPO

from abi import faults, uapi
from testkit.tenants import as_user
from tools.accel_exporter import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS

pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, timeout: float = 20.0) -> str:
    """The /metrics text, once the exporter listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return resp.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from the exposition text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_match_sysfs_and_sigterm_stops_it(make_daemon) -> None:
    d = make_daemon(devices=1)
    inject = d.debug(0, "ras_ctrl")
    inject.write_text("inject memory ce 0x100000")
    inject.write_text("inject memory ce 0x100008")  # the same page again: retired
    got, port, (returncode, out, err) = _scrape_once(d)
    assert returncode == 0, err
    assert out == f"accel-exporter: serving http://127.0.0.1:{port}/metrics\n"
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))

    a = {name: d.attr(0, name) for name in (
        "uuid", "name", "pci_bus_id", "firmware_version", "memory_used", "memory_free",
        "memory_total", "retired_pages", "contexts", "clients", "reset_count", "packets",
        "launches", "copies", "copy_bytes", "faults", "isolation/total", "clock")}
    base = (("device", "0"), ("name", a["name"]), ("uuid", a["uuid"]))

    def value(metric: str, *extra: tuple[str, str]) -> float:
        return got[(metric, tuple(sorted(base + extra)))]

    assert value("accel_device_info", ("pci_bus_id", a["pci_bus_id"])) == 1
    assert value("accel_firmware_info", ("firmware_version", a["firmware_version"])) == 1
    assert value("accel_device_state") == uapi.DeviceState.OPERATIONAL == 2
    assert value("accel_device_operational") == 1
    for metric, attr in (("accel_memory_used_bytes", "memory_used"),
                         ("accel_memory_free_bytes", "memory_free"),
                         ("accel_memory_total_bytes", "memory_total"),
                         ("accel_retired_pages", "retired_pages"),
                         ("accel_contexts", "contexts"), ("accel_clients", "clients"),
                         ("accel_clock_mhz", "clock"),
                         ("accel_resets_total", "reset_count"),
                         ("accel_packets_total", "packets"),
                         ("accel_launches_total", "launches"),
                         ("accel_copies_total", "copies"),
                         ("accel_copy_bytes_total", "copy_bytes"),
                         ("accel_faults_total", "faults"),
                         ("accel_isolation_refusals_total", "isolation/total")):
        assert value(metric) == float(a[attr]), metric
    assert a["retired_pages"] == "1" and a["memory_total"] == str(256 << 20)
    assert abs(value("accel_temperature_celsius") - float(d.attr(0, "temperature"))) < 10
    for block in faults.BLOCKS:
        for kind in ("ue", "ce"):
            want = 2 if (block, kind) == ("memory", "ce") else 0
            assert value("accel_ras_errors_total", ("block", block), ("type", kind)) == want
    for metric, attr in (("accel_utilization_percent", "utilization"),
                         ("accel_power_watts", "power"), ("accel_power_limit_watts",
                                                          "power_limit")):
        path = d.root / uapi.CLASS_DIR / "accel0" / attr
        present = [k for k in got if k[0] == metric]
        if path.exists():  # the value, once the driver has the attribute
            assert value(metric) == pytest.approx(float(path.read_text()), abs=100), metric
        else:  # absent, not zero
            assert present == [], metric


def _scrape_once(d) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], int,
                             tuple[int, str, str]]:
    """One scrape of an exporter started for it and stopped by SIGTERM: the samples, the
    port, and the exporter's exit status, stdout and stderr."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tools.accel_exporter", "--root",
                             str(d.root), "--port", str(port), "--interval", "0"],
                            env=d.env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        got = samples(scrape(port))
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    return got, port, (proc.returncode, out, err)


def test_faults_go_on_across_a_reset_and_state_is_a_value_not_a_label(make_daemon) -> None:
    """accel_faults_total (sysfs ``faults``) never goes down: a reset keeps the count the
    fault log keeps records of (it restarted at 0 before); identity stays in labels and the
    state is accel_device_state's value, so a reset starts no new series."""
    d = make_daemon(devices=1)
    out = d.run_py(KERNEL_FAULT_PRELUDE + "print(type(exc).__name__)\n", timeout=60)
    assert out.stdout.strip() == "KernelFaultError", out.stderr
    before = _scrape_once(d)[0]
    (d.root / uapi.CLASS_DIR / "accel0" / "reset").write_text("1")
    d.wait_attrs(0, {"state": "operational", "reset_count": "1"})
    assert d.attr(0, "faults") == "1"
    after = _scrape_once(d)[0]

    def series(got, metric):
        return {labels: v for (name, labels), v in got.items() if name == metric}

    for got in (before, after):
        [faults_total] = series(got, "accel_faults_total").values()
        assert faults_total == 1
        assert list(series(got, "accel_device_state").values()) == [2]
    for metric in ("accel_device_info", "accel_device_state", "accel_firmware_info"):
        assert series(before, metric).keys() == series(after, metric).keys(), metric


#: A tenant of another user claiming to be a diagnostic, to hide its faults.
CLAIMS_DIAG = """
try:
    runtime.empty(16, np.uint8, device=0)
    print("accepted")
except runtime.AccelError as exc:
    print(errno.errorcode[exc.errno])
"""


def test_diag_faults_are_marked_and_left_out_of_the_tenant_counter(make_daemon) -> None:
    """accel-diag -r 2's fault_isolation faults a stream on purpose: its record says
    origin "diag" and accel_faults_total (sysfs ``faults``) leaves it out, as dcgmi diag
    leaves no XIDs; a tenant's fault still counts, and a tenant that is not root cannot
    claim to be a diagnostic (EPERM, counted as an isolation refusal). Before the fix the
    diagnostic's PAGE_FAULT counted 1 and carried no origin."""
    d = make_daemon(devices=1, tenants=True)  # the other user must reach the mount
    diag = subprocess.run([sys.executable, "-m", "tools.accel_diag", "-r", "fault_isolation",
                           "--json"], capture_output=True, text=True, env=d.env(), cwd=REPO,
                          timeout=120)
    assert diag.returncode == 0, diag.stdout + diag.stderr
    assert "(diagnostic, not counted)" in diag.stdout
    [mine] = [r for r in d.fault_log(0) if r["name"] == "PAGE_FAULT"]
    assert mine["origin"] == faults.ORIGIN_DIAG and mine["pid"] is not None
    assert d.attr(0, "faults") == "0"
    errors = subprocess.run([sys.executable, "-m", "tools.accel_smi", "-q", "-d", "ERRORS"],
                            capture_output=True, text=True, env=d.env(), cwd=REPO, timeout=60)
    [row] = [r.split() for r in errors.stdout.splitlines() if "PAGE_FAULT" in r]
    assert row[-1] == "diag", errors.stdout  # the operator sees it as the diagnostic's
    out = d.run_py(KERNEL_FAULT_PRELUDE + "print(type(exc).__name__)\n", timeout=60)
    assert out.stdout.strip() == "KernelFaultError", out.stderr
    assert d.attr(0, "faults") == "1"  # the tenant's fault counts
    [tenant] = [r for r in d.fault_log(0) if r["seq"] > mine["seq"]]
    assert tenant["origin"] is None
    refusals = int(d.attr(0, "isolation/total"))
    claim = d.run_py(as_user(CLAIMS_DIAG), ACCEL_DIAGNOSTIC="1")
    assert claim.stdout.strip() == "EPERM", claim.stdout + claim.stderr
    assert int(d.attr(0, "isolation/total")) == refusals + 1
    [faults_total] = [v for (name, _), v in _scrape_once(d)[0].items()
                      if name == "accel_faults_total"]
    assert faults_total == 1


def test_a_busy_port_is_an_error(daemon) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tools.accel_exporter", "--port",
                               str(port)], env=daemon.env(), cwd=REPO, capture_output=True,
                              text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"accel-exporter: cannot listen on 127.0.0.1:{port}: ")


@contextmanager
def exporter(d, *args: str) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """An exporter on daemon ``d``'s root, listening once this yields (its port, its
    process); SIGTERMed and reaped at the end, and it must have exited 0."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tools.accel_exporter", "--root",
                             str(d.root), "--port", str(port), *args],
                            env=d.env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        scrape(port)
        yield port, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


HOLDER = """
import os, sys, numpy as np, runtime
x = runtime.to_device(np.ones(1 << 20, np.uint8))
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


def test_per_process_series_only_when_asked_for(make_daemon) -> None:
    """Every local user can scrape 127.0.0.1, and the exporter reads sysfs as root: its
    per-process series would show every user's pids and device bytes to anyone, which
    sysfs ``processes`` shows no other user. So they are served with --per-process only."""
    d = make_daemon(devices=1)
    holder = d.popen_py(HOLDER)
    try:
        pid = holder.stdout.readline().strip()
        assert pid.isdigit(), holder.stderr.read()
        with exporter(d) as (port, _):
            plain = samples(scrape(port))
        with exporter(d, "--per-process") as (port, _):
            opted = samples(scrape(port))
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not [k for k in plain if k[0] == "accel_process_memory_bytes"]
    held = {dict(labels)["pid"]: v for (name, labels), v in opted.items()
            if name == "accel_process_memory_bytes"}
    assert held.get(pid, 0) >= 1 << 20, held


@pytest.mark.timeout(180)
def test_idle_connections_hold_no_thread_and_keep_no_scrape_out(daemon) -> None:
    """The first exporter served each connection on a thread of its own with no timeout:
    400 idle connections held 402 threads, and 6-8 of 200 parallel scrapes failed (the
    slowest took 31 s). With 400 idle or half-sent connections open (more than the cap),
    the exporter keeps its few threads, 100 parallel scrapes all answer within seconds,
    and a connection that sends nothing is closed once its timeout is up."""
    with exporter(daemon) as (port, proc):
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
        idle = []
        try:
            for i in range(400):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                if i % 2:  # half-sent: a request line and no end of the head
                    idle[-1].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.5)
            assert len(os.listdir(f"/proc/{proc.pid}/task")) <= threads + 1
            took: list[float] = []

            def one() -> None:
                t0 = time.monotonic()
                if "accel_device_info" in scrape(port, timeout=0):
                    took.append(time.monotonic() - t0)

            scrapers = [threading.Thread(target=one) for _ in range(100)]
            for t in scrapers:
                t.start()
            for t in scrapers:
                t.join(timeout=60)
            assert len(took) == 100 and max(took) < 10, sorted(took)[-5:]
            # the newest idle connections are still open (the cap closed the oldest for
            # the scrapes); each is closed when its timeout is up
            last = idle[-1]
            last.settimeout(CONNECTION_TIMEOUT_S + 10)
            t0 = time.monotonic()
            assert last.recv(1) == b""  # the server closed it
            assert time.monotonic() - t0 < CONNECTION_TIMEOUT_S + 5
            assert MAX_CONNECTIONS < 400  # so the cap was exercised
        finally:
            for s in idle:
                s.close()
