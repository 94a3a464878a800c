"""A looping kernel's work per thread, bounded at launch (firmware/launch_work.py): the
bound grows with the loops' trips, is an upper bound of what runs, and is None -- the
launch then goes to an engine, as every looping launch did before -- for any loop or value
it cannot bound (a ``while``, a bound read from memory, a step that is not a known
positive value, a value whose int64 arithmetic could wrap)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from firmware import jit, launches
from firmware.launch_work import (MAX_KERNEL_NODES, MACS_PER_NODE, MMA_CALL_NODES,
                                   VALUE_LIMIT, LoopWork)
from runtime.kernels import compile_module
from torch_accel.kernels import matmul, nn, reduce

pytestmark = pytest.mark.timeout(60)

ONE = (1, 1, 1)


def work_of(source: str, types: tuple[str, ...]) -> LoopWork | None:
    ir = next(iter(compile_module(source)["kernels"].values()))
    return LoopWork.of(jit.validate(ir, types))


def per_thread(lw: LoopWork, *scalars: int, grid: tuple[int, int, int] = ONE,
               block: tuple[int, int, int] = (64, 1, 1)) -> int | None:
    """The bound for a kernel whose first parameter is a buffer and the rest scalars."""
    return lw.per_thread(grid, block, [None, *(np.int64(s) for s in scalars)])


ROW_SUM = """
def row_sum(x, n: 'int64'):
    i = global_id(0)
    s = 0.0
    for j in range(n):
        s += x[i * n + j]
    x[i * n] = s
"""


def test_the_bound_grows_with_the_trips_of_a_loop() -> None:
    lw = work_of(ROW_SUM, ("float32[1d]", "int64"))
    assert lw is not None
    w0, w10, w20 = (per_thread(lw, n) for n in (0, 10, 20))
    assert w0 is not None and w10 is not None and w20 is not None
    assert 0 < w0 < w10 < w20 and w20 - w10 == w10 - w0  # linear in the trips
    assert per_thread(lw, -5) == w0  # a negative bound runs no trip


def test_nested_loops_and_thread_strided_loops_are_bounded() -> None:
    nested = work_of("""
def tri(x, n: 'int64'):
    for i in range(n):
        for j in range(i):
            x[j] = x[j] + 1.0
""", ("float32[1d]", "int64"))
    assert nested is not None
    w = [per_thread(nested, n) for n in (4, 8, 16)]
    assert w[0] < w[1] < w[2] and w[2] - w[1] > 2 * (w[1] - w[0])  # grows as n * n
    strided = work_of("""
def count(x, rows: 'int64'):
    t = local_id(0)
    lo = group_id(0) * 4
    for r in range(lo + t, min(rows, lo + 1024), 256):
        x[r] = 1.0
""", ("float32[1d]", "int64"))
    assert strided is not None
    # at most ceil(min(rows, 1024 + 4 * (groups - 1)) / 256) trips for any thread
    one = per_thread(strided, 256, block=(256, 1, 1))
    four = per_thread(strided, 1024, block=(256, 1, 1))
    huge = per_thread(strided, 1 << 30, block=(256, 1, 1))
    assert one is not None and four is not None and one < four == huge


@pytest.mark.parametrize("source, types", [
    ("def spin(x, n: 'int64'):\n    i = 0\n    while i < n:\n        i += 1\n    x[0] = i\n",
     ("float32[1d]", "int64")),
    ("def loaded(x, n: 'int64'):\n    for j in range(x[0]):\n        x[j] = 0\n",
     ("int64[1d]", "int64")),
    ("def twice(x, n: 'int64'):\n    m = n\n    m = m + 1\n    for j in range(m):\n"
     "        x[j] = 0.0\n", ("float32[1d]", "int64")),
    ("def unsigned(x, n):\n    for j in range(n):\n        x[j] = 0.0\n",
     ("float32[1d]", "uint64")),
    ("def tile(a, b, c):\n    m = 4\n    m = m + 1\n    mma(c, a, b, 0, 0, 0, m, 4, 4, 0.0)\n",
     ("float32[2d]",) * 3),
])
def test_loops_no_launch_can_bound_leave_the_kernel_unbounded(source: str,
                                                             types: tuple[str, ...]) -> None:
    """A ``while``, a bound loaded from memory, a local assigned twice, an unsigned
    scalar, an ``mma`` whose tile no launch's values bound: no launch of such a kernel
    runs inline."""
    assert work_of(source, types) is None


STEPPED = """
def stepped(x, n: 'int64', s: 'int64'):
    for j in range(0, n, s):
        x[j] = 0.0
"""


@pytest.mark.parametrize("scalars, bounded", [
    ((100, 1), True), ((100, 7), True),
    ((100, 0), False), ((100, -1), False),             # no positive step: unbounded
    ((VALUE_LIMIT, 1), False), ((1 << 62, 1), False),  # past what cannot wrap
    ((-(1 << 62), 1), False),
])
def test_launch_values_it_cannot_bound_leave_the_launch_unbounded(scalars: tuple[int, int],
                                                                  bounded: bool) -> None:
    lw = work_of(STEPPED, ("float32[1d]", "int64", "int64"))
    assert lw is not None
    assert (per_thread(lw, *scalars) is not None) is bounded


def test_arithmetic_that_could_wrap_an_int64_is_not_bounded() -> None:
    """Each operand is small, the product is not: the kernel's int64 product could wrap
    to a small trip count the intervals would not see, so the bound says None."""
    lw = work_of("""
def product(x, n: 'int64', m: 'int64'):
    for j in range(n * m):
        x[0] = 0.0
""", ("float32[1d]", "int64", "int64"))
    assert lw is not None
    assert per_thread(lw, 1000, 1000) is not None
    assert per_thread(lw, 1 << 31, 1 << 31) is None


def test_a_kernel_past_the_node_limit_is_not_bounded() -> None:
    """Evaluating a plan costs the control loop time per node on every new launch shape:
    past MAX_KERNEL_NODES a kernel's launches go to an engine."""
    def loops(count: int) -> str:
        return "def many(x, n: 'int64'):\n" + "".join(
            f"    for j{q} in range(n):\n        x[j{q}] = {q}.0\n" for q in range(count))
    small, big = (work_of(loops(c), ("float32[1d]", "int64")) for c in (10, 120))
    assert small is not None and big is None
    assert MAX_KERNEL_NODES < 120 * 10


def test_a_launch_shape_is_bounded_once_then_remembered() -> None:
    lw = work_of(ROW_SUM, ("float32[1d]", "int64"))
    assert lw is not None
    first = per_thread(lw, 10)
    assert per_thread(lw, 10) == first and len(lw._seen) == 1
    assert per_thread(lw, 10, block=(32, 1, 1)) == first and len(lw._seen) == 2


def _inline_work(source: str, name: str, types: tuple[str, ...], grid: tuple[int, int, int],
                 block: tuple[int, int, int], values: list[Any]) -> int | None:
    ir = compile_module(source)["kernels"][name]
    lw = LoopWork.of(jit.validate(ir, types))
    assert lw is not None, name
    per = lw.per_thread(grid, block, values)
    threads = grid[0] * grid[1] * grid[2] * block[0] * block[1] * block[2]
    return None if per is None else per * threads * launches.LOOP_WORK_WEIGHT


@pytest.mark.parametrize("name, source, types, block, values", [
    # a classifier's softmax over 64 rows of 10 classes, and its backward
    ("softmax_short", nn.SOURCE, ("float32[1d]",) * 2 + ("int64",) * 3, (64, 1, 1),
     [None, None, np.int64(64), np.int64(10), np.int64(0)]),
    ("softmax_backward_short", nn.SOURCE, ("float32[1d]",) * 3 + ("int64",) * 3, (64, 1, 1),
     [None, None, None, np.int64(64), np.int64(10), np.int64(0)]),
    # cross-entropy's loss over a batch of 64, and its backward
    ("nll_loss", nn.SOURCE, ("float32[1d]", "float32[1d]", "float32[2d]", "int64[1d]")
     + ("int64",) * 3, (256, 1, 1), [None] * 4 + [np.int64(64), np.int64(1), np.int64(-100)]),
    ("nll_loss_backward", nn.SOURCE, ("float32[2d]", "float32[1d]", "int64[1d]")
     + ("int64",) * 4, (256, 1, 1),
     [None] * 3 + [np.int64(64), np.int64(10), np.int64(1), np.int64(-100)]),
    # a bias gradient: 256 columns of a batch of 64
    ("finish", reduce.SOURCE, ("float32[1d]", "float32[1d]", "int64[1d]", "int64", "int64",
                               "int64", "int64", "int64", "float64", "int64", "int64", "int64"),
     (256, 1, 1), [None] * 3 + [np.int64(v) for v in (0, 0, 256, 64, 64)] + [np.float64(0)]
     + [np.int64(v) for v in (0, 1, 256)]),
])
def test_a_training_steps_small_looping_kernels_run_inline(name: str, source: str,
                                                           types: tuple[str, ...],
                                                           block: tuple[int, int, int],
                                                           values: list[Any]) -> None:
    """The MLP step's looping launches fit the inline budget (each went to an engine, a
    hand-off of ~0.1 ms): a change that takes one past it fails here, not as a slowdown
    nobody sees (docs/launch.md, "Looping kernels inline")."""
    work = _inline_work(source, name, types, ONE, block, values)
    assert work is not None and work <= launches.INLINE_WORK, (name, work)


TILE = """
def tile(c, a, b, n: 'int64'):
    mma(c, a, b, 0, 0, 0, min(n, c.shape[0]), c.shape[1], n, 0.0)
"""


def test_an_mma_counts_its_tiles_multiply_adds_once_per_block() -> None:
    """The block issues an mma once: its multiply-adds (the tile's sizes as the launch's
    scalars and buffer shapes bound them) are shared among the block's threads."""
    lw = work_of(TILE, ("float32[2d]",) * 3 + ("int64",))
    assert lw is not None
    c = np.empty((8, 16), np.float32)

    def block_work(n: int, threads: int) -> int:
        per = lw.per_thread(ONE, (threads, 1, 1), [c, None, None, np.int64(n)])
        assert per is not None
        return per * threads

    macs = 8 * 16 * 36  # min(n, 8) rows, 16 columns, k = n (a multiple of MACS_PER_NODE)
    assert block_work(36, 1) >= macs // MACS_PER_NODE + MMA_CALL_NODES
    assert block_work(36, 1) - block_work(36, 64) < 64 * 8  # shared, not per thread
    assert block_work(72, 1) - block_work(36, 1) == macs // MACS_PER_NODE
    wider = np.empty((8, 32), np.float32)  # another shape: bounded again, not remembered
    assert lw.per_thread(ONE, (1, 1, 1), [wider, None, None, np.int64(36)]) \
        == block_work(36, 1) + macs // MACS_PER_NODE


def _mm_inline_work(m: int, n: int, k: int, bias: bool) -> int | None:
    """torch_accel's ``mm`` launch of an [m, n] product over k, as matmul.py makes it
    (with a bias row, as ``linear``'s forward, or without, as a backward's products)."""
    config = matmul._config(m, n, k, 2)
    values = [np.empty((m, n), np.float32), np.empty((m, k), np.float32),
              np.empty((k, n), np.float32), np.float64(0), np.float64(1), np.int64(0),
              np.int64(0), np.int64(k), np.empty(n, np.float32), np.int64(bias),
              np.int64(config.tile_m), np.int64(config.tile_n)]
    types = ("float32[2d]",) * 3 + ("float64",) * 2 + ("int64",) * 3 + ("float32[1d]",) \
        + ("int64",) * 3
    return _inline_work(matmul.SOURCE, "mm", types, (*config.grid, 1),
                        (config.threads, 1, 1), values)


@pytest.mark.parametrize("m, n, k, bias, inline", [
    (64, 10, 256, True, True),     # an MLP's 256-10 layer: forward,
    (64, 256, 10, False, True),    # the input's gradient
    (10, 256, 64, False, True),    # and the weight's
    (64, 256, 784, True, True),    # the 784-256 layer's: 12.8 M multiply-adds each,
    (256, 784, 64, False, True),   # ~0.2 ms of one core's BLAS
    (256, 784, 64, True, False),   # ...but not with a 200 K-element bias epilogue
    (256, 256, 784, False, False),  # 51 M multiply-adds
    (1024, 1024, 1024, False, False),
])
def test_small_products_run_inline_and_large_ones_on_an_engine(m: int, n: int, k: int,
                                                              bias: bool,
                                                              inline: bool) -> None:
    """A product of up to ~0.2 ms of BLAS no longer pays an engine's hand-off (0.14-0.31
    ms, and as much firmware CPU as the product); one of 51 M multiply-adds still goes to
    an engine, off the control loop. The bias epilogue counts only when there is a bias
    (the launch's ``has_bias`` decides its ``if``)."""
    work = _mm_inline_work(m, n, k, bias)
    assert work is not None
    assert (work <= launches.INLINE_WORK) is inline, (m, n, k, work)


DECIDED = """
def scale(x, n: 'int64', flag: 'int64', alpha: 'float64'):
    if flag != 0:
        for j in range(n):
            x[j] = x[j] * alpha
    if alpha != 1.0:
        for j in range(n):
            x[j] = x[j] * alpha
"""


@pytest.mark.parametrize("flag, alpha, loops", [
    (0, 1.0, 0), (1, 1.0, 1), (0, 0.5, 1), (1, 0.5, 2), (0, float("nan"), 1)])
def test_an_if_the_launchs_values_decide_counts_only_its_taken_arm(flag: int, alpha: float,
                                                                    loops: int) -> None:
    """An integer scalar against a constant, a float scalar against one (NaN differs from
    everything): the untaken arm's loop is not counted, the taken one is."""
    lw = work_of(DECIDED, ("float32[1d]", "int64", "int64", "float64"))
    assert lw is not None

    def work(n: int, flag: int, alpha: float) -> int | None:
        return lw.per_thread(ONE, (1, 1, 1), [None, np.int64(n), np.int64(flag),
                                              np.float64(alpha)])

    none, long = work(1000, flag, alpha), work(2000, flag, alpha)
    assert none is not None and long is not None
    per_loop = work(2000, 1, 1.0) - work(1000, 1, 1.0)  # type: ignore[operator]
    assert per_loop > 1000
    assert long - none == loops * per_loop


def test_an_if_no_launch_decides_counts_its_larger_arm() -> None:
    """A test on a thread's id differs between threads: both arms stay possible."""
    lw = work_of("""
def k(x, n: 'int64'):
    if local_id(0) == 0:
        for j in range(n):
            x[j] = 0.0
""", ("float32[1d]", "int64"))
    assert lw is not None
    small = lw.per_thread(ONE, (64, 1, 1), [None, np.int64(10)])
    big = lw.per_thread(ONE, (64, 1, 1), [None, np.int64(1000)])
    assert small is not None and big is not None and big - small >= 990
