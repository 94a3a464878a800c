"""Graphs: capture, replay, and what capture refuses (graphs of kernels:
test_kernel.py).
"""

from __future__ import annotations

from scenario import STREAM_PRELUDE as PRELUDE
from scenario import run_json


def test_graph_capture_replay_and_refusals(daemon):
    r = run_json(daemon, PRELUDE, """
        s = runtime.Stream()
        x = np.arange(1 << 18, dtype=np.float32)
        a = runtime.to_device(x); b = runtime.empty(x.shape, np.float32)
        g = runtime.Graph()
        with runtime.graph(g, s):
            t = runtime.empty(x.shape, np.float32)   # from the graph's pool
            t.copy_(a, stream=s)
            b.memset(0, stream=s)
            b.copy_(t, stream=s)
            refused = {}
            for what, bad in (("sync", s.synchronize), ("query", s.query),
                              ("host read", lambda: b.copy_to_host(stream=s)),
                              ("pinned", lambda: runtime.pinned_empty(8)),
                              ("event", lambda: s.record_event())):
                try:
                    bad(); refused[what] = False
                except runtime.InvalidValueError:
                    refused[what] = True
        report(refused=refused, packets=len(g))
        runtime.current_stream().synchronize()
        for _ in range(50):                          # identical results, many replays
            b.memset(9, stream=s)
            g.replay()
        s.synchronize()
        report(wrong_elements=np.count_nonzero(b.copy_to_host(stream=s) != x))
        del a
        try:
            g.replay()
            report(replay_after_free="allowed")
        except runtime.InvalidValueError as e:
            report(replay_after_free="refused")
    """)
    assert r == {"refused": dict.fromkeys(["sync", "query", "host read", "pinned", "event"], True),
                 "packets": 3, "wrong_elements": 0, "replay_after_free": "refused"}, r

