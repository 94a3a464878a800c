"""Device rows in ``torch.profiler``: what each operator ran on the accel device.

torch's profiler has no Python hook for a backend's device activity (kineto takes device
events only from C++ activity profilers), so while a ``torch.profiler.profile`` runs,
the runtime's own profiler (``runtime.profile``) records every kernel, copy and memset
packet with its device time. When the torch profile stops they are kept on it
(``prof.accel_events``: one dict per packet, with the runtime call that queued it; the
export fills in the aten operator), and ``prof.export_chrome_trace(path)`` merges them into the trace torch writes: one
process per device, one track per stream, kineto's categories (``kernel``,
``gpu_memcpy``, ``gpu_memset``) and an ``ac2g`` flow from the operator to its packets
(``accelClockUncertaintyUs`` says how closely the two clocks were tied),
so Perfetto and chrome://tracing show them under the operators as they show CUDA's.

The operator of a packet is the innermost ``cpu_op`` of the same thread whose interval
holds the host call that queued it (the runtime and kineto share the thread ids).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch.profiler

import runtime

_profile = torch.profiler.profile
_start, _stop, _export = _profile.start, _profile.stop, _profile.export_chrome_trace
#: the record_function marking the moments the two clocks are read together
ANCHOR = "accel::clock_anchor"


def _anchor() -> int:
    """A kineto range around one CLOCK_MONOTONIC reading: kineto stamps with its own
    (TSC-calibrated wall) clock, and converting through CLOCK_REALTIME was seen to be off
    by about a millisecond. The reading lies between the range's start and end stamps,
    which bounds the offset between the clocks (``_offset_us``)."""
    with torch.profiler.record_function(ANCHOR):
        return time.monotonic_ns()


def _first_anchor() -> int:
    """The first range of a profile pays kineto's first-use costs between its start stamp
    and its body, which would stretch the first user range: a range of another name takes them first."""
    with torch.profiler.record_function("accel::clock_warmup"):
        pass
    return _anchor()


def start(self: torch.profiler.profile) -> None:
    _start(self)
    self._accel = runtime.profile()
    try:
        self._accel.__enter__()
    except runtime.InvalidValueError:  # a runtime profile is already running: leave it be
        self._accel = None
        return
    self._accel_anchors = [_first_anchor()]


def stop(self: torch.profiler.profile) -> None:
    accel = getattr(self, "_accel", None)
    self._accel = None
    if accel is not None:
        self._accel_anchors.append(_anchor())
        accel.__exit__(None, None, None)
        self.accel_events = _events(accel)
    _stop(self)


def _events(p: runtime.Profile) -> list[dict[str, Any]]:
    """The runtime profile's packets (CLOCK_MONOTONIC ns), with their host call's thread."""
    calls = {e.correlation: e for e in p.host_events}
    out = []
    for e in p.device_events:
        call = calls.get(e.correlation)
        out.append({"name": e.name, "cat": e.cat, "device": e.device, "stream": e.stream,
                    "start_ns": e.start_ns, "end_ns": e.end_ns,
                    "host_call": call.name if call else None, "tid": call.tid if call else None,
                    "host_ns": call.start_ns if call else None, "op": None, **e.args})
    return out


def _offset_us(events: list[dict[str, Any]], anchors: list[int]) -> tuple[float, float]:
    """(trace time minus CLOCK_MONOTONIC, its uncertainty), in us. Each anchor's reading
    ``m`` lies inside its range ``[ts, ts + dur]``, so the offset lies in
    ``[ts - m, ts + dur - m]``; the anchors' intervals are intersected (or, were the clocks
    to drift apart, spanned) and the middle taken."""
    marks = sorted((e for e in events if e.get("name") == ANCHOR and e.get("ph") == "X"),
                   key=lambda e: e["ts"])
    if len(marks) != len(anchors):
        raise RuntimeError(f"torch_accel: {len(marks)} clock anchors in the trace, "
                           f"{len(anchors)} taken")
    lows = [m["ts"] - a / 1000 for m, a in zip(marks, anchors)]
    highs = [m["ts"] + m["dur"] - a / 1000 for m, a in zip(marks, anchors)]
    low, high = max(lows), min(highs)
    if low > high:
        low, high = min(lows), max(highs)
    return (low + high) / 2, (high - low) / 2


def _innermost(ops: list[dict[str, Any]], tid: int, ts_us: float) -> dict[str, Any] | None:
    inside = [o for o in ops if o["tid"] == tid and o["ts"] <= ts_us <= o["ts"] + o["dur"]]
    return min(inside, key=lambda o: o["dur"]) if inside else None


def export_chrome_trace(self: torch.profiler.profile, path: str) -> Any:
    result = _export(self, path)
    events = getattr(self, "accel_events", None)
    if not events:
        return result
    with open(path) as f:
        trace = json.load(f)
    out = trace["traceEvents"]
    offset, trace["accelClockUncertaintyUs"] = _offset_us(out, self._accel_anchors)
    ops = [e for e in out if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    devices = sorted({e["device"] for e in events})
    pids = {d: f"accel:{d}" for d in devices}
    for d in devices:
        out.append({"ph": "M", "name": "process_name", "pid": pids[d], "tid": 0,
                    "args": {"name": f"accel:{d}"}})
    for flow_id, e in enumerate(events, 1):
        ts = e["start_ns"] / 1000 + offset
        op = _innermost(ops, e["tid"], e["host_ns"] / 1000 + offset) if e["tid"] else None
        e["op"] = op["name"] if op else None
        e["op_external_id"] = op["args"].get("External id") if op else None
        args = {k: v for k, v in e.items() if k not in ("name", "cat", "start_ns", "end_ns",
                                                         "host_ns", "tid")}
        out.append({"ph": "X", "cat": e["cat"], "name": e["name"], "pid": pids[e["device"]],
                    "tid": e["stream"], "ts": ts, "dur": (e["end_ns"] - e["start_ns"]) / 1000,
                    "args": args})
        if op is not None:
            flow = {"cat": "ac2g", "name": "ac2g", "id": 1 << 40 | flow_id}
            out.append({**flow, "ph": "s", "pid": op["pid"], "tid": op["tid"], "ts": op["ts"]})
            out.append({**flow, "ph": "f", "bp": "e", "pid": pids[e["device"]],
                        "tid": e["stream"], "ts": ts})
    with open(os.fspath(path), "w") as f:
        json.dump(trace, f)
    return result


def install() -> None:
    """Hook torch.profiler.profile (idempotent): run the runtime's profiler alongside."""
    _profile.start, _profile.stop, _profile.export_chrome_trace = start, stop, export_chrome_trace
