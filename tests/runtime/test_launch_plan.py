"""Launch plans (``Kernel.plan``): a launch checked once and run again with only its
buffers new, as a framework's eager operator launches (torch_accel/ops/_plans.py).

A plan's fast path skips ``Kernel.launch``; these tests hold it to what a launch does:
the same results, the same errors for a bad buffer, a capture that records it, and no
memory kept from the call it was planned with.
"""

from __future__ import annotations

from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_json

SETUP = """
from runtime import kernel_lib
lib = runtime.compile(kernel_lib.SOURCE)
N = 1000
def err(f):
    try:
        f()
        return None
    except runtime.AccelError as e:
        return f"{type(e).__name__}: {e}"
def planned(a=2.0):
    x = runtime.to_device(np.arange(N, dtype=np.float32))
    y = runtime.to_device(np.ones(N, np.float32))
    out = runtime.empty(N, np.float32)
    return lib.saxpy.plan((N + 255) // 256, 256, [np.float32(a), x, y, out]), x, y
"""


def test_a_plan_computes_what_a_launch_does_with_new_buffers_and_offsets(daemon):
    r = run_json(daemon, PRELUDE + SETUP, """
        plan, x, y = planned()
        big = runtime.empty(4 * N, np.float32)
        big.memset(0)
        runtime.synchronize()
        for k in range(3):                                  # the result at three offsets
            plan([(x, 0), (y, 0), (big, 4 * N * k)])
        other = runtime.to_device(np.full(2 * N, 5, np.float32))
        runtime.synchronize()                               # its upload, before another stream
        plan([(other, 4 * N), (y, 0), (big, 12 * N)], runtime.Stream())  # another stream
        runtime.synchronize()
        got = big.copy_to_host()
        want = 2 * np.arange(N, dtype=np.float32) + 1
        report(planned=int(np.count_nonzero(got[:3 * N] != np.tile(want, 3))),
               other=int(np.count_nonzero(got[3 * N:] != 11)))
    """)
    assert r == {"planned": 0, "other": 0}, r


def test_a_bad_buffer_is_refused_as_a_launch_refuses_it_and_nothing_runs(daemon):
    r = run_json(daemon, PRELUDE + SETUP, """
        plan, x, y = planned()
        big = runtime.empty(2 * N, np.float32)
        big.memset(0)
        runtime.synchronize()
        other = runtime.empty(N, np.float32, device=1)
        report(past=err(lambda: plan([(x, 0), (y, 0), (big, 4 * N + 4)])),
               negative=err(lambda: plan([(x, 0), (y, 0), (big, -4)])),
               too_few=err(lambda: plan([(x, 0), (y, 0)])),
               not_device=err(lambda: plan([(x, 0), (y, 0), (np.zeros(N, np.float32), 0)])),
               other_device=err(lambda: plan([(x, 0), (y, 0), (other, 0)])))
        runtime.synchronize()
        report(written=int(np.count_nonzero(big.copy_to_host())))
    """)
    fit = "does not fit in DeviceArray(shape=(2000,), dtype=float32, device=accel:0) (8000 bytes)"
    assert r["past"] == f"InvalidValueError: a view of (1000,) float32 at byte 4004 {fit}", r
    assert r["negative"] == f"InvalidValueError: a view of (1000,) float32 at byte -4 {fit}", r
    assert r["too_few"] == "InvalidValueError: saxpy: its plan takes 3 buffers, got 2", r
    assert r["not_device"] == ("InvalidValueError: saxpy: a plan's buffer must be a device "
                               "array, got ndarray"), r
    assert r["other_device"] == ("InvalidValueError: saxpy: argument out lives on accel:1, "
                                 "the kernel runs on accel:0"), r
    assert r["written"] == 0, r


def test_a_plan_keeps_no_memory_of_the_call_it_was_planned_with(daemon):
    r = run_json(daemon, PRELUDE + SETUP, """
        base = runtime.memory_allocated()
        plan, x, y = planned()
        del x, y
        report(held=runtime.memory_allocated() - base)
    """)
    assert r == {"held": 0}, r


def test_a_capturing_stream_records_a_planned_launch(daemon):
    r = run_json(daemon, PRELUDE + SETUP, """
        plan, x, y = planned(a=3.0)
        out = runtime.empty(N, np.float32)
        s = runtime.Stream()
        g = runtime.Graph()
        with runtime.graph(g, s):
            plan([(x, 0), (y, 0), (out, 0)], s)
        report(packets=len(g))
        out.memset(0)
        runtime.synchronize()
        g.replay()
        s.synchronize()
        want = 3 * np.arange(N, dtype=np.float32) + 1
        report(wrong=int(np.count_nonzero(out.copy_to_host(stream=s) != want)))
    """)
    assert r == {"packets": 1, "wrong": 0}, r
