"""Telemetry computed from what the device runs (kmod_emul/activity.py): utilization over
the last second per engine kind, power, and DRM fdinfo's per-client engine time and memory.

Each figure is read before, during and after a load that a tenant process runs, and must
move with it: up under load, back once the load stops. Nothing is compared with a fixed
value but the idle floor the figure returns to.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from testkit import REPO
from testkit.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

def _load(setup: str, one_round: str) -> str:
    """A tenant that runs ``one_round`` (after ``setup``) in a loop until told to stop (a
    line on stdin); it prints its pid once the loop runs."""
    return f"""
import os, sys, threading, numpy as np, runtime
{setup}
stop = threading.Event()
def load():
    while not stop.is_set():
{textwrap.indent(one_round, "        ")}
t = threading.Thread(target=load)
t.start()
print(os.getpid(), flush=True)
sys.stdin.readline()
stop.set()
t.join()
"""


#: compile the counting kernel before the load says it runs: the first launch's compile
#: (seconds: the lowering's vectorised variants too) is not device activity
WARM = "mod.spin[1, 256](x, 1)\nruntime.synchronize()"
#: the compute engines busy with a counting kernel, and device memory its fdinfo shows
COMPUTE_LOAD = _load(
    "from runtime import kernel_lib\nmod = runtime.compile(kernel_lib.SOURCE)\n"
    "x = runtime.empty(64 * 256, np.float32)\nkeep = runtime.empty(4 << 20, np.uint8)\n"
    + WARM,
    "mod.spin[64, 256](x, 20000)\nruntime.synchronize()")
#: a copy engine busy with 64 MiB device-to-device copies
COPY_LOAD = _load(
    "a = runtime.empty(64 << 20, np.uint8)\nb = runtime.empty(64 << 20, np.uint8)\n"
    "s = runtime.Stream()",
    "for _ in range(4):\n    b.copy_(a, stream=s)\ns.synchronize()")


def _blocks(text: str) -> dict[int, dict[str, str]]:
    """fdinfo's blocks by pid: each block's ``key: value`` lines."""
    out: dict[int, dict[str, str]] = {}
    for block in filter(None, text.split("\n\n")):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out[int(fields["pid"])] = fields
    return out


def _ns(value: str) -> int:
    number, unit = value.split()
    assert unit == "ns"
    return int(number)


def _watch(d, name: str, seconds: float) -> list[float]:
    """``name`` read every 0.1 s for ``seconds``."""
    seen = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append(float(d.attr(0, name)))
        time.sleep(0.1)
    return seen


def _until(d, name: str, want: str, timeout: float = 10.0) -> None:
    wait_until(lambda: d.attr(0, name), timeout, f"accel0's {name} to be {want}",
               ok=lambda now: now == want)


def test_compute_load_moves_utilization_power_and_the_clients_fdinfo(make_daemon):
    d = make_daemon()
    idle_power = d.attr(0, "power")
    assert d.attr(0, "utilization") == "0" and d.attr(0, "utilization_copy") == "0"
    bystander = d.popen_py("import os, sys, runtime\nruntime.init()\n"
                           "print(os.getpid(), flush=True)\nsys.stdin.readline()\n")
    load = d.popen_py(COMPUTE_LOAD)
    try:
        quiet = int(bystander.stdout.readline())
        busy = int(load.stdout.readline())
        util = _watch(d, "utilization", 3.0)
        power = [float(d.attr(0, "power")) for _ in range(3)]
        smi = subprocess.run(  # what accel-smi prints is the same figures
            [sys.executable, "-m", "tools.accel_smi", "--root", str(d.root), "-i", "0",
             "--query-gpu=utilization.gpu,power.draw", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, cwd=REPO, timeout=60)
        smi_util, smi_power = (float(v) for v in smi.stdout.strip().split(", "))
        first = _blocks(d.attr(0, "fdinfo"))
        second = wait_until(lambda: _blocks(d.attr(0, "fdinfo")), 30,
                            "the loaded client's compute time to grow",
                            ok=lambda now: _ns(now[busy]["drm-engine-compute"]) > _ns(
                                first[busy]["drm-engine-compute"]))
        assert max(util) >= 30, util  # two compute engines, one kernel at a time: ~50 %
        assert min(power) > float(idle_power), (power, idle_power)
        assert smi_util >= 10 and smi_power > float(idle_power), smi.stdout
        assert {busy, quiet} <= set(second)
        assert _ns(second[busy]["drm-engine-compute"]) > _ns(first[busy]["drm-engine-compute"]) > 0
        held = dict(row.split() for row in d.attr(0, "processes").splitlines()[1:])
        assert second[busy]["drm-total-vram"] == f"{int(held[str(busy)]) // 1024} KiB" != "0 KiB"
        assert _ns(second[quiet]["drm-engine-compute"]) == 0
        assert second[quiet]["drm-total-vram"] == "0 KiB"
        assert second[busy]["drm-pdev"] == d.attr(0, "pci_bus_id")
    finally:
        for p in (load, bystander):
            p.stdin.close()
            p.wait(timeout=60)
    _until(d, "utilization", "0")  # a second after the load, the window is quiet
    _until(d, "power", idle_power)
    assert d.attr(0, "fdinfo") == ""  # no client left


def test_copy_load_moves_copy_utilization_only(make_daemon):
    d = make_daemon()
    load = d.popen_py(COPY_LOAD)
    try:
        load.stdout.readline()
        copy = _watch(d, "utilization_copy", 2.0)
        compute = _watch(d, "utilization", 1.0)
    finally:
        load.stdin.close()
        load.wait(timeout=60)
    assert max(copy) >= 10, copy
    assert max(compute) <= 5, compute
    _until(d, "utilization_copy", "0")


def test_another_user_sees_only_their_own_clients(make_daemon, other_user):
    d = make_daemon(tenants=True)
    root_client = d.popen_py("import os, sys, runtime\nruntime.init()\n"
                             "print(os.getpid(), flush=True)\nsys.stdin.readline()\n")
    try:
        root_pid = int(root_client.stdout.readline())
        out = other_user.run(d, """
import os, runtime
runtime.init()
print(os.getpid())
print(open(os.environ["ACCEL_EMU_ROOT"] + "/sys/class/accel/accel0/fdinfo").read())
""")
        assert out.returncode == 0, out.stderr
        mine, text = out.stdout.split("\n", 1)
        assert set(_blocks(text)) == {int(mine)}  # not root's
        assert root_pid in _blocks(d.attr(0, "fdinfo"))  # root sees every client
    finally:
        root_client.stdin.close()
        root_client.wait(timeout=60)


#: both compute engines busy all the time: two streams of long counting kernels
FULL_LOAD = _load(
    "from runtime import kernel_lib\nmod = runtime.compile(kernel_lib.SOURCE)\n"
    "x = runtime.empty(128 * 256, np.float32)\nstreams = [runtime.Stream(), runtime.Stream()]\n"
    + WARM,
    "for s in streams:\n    mod.spin[128, 256](x, 50000, stream=s)\nruntime.synchronize()")


def test_sustained_full_load_throttles_the_clocks(make_daemon):
    """Sustained full use heats the die past the slowdown threshold within seconds (the
    thermal model's load term follows utilization), the clocks throttle and power's
    dynamic part halves; once the load stops the die cools and the clocks come back."""
    d = make_daemon()
    assert (d.attr(0, "throttle_reasons"), d.attr(0, "clock")) == ("none", "1500")
    load = d.popen_py(FULL_LOAD)
    try:
        load.stdout.readline()
        wait_until(lambda: (d.attr(0, "throttle_reasons"), d.attr(0, "temperature"),
                            d.attr(0, "utilization")), 30,
                   "the clocks to throttle (reasons, temperature, utilization)",
                   ok=lambda now: now[0] == "sw_thermal_slowdown")
        assert d.attr(0, "clock") == "750" and float(d.attr(0, "temperature")) >= 85
    finally:
        load.stdin.close()
        load.wait(timeout=120)
    _until(d, "throttle_reasons", "none", timeout=30)
    assert d.attr(0, "clock") == "1500"
