"""Events (OpenReg's test_event, torch.cuda's semantics): torch.Event and
torch.accel.Event, ids given at the first record, query and synchronize against a busy
stream, stream waits, reuse, and elapsed_time in milliseconds."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_events_get_their_device_and_id_when_recorded(torch_run):
    lines = torch_run("""
        for e in (torch.Event(device="accel"), torch.Event(device="accel:1"), torch.Event()):
            print(e.device, e.device.index, e.event_id, e.query())
        s = torch.Stream(device="accel:1")
        e1, e2 = s.record_event(), s.record_event()
        print(e1.device, e1.event_id, e2.event_id)
        e = torch.Event(device="accel:0")
        e.record(torch.Stream(device="accel:0"))
        print(e.device, e.event_id)
        e.record(torch.Stream(device="accel:0"))   # recorded again: reused
        e.synchronize()
        print(e.query(), isinstance(torch.accel.Event(), torch.Event))
        with torch.accel.device(1):
            d = torch.Event()
            d.record()                            # no stream: the current one
        print(d.device)
    """)
    assert lines[:3] == ["accel None 0 True"] * 3, lines
    device, first, second = lines[3].split()
    assert device == "accel:1" and first != "0" and second not in ("0", first), lines
    device, event_id = lines[4].split()
    assert device == "accel:0" and event_id != "0", lines
    assert lines[5:] == ["True True", "accel:1"], lines


def test_query_and_synchronize_follow_the_streams_work(torch_run):
    lines = torch_run("""
        torch.accel._sleep(1); torch.accel.synchronize()
        s1, s2, s3 = (torch.Stream(device="accel:0") for _ in range(3))
        # held, the device takes nothing: the sleep cannot end before this process looks
        hold = f"{os.environ['ACCEL_EMU_ROOT']}/sys/kernel/debug/accel/accel0/sched_hold"
        open(hold, "w").write("1")
        with s1:
            torch.accel._sleep(10**8)
        e = s1.record_event()
        print(e.query())
        open(hold, "w").write("0")
        s2.wait_event(e)
        s3.wait_event(e)                           # two streams waiting on one event
        x = torch.arange(6.0, device="accel")
        with s2:
            a = x + 1
        with s3:
            b = x + 1
        e.synchronize()
        print(e.query())
        torch.accelerator.synchronize()
        print(s2.query(), s3.query())
        print(a.cpu().tolist())
        print(b.cpu().tolist())
    """)
    assert lines[:3] == ["False", "True", "True True"] and lines[3] == lines[4], lines



def test_elapsed_time_is_positive_milliseconds_only_for_timing_events(torch_run):
    """Plain torch.Event pairs are measured by torch, torch.accel.Event pairs by the
    backend (torch's binding refuses a subclass as the end event): the same answers."""
    lines = torch_run("""
        torch.accel._sleep(1); torch.accel.synchronize()
        s = torch.Stream(device="accel:1")
        for make in (lambda **kw: torch.Event(device="accel:1", **kw), torch.accel.Event):
            start, end = make(enable_timing=True), make(enable_timing=True)
            start.record(s)
            with s:
                torch.accel._sleep(10**8)
            end.record(s)
            t0 = time.monotonic()
            end.synchronize()
            wall_ms = (time.monotonic() - t0) * 1000
            ms = start.elapsed_time(end)
            print(type(ms).__name__, ms, wall_ms)
            plain = [make(), make()]
            for p in plain:
                p.record(s)
            s.synchronize()
            try:
                plain[0].elapsed_time(plain[1])
            except ValueError as e:
                print(e)
        try:
            torch.accel.Event(enable_timing=True).elapsed_time(end)
        except RuntimeError as e:
            print(e)
    """)
    for timed in (lines[0], lines[2]):
        kind, ms, wall_ms = timed.split()
        assert kind == "float" and 0 < float(ms) < 60_000, lines
        assert float(ms) >= 0.5 * float(wall_ms), lines
    assert lines[1::2] == ["Both events must be created with argument 'enable_timing=True'."] * 2
    assert lines[4:] == ["Both events must be recorded before calculating elapsed time."], lines

