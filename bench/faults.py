"""How fast faults are noticed and recovered, each against what bounds it from below.

- A hung kernel: launch to the ``KernelFaultError`` (ETIMEDOUT) vs the image's watchdog
  period (a firmware image with a 300 ms watchdog): the ratio is the watchdog's overshoot.
- A reset: the sysfs ``reset`` write to the device being operational again vs a fresh
  ``accel-emud`` (one device) start to ready, measured in alternating rounds: a reset is
  a firmware restart, so it should cost less than a whole daemon.
- A firmware death: SIGKILL of the firmware to a waiting client's ``DeviceLostError`` vs a
  process blocked in poll(2) noticing a killed peer's pipe hang-up (the floor for hearing
  of a death at all). The driver then recovers the device by itself (recovery auto).

The client runs in its own process on a private daemon (it is reset and its firmware
killed); every round it does each once, then the bench process times one daemon start.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from bench.core import Env, Row, middle_half
from bench.procs import REPO
from firmware import image

WATCHDOG_MS = 300

_CLIENT = r"""
import json, os, select, signal, sys, threading, time
import numpy as np, runtime
from runtime import discovery

root = os.environ["ACCEL_EMU_ROOT"]
debug = root + "/sys/kernel/debug/accel/accel0/"
SPIN = '''
def spin(x):
    i = 0
    while i >= 0:
        i = i + 1
        x[0] = i
'''
def build():  # after runtime.recover(), what the old primary context held is gone
    return runtime.compile(SPIN), runtime.empty(1, np.int64)
spin, x = build()

def operational_again(count):
    while not (discovery.read_attr("accel0", "state") == "operational"
               and int(discovery.read_attr("accel0", "reset_count")) > count):
        time.sleep(0.001)

def pipe_hangup():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        time.sleep(60)
        os._exit(0)
    os.close(w)
    poller = select.poll()
    poller.register(r, select.POLLIN)
    at = []
    def kill():
        at.append(time.perf_counter())
        os.kill(pid, signal.SIGKILL)
    threading.Timer(0.05, kill).start()
    poller.poll()
    dt = time.perf_counter() - at[0]
    os.waitpid(pid, 0)
    os.close(r)
    return dt

warm = runtime.Stream()  # once untimed: the JIT compiles the kernel on its first launch
spin.spin[1, 1](x, stream=warm)
try:
    warm.synchronize()
except runtime.KernelFaultError:
    pass
print("ready", flush=True)
for line in sys.stdin:
    out = {}
    s = runtime.Stream()
    t = time.perf_counter()
    spin.spin[1, 1](x, stream=s)
    try:
        s.synchronize()
    except runtime.KernelFaultError:
        out["hang_s"] = time.perf_counter() - t
    count = int(discovery.read_attr("accel0", "reset_count"))
    t = time.perf_counter()
    open(root + "/sys/class/accel/accel0/reset", "w").write("1")
    operational_again(count)
    out["reset_s"] = time.perf_counter() - t
    runtime.recover()
    spin, x = build()
    s = runtime.Stream()
    spin.spin[1, 1](x, stream=s)  # the client waits on it when the firmware dies
    fw = int(open(debug + "fw_pid").read())
    at = []
    def kill():
        at.append(time.perf_counter())
        os.kill(fw, signal.SIGKILL)
    count = int(discovery.read_attr("accel0", "reset_count"))
    threading.Timer(0.05, kill).start()
    try:
        s.synchronize()
    except runtime.DeviceLostError:
        out["lost_s"] = time.perf_counter() - at[0]
    operational_again(count)  # the driver's own recovery
    runtime.recover()
    spin, x = build()
    out["pipe_s"] = pipe_hangup()
    print(json.dumps(out), flush=True)
"""


def fault_recovery(env: Env) -> list[Row]:
    """Hung kernel detection vs the watchdog, reset to service vs a daemon start, firmware
    death to the client's DeviceLostError vs a poll(2) seeing a killed peer's hang-up."""
    rounds = 2 if env.quick else 6
    fw_dir = image.build_into(env.workdir / "fw-short-watchdog", watchdog_ms=WATCHDOG_MS)
    d = env.new_accel(1, firmware_dir=fw_dir)
    d.start()
    client = subprocess.Popen([sys.executable, "-c", _CLIENT], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "ACCEL_EMU_ROOT": str(d.root)})
    got: list[dict[str, float]] = []
    starts: list[float] = []
    try:
        if client.stdout.readline().strip() != "ready":
            raise RuntimeError("the fault client did not start")
        for _ in range(rounds):
            client.stdin.write("round\n")
            client.stdin.flush()
            line = client.stdout.readline()
            if not line:
                raise RuntimeError("the fault client died")
            got.append(json.loads(line))
            fresh = env.new_accel(1)
            try:
                starts.append(fresh.start())
            finally:
                fresh.stop()
    finally:
        client.stdin.close()
        client.wait(timeout=60)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in got)

    watchdog_s = WATCHDOG_MS / 1e3
    return [
        Row("hung kernel detected (launch to KernelFaultError)", med("hang_s") * 1e3,
            "the image's watchdog period", WATCHDOG_MS, "ms", None,
            middle_half([r["hang_s"] / watchdog_s for r in got]),
            note=f"median of {rounds}; a spinning block is stopped once it runs past "
                 "watchdog_ms (the deadline thread checks every slice)",
            details={"hang_s": [r["hang_s"] for r in got]}),
        Row("reset request to back in service (1 device)", med("reset_s") * 1e3,
            "accel-emud start to ready (1 device)", statistics.median(starts) * 1e3, "ms",
            None, middle_half([r["reset_s"] / s for r, s in zip(got, starts)]),
            note=f"median of {rounds} each, alternating; a reset halts and reboots the "
                 "firmware, a start is two interpreters, the mount and a boot",
            details={"reset_s": [r["reset_s"] for r in got], "start_s": starts}),
        Row("firmware death to the waiting client's DeviceLostError", med("lost_s") * 1e6,
            "poll(2) seeing a killed peer's pipe hang-up", med("pipe_s") * 1e6, "us", None,
            middle_half([r["lost_s"] / r["pipe_s"] for r in got]),
            note=f"median of {rounds}; the driver sees the exit, marks every context lost "
                 "and signals its event pipe; then it recovers the device (recovery auto)",
            details={"lost_s": [r["lost_s"] for r in got],
                     "pipe_s": [r["pipe_s"] for r in got]}),
    ]
