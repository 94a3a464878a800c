"""``runtime.profile()``: host calls, the packets they queued, and the trace real tools read.

Each scenario runs in a fresh interpreter (the recorder is per process) and exports its
trace; the checks read the JSON as Perfetto and chrome://tracing would (the trace-event
format's keys per phase, flows bound by id) and as Holistic Trace Analysis does (its
``TraceAnalysis`` on a directory of rank traces). ``sched_hold`` queues work while the
firmware takes none, so device start times can be checked against the queue order.
"""

from __future__ import annotations

import json
import numbers
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from abi.userq import RING_SLOTS
from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_json, run_scenario


#: the workload: a kernel, copies each way, a memset, a second stream joined by an event,
#: a second thread, every kind of synchronisation, an allocation and its free
WORKLOAD = """
    import threading
    m = runtime.compile('''
    def scale(x, a):
        i = global_id(0)
        x[i] = x[i] * a
    ''')
    x = runtime.to_device(np.ones(4096, np.float32))
    runtime.synchronize()                     # compiled and loaded before the profile
    with runtime.profile() as p:
        y = runtime.empty(4096, np.float32)
        m.scale[16, 256](x, 2.0)
        m.scale[16, 256](x, 3.0)
        y.copy_(x)
        pinned = runtime.pinned_empty(4096, np.float32)
        x.copy_to_host(pinned, stream=runtime.current_stream())
        y.memset(0)
        s = runtime.Stream()
        ev = runtime.Event(enable_timing=True)
        ev.record()
        s.wait_event(ev)
        y.copy_from_host(np.full(4096, 7, np.float32), stream=s)
        s.synchronize()
        ev.synchronize()
        t = threading.Thread(target=lambda: x.memset(1), name="worker")
        t.start(); t.join()
        runtime.synchronize()
        del y
    p.export_chrome_trace(os.environ["TRACE"])
    print(np.unique(pinned).tolist(), p.lost_packets)
    print(p.key_averages().table(sort_by="device_total"))
"""

PHASE_KEYS = {"X": {"name", "cat", "ph", "ts", "dur", "pid", "tid"},
              "M": {"name", "ph", "pid", "args"},
              "s": {"name", "cat", "ph", "ts", "id", "pid", "tid"},
              "f": {"name", "cat", "ph", "ts", "id", "pid", "tid", "bp"}}
HOST_CALLS = {"alloc", "free", "Kernel.launch", "DeviceArray.copy_", "DeviceArray.copy_to_host",
              "DeviceArray.copy_from_host", "DeviceArray.memset", "Event.record",
              "Stream.wait_event", "Stream.synchronize", "Event.synchronize", "synchronize"}


def run(d, body: str, **env) -> list[str]:
    return run_scenario(d, PRELUDE, body, timeout=120, **env)


def check_trace_format(trace: dict) -> tuple[list[dict], list[dict]]:
    """What every trace-event viewer needs; returns the host and device complete events."""
    events = trace["traceEvents"]
    for e in events:
        assert PHASE_KEYS[e["ph"]] <= set(e), e
        for key in ("ts", "dur"):
            if key in e:
                assert isinstance(e[key], numbers.Real) and not isinstance(e[key], bool), e
        assert e.get("dur", 0) >= 0, e
    host_pid = next(e["pid"] for e in events
                    if e["ph"] == "M" and e["name"] == "process_name" and "host" in e["args"]["name"])
    host = [e for e in events if e["ph"] == "X" and e["pid"] == host_pid]
    device = [e for e in events if e["ph"] == "X" and e["pid"] != host_pid]
    assert {e["cat"] for e in host} == {"runtime"}
    assert {e["cat"] for e in device} <= {"kernel", "kernel_compile", "gpu_memcpy", "gpu_memset",
                                          "gpu_sync"}
    # every device event's correlation is a host call's
    by_corr = {e["args"]["correlation"]: e for e in host}
    assert len(by_corr) == len(host)
    assert {e["args"]["correlation"] for e in device} <= set(by_corr)
    # flows: one start and one finish per id, each inside the slice it binds to
    flows: dict[int, dict[str, dict]] = defaultdict(dict)
    for e in events:
        if e["ph"] in "sf":
            assert e["cat"] == "ac2g" and e["ph"] not in flows[e["id"]], e
            flows[e["id"]][e["ph"]] = e
    assert len(flows) == len(device)

    def encloses(flow: dict) -> list[dict]:
        return [x for x in host + device if (x["pid"], x["tid"]) == (flow["pid"], flow["tid"])
                and x["ts"] <= flow["ts"] <= x["ts"] + x["dur"]]
    for pair in flows.values():
        assert set(pair) == {"s", "f"}
        start, = encloses(pair["s"])
        assert start["cat"] == "runtime"
        assert any(x["cat"] != "runtime" for x in encloses(pair["f"]))
    # names for every process and thread an event is on
    named = {(e["pid"], e.get("tid")) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in host + device} <= named
    procs = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {e["pid"] for e in host + device} <= procs
    return host, device


@pytest.mark.timeout(180)
def test_host_calls_and_device_packets_in_a_trace_viewers_open(daemon, tmp_path):
    path = tmp_path / "trace.json"
    lines = run(daemon, WORKLOAD, TRACE=str(path))
    assert lines[0] == "[6.0] 0"
    table = "\n".join(lines[1:])
    header = table.splitlines()[0].split()
    assert header[:2] == ["Name", "Calls"] and "Device" in header
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert rows["scale"][1] == "2" and rows["Kernel.launch"][1] == "2"
    trace = json.loads(path.read_text())
    assert trace["distributedInfo"]["rank"] == 0 and trace["deviceProperties"][0]["id"] == 0
    assert trace["traceName"] == str(path)
    host, device = check_trace_format(trace)
    assert HOST_CALLS <= {e["name"] for e in host}
    assert len({e["tid"] for e in host}) == 2  # the main thread and "worker"
    # the kernel's first launch may wait for its compile (a row of its own; its own test)
    assert Counter(e["name"] for e in device if e["cat"] != "kernel_compile") == {
        "scale": 2, "Memcpy DtoD": 1, "Memcpy DtoH": 1, "Memcpy HtoD": 1, "Memset": 2,
        "Marker Sync": 1, "Wait Queue Sync": 1}
    kernels = [e for e in device if e["cat"] == "kernel"]
    assert all(e["args"]["grid"] == [16, 1, 1] and e["args"]["block"] == [256, 1, 1]
               for e in kernels)
    assert all(e["args"]["bytes"] == 4096 * 4 for e in device if e["cat"] in ("gpu_memcpy", "gpu_memset"))
    by_corr = {e["args"]["correlation"]: e for e in host}
    for e in device:
        call = by_corr[e["args"]["correlation"]]
        assert e["ts"] >= call["ts"] - 1  # no packet starts before its call (us rounding)
        if e["cat"] == "kernel":
            assert call["name"] == "Kernel.launch" and call["args"]["kernel"] == "scale"
    # one queue runs in order: its events do not overlap
    for stream in {(e["pid"], e["tid"]) for e in device}:
        on = sorted((e for e in device if (e["pid"], e["tid"]) == stream),
                    key=lambda e: e["args"]["seqno"])
        for a, b in zip(on, on[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3
    assert 0 <= abs(trace["clockOffsetsNs"]["accel:0"]) < 100_000_000  # one clock here


@pytest.mark.timeout(120)
def test_device_start_is_the_queues_previous_end_when_work_waited(daemon, tmp_path):
    """Held by the scheduler, three memsets queue at once: each starts when the one
    before it ended, not when it was submitted; a later device (first used inside the
    profile) gets its clock offset at the end."""
    r = run_json(daemon, PRELUDE, """
        a = runtime.empty(16 << 20, np.uint8)
        runtime.synchronize()
        with runtime.profile() as p:
            hold(True)
            for v in (1, 2, 3):
                a.memset(v)
            time.sleep(0.05)
            hold(False)
            runtime.synchronize()
            b = runtime.empty(16, np.uint8, device=1)
            b.memset(0)
        ev = [e for e in p.device_events if e.device == 0]
        calls = {h.correlation: h for h in p.host_events}
        report(waited_ns=[e.start_ns - calls[e.correlation].end_ns for e in ev[1:]],
               gaps_ns=[b.start_ns - a.end_ns for a, b in zip(ev, ev[1:])],
               clock_offsets=sorted(p.clock_offsets), lost_packets=p.lost_packets)
    """)
    assert [w > 40_000_000 for w in r["waited_ns"]] == [True, True], r
    assert r["gaps_ns"] == [0, 0], r
    assert r["clock_offsets"] == [0, 1] and r["lost_packets"] == 0, r


@pytest.mark.timeout(120)
def test_more_packets_than_the_ring_has_slots_lose_no_stamp(daemon):
    """The stamps are read back at each submission, before their slots come round again."""
    lines = run(daemon, f"""
        s = runtime.Stream()
        with runtime.profile() as p:
            for _ in range({3 * RING_SLOTS}):
                s.submit([pkt(userq.Op.NOP)])
        print(len(p.device_events), p.lost_packets, len(p.host_events))
        print("overlaps", [(a.end_ns, b.start_ns) for a, b in zip(p.device_events, p.device_events[1:])
                           if a.end_ns > b.start_ns])
    """)
    assert lines == [f"{3 * RING_SLOTS} 0 {3 * RING_SLOTS}", "overlaps []"]


@pytest.mark.timeout(120)
def test_a_graph_replay_is_one_host_call_and_its_captured_packets(daemon):
    """A replay writes all its packets at once (``Stream._write``, not ``submit``): each
    is a device event of the replay's correlation, its kernel named by the capture."""
    lines = run(daemon, """
        m = runtime.compile('''
        def inc(x):
            x[global_id(0)] = x[global_id(0)] + 1.0
        ''')
        s = runtime.Stream()
        x = runtime.empty(256, np.float32)
        g = runtime.Graph()
        with runtime.graph(g, s):
            x.memset(0, stream=s)
            m.inc[1, 256](x, stream=s)
        with runtime.profile() as p:
            g.replay(); g.replay()
            s.synchronize()
        replays = [h.correlation for h in p.host_events if h.name == "Graph.replay"]
        print([h.name for h in p.host_events])
        print([(e.name, replays.index(e.correlation)) for e in p.device_events
               if e.cat != "kernel_compile"])   # inc's first launch may wait for its compile
    """)
    assert lines == ["['Graph.replay', 'Graph.replay', 'Stream.synchronize']",
                     "[('Memset', 0), ('inc', 0), ('Memset', 1), ('inc', 1)]"]


@pytest.mark.timeout(120)
def test_off_after_the_profile_and_one_profile_at_a_time(daemon):
    lines = run(daemon, """
        from runtime import _trace
        a = runtime.empty(16, np.uint8)
        try:
            with runtime.profile() as p:
                a.memset(1)
                with runtime.profile():
                    pass
        except runtime.InvalidValueError as exc:
            print("refused:", exc)
        print(_trace.active, [e.name for e in p.host_events])
        a.memset(2); runtime.synchronize()
        print(len(p.device_events))
    """)
    assert lines[0].startswith("refused:") and "already running" in lines[0], lines
    assert lines[1:] == ["None ['DeviceArray.memset']", "1"], lines


@pytest.mark.timeout(240)
def test_holistic_trace_analysis_names_our_kernels_with_their_device_times(daemon, tmp_path):
    """HTA (pinned in pyproject.toml's test extra) reads a directory of rank traces, the
    rank from each file's ``distributedInfo``; its kernel breakdown must list our kernel
    with the device time the trace says, and the copies as memory kernels."""
    from hta.trace_analysis import TraceAnalysis

    traces = tmp_path / "traces"
    traces.mkdir()
    run(daemon, WORKLOAD, TRACE=str(traces / "rank0.trace.json"))
    trace = json.loads((traces / "rank0.trace.json").read_text())
    kernel_durs = [e["dur"] for e in trace["traceEvents"]
                   if e["ph"] == "X" and e["cat"] == "kernel"]
    analysis = TraceAnalysis(trace_dir=str(traces))
    _types, kernels = analysis.get_gpu_kernel_breakdown(visualize=False,
                                                        include_memory_kernels=True)
    rows = {r["name"]: r for r in kernels.to_dict("records")}
    assert rows["scale"]["kernel_type"] == "COMPUTATION" and rows["scale"]["rank"] == 0
    # HTA rounds a fractional event inward to whole microseconds (its start up, its end
    # down: hta/common/trace_parser.py round_down_time_stamps): up to 2 us lost per event
    assert 0 <= sum(kernel_durs) - rows["scale"]["sum (us)"] <= 2 * len(kernel_durs)
    assert {"Memcpy DtoD", "Memcpy HtoD", "Memcpy DtoH", "Memset"} <= set(rows)
    assert {rows[n]["kernel_type"] for n in ("Memcpy DtoD", "Memset")} == {"MEMORY"}
    assert "Marker Sync" not in rows
    assert Path(trace["traceName"]).name == "rank0.trace.json"


@pytest.mark.timeout(120)
def test_a_kernels_first_compile_is_its_own_row_not_kernel_time(daemon):
    """The firmware compiles a kernel when its first launch reaches an engine, and notes in
    the ring how long the launch waited for that (abi/userq.py ``RING_COMPILE``). The
    profile shows the wait as ``compile <kernel>`` (category ``kernel_compile``), before
    the kernel, whose own time is only its run: a first ``sum`` in torch had shown 8.8 s
    of kernel time. A kernel of a source no daemon has seen forces the compile."""
    r = run_json(daemon, PRELUDE, """
        name = f"scale{os.getpid()}_{time.monotonic_ns()}"
        m = runtime.compile(f'''
        def {name}(x, a):
            i = global_id(0)
            x[i] = x[i] * a
        ''')
        x = runtime.to_device(np.ones(1 << 14, np.float32))
        runtime.synchronize()
        with runtime.profile() as p:
            getattr(m, name)[64, 256](x, 2.0)
            getattr(m, name)[64, 256](x, 2.0)
        rows = {row.name: [row.calls, row.device_total_ns, row.host] for row in p.key_averages()}
        report(events=[[e.cat, e.name.replace(name, "K"), e.seqno, e.start_ns, e.end_ns]
                       for e in p.device_events], rows={k.replace(name, "K"): v for k, v in rows.items()})
    """)
    events = r["events"]
    assert [e[:2] for e in events] == [["kernel_compile", "compile K"], ["kernel", "K"],
                                       ["kernel", "K"]], events
    compile_, first, second = events
    assert compile_[2] == first[2] and compile_[4] == first[3], events  # same packet, back to back
    compile_ns, run_ns = compile_[4] - compile_[3], first[4] - first[3]
    assert compile_ns > 10 * run_ns, events       # numba compiles for 100s of ms at least
    rows = r["rows"]
    assert rows["compile K"][:2] == [1, compile_ns] and rows["K"][0] == 2, rows
    assert rows["K"][1] == run_ns + second[4] - second[3], rows
    assert rows["Kernel.launch"][1] == rows["K"][1], rows   # the call's device time: runs only
