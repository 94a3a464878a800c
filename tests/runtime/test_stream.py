"""Streams: user-mode queues, order within a stream, overlap on the copy engines, async
errors, priorities, host waits and synchronize, including the races that must not happen
(events: test_event.py; graphs: test_graph.py).

``sched_hold`` (debugfs) stops the firmware taking packets, so tests can queue work on
several streams first and then watch the order it runs in, without relying on timing.
"""

from __future__ import annotations

import signal
import time

from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_json, run_scenario


def run(d, body: str, timeout: float = 120, **env) -> list[str]:
    return run_scenario(d, PRELUDE, body, timeout=timeout, **env)


def test_submission_takes_no_system_call_while_the_firmware_is_awake(daemon):
    """A submit writes the doorbell pipe only while the firmware says it sleeps. Counted
    per submit, over the submits that found it awake before and after. The firmware's
    control loop sleeps once idle for a while, and on a loaded machine (the suite's other
    worker) this process may not run for that long between two submits, so each measured
    submit follows a round trip that woke the firmware; one write in 50 is allowed for a
    firmware that fell asleep between the look and the submit's own."""
    r = run_json(daemon, PRELUDE, """
        s = runtime.Stream()
        s.synchronize()
        sleeping = s.ctx.db.words[userq.DB_FW_SLEEPING >> 3 : (userq.DB_FW_SLEEPING >> 3) + 1]
        io = open(f"/proc/{os.getpid()}/io", "rb", buffering=0)
        def writes():
            io.seek(0)
            return int(io.read().split(b"syscw: ")[1].split()[0])
        nop = pkt(userq.Op.NOP)
        awake = awake_writes = 0
        for _ in range(2000):
            s.submit([nop])
            s.synchronize()
            asleep, n0 = sleeping[0], writes()
            s.submit([nop])
            n1 = writes()
            if not asleep and not sleeping[0]:
                awake += 1
                awake_writes += n1 - n0
        s.synchronize()
        report(completed=s.completed, last_seqno=s.last_seqno, awake=awake,
               awake_writes=awake_writes)
    """, timeout=120)
    assert r["completed"] == r["last_seqno"] == 4000, r
    assert r["awake"] >= 200, r
    assert r["awake_writes"] <= r["awake"] // 50, r


def test_in_order_within_a_stream_and_fence_in_shared_memory(daemon):
    r = run_json(daemon, PRELUDE, """
        s = runtime.Stream()
        a = runtime.empty(1 << 20, np.uint8)
        for v in range(1, 60):
            a.memset(v, stream=s)          # only the last one may win
        s.synchronize()
        report(values=np.unique(a.copy_to_host()), completed=s.completed,
               last_seqno=s.last_seqno)
    """)
    assert r == {"values": [59], "completed": 59, "last_seqno": 59}, r


def test_streams_overlap_on_separate_copy_engines(make_daemon):
    d = make_daemon(extra=[])
    lines = run(d, """
        x = [runtime.empty(48 << 20, np.uint8) for _ in range(4)]
        s1, s2 = runtime.Stream(), runtime.Stream()
        hold(True)
        for _ in range(3):
            x[1].copy_(x[0], stream=s1)
            x[3].copy_(x[2], stream=s2)
        hold(False)
        s1.synchronize(); s2.synchronize()
        print(stat("copy_engines_busy_peak", at_least=2))
    """)
    assert lines == ["2"]  # both engines ran at once: the streams' copies overlapped


def test_async_error_surfaces_at_sync_and_spares_other_streams(daemon):
    r = run_json(daemon, PRELUDE, """
        bad, good = runtime.Stream(), runtime.Stream()
        a = runtime.to_device(np.ones(1024, np.float32))
        good.wait_stream(runtime.current_stream())  # the upload ran on the default stream
        bad.submit([pkt(userq.Op.COPY, a.va, 1 << 43, 64)])  # returns at once, before it runs
        a.memset(0, stream=good)
        good.synchronize()
        try:
            bad.synchronize()
        except runtime.DeviceFaultError as e:
            report(fault=[e.record["opcode"], e.record["errno"], e.record["seqno"]])
        report(good_nonzero=np.count_nonzero(a.copy_to_host(stream=good)))
    """)
    assert r == {"fault": ["COPY", "EFAULT", 1], "good_nonzero": 0}, r


def test_freeing_memory_while_queued_work_uses_it_is_safe(daemon):
    r = run_json(daemon, PRELUDE, """
        s = runtime.Stream()
        src = runtime.to_device(np.full(16 << 20, 7, np.uint8))
        runtime.current_stream().synchronize()  # its upload ran on the default stream
        pin = runtime.pinned_empty(16 << 20, np.uint8)
        hold(True)
        tmp = runtime.empty(16 << 20, np.uint8, stream=s)
        tmp.copy_(src, stream=s)
        tmp.copy_to_host(pin, stream=s)     # queued, not run: the scheduler is held
        tmp_va = tmp.va
        del tmp                              # freed at once on its stream ...
        other = runtime.Stream()
        reuse = runtime.empty(16 << 20, np.uint8, stream=other)
        report(freed_va=tmp_va, other_va=reuse.va)  # ... but not reused by another stream
        reuse.memset(1, stream=other)
        hold(False)
        s.synchronize(); other.synchronize()
        report(read_back=np.unique(pin))
    """)
    assert r["other_va"] != r["freed_va"] and r["read_back"] == [7], r


def test_destroying_a_stream_with_work_in_flight(daemon):
    r = run_json(daemon, PRELUDE, """
        s = runtime.Stream()
        a = runtime.empty(4 << 20, np.uint8)
        out = runtime.pinned_empty(4 << 20, np.uint8)
        hold(True)
        a.memset(3, stream=s)
        a.copy_to_host(out, stream=s)
        ev = s.record_event()
        s.close()                           # queued work still runs to completion
        hold(False)
        ev.synchronize()
        report(read_back=np.unique(out))
    """)
    assert r == {"read_back": [3]}, r


def test_synchronize_waits_for_the_work_of_a_stream_already_dropped(daemon):
    """A stream closed or dropped with work queued: that work still runs, and a device or
    context synchronize waits for it, as cudaDeviceSynchronize waits for a destroyed
    stream's work. Found as a flaky launch-plan test (a plan launched on
    ``runtime.Stream()`` made inline, then ``runtime.synchronize()``, then a copy on the
    default stream that ran before the launch: 1 run in 4). Here the firmware is held
    while the dropped stream's memset is queued and let go 0.3 s later, so a synchronize
    that forgot the stream returns at once and reads the old bytes."""
    r = run_json(daemon, PRELUDE, """
        import gc, threading
        x = runtime.empty(1 << 16, np.uint8)
        x.memset(1)
        runtime.synchronize()
        for close in (True, False):
            hold(True)
            s = runtime.Stream()
            x.memset(7 if close else 9, stream=s)
            if close:
                s.close()
            del s
            gc.collect()
            threading.Timer(0.3, hold, (False,)).start()
            t0 = time.monotonic()
            runtime.synchronize(timeout=60)
            report(**{f"{'closed' if close else 'dropped'}": {
                "waited": time.monotonic() - t0 >= 0.25,
                "bytes": np.unique(x.copy_to_host()).tolist()}})
    """)
    assert r == {"closed": {"waited": True, "bytes": [7]},
                 "dropped": {"waited": True, "bytes": [9]}}, r


def test_process_exiting_with_work_queued_leaves_nothing(daemon):
    daemon.wait_attrs(0, {"contexts": "0", "memory_used": "0"})
    run(daemon, """
        s = runtime.Stream()
        a = runtime.empty(8 << 20, np.uint8)
        hold(True)
        for _ in range(500):
            a.memset(1, stream=s)
        os._exit(0)                          # no goodbye, work still queued and held
    """)
    daemon.debug(0, "sched_hold").write_text("0")
    daemon.wait_attrs(0, {"contexts": "0", "memory_used": "0"})


def test_priorities_high_runs_first_and_preempts_long_copies(make_daemon):
    d = make_daemon()
    r = run_json(d, PRELUDE, """
        low1, low2 = runtime.Stream(priority=0), runtime.Stream(priority=0)
        high = runtime.Stream(priority=-1)
        big = [runtime.empty(72 << 20, np.uint8) for _ in range(3)]
        small = [runtime.empty(8 << 20, np.uint8) for _ in range(2)]
        # queued order: low before high; the scheduler is held while they queue
        hold(True)
        a = runtime.Event(enable_timing=True); a.record(low1)
        low1.submit([pkt(userq.Op.NOP)])
        b = runtime.Event(enable_timing=True); b.record(high)
        hold(False)
        high.synchronize(); low1.synchronize()
        report(high_ns=b.stream.timestamp(b.seqno), low_nop_ns=a.stream.timestamp(a.seqno + 1))
        # preemption: each copy engine busy with one long (18-chunk) low-priority copy
        taken = lambda s: s._ring.rptr
        for attempt in range(1, 6):
            big[1].copy_(big[0], stream=low1)
            big[2].copy_(big[0], stream=low2)
            t_end = time.monotonic() + 5
            while (taken(low1) < low1.last_seqno or taken(low2) < low2.last_seqno) and time.monotonic() < t_end:
                pass                                     # both dispatched to the engines
            time.sleep(0.001)
            high.submit([pkt(userq.Op.NOP)])             # its time: when the firmware took
            arrived = high.last_seqno                    # the high work (a NOP runs inline)
            small[1].copy_(small[0], stream=high)
            hi = high.record_event(); l1, l2 = low1.record_event(), low2.record_event()
            for s in (high, low1, low2):
                s.synchronize()
            lows = [low1.timestamp(l1.seqno), low2.timestamp(l2.seqno)]
            if high.timestamp(arrived) < min(lows):
                break  # the scenario: the high copy came while both engines had a low one
            # this process was held off its CPU until a low copy had ended: nothing was
            # tested (the host's scheduling, not the device's); again
        # both engines were busy with one long copy each: finishing first means a low copy
        # yielded its engine between chunks (counted in sysfs preemptions; the bench
        # measures the delay)
        report(high_copy_ns=high.timestamp(hi.seqno), low_copies_ns=lows, attempt=attempt,
               arrived_ns=high.timestamp(arrived))
    """)
    assert r["high_ns"] <= r["low_nop_ns"], r
    assert r["arrived_ns"] < min(r["low_copies_ns"]), r  # the scenario happened (5 tries)
    assert r["high_copy_ns"] < min(r["low_copies_ns"]), r


def test_sched_hold_returns_once_the_firmware_has_taken_it(make_daemon):
    """A debugfs ``sched_hold`` write returns once the firmware took the message, so work
    the writer queues next is held however busy the machine is (the firmware handles a
    message as it takes it, before it takes packets again); with a firmware that takes
    nothing (hung), after its bound of a second."""
    d = make_daemon(extra=["--heartbeat-timeout", "60"])
    r = run_json(d, PRELUDE, """
        s = runtime.Stream()
        held = 0
        for _ in range(20):
            hold(True)
            s.submit([pkt(userq.Op.NOP)])
            time.sleep(0.002)
            held += s.completed < s.last_seqno
            hold(False)
            s.synchronize()
        open(f"{ROOT}/sys/kernel/debug/accel/accel0/fw_hang", "w").write("1")
        t = time.monotonic()
        hold(True)
        report(held=held, hung_hold_s=time.monotonic() - t)
    """)
    assert r["held"] == 20 and r["hung_hold_s"] >= 0.9, r


def test_host_wait_timeout_and_ctrl_c(make_daemon):
    d = make_daemon()
    lines = run(d, """
        s = runtime.Stream()
        hold(True)
        s.submit([pkt(userq.Op.NOP)])
        t = time.monotonic()
        try:
            s.synchronize(timeout=0.3)
        except runtime.AccelTimeoutError as e:
            print("timeout", round(time.monotonic() - t, 1))
        hold(False)
    """)
    assert lines == ["timeout 0.3"]
    code = PRELUDE + """
s = runtime.Stream()
hold(True)
s.submit([pkt(userq.Op.NOP)])
print("waiting", flush=True)
try:
    s.synchronize()
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""
    proc = d.popen_py(code)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.3)
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == "interrupted"
        assert time.monotonic() - t < 2  # bounded driver waits: Ctrl-C lands within a slice
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        d.debug(0, "sched_hold").write_text("0")



def test_a_host_wait_naps_only_while_an_engine_runs_the_work(daemon):
    # The engines are threads on the host's CPUs: a waiter lends its CPU (naps) while the
    # firmware says an engine runs the stream's packet, and otherwise keeps polling, since a
    # nap costs a halted vCPU's wake-up (docs/submission.md)
    r = run_json(daemon, PRELUDE, """
        import threading
        naps, real_sleep, main = [], time.sleep, threading.get_ident()
        def sleep(seconds):
            if threading.get_ident() == main:
                naps.append(seconds)
            real_sleep(seconds)
        time.sleep = sleep
        s = runtime.Stream()
        a, b = runtime.empty(64 << 20, np.uint8), runtime.empty(64 << 20, np.uint8)
        # A copy engine's work (milliseconds), waited for once the firmware says an engine
        # runs it (the ring's RING_ON_ENGINE word, which the waiter reads). The waiter is
        # real-time meanwhile: on a loaded host an ordinary one's first yield can give its
        # CPU away for longer than its 2 ms of polling, so it never reaches the nap.
        words = s._ring.words
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        for _ in range(5):
            b.copy_(a, stream=s)
            until = time.monotonic() + 10
            while not words[userq.RING_ON_ENGINE >> 3] and not s.query():
                assert time.monotonic() < until
                real_sleep(0.0002)
            s.synchronize()
            if naps:
                break
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        report(engine_naps=len(naps))
        naps.clear()
        hold(True)  # nothing runs: the wait polls for its 2 ms, then sleeps on its pipe
        s.submit([pkt(userq.Op.NOP)])
        threading.Timer(0.05, hold, (False,)).start()
        s.synchronize()
        report(held_naps=naps, completed=s.completed, last_seqno=s.last_seqno)
    """)
    assert r["engine_naps"] > 0 and r["held_naps"] == [], r
    assert r["completed"] == r["last_seqno"], r


def test_fence_timeout_on_hung_device(make_daemon):
    d = make_daemon(extra=["--heartbeat-timeout", "60"])
    r = run_json(d, "", f"""
        import time, runtime
        ctx = runtime.new_context(0)
        open("{d.debug(0, 'fw_hang')}", "w").write("1")
        f = ctx.submit_noop()
        assert not f.query()
        t = time.monotonic()
        try:
            f.wait(timeout=0.35)
        except runtime.AccelTimeoutError as exc:
            report(base=type(exc).__mro__[1].__name__, builtin=isinstance(exc, TimeoutError),
                   errno=exc.errno, waited_s=time.monotonic() - t)
    """)
    assert (r["base"], r["builtin"], r["errno"]) == ("AccelError", True, 62), r
    assert round(r["waited_s"], 1) >= 0.3, r


def test_synchronize_waits_for_every_stream_and_raises_the_first_fault(daemon):
    """Like torch.cuda.synchronize: every stream of the process on the device has finished
    what was queued before the call, and a pending fault is raised with its record."""
    r = run_json(daemon, "", """
        import numpy as np, runtime
        from abi import userq
        streams = [runtime.Stream(0) for _ in range(2)]
        bufs = [runtime.empty(96 << 20, np.uint8) for _ in streams]
        for s, b in zip(streams, bufs):
            for _ in range(4):
                b.memset(7, stream=s)
        runtime.synchronize(0)
        report(queried=[s.query() for s in streams], last_byte=bufs[1].copy_to_host()[-1],
               faulty_queue=streams[1].queue_id)
        streams[1].submit([userq.Memset(0x10, 64, 0)])
        faults = []
        for _ in range(2):  # sticky, as CUDA's: the stream keeps its fault
            try:
                runtime.synchronize(0)
                faults.append("no fault")
            except runtime.DeviceFaultError as exc:
                faults.append([exc.record["errno"], exc.record["queue"]])
        try:
            runtime.synchronize(1, timeout=10)  # the other device has nothing of it
            other = "clean"
        except runtime.AccelError as exc:
            other = repr(exc)
        report(faults=faults, device_1=other)
    """)
    assert r["queried"] == [True, True] and r["last_byte"] == 7, r
    assert r["faults"] == [["EFAULT", r["faulty_queue"]]] * 2 and r["device_1"] == "clean", r


def test_synchronize_honours_its_timeout(daemon):
    r = run_json(daemon, "", """
        import os, time, numpy as np, runtime
        hold = os.environ["ACCEL_EMU_ROOT"] + "/sys/kernel/debug/accel/accel0/sched_hold"
        s = runtime.Stream(0)
        open(hold, "w").write("1")
        try:
            s.submit_nop()
            t0 = time.monotonic()
            try:
                runtime.synchronize(0, timeout=0.3)
                report(timeout="returned")
            except runtime.AccelTimeoutError as exc:
                report(timeout=exc.errno, waited_s=time.monotonic() - t0)
        finally:
            open(hold, "w").write("0")
        runtime.synchronize(0, timeout=10)
        report(queried=s.query())
    """)
    assert r["timeout"] == 62 and round(r["waited_s"], 1) >= 0.3 and r["queried"] is True, r

