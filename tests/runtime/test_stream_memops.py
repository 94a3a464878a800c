"""Stream memory operations (``Stream.wait_value32/64``, ``write_value32/64``: WAIT_VALUE
and WRITE_VALUE packets): a stream waits on the device for a word the host stores into
pinned memory, in order with its other work; what may be named is refused exactly, at the
runtime and again at the firmware; a wait nobody ends is a bounded fault of its own queue;
and a queue or context that goes away while one waits does not hang (docs/submission.md,
"Stream memory operations").
"""

from __future__ import annotations

from scenario import IDLE
from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_json

#: a client whose stream waits (an hour's timeout) on a pinned word nobody writes, then
#: says so on its stdout
WAITING = """
flag = runtime.pinned_empty(1, np.uint32)
flag[0] = 0
s = runtime.Stream()
s.wait_value32(flag, 0, 1, timeout=3600)
s.submit_nop()
print("waiting", flush=True)
"""


def test_a_stream_waits_for_the_host_s_store(daemon):
    r = run_json(daemon, PRELUDE, """
        flag = runtime.pinned_empty(2, np.uint64)
        flag[:] = 0
        x = runtime.empty(1 << 20, np.uint8)
        s = runtime.Stream()
        x.memset(1, stream=s)
        s.wait_value32(flag, 0, 3)                    # geq 3
        x.memset(7, stream=s)                         # runs only after the store
        after = s.record_event()
        # the firmware took the wait (its read pointer passed it), the memset behind it
        # did not run: the word is not there yet
        deadline = time.monotonic() + 30
        while s._ring.rptr < after.seqno - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        report(taken=s._ring.rptr >= after.seqno - 1, before=after.query(),
               still_ones=int(np.unique(x.copy_to_host(stream=runtime.Stream())).tolist() == [1]))
        flag.view(np.uint32)[0] = 2                   # not yet: 2 < 3
        time.sleep(0.05)
        report(at_two=after.query())
        flag.view(np.uint32)[0] = 3
        after.synchronize(timeout=30)
        report(read_back=np.unique(x.copy_to_host(stream=s)))

        # a 32-bit counter that wraps: 0xffffffff has not reached 2, 1 past the wrap has
        flag.view(np.uint32)[0] = 0xFFFFFFFF
        w = runtime.Stream()
        w.wait_value32(flag, 0, 2)
        mark = w.record_event(); time.sleep(0.05)
        report(wrapped_before=mark.query())
        flag.view(np.uint32)[0] = 2
        mark.synchronize(timeout=30)

        # stream to stream: one writes the 64-bit word, the other waits for exactly it
        a, b = runtime.Stream(), runtime.Stream()
        b.wait_value64(flag, 8, 1 << 40, cmp="eq")
        y = runtime.empty(1 << 20, np.uint8)
        y.memset(9, stream=b)
        done_b = b.record_event(); time.sleep(0.05)
        report(b_before=done_b.query())
        x.memset(4, stream=a)
        a.write_value64(flag, 8, 1 << 40)             # after a's memset
        done_b.synchronize(timeout=30)
        report(word=int(flag[1]), a_done=a.query(), y=np.unique(y.copy_to_host(stream=b)))
        # the comparisons other than geq, each satisfied at once
        flag.view(np.uint32)[0] = 0b0100
        c = runtime.Stream()
        c.wait_value32(flag, 0, 0b0110, cmp="and")
        c.wait_value32(flag, 0, 0b1000, cmp="nor")
        c.wait_value32(flag, 0, 0b0100, cmp="eq")
        c.synchronize(timeout=30)
        report(cmp_ok=True)
    """)
    assert r["taken"] and r["before"] is False and r["still_ones"] == 1, r
    assert r["at_two"] is False and r["read_back"] == [7], r
    assert r["wrapped_before"] is False, r
    assert r["b_before"] is False and r["word"] == 1 << 40 and r["a_done"] is True, r
    assert r["y"] == [9] and r["cmp_ok"] is True, r


def test_what_a_stream_may_name_is_refused_exactly(daemon):
    r = run_json(daemon, PRELUDE, """
        import errno
        flag = runtime.pinned_empty(4, np.uint32)
        other_dev = runtime.pinned_empty(4, np.uint32, device=1)
        managed = runtime.managed_empty(4, np.uint32)
        dev = runtime.empty(4, np.uint32)
        s = runtime.Stream()
        refused = {}
        for name, call in {
            "numpy": lambda: s.wait_value32(np.zeros(4, np.uint32), 0, 1),
            "device array": lambda: s.wait_value32(dev, 0, 1),
            "managed": lambda: s.write_value32(managed, 0, 1),
            "another device's pinned": lambda: s.wait_value32(other_dev, 0, 1),
            "misaligned": lambda: s.wait_value64(flag, 4, 1),
            "past the end": lambda: s.write_value32(flag, 16, 1),
            "negative offset": lambda: s.write_value32(flag, -4, 1),
            "too wide": lambda: s.write_value32(flag, 0, 1 << 32),
            "negative": lambda: s.wait_value64(flag, 8, -1),
            "cmp": lambda: s.wait_value32(flag, 0, 1, cmp="gt"),
            "timeout 0": lambda: s.wait_value32(flag, 0, 1, timeout=0),
            "timeout too long": lambda: s.wait_value32(flag, 0, 1, timeout=86_401),
        }.items():
            try:
                call()
                refused[name] = None
            except runtime.InvalidValueError as e:
                refused[name] = type(e).__name__
        report(refused=refused, stream_fine=s.last_seqno == 0)

        # the same, written as raw packets: the firmware refuses them when they run
        va = flag.device_va
        faults = {}
        for name, pkt in {
            "unmapped": userq.WaitValue(0x10, 1, 4, 0, 0),
            "past the mapping": userq.WriteValue(va + 4096, 1, 4),
            "another context's pinned": userq.WaitValue(other_dev.device_va, 1, 4, 0, 0),
            "device memory": userq.WaitValue(dev.va, 1, 4, 0, 0),
            "managed": userq.WriteValue(managed.device_va, 1, 4),
            "misaligned": userq.WaitValue(va + 2, 1, 4, 0, 0),
            "width": userq.WaitValue(va, 1, 2, 0, 0),
            "write width": userq.WriteValue(va, 1, 16),
            "value": userq.WaitValue(va, 1 << 32, 4, 0, 0),
            "cmp": userq.WaitValue(va, 1, 4, 4, 0),
            "timeout": userq.WaitValue(va, 1, 4, 0, userq.WAIT_VALUE_TIMEOUT_MAX_NS + 1),
        }.items():
            q = runtime.Stream()
            q.submit([pkt])
            try:
                q.synchronize(timeout=30)
                faults[name] = None
            except runtime.DeviceFaultError as e:
                faults[name] = [errno.errorcode[e.errno], e.record["errno"],
                                e.record["opcode"], hex(e.record["address"] or 0)]
        bystander = runtime.Stream()
        x = runtime.to_device(np.arange(1024, dtype=np.float32))
        report(faults=faults, va=hex(va), other=hex(other_dev.device_va), dev=hex(dev.va),
               managed=hex(managed.device_va),
               bystander_ok=bool((x.copy_to_host(stream=bystander) == np.arange(1024)).all()),
               flag=flag.tolist())
    """)
    assert all(v == "InvalidValueError" for v in r["refused"].values()), r["refused"]
    assert r["stream_fine"] is True, r
    va, f = int(r["va"], 16), r["faults"]
    assert f["unmapped"] == ["EFAULT", "EFAULT", "WAIT_VALUE", "0x10"], f
    assert f["past the mapping"][:3] == ["EFAULT", "EFAULT", "WRITE_VALUE"], f
    assert int(f["past the mapping"][3], 16) >= va + 16, f
    assert f["another context's pinned"] == ["EFAULT", "EFAULT", "WAIT_VALUE", r["other"]], f
    assert f["device memory"] == ["EINVAL", "EINVAL", "WAIT_VALUE", r["dev"]], f
    assert f["managed"] == ["EINVAL", "EINVAL", "WRITE_VALUE", r["managed"]], f
    assert f["misaligned"] == ["EINVAL", "EINVAL", "WAIT_VALUE", hex(va + 2)], f
    for name in ("width", "value", "cmp", "timeout"):
        assert f[name] == ["EINVAL", "EINVAL", "WAIT_VALUE", hex(va)], (name, f)
    assert f["write width"] == ["EINVAL", "EINVAL", "WRITE_VALUE", hex(va)], f
    assert r["bystander_ok"] is True and r["flag"] == [0, 0, 0, 0], r


def test_a_wait_nobody_ends_faults_its_own_queue_only(daemon):
    r = run_json(daemon, PRELUDE, """
        import subprocess
        # another process (another context), its imports and context made before the wait
        # starts, so that what it does while the wait stands takes milliseconds, not the
        # seconds a loaded host may take to start an interpreter
        other = subprocess.Popen([sys.executable, "-c", '''if True:
            import sys, numpy as np, runtime
            runtime.to_device(np.zeros(1, np.float32)).copy_to_host()
            print("ready", flush=True)
            sys.stdin.readline()
            x = np.arange(1 << 16, dtype=np.float32)
            d = runtime.to_device(x)
            print(int((d.copy_to_host() == x).all()), flush=True)
        '''], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        ready = other.stdout.readline().strip()
        flag = runtime.pinned_empty(1, np.uint32)
        flag[0] = 0
        s, mine = runtime.Stream(), runtime.Stream()
        t = time.monotonic()
        s.wait_value32(flag, 0, 1, timeout=1.5)
        s.submit_nop()
        other.stdin.write("go\\n")
        other.stdin.flush()
        other_says = other.stdout.readline().strip()
        x = runtime.to_device(np.full(4096, 3, np.float32))
        report(ready=ready, other=other_says, mine=np.unique(x.copy_to_host(stream=mine)),
               waiting=not s.query(), worked_s=time.monotonic() - t)
        other.stdin.close()
        report(other_rc=other.wait(timeout=120), other_err=other.stderr.read()[-300:])
        try:
            s.synchronize(timeout=60)
        except runtime.DeviceFaultError as e:
            report(fault=[e.record["errno"], e.record["code"], e.record["name"],
                          e.record["scope"], e.record["opcode"]],
                   message=str(e), after_s=time.monotonic() - t)
        logged = [r["name"] for r in runtime.fault_records()
                  if r.get("queue") == s.queue_id]
        ok = runtime.Stream(); ok.submit_nop(); ok.synchronize(timeout=30)
        report(logged=logged, state=open(f"{ROOT}/sys/class/accel/accel0/state").read().strip())
    """)
    assert r["ready"] == "ready" and r["other"] == "1" and r["other_rc"] == 0, r
    # "still waiting" holds only if the host ran the steps above within the wait's 1.5 s
    assert r["mine"] == [3] and (r["waiting"] is True or r["worked_s"] >= 1.5), r
    assert r["fault"] == ["ETIMEDOUT", 47, "QUEUE_WAIT_TIMEOUT", "queue", "WAIT_VALUE"], r
    assert "before the wait's timeout" in r["message"] and 1.4 < r["after_s"] < 30, r
    assert r["logged"] == ["QUEUE_WAIT_TIMEOUT"] and r["state"] == "operational", r


def test_a_queue_or_process_that_goes_away_while_waiting_does_not_hang(daemon):
    r = run_json(daemon, PRELUDE, """
        flag = runtime.pinned_empty(1, np.uint32)
        flag[0] = 0
        s = runtime.Stream()
        s.wait_value32(flag, 0, 1, timeout=3600)
        s.submit_nop()
        t = time.monotonic()
        s.close()                                     # QUEUE_DESTROY drains the wait
        report(closed_s=time.monotonic() - t)
    """)
    assert r["closed_s"] < 30, r
    # a process that exits with a wait of an hour pending: its context is torn down
    child = daemon.popen_py(PRELUDE + WAITING + """
sys.stdin.readline()
""")
    try:
        assert child.stdout.readline().strip() == "waiting", child.stderr.read()
        child.kill()
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
    daemon.wait_attrs(0, IDLE)


def test_a_reset_with_a_wait_pending_loses_the_stream_at_once(make_daemon):
    """A device reset while a stream waits (an hour's timeout) on a word nobody writes: the
    waiter raises DeviceLostError when the reset comes, not when the wait would end, and the
    device serves again."""
    d = make_daemon(devices=1)
    client = d.popen_py(PRELUDE + WAITING + """
import time
t = time.monotonic()
try:
    s.synchronize(timeout=120)
    print("no error", flush=True)
except runtime.DeviceLostError as e:
    print(f"lost within 60 s {time.monotonic() - t < 60}", flush=True)
""")
    try:
        assert client.stdout.readline().strip() == "waiting", client.stderr.read()
        (d.root / "sys/class/accel/accel0/reset").write_text("1")
        assert client.stdout.readline().strip() == "lost within 60 s True", client.stderr.read()
        assert client.wait(timeout=60) == 0, client.stderr.read()
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(timeout=60)
    d.wait_state(0, "operational")
    d.wait_attrs(0, IDLE)
    out = d.run_py(PRELUDE + """
s = runtime.Stream(); s.submit_nop(); s.synchronize(timeout=30); print("works")
""", timeout=120)
    assert out.stdout.strip() == "works", out.stderr
