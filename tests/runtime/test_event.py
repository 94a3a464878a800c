"""Events: joining streams on the device, elapsed time, waits across devices
(``sched_hold`` holds the firmware while work queues, as in test_stream.py).
"""

from __future__ import annotations

from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_scenario


def run(d, body: str, timeout: float = 120, **env) -> list[str]:
    return run_scenario(d, PRELUDE, body, timeout=timeout, **env)


def test_event_joins_streams_and_elapsed_time(daemon):
    lines = run(daemon, """
        s1, s2 = runtime.Stream(), runtime.Stream()
        a, b = runtime.empty(8 << 20, np.uint8), runtime.empty(8 << 20, np.uint8)
        hold(True)
        start, end = runtime.Event(enable_timing=True), runtime.Event(enable_timing=True)
        start.record(s1)
        a.memset(5, stream=s1)
        end.record(s1)
        s2.wait_event(end)                 # device-side: s2's copy waits for s1's memset
        b.copy_(a, stream=s2)
        print(end.query(), s2.query())     # nothing ran yet: the scheduler is held
        hold(False)
        s2.synchronize()
        print(np.all(b.copy_to_host() == 5), end.query(), start.elapsed_time(end) > 0)
        never = runtime.Event()
        s2.wait_event(never)               # never recorded: a no-op, as in torch
        never.synchronize(); print(never.query())
    """)
    assert lines == ["False False", "True True True", "True"]


def test_event_across_devices_waits_on_the_device(daemon):
    lines = run(daemon, """
        runtime.enable_peer_access(0, device=1)
        s0, s1 = runtime.Stream(0), runtime.Stream(1)
        a = runtime.empty(4 << 20, np.uint8, device=0)
        b = runtime.empty(4 << 20, np.uint8, device=1)
        hold(True, dev=0)
        a.memset(9, stream=s0)
        ev = s0.record_event()
        s1.wait_event(ev)                  # accel1's queue waits for accel0's fence
        b.copy_(a, stream=s1)              # a peer copy, after the memset
        time.sleep(0.05)
        print(s1.query())
        hold(False, dev=0)
        s1.synchronize()
        print(np.all(b.copy_to_host() == 9))
    """)
    assert lines == ["False", "True"]
