"""Graphs: capture, replay, and what capture refuses (graphs of kernels:
test_kernel.py).
"""

from __future__ import annotations

from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_scenario


def run(d, body: str, timeout: float = 120, **env) -> list[str]:
    return run_scenario(d, PRELUDE, body, timeout=timeout, **env)


def test_graph_capture_replay_and_refusals(daemon):
    lines = run(daemon, """
        s = runtime.Stream()
        x = np.arange(1 << 18, dtype=np.float32)
        a = runtime.to_device(x); b = runtime.empty(x.shape, np.float32)
        g = runtime.Graph()
        with runtime.graph(g, s):
            t = runtime.empty(x.shape, np.float32)   # from the graph's pool
            t.copy_(a, stream=s)
            b.memset(0, stream=s)
            b.copy_(t, stream=s)
            for what, bad in (("sync", s.synchronize), ("query", s.query),
                              ("host read", lambda: b.copy_to_host(stream=s)),
                              ("pinned", lambda: runtime.pinned_empty(8)),
                              ("event", lambda: s.record_event())):
                try:
                    bad(); print(what, "allowed")
                except runtime.InvalidValueError:
                    print(what, "refused")
        print(len(g))
        runtime.current_stream().synchronize()
        for _ in range(50):                          # identical results, many replays
            b.memset(9, stream=s)
            g.replay()
        s.synchronize()
        print(np.array_equal(b.copy_to_host(stream=s), x))
        del a
        try:
            g.replay()
        except runtime.InvalidValueError as e:
            print("replay after free refused")
    """)
    assert lines == ["sync refused", "query refused", "host read refused", "pinned refused",
                     "event refused", "3", "True", "replay after free refused"]
