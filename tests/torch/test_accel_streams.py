"""Streams (OpenReg's test_streams, torch.cuda's semantics): torch.Stream and
torch.accel.Stream from the per-device pool, ids, the current stream and its context
managers, ordering (query, synchronize, wait_stream, wait_event) proven against a kernel
that keeps a stream busy (``torch.accel._sleep``), and Tensor.record_stream keeping the
caching allocator's reuse stream-safe."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)

#: ``torch.accel._sleep`` cycles that keep a stream busy for a good fraction of a second
BUSY = "10**8"


def test_streams_ids_pool_and_equality(torch_run):
    lines = torch_run("""
        s = torch.Stream(device="accel")
        print(s.device_index == torch.accel.current_device(), s.device.type, s.stream_id != 0)
        s1 = torch.Stream(device="accel:1")
        print(s1.device, torch.Stream(1).device, "torch.Stream device_type=accel, device_index=1" in repr(s1))
        same = torch.Stream(stream_id=s1.stream_id, device_type=s1.device_type, device_index=s1.device_index)
        print(same == s1, hash(same) == hash(s1), s1 != torch.Stream(device="accel:1"))
        hp = torch.accel.Stream(priority=-1)
        print(type(hp).__name__, hp.runtime_stream.priority, torch.accel.Stream().runtime_stream.priority,
              torch.accel.Stream.priority_range())
        print(torch.accel.default_stream().stream_id, torch.accel.current_stream() == torch.accel.default_stream())
        # a pool per priority, round robin: many streams never exhaust the device's queues
        print(len({torch.Stream(device="accel").stream_id for _ in range(100)}))
    """)
    assert lines == ["True accel True", "accel:1 accel:1 True", "True True True",
                     "Stream -1 0 (0, -1)", "0 True", "32"]


def test_current_stream_switches_with_its_device(torch_run):
    lines = torch_run("""
        acc = torch.accelerator
        with torch.Stream(device="accel:1") as s:
            print(acc.current_stream() == s, acc.current_device_index())
        print(acc.current_stream() == torch.accel.default_stream(0), acc.current_device_index())
        hp = torch.accel.Stream(device=1, priority=-1)
        with torch.accel.stream(hp):
            print(torch.accel.current_stream() == hp, torch.accel.current_device(), acc.current_stream(1) == hp)
        print(torch.accel.current_stream(1) == torch.accel.default_stream(1), torch.accel.current_device())
        a = torch.Stream(device="accel:0")
        acc.set_stream(a)
        print(acc.current_stream() == a)
        b = torch.Stream(device="accel:1")
        acc.set_stream(b)
        print(acc.current_stream() == b, acc.current_device_index(), torch.accel.current_stream(0) == a)
    """)
    assert lines == ["True 1", "True 0", "True 1 True", "True 0", "True", "True 1 True"]


def test_query_synchronize_wait_event_and_wait_stream_order_work(torch_run):
    lines = torch_run(f"""
        torch.accel._sleep(1); torch.accel.synchronize()  # the sleep kernel compiled
        s1, s2 = torch.accel.Stream(), torch.accel.Stream()
        print(s1.query(), s2.query())
        with torch.accel.stream(s1):
            torch.accel._sleep({BUSY})
        e = s1.record_event()
        s2.wait_event(e)
        after = s2.record_event()                  # behind s1's sleep, through the wait
        print(s1.query(), e.query(), after.query())
        s2.synchronize()
        print(s1.query(), e.query(), after.query())
        with torch.accel.stream(s1):
            torch.accel._sleep({BUSY})
        s2.wait_stream(s1)
        print(s2.record_event().query())
        torch.accelerator.synchronize()
        print(s1.query(), s2.query())
        torch.Stream(device="accel:1").wait_stream(torch.Stream(device="accel:0"))  # across devices
        x = torch.arange(4.0, device="accel")
        with torch.accel.stream(s2):
            y = x * 2                              # work queued on a side stream
        s2.synchronize()
        print(y.cpu().tolist())
    """)
    assert lines == ["True True", "False False False", "True True True", "False", "True True",
                     "[0.0, 2.0, 4.0, 6.0]"]


def test_record_stream_keeps_a_freed_block_until_that_streams_work_is_done(torch_run):
    """Freed memory goes back to the cache at once, unless record_stream says another
    stream still uses it: then it is handed out again only after that stream's work."""
    lines = torch_run(f"""
        torch.accel._sleep(1); torch.accel.synchronize()
        MiB = 1 << 20
        x = torch.empty(MiB, dtype=torch.uint8, device="accel")
        ptr = x.data_ptr()
        del x
        y = torch.empty(MiB, dtype=torch.uint8, device="accel")
        print(y.data_ptr() == ptr)                 # no other stream: reused at once
        side = torch.accel.Stream()
        with torch.accel.stream(side):
            torch.accel._sleep({BUSY})
        y.record_stream(side)
        del y
        # best fit may pick another free block first: two requests show where ptr went
        busy = [torch.empty(MiB, dtype=torch.uint8, device="accel") for _ in range(2)]
        print(ptr in set(t.data_ptr() for t in busy), side.query())   # side busy: held back
        side.synchronize()
        done = [torch.empty(MiB, dtype=torch.uint8, device="accel") for _ in range(2)]
        print(ptr in set(t.data_ptr() for t in done))                 # side done: reused
        try:
            done[0].record_stream(torch.Stream(device="accel:1"))
        except RuntimeError as e:
            print("other device:", "the stream is on accel:1 but the tensor is on accel:0" in str(e))
    """)
    assert lines == ["True", "False False", "True", "other device: True"]
