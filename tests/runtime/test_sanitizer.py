"""The stream-race sanitizer (``ACCEL_SANITIZE``, docs/sanitizer.md) on a corpus of racy
and correct programs, run on a real mount through the public API.

Every racy program must raise ``runtime.RaceError`` at its synchronisation point with a
report naming both accesses exactly (stream queue, seqno, op, mode, call site line), the
overlapping bytes and their kind; every correct one must not. The corpus runs in one
process, each program ending in a device synchronize, so the next starts ordered after
everything before it. Precision and recall over the corpus are in docs/sanitizer.md.
"""

from __future__ import annotations

import pytest

from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_json, run_scenario

pytestmark = pytest.mark.timeout(300)

#: The corpus's helpers: kernels, streams, and ``run`` which runs a program and reports
#: whether it raised and what. ``here()`` is the caller's line: a program notes the line
#: of each access it expects in a report.
SETUP = """
import dataclasses
from runtime import sanitizer
assert sanitizer.active is not None and sanitizer.active.mode == "raise"
SOURCE = '''
def fill(out, v):
    i = global_id(0)
    if i < out.size:
        out[i] = v

def scale(out, x, a):
    i = global_id(0)
    if i < out.size:
        out[i] = x[i] * a

def count(total, x):
    i = global_id(0)
    if i < x.size:
        atomic_add(total, 0, x[i])

def bump(x):
    i = global_id(0)
    if i < x.size:
        x[i] += 1.0
'''
K = runtime.compile(SOURCE)
N = 4096
G, B = N // 256, 256
s1, s2 = runtime.Stream(), runtime.Stream()
host = runtime.pinned_empty(N, np.float32)
host2 = runtime.pinned_empty(N, np.float32)
host[:] = 1
runtime.enable_peer_access(1, device=0)
K1 = runtime.compile(SOURCE, device=1)
t1 = runtime.Stream(1)
results = {}
def here():
    return sys._getframe(1).f_lineno
def sync():
    runtime.synchronize(0)
    runtime.synchronize(1)
def run(name, program):
    expect = {}
    try:
        program(expect)
        sync()
        results[name] = {"raised": False, "expect": expect}
    except runtime.RaceError as e:
        sync()
        results[name] = {"raised": True, "expect": expect,
                         "report": dataclasses.asdict(e.report), "n": len(e.reports),
                         "text": str(e)}
def note(expect, key, stream, **kw):
    expect[key] = dict(queue=stream.queue_id, seqno=stream.last_seqno, **kw)
"""

#: racy programs: each leaves two accesses unordered; ``a``/``b`` note them (first queued,
#: second queued) with the bytes they overlap on
RACY = """
def copy_copy(x):  # two copies into one array on two streams
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    a.copy_from_host(host, s1); note(x, "first", s1, op="copy", mode="write", line=here())
    a.copy_from_host(host2, s2); note(x, "second", s2, op="copy", mode="write", line=here())
    x["range"] = [a.va, a.va + a.nbytes]; x["kind"] = "device"
run("copy_copy", copy_copy)

def kernel_then_read(x):  # a kernel writes, a copy on another stream reads
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    K.fill[G, B](a, np.float32(2), stream=s1); note(x, "first", s1, op="fill", mode="write", line=here())
    a.copy_to_host(host2, stream=s2); note(x, "second", s2, op="copy", mode="read", line=here())
    x["range"] = [a.va, a.va + a.nbytes]; x["kind"] = "device"
run("kernel_then_read", kernel_then_read)

def read_then_write(x):  # a kernel reads its input, a memset on another stream writes it
    a, b = runtime.empty(N, np.float32), runtime.empty(N, np.float32)
    runtime.synchronize()
    K.scale[G, B](b, a, np.float32(3), stream=s1); note(x, "first", s1, op="scale", mode="read", line=here())
    a.memset(0, stream=s2); note(x, "second", s2, op="memset", mode="write", line=here())
    x["range"] = [a.va, a.va + a.nbytes]; x["kind"] = "device"
run("read_then_write", read_then_write)

def overlapping_views(x):  # two views of one array, overlapping by half
    base = runtime.empty(2 * N, np.float32)
    runtime.synchronize()
    v1 = base.view(np.float32, (N,), 0)
    v2 = base.view(np.float32, (N,), 2 * N)
    K.fill[G, B](v1, np.float32(1), stream=s1); note(x, "first", s1, op="fill", mode="write", line=here())
    K.fill[G, B](v2, np.float32(2), stream=s2); note(x, "second", s2, op="fill", mode="write", line=here())
    x["range"] = [base.va + 2 * N, base.va + 4 * N]; x["kind"] = "device"
run("overlapping_views", overlapping_views)

def event_too_early(x):  # the event is recorded before the work it should cover
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    e = runtime.Event()
    e.record(s1)
    K.fill[G, B](a, np.float32(1), stream=s1); note(x, "first", s1, op="fill", mode="write", line=here())
    s2.wait_event(e)
    a.copy_to_host(host2, stream=s2); note(x, "second", s2, op="copy", mode="read", line=here())
    x["range"] = [a.va, a.va + a.nbytes]; x["kind"] = "device"
run("event_too_early", event_too_early)

def pinned_host_memory(x):  # a copy reads pinned memory another stream's copy writes
    a, b = runtime.empty(N, np.float32), runtime.empty(N, np.float32)
    runtime.synchronize()
    a.copy_to_host(host2, stream=s1); note(x, "first", s1, op="copy", mode="write", line=here())
    b.copy_from_host(host2, s2); note(x, "second", s2, op="copy", mode="read", line=here())
    x["range"] = [host2.device_va, host2.device_va + host2.nbytes]; x["kind"] = "host_pinned"
run("pinned_host_memory", pinned_host_memory)

def reuse_without_record_stream(x):  # s2 uses s1's array, which is freed and reused on s1
    a = runtime.empty(N, np.float32, stream=s1)
    runtime.synchronize()
    va = a.va
    K.fill[G, B](a, np.float32(1), stream=s2); note(x, "first", s2, op="fill", mode="write", line=here())
    del a
    b = runtime.empty(N, np.float32, stream=s1)
    x["reused"] = b.va == va
    b.memset(0, stream=s1); note(x, "second", s1, op="memset", mode="write", line=here())
    x["range"] = [b.va, b.va + b.nbytes]; x["kind"] = "device"
run("reuse_without_record_stream", reuse_without_record_stream)

def graph_replay(x):  # a replayed kernel and a memset on another stream
    a = runtime.empty(N, np.float32, stream=s1)
    g = runtime.Graph()
    with runtime.graph(g, s1):
        K.fill[G, B](a, np.float32(5), stream=s1)
    runtime.synchronize()
    g.replay(s1); note(x, "first", s1, op="fill", mode="write", line=here())
    a.memset(0, stream=s2); note(x, "second", s2, op="memset", mode="write", line=here())
    x["range"] = [a.va, a.va + a.nbytes]; x["kind"] = "device"
run("graph_replay", graph_replay)

def raw_packets(x):  # packets a client encodes itself, written through Stream.submit
    a, b = runtime.empty(N, np.float32), runtime.empty(N, np.float32)
    runtime.synchronize()
    s1.submit([pkt(userq.Op.MEMSET, a.va + 64, 128, 7)]); note(x, "first", s1, op="memset", mode="write", line=here())
    s2.submit([pkt(userq.Op.COPY, b.va, a.va, 4 * N)]); note(x, "second", s2, op="copy", mode="read", line=here())
    x["range"] = [a.va + 64, a.va + 192]; x["kind"] = "device"
run("raw_packets", raw_packets)

def atomic_then_read(x):  # atomics on s1, a plain read of the total on s2
    a, total = runtime.empty(N, np.float32), runtime.empty(4, np.float32)
    runtime.synchronize()
    K.count[G, B](total, a, stream=s1); note(x, "first", s1, op="count", mode="atomic", line=here())
    total.copy_to_host(runtime.pinned_empty(4, np.float32), stream=s2); note(x, "second", s2, op="copy", mode="read", line=here())
    x["range"] = [total.va, total.va + 16]; x["kind"] = "device"
run("atomic_then_read", atomic_then_read)

def read_modify_write(x):  # x[i] += 1 reads and writes: racing a read on another stream
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    a.copy_to_host(host2, stream=s2); note(x, "first", s2, op="copy", mode="read", line=here())
    K.bump[G, B](a, stream=s1); note(x, "second", s1, op="bump", mode="read+write", line=here())
    x["range"] = [a.va, a.va + a.nbytes]; x["kind"] = "device"
run("read_modify_write", read_modify_write)

def peer_copy(x):  # device 0 copies device 1's array while a kernel on device 1 writes it
    b = runtime.empty(N, np.float32, device=1)
    a = runtime.empty(N, np.float32)
    runtime.synchronize(1)
    K1.fill[G, B](b, np.float32(1), stream=t1); note(x, "first", t1, op="fill", mode="write", line=here())
    a.copy_(b, stream=s1); note(x, "second", s1, op="copy", mode="read", line=here())
    x["range"] = [b.va, b.va + b.nbytes]; x["kind"] = "device"
run("peer_copy", peer_copy)
"""

#: correct programs: the same shapes of work, ordered by each rule of docs/sanitizer.md
CORRECT = """
def disjoint_views(x):
    base = runtime.empty(2 * N, np.float32)
    runtime.synchronize()
    K.fill[G, B](base.view(np.float32, (N,), 0), np.float32(1), stream=s1)
    K.fill[G, B](base.view(np.float32, (N,), 4 * N), np.float32(2), stream=s2)
run("disjoint_views", disjoint_views)

def atomics_on_two_streams(x):  # atomic adds do not race with atomic adds
    a, total = runtime.empty(N, np.float32), runtime.empty(4, np.float32)
    runtime.synchronize()
    K.count[G, B](total, a, stream=s1)
    K.count[G, B](total, a, stream=s2)
run("atomics_on_two_streams", atomics_on_two_streams)

def same_stream(x):
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    K.fill[G, B](a, np.float32(1), stream=s1)
    a.copy_from_host(host, s1)
    a.copy_to_host(host2, stream=s1)
run("same_stream", same_stream)

def reads_only(x):
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    a.copy_to_host(host, stream=s1)
    a.copy_to_host(host2, stream=s2)
run("reads_only", reads_only)

def event_ordered(x):
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    K.fill[G, B](a, np.float32(1), stream=s1)
    e = runtime.Event()
    e.record(s1)
    s2.wait_event(e)
    a.copy_to_host(host2, stream=s2)
run("event_ordered", event_ordered)

def wait_stream_ordered(x):
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    a.copy_from_host(host, s1)
    s2.wait_stream(s1)
    a.memset(0, stream=s2)
run("wait_stream_ordered", wait_stream_ordered)

def synchronize_ordered(x):
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    K.fill[G, B](a, np.float32(1), stream=s1)
    s1.synchronize()
    a.memset(0, stream=s2)
run("synchronize_ordered", synchronize_ordered)

def event_query_ordered(x):
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    K.fill[G, B](a, np.float32(1), stream=s1)
    e = runtime.Event()
    e.record(s1)
    while not e.query():
        time.sleep(0.001)
    a.memset(0, stream=s2)
run("event_query_ordered", event_query_ordered)

def blocking_copy_ordered(x):
    a = runtime.empty(N, np.float32)
    runtime.synchronize()
    with runtime.stream(s1):
        K.fill[G, B](a, np.float32(1))
        a.copy_to_host()  # blocking: the host waits for s1
    a.memset(0, stream=s2)
run("blocking_copy_ordered", blocking_copy_ordered)

def reuse_same_stream(x):
    a = runtime.empty(N, np.float32, stream=s1)
    runtime.synchronize()
    va = a.va
    K.fill[G, B](a, np.float32(1), stream=s1)
    del a
    b = runtime.empty(N, np.float32, stream=s1)
    x["reused"] = b.va == va
    b.memset(0, stream=s1)
run("reuse_same_stream", reuse_same_stream)

def reuse_with_record_stream(x):
    a = runtime.empty(N, np.float32, stream=s1)
    runtime.synchronize()
    va = a.va
    K.fill[G, B](a, np.float32(1), stream=s2)
    a.record_stream(s2)
    del a
    s2.synchronize()  # the event completes: the allocator may hand the block out again
    b = runtime.empty(N, np.float32, stream=s1)
    x["reused"] = b.va == va
    b.memset(0, stream=s1)
run("reuse_with_record_stream", reuse_with_record_stream)

def reuse_when_the_allocator_finds_the_event_done(x):  # no host wait but the allocator's
    a = runtime.empty(N, np.float32, stream=s1)
    runtime.synchronize()
    va = a.va
    K.fill[G, B](a, np.float32(1), stream=s2)
    a.record_stream(s2)
    del a
    while s2.completed < s2.last_seqno:  # reading the fence is no synchronisation
        time.sleep(0.001)
    b = runtime.empty(N, np.float32, stream=s1)  # the allocator's Event.query finds it done
    x["reused"] = b.va == va
    b.memset(0, stream=s1)
run("reuse_when_the_allocator_finds_the_event_done", reuse_when_the_allocator_finds_the_event_done)

def graph_replay_ordered(x):
    a = runtime.empty(N, np.float32, stream=s1)
    g = runtime.Graph()
    with runtime.graph(g, s1):
        K.fill[G, B](a, np.float32(5), stream=s1)
    runtime.synchronize()
    g.replay(s1)
    s2.wait_stream(s1)
    a.memset(0, stream=s2)
run("graph_replay_ordered", graph_replay_ordered)

def peer_copy_ordered(x):  # the same, device 0's stream waiting for device 1's event
    b = runtime.empty(N, np.float32, device=1)
    a = runtime.empty(N, np.float32)
    runtime.synchronize(1)
    K1.fill[G, B](b, np.float32(1), stream=t1)
    e = runtime.Event()
    e.record(t1)
    s1.wait_event(e)
    a.copy_(b, stream=s1)
run("peer_copy_ordered", peer_copy_ordered)

def across_devices_ordered(x):  # an event of device 0 orders work on device 1
    a = runtime.empty(N, np.float32, device=1)
    runtime.synchronize(1)
    K1.fill[G, B](a, np.float32(1), stream=t1)
    e = runtime.Event()
    e.record(t1)
    t2 = runtime.Stream(1)
    s1.wait_event(e)  # device 0 waits for device 1's event...
    t2.wait_event(runtime.Stream.record_event(s1))  # ...and device 1 for device 0's
    a.memset(0, stream=t2)
    runtime.synchronize(1)
run("across_devices_ordered", across_devices_ordered)
"""

RACY_NAMES = ["copy_copy", "kernel_then_read", "read_then_write", "overlapping_views",
              "event_too_early", "pinned_host_memory", "reuse_without_record_stream",
              "graph_replay", "raw_packets", "atomic_then_read", "read_modify_write",
              "peer_copy"]
CORRECT_NAMES = ["disjoint_views", "atomics_on_two_streams", "same_stream", "reads_only", "event_ordered",
                 "wait_stream_ordered", "synchronize_ordered", "event_query_ordered",
                 "blocking_copy_ordered", "reuse_same_stream", "reuse_with_record_stream",
                 "reuse_when_the_allocator_finds_the_event_done",
                 "graph_replay_ordered", "across_devices_ordered",
                 "peer_copy_ordered"]


@pytest.fixture(scope="module")
def corpus(daemon):
    """The corpus's results, from one process with ``ACCEL_SANITIZE=1``."""
    r = run_json(daemon, PRELUDE, SETUP + RACY + CORRECT + "report(results=results)\n",
                 timeout=240, ACCEL_SANITIZE="1")
    return r["results"]


def _access(got: dict, want: dict) -> None:
    assert (got["queue"], got["seqno"], got["op"], got["mode"]) == \
        (want["queue"], want["seqno"], want["op"], want["mode"]), (got, want)
    assert got["site"] == f"<string>:{want['line']}", (got, want)


@pytest.mark.parametrize("name", RACY_NAMES)
def test_racy_program_raises_naming_both_accesses(corpus, name):
    r = corpus[name]
    assert r["raised"], r
    report, want = r["report"], r["expect"]
    _access(report["first"], want["first"])
    _access(report["second"], want["second"])
    assert [report["start"], report["end"]] == want["range"], (report, want)
    assert report["kind"] == want["kind"]
    assert r["n"] == 1, r["text"]  # one race, reported once
    if "reused" in want:
        assert want["reused"], "the allocator handed the block out again on s1"


@pytest.mark.parametrize("name", CORRECT_NAMES)
def test_correct_program_does_not_raise(corpus, name):
    r = corpus[name]
    assert not r["raised"], r.get("text")
    if "reused" in r["expect"]:
        assert r["expect"]["reused"], "the allocator handed the block out again"


def test_the_corpus_is_the_documented_one(corpus):
    """docs/sanitizer.md states precision and recall over exactly this corpus."""
    assert sorted(corpus) == sorted(RACY_NAMES + CORRECT_NAMES)
    text = open("docs/sanitizer.md").read()
    assert f"{len(RACY_NAMES)} racy and {len(CORRECT_NAMES)} correct" in text


def test_warn_mode_prints_and_goes_on(daemon):
    out = daemon.run_py(PRELUDE + """
from runtime import sanitizer
a = runtime.empty(1024, np.uint8)
s1, s2 = runtime.Stream(), runtime.Stream()
runtime.synchronize()
a.memset(1, stream=s1)
a.memset(2, stream=s2)
runtime.synchronize()
print("went on", sanitizer.active.mode, len(sanitizer.active.found))
""", timeout=120, ACCEL_SANITIZE="warn")
    assert out.returncode == 0, out.stderr
    assert "went on warn 1" in out.stdout
    assert "accel sanitizer: race on device memory" in out.stderr
    assert "write by memset" in out.stderr


def test_off_by_default_and_racy_work_runs(daemon):
    lines = run_scenario(daemon, PRELUDE, """
        from runtime import sanitizer
        a = runtime.empty(1024, np.uint8)
        s1, s2 = runtime.Stream(), runtime.Stream()
        a.memset(1, stream=s1)
        a.memset(2, stream=s2)
        runtime.synchronize()
        print("active", sanitizer.active)
    """, timeout=120, ACCEL_SANITIZE="")
    assert "active None" in lines


@pytest.mark.parametrize("seed", range(60))
def test_shadow_memory_finds_exactly_the_races_a_full_history_finds(seed):
    """The sanitizer keeps per byte range only the last write and each stream's last read
    and atomic; a full history of every access, checked pairwise, is the reference.
    Random programs on 3 streams over overlapping ranges of up to 64 bytes in 256, each
    access first waiting for each other stream's work so far with probability 0.9 (so runs
    go tens of accesses before their first race): up to the first race, each access races
    under one exactly when it does under the other (after a race, an access ordered only
    through the racing one may go unreported, as in any vector-clock detector)."""
    import random
    from types import SimpleNamespace

    from runtime.sanitizer import Access, _Clock, _ordered, _Shadow

    rng = random.Random(seed)
    clocks = [_Clock(i + 1, SimpleNamespace(last_seqno=0, device=0, queue_id=i + 1))
              for i in range(3)]
    shadow, history = _Shadow(), []
    writes = {"write", "read+write"}
    for _ in range(400):
        c = rng.choice(clocks)
        for other in clocks:
            if other is not c and rng.random() < 0.9:
                c.join(other.at(other.vc[other.serial]), c.vc[c.serial] + 1)
        c.vc[c.serial] += 1
        lo = rng.randrange(0, 200)
        acc = Access("s", 0, c.serial, c.vc[c.serial], "op",
                     rng.choice(["read", "write", "atomic", "read+write"]), "x:1",
                     lo, lo + rng.randrange(1, 64), None, c.serial)
        found = shadow.access(acc, c)
        full = [p for p in history if p.start < acc.end and acc.start < p.end
                and (p.mode in writes or acc.mode in writes or p.mode != acc.mode)
                and not _ordered(p, c)]
        assert bool(found) == bool(full), (acc, found, full)
        assert all(p in full for p in found)
        assert shadow.starts == sorted(shadow.starts)
        assert all(c.end <= n for c, n in zip(shadow.cells, shadow.starts[1:]))
        if full:
            return
        history.append(acc)
