"""The SIGKILL storm (stress/kill_storm.py) in CI size: 60 kills with a fixed seed on a
private 2-device daemon that another uid can reach (about 20-40 s on the 2-core machine;
``python -m stress`` makes 1,000).

Victims work on both devices -- allocations of every kind, copies, peer copies, kernels,
cross-device event waits, IPC imports and exports -- and die by SIGKILL at random points;
bystanders and a long-lived exporter check their data throughout; after every 15 kills and
at the end the daemon's books, descriptors and /dev/shm must be back. At this size a run
still kills victims after every one of their markers and at their start, while blocked
behind a giant grid, and kills the exporter once (the report's ``done``: 100 kills gave
nothing more).
"""

from __future__ import annotations

import time

import pytest

from stress import kill_storm
from testkit.contained import assert_contained, snapshot


@pytest.mark.timeout(300)
def test_kill_storm_leaves_nothing_behind(make_daemon):
    d = make_daemon(devices=2, tenants=True)
    report = kill_storm.run(d, count=60, seed=20261201, check_every=15)
    print(report.line())
    assert report.ok, f"{report.line()}\n" + "\n".join(report.notes)
    assert report.done.get("kills", 0) == 60, report.done
    assert report.done.get("victims_uid65534", 0) > 0, report.done
    assert report.done.get("checks", 0) >= 4, report.done
    # every victim died by the storm's SIGKILL, none of an error of its own, and the
    # device refused none of their work (but imports of exports whose holders all died)
    assert report.done.get("victim_exits", 0) == 0, "\n".join(report.notes)
    assert report.done.get("victim_errors", 0) == 0, "\n".join(report.notes)


_GIANT_LAUNCH = """
import numpy as np, runtime
mod = runtime.compile('''
def spin(x, n):
    acc = 0.0
    for j in range(n):
        acc = acc + 1.0
    x[0] = acc
''')
x = runtime.empty(16 << 20, np.float32)  # 64 MiB the dead process must give back
s = runtime.Stream()
mod.spin[1, 1](x, np.int64(10), stream=s)
s.synchronize()
# 2**21 - 1 blocks of ~50 us each: a minute of work, no block anywhere near the watchdog
mod.spin[(1 << 21) - 1, 1](x, np.int64(100_000), stream=s)
print("launched", flush=True)
import time; time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_launch_of_a_killed_process_is_stopped_and_its_memory_returns(make_daemon):
    """Found while building the storm, at 5655b2d: a SIGKILLed process's launch ran on
    to its end -- CTX_DESTROY only marked the rings faulted and deferred the teardown while
    a ring was busy, the running launch never learnt its context was gone, and the
    watchdog is re-armed every slice -- so the dead process's 64 MiB stayed held for the
    minute its grid took. The teardown must stop the launch at its next slice."""
    d = make_daemon(devices=1)
    before = snapshot(d)
    victim = d.popen_py(_GIANT_LAUNCH)
    try:
        assert victim.stdout.readline().strip() == "launched", victim.stderr.read()
        time.sleep(0.5)
    finally:
        victim.kill()
        victim.wait()
    # a fixed device stops the launch at its next block (or at the watchdog, 10 s)
    assert_contained(d, before, timeout=15)
