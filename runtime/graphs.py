"""Graph capture and replay: record a stream's work once, submit it again as one batch.

While a stream captures (``with graph(g, stream): ...``), what would be queued on it is
recorded into the graph instead. ``g.replay()`` writes every recorded packet into the
stream's ring in one submission, so a replay costs one publish however many nodes.

What cannot be captured is refused with InvalidValueError at the call:
* synchronizing or querying the capturing stream (or an event on it), and so any copy that
  needs the host to wait: copies to or from pageable memory (pinned memory is capturable);
* events recorded on or waited for by the capturing stream;
* allocations outside the graph's pool: pinned, managed and IPC memory. Device arrays
  created during capture come from the graph's own pool and live as long as the graph.
  A captured kernel launch keeps its argument block's bytes: a replay writes them in the
  replaying stream's argument arena (runtime/stream.py ``ArgArena``), as every launch's
  block goes, so replays use the arguments as they were at capture.

A replay checks that every array the captured work touches is still alive: replaying after
captured memory was freed is refused rather than writing into memory someone else owns.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from runtime import _trace, errors
from runtime.memory import DeviceView
from runtime.stream import ArgLaunch, Stream, current_stream

_capturing = threading.local()


def capturing_graph() -> Graph | None:
    """The graph this thread is capturing into, if any (allocation checks use it)."""
    return getattr(_capturing, "graph", None)


class GraphPool:
    """The caching allocator's key for the blocks graphs allocate while capturing (a
    graph's private pool). Graphs given one pool share its cached blocks. The blocks name
    the pool rather than the graph, so a dropped graph's arrays go back to the pool
    (``empty_cache`` then releases them) instead of the allocator keeping the graph alive."""

    def __repr__(self) -> str:
        return f"<GraphPool {id(self):#x}>"


class Graph:
    """Recorded packets, the arrays they touch, and the memory allocated while capturing
    (from ``pool``, a new private one by default)."""

    def __init__(self, pool: GraphPool | None = None) -> None:
        self.pool = pool if pool is not None else GraphPool()
        #: the captured packets; a launch as its packet and argument block, which a
        #: replay writes in the stream's arena for the replay's seqno (``ArgLaunch``)
        self.packets: list[bytes | ArgLaunch] = []
        self.launches = 0  # how many of them are ArgLaunch
        self._uses: list[weakref.ref[Any]] = []
        self._names: list[str] = []
        #: device arrays allocated during capture: the graph keeps them (its pool)
        self.owned: list[Any] = []
        #: packet index -> kernel name, so a fault in a replay names its kernel
        self.stream: Stream | None = None
        self.captured = False

    def __len__(self) -> int:
        return len(self.packets)

    def record(self, stream: Stream, packets: Sequence[Any], uses: Sequence[Any]) -> int:
        if stream is not self.stream:
            raise errors.InvalidValueError(f"{stream!r} is capturing into another graph")
        for p in packets:
            if type(p) is ArgLaunch:
                self.launches += 1
            self.packets.append(p if isinstance(p, (bytes, ArgLaunch)) else p.encode())
        for obj in uses:
            if isinstance(obj, DeviceView):  # a view's memory lives as long as its base
                obj = obj.base
            self._uses.append(weakref.ref(obj))
            self._names.append(repr(obj))
        return len(self.packets)

    def replay(self, stream: Stream | None = None) -> int:
        """Submit the captured work as one batch; return the last packet's seqno."""
        if (rec := _trace.active) is not None and rec.outermost():
            return rec.call("Graph.replay", {}, self.replay, stream)
        if not self.captured:
            raise errors.InvalidValueError("replay of a graph whose capture has not ended")
        for ref, name in zip(self._uses, self._names):
            if ref() is None:
                raise errors.InvalidValueError(
                    f"graph replay refused: {name}, which the captured work uses, was freed")
        target = stream or self.stream
        assert target is not None
        if target.device != self.stream.device:  # type: ignore[union-attr]
            raise errors.InvalidValueError("a graph replays on a stream of the device it was captured on")
        if self.launches:
            target.arena()  # where the replayed launches' blocks go
        return target._write(self.packets)


@contextmanager
def graph(g: Graph, stream: Stream | None = None) -> Iterator[Graph]:
    """Capture what is queued on ``stream`` (the current one by default) into ``g``."""
    s = stream or current_stream()
    if g.captured or g.stream is not None:
        raise errors.InvalidValueError("a graph is captured once")
    if s.capturing is not None or capturing_graph() is not None:
        raise errors.InvalidValueError(f"{s!r} or this thread is already capturing")
    g.stream = s
    s.capturing = g
    _capturing.graph = g
    try:
        yield g
    finally:
        s.capturing = None
        _capturing.graph = None
        g.captured = True
