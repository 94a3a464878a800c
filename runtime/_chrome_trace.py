"""A profile as Chrome trace-event JSON, in the layout kineto (torch.profiler) writes.

The host is one process (pid: the profiled process's), each thread a track, its runtime
calls complete events of category ``runtime``. Each device is a process whose pid is its
index (as kineto numbers GPUs) and each stream a thread (tid: the queue id), with events
of kineto's device categories: ``kernel``, ``gpu_memcpy``, ``gpu_memset`` (HTA finds
device work by an integer ``args.stream``; its kernel breakdown sorts by name:
``Memcpy``/``Memset`` prefixes are memory, names with ``Sync`` neither compute nor memory).
A flow (``ac2g``, as kineto's) joins each device event to the host call that queued it.
Times are microseconds of the host's ``CLOCK_MONOTONIC``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.profiler import Profile


def _us(ns: int) -> float:
    return ns / 1000


def _complete(name: str, cat: str, pid: int, tid: int, start_ns: int, end_ns: int,
              args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": _us(start_ns),
            "dur": _us(end_ns - start_ns), "args": args}


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def events(p: Profile) -> list[dict[str, Any]]:
    """The ``traceEvents``: metadata, host calls, device packets, flows between them."""
    out = [_meta("process_name", p.pid, 0, name=f"python {p.pid} (host)"),
           _meta("process_sort_index", p.pid, 0, sort_index=-1)]
    out += [_meta("thread_name", p.pid, tid, name=f"{name} ({tid})")
            for tid, name in sorted(p.thread_names.items())]
    for index, props in sorted(p.devices.items()):
        out += [_meta("process_name", index, 0, name=f"accel:{index} ({props.name})"),
                _meta("process_labels", index, 0, labels=f"accel:{index}"),
                _meta("process_sort_index", index, 0, sort_index=index)]
    out += [_meta("thread_name", d, s, name=f"stream {s}")
            for d, s in sorted({(e.device, e.stream) for e in p.device_events})]
    host_start = {}
    for e in p.host_events:
        host_start[e.correlation] = (e.tid, e.start_ns)
        out.append(_complete(e.name, "runtime", p.pid, e.tid, e.start_ns, e.end_ns,
                             {"correlation": e.correlation, **e.args}))
    for flow_id, e in enumerate(p.device_events, 1):
        out.append(_complete(e.name, e.cat, e.device, e.stream, e.start_ns, e.end_ns,
                             {"correlation": e.correlation, "device": e.device,
                              "stream": e.stream, "seqno": e.seqno, **e.args}))
        tid, ts = host_start[e.correlation]
        flow = {"cat": "ac2g", "name": "ac2g", "id": flow_id}
        out.append({**flow, "ph": "s", "pid": p.pid, "tid": tid, "ts": _us(ts)})
        out.append({**flow, "ph": "f", "bp": "e", "pid": e.device, "tid": e.stream,
                    "ts": _us(e.start_ns)})
    return out


def trace(p: Profile, path: str, rank: int, world_size: int) -> dict[str, Any]:
    """The whole JSON object: kineto's top-level keys around ``traceEvents``."""
    return {
        "schemaVersion": 1,
        "deviceProperties": [
            {"id": i, "name": d.name, "uuid": d.uuid, "totalGlobalMem": d.total_memory,
             "maxThreadsPerBlock": d.max_threads_per_block,
             "sharedMemPerBlock": d.max_shared_mem_per_block,
             "computeEngines": d.compute_engines, "copyEngines": d.copy_engines}
            for i, d in sorted(p.devices.items())],
        "distributedInfo": {"backend": "none", "rank": rank, "world_size": world_size},
        "clockOffsetsNs": {f"accel:{i}": off for i, off in sorted(p.clock_offsets.items())},
        "lostPackets": p.lost_packets,
        "traceEvents": events(p),
        "traceName": path,
        "displayTimeUnit": "ms",
    }


def write(p: Profile, path: str | os.PathLike[str], rank: int, world_size: int) -> None:
    """Write it; the default separators matter: HTA finds the rank with ``"rank":\\s+``."""
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(trace(p, path, rank, world_size), f)
