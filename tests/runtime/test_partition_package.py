"""The partitions of a device are one package (docs/partitions.md): a reset of the split
device (sysfs ``reset``, ``accel-smi -r``, a link error's) resets every partition, and
their tenants see what a partition's own reset shows them; a mode change whose new
partitions do not all boot is rolled back to the partitions (or the whole device) it
had, with EIO; and the
partitions share the package's thermal budget: one partition's load warms its sibling, a
throttle injected on one slows both, and a shutdown loses both until the package's
recovery resets them."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from scenario import HOLD_DATA, NOP_LOAD

from kmod_emul import thermal
from testkit import REPO
from testkit.daemon import Daemon
from testkit.procs import firmware_children
from testkit.waiting import wait_until

RESET = 120  # abi/faults.py: DEVICE_RESET
THROTTLE, SHUTDOWN = 140, 141  # THERMAL_THROTTLE, THERMAL_SHUTDOWN

#: A tenant of one partition (the only device it sees): holds data, then on each line of
#: stdin reads it back and says what happened.
HOLDER = HOLD_DATA + """
try:
    print("ran", float(x.copy_to_host().sum()))
except runtime.AccelError as exc:
    record = getattr(exc, "record", {})  # the errors of a lost device carry their record
    print(type(exc).__name__, record.get("code"), record.get("name"))
"""

#: Work on every visible device: a kernel and a copy each.
WORK = """
import numpy as np, runtime
from runtime.kernel_lib import SOURCE
for dev in range(runtime.device_count()):
    lib = runtime.compile(SOURCE, dev)
    x = runtime.to_device(np.arange(4096, dtype=np.float32), device=dev)
    out = runtime.to_device(np.zeros(4096, np.float32), device=dev)
    lib.saxpy[4096 // 64, 64](np.float32(2.0), x, x, out, stream=runtime.current_stream(dev))
    print(dev, float(out.copy_to_host().sum()))
"""
WORK_OUT = "{} 25159680.0"


def set_mode(d: Daemon, mode: str) -> None:
    (d.root / "sys/class/accel/accel0/partition_mode").write_text(mode)


@contextmanager
def holder(d: Daemon, dev: int) -> Iterator[subprocess.Popen[str]]:
    """A ``HOLDER`` on partition ``dev``, killed at the end if it is still there."""
    proc = d.popen_py(HOLDER, ACCEL_VISIBLE_DEVICES=str(dev))
    try:
        line = proc.stdout.readline()
        assert line == "ready\n", (line, proc.stderr.read())
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def outcome(proc: subprocess.Popen[str]) -> str:
    """What the holder saw when told to read its data back."""
    out, err = proc.communicate("\n", timeout=30)
    assert proc.returncode == 0, err
    return out.strip()


def smi(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.accel_smi", *args], capture_output=True,
                          text=True, env=d.env(), cwd=REPO, timeout=60)


def write_errno(path: Path, text: str) -> int:
    with pytest.raises(OSError) as exc:
        path.write_text(text)
    return exc.value.errno


@pytest.mark.timeout(150)
def test_a_package_reset_resets_every_partition(make_daemon):
    d = make_daemon(devices=1)
    set_mode(d, "2")
    with holder(d, 1) as own:  # first what a partition's own reset shows its tenant
        (d.root / "sys/class/accel/accel1/reset").write_text("1")
        alone = outcome(own)
    assert alone == f"DeviceLostError {RESET} DEVICE_RESET"
    d.wait_attrs(1, {"state": "operational", "reset_count": "1"})
    assert d.attr(2, "reset_count") == "0" and d.attr(0, "reset_count") == "0"

    package_reset = d.root / "sys/class/accel/accel0/reset"
    assert write_errno(package_reset, "0") == errno.EINVAL  # the same refusals as a device's
    assert [d.attr(p, "reset_count") for p in (0, 1, 2)] == ["0", "1", "0"]
    with holder(d, 1) as first, holder(d, 2) as second:
        package_reset.write_text("1")
        assert [outcome(first), outcome(second)] == [alone, alone]
    for dev, count in ((0, "1"), (1, "2"), (2, "1")):
        d.wait_attrs(dev, {"state": "operational", "reset_count": count})
    comm = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert d.attr(2, "reset_reason") == ("package reset of accel0: reset requested through "
                                         f"sysfs by pid {os.getpid()} ({comm}), uid {os.getuid()}")

    # accel-smi -r refuses a package whose partition a process holds, as a held device
    with holder(d, 2) as held:
        out = smi(d, "-r", "-i", "0")
        assert out.returncode == 19, out.stdout + out.stderr
        assert "accel 2 is in use by 1 process" in out.stderr + out.stdout
        assert [d.attr(p, "reset_count") for p in (0, 1, 2)] == ["1", "2", "1"]
        out = smi(d, "-r", "-i", "0", "--force")
        assert out.returncode == 0, out.stdout + out.stderr
        assert outcome(held) == alone
    for dev, count in ((0, "2"), (1, "3"), (2, "2")):
        d.wait_attrs(dev, {"state": "operational", "reset_count": count})

    # the package reset an uncorrectable link error makes reaches them too
    d.debug(0, "ras_ctrl").write_text("inject link ue 0")
    for dev, count in ((0, "3"), (1, "4"), (2, "3")):
        d.wait_attrs(dev, {"state": "operational", "reset_count": count})
    assert d.attr(1, "reset_reason").startswith("package reset of accel0: link error on ")
    out = d.run_py(WORK)
    assert out.stdout.splitlines() == [WORK_OUT.format(0), WORK_OUT.format(1)], out.stderr


@pytest.mark.timeout(180)
def test_a_failed_mode_change_rolls_back(make_daemon):
    d = make_daemon(devices=1)
    mode_attr = d.root / "sys/class/accel/accel0/partition_mode"
    knob = d.debug(0, "partition_fail_step")
    assert knob.read_text().strip() == "none"
    for bad in ("handshake", "4:handshake", "1:nostep", "x:image"):
        assert write_errno(knob, bad) == errno.EINVAL, bad

    # from whole: partition 0 fails at config, the device is whole again
    knob.write_text("0:config")
    assert knob.read_text().strip() == "0:config"
    assert write_errno(mode_attr, "2") == errno.EIO
    assert (d.attr(0, "partition_mode"), d.attr(0, "partitions")) == ("1", "")
    assert sorted(os.listdir(d.root / "dev/accel")) == ["accel0"]
    assert not (d.state_dir / "partitions.json").exists()
    assert firmware_children(d) == 1
    out = d.run_py(WORK)
    assert out.stdout.splitlines() == [WORK_OUT.format(0)], out.stderr

    # from mode 2: partition 1 of mode 4 (accel2) fails at handshake; the other three
    # booted and are stopped, and mode 2's partitions come back with their UUIDs
    knob.write_text("none")
    set_mode(d, "2")
    uuids = [d.attr(p, "uuid") for p in (1, 2)]
    store = (d.state_dir / "partitions.json").read_bytes()
    knob.write_text("1:handshake")
    assert write_errno(mode_attr, "4") == errno.EIO
    assert (d.attr(0, "partition_mode"), d.attr(0, "partitions")) == ("2", "accel1 accel2")
    assert sorted(os.listdir(d.root / "dev/accel")) == ["accel0", "accel1", "accel2"]
    assert [d.attr(p, "uuid") for p in (1, 2)] == uuids
    assert [d.attr(p, "state") for p in (1, 2)] == ["operational"] * 2
    assert (d.state_dir / "partitions.json").read_bytes() == store
    assert firmware_children(d) == 3  # the device's and its two partitions'
    log = (d.state_dir / "accel-emud.log").read_text()
    assert ("accel0: partition mode 4 failed, back to mode 2: accel2 (partition 1): "
            "injected failure at bring-up step handshake") in log
    out = d.run_py(WORK)
    assert out.stdout.splitlines() == [WORK_OUT.format(0), WORK_OUT.format(1)], out.stderr

    knob.write_text("none")  # a valid change succeeds afterwards
    set_mode(d, "4")
    assert d.attr(0, "partitions") == "accel1 accel2 accel3 accel4"
    assert {d.attr(p, "state") for p in range(1, 5)} == {"operational"}
    set_mode(d, "1")
    assert d.attr(0, "partitions") == ""


@pytest.mark.timeout(180)
def test_a_mode_whose_partitions_cannot_be_made_goes_back(make_daemon):
    """Partitions whose memory cannot be made (injected ``K:memory``) fail the change
    with ENOMEM before any exists; the device goes back to its previous mode's partitions
    (same UUIDs, booted) -- or stays whole -- and never keeps a mode with no partition."""
    d = make_daemon(devices=1)
    mode_attr = d.root / "sys/class/accel/accel0/partition_mode"
    knob = d.debug(0, "partition_fail_step")
    knob.write_text("0:memory")
    assert write_errno(mode_attr, "2") == errno.ENOMEM
    assert (d.attr(0, "partition_mode"), d.attr(0, "partitions")) == ("1", "")
    assert sorted(os.listdir(d.root / "dev/accel")) == ["accel0"]
    assert json.loads((d.state_dir / "partitions.json").read_text()) == {d.attr(0, "uuid"): 1}
    out = d.run_py(WORK)
    assert out.stdout.splitlines() == [WORK_OUT.format(0)], out.stderr

    knob.write_text("none")
    set_mode(d, "2")
    uuids = [d.attr(p, "uuid") for p in (1, 2)]
    fds = len(os.listdir(f"/proc/{d.pid}/fd"))
    knob.write_text("3:memory")  # partitions 0 to 2 of mode 4 made, the fourth not
    assert write_errno(mode_attr, "4") == errno.ENOMEM
    assert (d.attr(0, "partition_mode"), d.attr(0, "partitions")) == ("2", "accel1 accel2")
    assert [d.attr(p, "uuid") for p in (1, 2)] == uuids
    assert [d.attr(p, "state") for p in (1, 2)] == ["operational"] * 2
    assert firmware_children(d) == 3
    # the three partitions' memory made before the fourth failed is closed again
    wait_until(lambda: len(os.listdir(f"/proc/{d.pid}/fd")), 30,
               "the daemon's descriptors back to mode 2's", ok=lambda now: now <= fds)
    log = (d.state_dir / "accel-emud.log").read_text()
    assert "accel0: partition mode 4 could not be made" in log
    out = d.run_py(WORK)
    assert out.stdout.splitlines() == [WORK_OUT.format(0), WORK_OUT.format(1)], out.stderr




def temperature(d: Daemon, dev: int) -> float:
    return float(d.attr(dev, "temperature"))


@pytest.mark.timeout(150)
def test_the_partitions_share_the_package_thermal_budget(make_daemon):
    d = make_daemon(devices=1)
    set_mode(d, "2")
    before = temperature(d, 2)
    out = d.run_py(NOP_LOAD, timeout=120, ACCEL_VISIBLE_DEVICES="1")
    assert out.stdout.split() == ["ok"], out.stderr
    warm = temperature(d, 2)
    assert warm > before  # the sibling warms with accel1's load: one package
    assert abs(temperature(d, 1) - warm) <= 1 and abs(temperature(d, 0) - warm) <= 1

    d.debug(1, "ras_ctrl").write_text("inject thermal ce 0")
    for dev in (0, 1, 2):
        assert (d.attr(dev, "clock"), d.attr(dev, "throttle_reasons")) == (
            str(thermal.THROTTLED_CLOCK_MHZ), "sw_thermal_slowdown"), dev
        assert d.attr(dev, "state") == "operational"
        assert [r["code"] for r in d.fault_log(dev)] == [THROTTLE], dev
    assert d.attr(1, "ras/thermal_err_count") == "ue: 0\nce: 1"
    assert d.attr(2, "ras/thermal_err_count") == "ue: 0\nce: 0"
    wait_until(lambda: {d.attr(p, "throttle_reasons") for p in (1, 2)}, 20,
               "partitions 1 and 2 to cool back", ok=lambda reasons: reasons == {"none"})
    assert {d.attr(p, "clock") for p in (1, 2)} == {str(thermal.BASE_CLOCK_MHZ)}

    # a shutdown injected on accel1 loses accel2's tenant too; the package recovers
    with holder(d, 2) as sibling:
        d.debug(1, "ras_ctrl").write_text("inject thermal ue 0")
        assert outcome(sibling) == f"DeviceLostError {SHUTDOWN} THERMAL_SHUTDOWN"
    for dev in (0, 1, 2):
        d.wait_attrs(dev, {"state": "operational", "reset_count": "1"})
        assert "thermal shutdown" in d.attr(dev, "last_failure"), dev
        assert [r["code"] for r in d.fault_log(dev)].count(SHUTDOWN) == 1, dev
    assert temperature(d, 2) < thermal.SLOWDOWN_C
    out = d.run_py(WORK)
    assert out.stdout.splitlines() == [WORK_OUT.format(0), WORK_OUT.format(1)], out.stderr
