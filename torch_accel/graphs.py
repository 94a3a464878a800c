"""``torch.accel.AccelGraph`` and ``torch.accel.graph``: torch.cuda's graph capture and
replay (``CUDAGraph``, ``torch.cuda.graph``) on the runtime's graphs (runtime/graphs.py).

While a stream captures, every operator still runs its Python on the host once, but what it
would queue (kernel launches with their argument blocks, copies, memsets) is recorded into
a runtime graph instead of submitted. ``replay()`` writes all of it into the current
stream's ring in one submission: no operator, dispatcher or launch code runs again, so a
replay costs the same host time for 3 operators or 300.

As with CUDA graphs:
* replays read and write the tensors the capture used (the "static" inputs and outputs):
  new inputs are copied into the static inputs before ``replay()``;
* tensors allocated during capture come from the graph's private pool: they stay the
  graph's until ``reset()`` or the graph is collected, so a replay never writes into memory
  handed to someone else. The runtime keeps every block the capture allocated, even a
  temporary freed mid-capture (CUDA's pool reuses those within the capture): it costs
  memory but needs no liveness analysis. Graphs given one ``pool`` token share the blocks
  that dropped graphs gave back;
* work that needs the host mid-capture (``.item()``, ``.cpu()``, ``synchronize``,
  pageable copies) is refused with ``runtime.InvalidValueError`` at the call;
* random operators draw the (seed, offset) they had at capture on every replay (torch.cuda
  advances the philox offset per replay; this backend does not yet).
"""

from __future__ import annotations

import gc
import itertools
import types
import weakref
from contextlib import ExitStack
from typing import Any

import torch

import runtime
from torch_accel import _hooks

__all__ = ["AccelGraph", "graph", "graph_pool_handle", "is_current_stream_capturing",
           "make_graphed_callables"]

_pool_ids = itertools.count(1)
#: torch's pool tokens, ``(0, n)``, and the runtime pools they name (while a graph uses one)
_pools: weakref.WeakValueDictionary[tuple[int, int], runtime.GraphPool] = (
    weakref.WeakValueDictionary())


def is_current_stream_capturing() -> bool:
    """Whether the current stream of the current device is capturing a graph."""
    if not _hooks.is_initialized():
        return False
    return runtime.current_stream().capturing is not None


def graph_pool_handle() -> tuple[int, int]:
    """A token naming a new pool (torch.cuda.graph_pool_handle), for graphs' ``pool``
    argument: graphs captured with one token allocate from one runtime pool."""
    return (0, next(_pool_ids))


class AccelGraph:
    """A captured sequence of device work, replayed as one submission (torch.cuda.CUDAGraph).

    ``keep_graph`` is accepted for torch.cuda's signature; the runtime graph is always
    kept, and ``instantiate()`` has nothing to build.
    """

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = keep_graph
        self._graph: runtime.Graph | None = None
        self._capture: ExitStack | None = None
        self._pool: tuple[int, int] | None = None

    def capture_begin(self, pool: tuple[int, int] | None = None,
                      capture_error_mode: str = "global") -> None:
        """Begin capturing the current stream's work (torch.cuda.CUDAGraph.capture_begin)."""
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError(f"unknown capture_error_mode {capture_error_mode!r}")
        if self._graph is not None:
            raise RuntimeError("this graph was already captured: reset() it first")
        _hooks.lazy_init()
        self._pool = tuple(pool) if pool is not None else graph_pool_handle()
        shared = _pools.get(self._pool)
        if shared is None:
            shared = _pools[self._pool] = runtime.GraphPool()
        g = runtime.Graph(shared)
        stack = ExitStack()
        stack.enter_context(runtime.graph(g, runtime.current_stream()))
        self._graph, self._capture = g, stack

    def capture_end(self) -> None:
        """End the capture begun by ``capture_begin``."""
        if self._capture is None:
            raise RuntimeError("capture_end() without capture_begin()")
        stack, self._capture = self._capture, None
        stack.close()

    def instantiate(self) -> None:
        """Nothing to build: a runtime graph replays its recorded packets as they are."""
        self._captured()

    def replay(self) -> None:
        """Queue the captured work on the current stream, in one submission."""
        self._captured().replay(runtime.current_stream(self._graph.stream.device))

    def reset(self) -> None:
        """Drop the captured work and give its private pool back; the graph can then be
        captured again. Tensors the program still holds keep their own memory."""
        if self._capture is not None:
            raise RuntimeError("reset() during capture")
        self._graph = None
        self._pool = None

    def pool(self) -> tuple[int, int]:
        """The token of this graph's pool, for another graph's ``pool`` argument."""
        if self._pool is None:
            raise RuntimeError("pool() of a graph that has not begun capturing")
        return self._pool

    def _captured(self) -> runtime.Graph:
        if self._graph is None or self._capture is not None:
            raise RuntimeError("the graph has not been captured (capture_begin/capture_end)")
        return self._graph

    def __len__(self) -> int:
        """How many packets (launches, copies, memsets) a replay submits."""
        return len(self._graph) if self._graph is not None else 0


class graph:
    """Capture the body's work into ``accel_graph`` on a side stream (torch.cuda.graph).

    As torch.cuda's: the device is synchronized and the cache emptied first, so the capture
    starts from settled memory; the capture runs on ``stream`` (by default one side stream
    shared by every ``graph``) and that stream is current for the body.
    """

    default_capture_stream: torch.Stream | None = None

    def __init__(self, accel_graph: AccelGraph, pool: tuple[int, int] | None = None,
                 stream: torch.Stream | None = None,
                 capture_error_mode: str = "global") -> None:
        from torch_accel import accel

        if self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = accel.Stream()
        self.pool = pool
        self.capture_stream = stream if stream is not None else self.__class__.default_capture_stream
        self.stream_ctx = accel.stream(self.capture_stream)
        self.accel_graph = accel_graph
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        from torch_accel import accel

        accel.synchronize()
        gc.collect()
        accel.empty_cache()
        self.stream_ctx.__enter__()
        try:
            self.accel_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self.stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.accel_graph.capture_end()
        finally:
            self.stream_ctx.__exit__(*exc)


def make_graphed_callables(callables: Any, sample_args: Any, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, pool: tuple[int, int] | None = None
                           ) -> Any:
    """torch.cuda.make_graphed_callables on accel: each callable's forward and backward are
    captured into an ``AccelGraph`` and replayed through an autograd Function.

    This runs torch's own implementation (torch/cuda/graphs.py) with its ``torch.cuda``
    names bound to accel's (``_CudaNames``), rather than a copy of its 300 lines: the
    algorithm (warm up on a side stream, capture forwards in order and backwards in reverse
    into one pool, copy new inputs into the static ones) is device-neutral.
    """
    from torch.cuda import graphs as cuda_graphs

    impl = cuda_graphs.make_graphed_callables
    names = {**impl.__globals__, "torch": _TorchWithAccelAsCuda(), "graph_pool_handle": graph_pool_handle}
    rebound = types.FunctionType(impl.__code__, names, impl.__name__, impl.__defaults__,
                                 impl.__closure__)
    return rebound(callables, sample_args, num_warmup_iters, allow_unused_input, pool)


class _TorchWithAccelAsCuda:
    """``torch`` as torch.cuda.make_graphed_callables sees it here: every name is torch's,
    but ``torch.cuda`` is accel's graph, stream and synchronize names."""

    def __init__(self) -> None:
        from torch_accel import accel

        self.cuda = types.SimpleNamespace(CUDAGraph=AccelGraph, graph=graph, Stream=accel.Stream,
                                    stream=accel.stream, synchronize=accel.synchronize)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)
