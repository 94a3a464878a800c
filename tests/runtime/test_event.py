"""Events: joining streams on the device, elapsed time, waits across devices
(``sched_hold`` holds the firmware while work queues, as in test_stream.py).
"""

from __future__ import annotations

from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_json



def test_event_joins_streams_and_elapsed_time(daemon):
    r = run_json(daemon, PRELUDE, """
        s1, s2 = runtime.Stream(), runtime.Stream()
        a, b = runtime.empty(8 << 20, np.uint8), runtime.empty(8 << 20, np.uint8)
        hold(True)
        start, end = runtime.Event(enable_timing=True), runtime.Event(enable_timing=True)
        start.record(s1)
        a.memset(5, stream=s1)
        end.record(s1)
        s2.wait_event(end)                 # device-side: s2's copy waits for s1's memset
        b.copy_(a, stream=s2)
        report(held_queried=[end.query(), s2.query()])  # nothing ran yet: the scheduler is held
        hold(False)
        s2.synchronize()
        report(read_back=np.unique(b.copy_to_host()), end_queried=end.query(),
               elapsed_ms=start.elapsed_time(end))
        never = runtime.Event()
        s2.wait_event(never)               # never recorded: a no-op, as in torch
        never.synchronize(); report(never_queried=never.query())
    """)
    assert r["held_queried"] == [False, False], r
    assert r["read_back"] == [5] and r["end_queried"] is True and r["elapsed_ms"] > 0, r
    assert r["never_queried"] is True, r


def test_event_across_devices_waits_on_the_device(daemon):
    r = run_json(daemon, PRELUDE, """
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
        report(held_queried=s1.query())
        hold(False, dev=0)
        s1.synchronize()
        report(read_back=np.unique(b.copy_to_host()))
    """)
    assert r == {"held_queried": False, "read_back": [9]}, r

