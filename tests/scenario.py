"""Runtime scenarios, each run in a fresh process against a daemon (the runtime's state is
per process, as the fork rules need), shared by the files of tests/runtime/: the preludes
they start with and the runner that checks the exit status and returns the printed lines.

A scenario that measures something reports the values (``report(name=value)``, run with
``run_json``), and the test asserts on them: a failure then says what was measured, where
printed verdicts said only ``'True False' != 'True True'``.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from typing import Any, Protocol


class Runner(Protocol):
    """What runs a snippet in a fresh process against a daemon: ``Daemon`` (a new
    interpreter) or ``zygote.Zygote`` (a fork of one that has imported torch)."""

    def run_py(self, code: str, *, timeout: float = 60, **env: str
               ) -> subprocess.CompletedProcess[str]: ...

#: A kernel that writes out of bounds, once, on device 0: the exception it raises at
#: ``synchronize`` is left as ``exc`` (fault-record scenarios continue from there).
KERNEL_FAULT_PRELUDE = """
import json, os, time, numpy as np, runtime
m = runtime.compile('''
def oob(x):
    x[global_id(0) + 100000] = 1.0
''')
x = runtime.empty(16, np.float32)
m.oob[1, 1](x)
try:
    runtime.synchronize()
except runtime.KernelFaultError as caught:
    exc = caught
"""

#: Memory scenarios (test_memory.py, test_ipc.py): numpy, the runtime, the uAPI, packets.
MEMORY_PRELUDE = """
import os, sys, json, numpy as np, runtime
from abi import uapi, userq
def pkt(op, *a):
    return userq.RAW_PACKET.pack(op, 0, *a, *(0,) * (7 - len(a)))
"""

#: Submission scenarios (test_stream.py, test_event.py, test_graph.py): also ``hold``
#: (debugfs ``sched_hold``: the firmware takes no packets while set) and the firmware's
#: counters (``stat``).
STREAM_PRELUDE = """
import os, sys, time, numpy as np, runtime
from abi import userq
ROOT = os.environ["ACCEL_EMU_ROOT"]
def pkt(op, *a):
    return userq.RAW_PACKET.pack(op, 0, *a, *(0,) * (7 - len(a)))
def hold(on, dev=0):
    open(f"{ROOT}/sys/kernel/debug/accel/accel{dev}/sched_hold", "w").write("1" if on else "0")
def stat(name, dev=0, at_least=0):
    # the firmware publishes its counters when it idles: poll for them to settle (a limit
    # generous for a loaded machine: only a counter that never gets there waits it out)
    deadline = time.monotonic() + 30
    while True:
        v = int(open(f"{ROOT}/sys/class/accel/accel{dev}/{name}").read())
        if v >= at_least or time.monotonic() > deadline:
            return v
        time.sleep(0.01)
"""

#: A process whose stream ``s`` runs a kernel that never ends (until a watchdog, a reset or
#: the daemon's death stops it); it says "waiting" once the launch is queued.
SPINNING = """
import sys, time
import numpy as np, runtime
spin = runtime.compile('''
def spin(x):
    i = 0
    while i >= 0:
        i = i + 1
        x[0] = i
''')
s = runtime.Stream()
spin.spin[1, 1](runtime.empty(1, np.int64), stream=s)
print("waiting", flush=True)
"""

#: What device 0 of the shared daemon shows when no process holds anything on it.
#: Load on the first visible device: 25,600 no-ops on one stream (the thermal model's
#: load term follows the packet rate), then "ok".
NOP_LOAD = """
import runtime
from abi import userq
s = runtime.Stream()
nop = userq.Nop()
for _ in range(400):
    s.submit([nop] * 64)
s.synchronize()
print("ok")
"""

#: A tenant holding data on its first visible device: it says "ready", then waits for a
#: line on stdin; what follows reads ``x`` back and says what happened.
HOLD_DATA = """
import numpy as np, runtime
x = runtime.to_device(np.ones(4096, np.float32))
runtime.synchronize()
print("ready", flush=True)
input()
"""

IDLE = {"memory_used": "0", "contexts": "0", "processes": "pid device_bytes"}


#: The child's half of ``run_json``: ``report(**values)`` prints one tagged JSON line
#: (numpy and torch values as lists or numbers, anything else as its ``str``);
#: ``misses(got, want, **tol)`` is what to report of a comparison with ``np.allclose``:
#: how many elements it finds apart (0: it holds) and the widest gap.
REPORT_TAG = "@report "
REPORT = f"""
import json as _json
def _plain(v):
    return v.tolist() if hasattr(v, "tolist") else str(v)
def report(**values):
    print({REPORT_TAG!r} + _json.dumps(values, default=_plain), flush=True)
def misses(got, want, **tol):
    import numpy as _np
    got, want = _np.asarray(got), _np.asarray(want)
    gap = _np.abs(got.astype(_np.float64) - want) if got.size else _np.zeros(1)
    return {{"apart": int(_np.count_nonzero(~_np.isclose(got, want, **tol))),
             "worst": float(gap.max())}}
"""



def reports(lines: list[str]) -> dict[str, Any]:
    """The values of every ``report`` line among ``lines``, merged (a name reported twice
    is a scenario's mistake, not a later measurement to keep)."""
    values: dict[str, Any] = {}
    for line in lines:
        if line.startswith(REPORT_TAG):
            new = json.loads(line[len(REPORT_TAG):])
            assert not values.keys() & new.keys(), f"reported twice: {values.keys() & new.keys()}"
            values.update(new)
    return values


def run_json(d: Runner, prelude: str, body: str, **kw) -> dict[str, Any]:
    """``run_scenario`` with ``report`` defined after ``prelude``: what the child
    reported."""
    return reports(run_scenario(d, prelude + REPORT, body, **kw))


def run_scenario(d: Runner, prelude: str, body: str, **kw) -> list[str]:
    """Run ``prelude`` + the dedented ``body`` (``timeout`` and environment variables as
    for ``Daemon.run_py``); it must exit 0. Its stdout lines."""
    out = d.run_py(prelude + textwrap.dedent(body), **kw)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout.split("\n")[:-1]
