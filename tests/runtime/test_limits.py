"""The operator's limits (``accel-emud start --limit NAME=VALUE``), as a tenant meets them.

Per-process contexts and queues, and the depth of every queue (the in-flight work it may
hold untaken), set on the daemon: shown in ``sys/class/accel/accelN/limits/`` and by
DEVICE_QUERY, refused past them with the errno that says which (EDQUOT), and a full queue
blocks its producer until the firmware took a quarter of it, in order and without loss.
Bad values stop the daemon's start with a message that names them (tools/test_daemon.py).
"""

from __future__ import annotations

import pytest
from rawdev import RawDev

pytestmark = pytest.mark.timeout(180)

LIMITS = {"max_contexts_per_process": 2, "max_queues_per_process": 3, "max_queue_depth": 16}

#: a process that meets each limit: its output lines say what it saw
TENANT = """
import os, sys, threading, time, numpy as np, runtime
from abi import userq
hold = os.environ["ACCEL_EMU_ROOT"] + "/sys/kernel/debug/accel/accel0/sched_hold"
runtime.init()  # the primary context of device 0 (its streams' context)
extra = runtime.new_context(0)  # a second context of this process
try:
    runtime.new_context(0)
except runtime.ResourceLimitError as e:
    print("third context", e.errno)
streams = []
try:
    while len(streams) < 10:
        streams.append(runtime.Stream(0))
except runtime.ResourceLimitError as e:
    print("queue", len(streams) + 1, e.errno)
s = streams[0]
open(hold, "w").write("1")  # the firmware takes nothing: the queue fills
nop = userq.Nop()
done = []
t = threading.Thread(target=lambda: done.append(s.submit([nop] * 40)))
t.start()
time.sleep(0.5)
print("blocked", t.is_alive(), "published", s._ring.words[userq.RING_WPTR >> 3])
open(hold, "w").write("0")
t.join(30)
s.synchronize(timeout=30)
print("done", done, s._ring.words[userq.RING_COMPLETED >> 3])
"""


def test_limits_set_on_the_daemon_are_shown_and_enforced(make_daemon):
    d = make_daemon(extra=[f"--limit={k}={v}" for k, v in LIMITS.items()])
    for name, value in LIMITS.items():
        assert d.attr(0, f"limits/{name}") == str(value)
    with RawDev(d.node(0)) as dev:
        info = dev.query()
        assert (info.max_contexts_per_process, info.max_queues_per_process,
                info.max_queue_depth) == tuple(LIMITS.values())
    out = d.run_py(TENANT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "third context 122", "queue 4 122",  # EDQUOT
        "blocked True published 16",  # its depth, then the producer waits for room
        "done [40] 40"]


def test_the_default_depth_is_the_ring(daemon):
    """Without ``--limit`` a queue holds a whole ring untaken (DEVICE_QUERY says so)."""
    with RawDev(daemon.node(0)) as dev:
        assert dev.query().max_queue_depth == 1024
    assert daemon.attr(0, "limits/max_queue_depth") == "1024"
