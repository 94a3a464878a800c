"""Unit tests of the firmware's kernel JIT (firmware/jit.py), without a daemon.

Numba compiles are slow on the 2-core test machines, so the compiled kernels are shared:
one module-scoped cache directory, one KernelCache, kernels compiled once and reused by
every test that needs them. Tests that must see a *fresh* process (the persistent cache,
two compiling processes) run a small script in a subprocess.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from abi import kernel_lang
from firmware import jit, kernel_check, matrix
from firmware.jit import (
    ABORT_PREEMPT,
    ABORT_WATCHDOG,
    KernelCache,
    KernelFault,
    Options,
    compat_key,
    lower,
)
from testkit import REPO
from testkit.waiting import wait_until


#: The matrix unit's paths (firmware/matrix.py): MKL (when torch's library is installed),
#: OpenBLAS, and the plain loops used without a BLAS.
BLAS_PATHS = [pytest.param("mkl", marks=pytest.mark.skipif(matrix.mkl_library() is None,
                                                           reason="no torch: no MKL")),
              "openblas", "loops"]


def ir_of(src: str, ndims: dict[str, int] | None = None) -> dict[str, Any]:
    """A kernel IR as the runtime's front end would produce it: parameters used with
    ``[...]``/``.shape``/``.size`` are buffers (ndim from ``ndims``, default 1)."""
    src = textwrap.dedent(src)
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    used = {n.value.id for n in ast.walk(fn)
            if isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.value, ast.Name)}
    used |= {n.args[0].id for n in ast.walk(fn) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == "atomic_add"}  # type: ignore
    used |= {a.id for n in ast.walk(fn) if isinstance(n, ast.Call)  # type: ignore
             and isinstance(n.func, ast.Name) and n.func.id == "mma" for a in n.args[:3]}
    params = []
    for a in fn.args.args:
        if a.arg in used:
            params.append({"name": a.arg, "kind": "buffer", "dtype": None,
                           "ndim": (ndims or {}).get(a.arg, 1)})
        else:
            params.append({"name": a.arg, "kind": "scalar", "dtype": None})
    shared_mem = 0  # what the front end counts: static shared_array bytes
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                and n.func.id == "shared_array":
            dims = n.args[0].elts if isinstance(n.args[0], ast.Tuple) else [n.args[0]]
            dtype = kernel_lang.DTYPE_ALIASES.get(n.args[1].value, n.args[1].value)  # type: ignore
            shared_mem += int(np.prod([d.value for d in dims])) * np.dtype(dtype).itemsize  # type: ignore
    return {"name": fn.name, "params": params, "source": ast.unparse(fn),
            "shared_mem": shared_mem,
            "uses_barrier": "barrier()" in src, "uses_atomics": "atomic_add" in src,
            "uses_mma": "mma(" in src}


SAXPY = ir_of("""
    def saxpy(a, x, y, out):
        i = global_id(0)
        if i < out.shape[0]:
            out[i] = a * x[i] + y[i]
""")
SAXPY_T = ("float32", "float32[1d]", "float32[1d]", "float32[1d]")

ADD2D = ir_of("""
    def add2d(a, b, out):
        r = global_id(1)
        c = global_id(0)
        if r < out.shape[0] and c < out.shape[1]:
            out[r, c] = a[r, c] * 2.0 + b[r, c]
""", {"a": 2, "b": 2, "out": 2})

BLOCK_SUM = ir_of("""
    def block_sum(x, partial):
        s = shared_array(256, "float64")
        lid = local_id(0)
        i = global_id(0)
        if i < x.shape[0]:
            s[lid] = x[i]
        else:
            s[lid] = 0.0
        barrier()
        for k in range(7, -1, -1):
            if lid < (1 << k):
                s[lid] += s[lid + (1 << k)]
            barrier()
        if lid == 0:
            partial[group_id(0)] = s[0]
""")

MATMUL = ir_of("""
    def matmul(a, b, c, n):
        tx = local_id(0)
        ty = local_id(1)
        col = global_id(0)
        row = global_id(1)
        sa = shared_array((16, 16), "float32")
        sb = shared_array((16, 16), "float32")
        acc = 0.0
        for t in range(n // 16):
            sa[ty, tx] = a[row, t * 16 + tx]
            sb[ty, tx] = b[t * 16 + ty, col]
            barrier()
            for k in range(16):
                acc += sa[ty, k] * sb[k, tx]
            barrier()
        c[row, col] = acc
""", {"a": 2, "b": 2, "c": 2})

ATOMICS = ir_of("""
    def hist(x, bins, total, count):
        i = global_id(0)
        if i >= x.shape[0]:
            return
        atomic_add(bins, x[i] % 16, 1)
        atomic_add(total, 0, float(x[i]))
        atomic_add(count, 0, 1)
""")

COPY = ir_of("""
    def copy(x, out):
        i = global_id(0)
        out[i] = x[i]
""")

SPIN = ir_of("""
    def spin(x):
        while True:
            x[0] += 1.0
""")


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jitcache")


@pytest.fixture(scope="module")
def cache(cache_root: Path) -> KernelCache:
    return KernelCache(cache_root)


def grid1(n: int, bs: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return ((n + bs - 1) // bs, 1, 1), (bs, 1, 1)


def nblocks(grid: tuple[int, int, int]) -> int:
    return grid[0] * grid[1] * grid[2]


def no_abort() -> np.ndarray:
    return np.zeros(1, np.int64)


def run_script(code: str, *args: str, timeout: float = 120) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


# --------------------------------------------------------------------------- correctness


def test_saxpy(cache: KernelCache) -> None:
    k = cache.get(SAXPY, SAXPY_T, Options())
    n = 10_000  # not a multiple of the block
    rng = np.random.default_rng(1)
    x, y = rng.random(n, np.float32), rng.random(n, np.float32)
    out = np.zeros(n, np.float32)
    grid, block = grid1(n, 256)
    assert k.run(0, nblocks(grid), grid, block, [np.float32(3), x, y, out], no_abort()) \
        == nblocks(grid)
    np.testing.assert_allclose(out, np.float32(3) * x + y, rtol=1e-6)


def test_2d(cache: KernelCache) -> None:
    k = cache.get(ADD2D, ("float64[2d]", "float64[2d]", "float64[2d]"), Options())
    rng = np.random.default_rng(2)
    a, b = rng.random((37, 53)), rng.random((37, 53))
    out = np.zeros((37, 53))
    grid, block = ((53 + 7) // 8, (37 + 7) // 8, 1), (8, 8, 1)
    assert k.run(0, nblocks(grid), grid, block, [a, b, out], no_abort()) == nblocks(grid)
    np.testing.assert_allclose(out, a * 2 + b)


def test_shared_array_and_barrier_block_reduction(cache: KernelCache) -> None:
    k = cache.get(BLOCK_SUM, ("float64[1d]", "float64[1d]"), Options())
    n = 256 * 9 + 17
    x = np.random.default_rng(3).random(n)
    grid, block = grid1(n, 256)
    partial = np.zeros(nblocks(grid))
    k.run(0, nblocks(grid), grid, block, [x, partial], no_abort())
    want = [x[i:i + 256].sum() for i in range(0, n, 256)]
    np.testing.assert_allclose(partial, want)


def test_barrier_in_uniform_loop_tiled_matmul(cache: KernelCache) -> None:
    k = cache.get(MATMUL, ("float32[2d]", "float32[2d]", "float32[2d]", "int64"), Options())
    rng = np.random.default_rng(4)
    a, b = rng.random((64, 64), np.float32), rng.random((64, 64), np.float32)
    c = np.zeros((64, 64), np.float32)
    grid, block = (4, 4, 1), (16, 16, 1)
    assert k.run(0, 16, grid, block, [a, b, c, np.int64(64)], no_abort()) == 16
    np.testing.assert_allclose(c, a @ b, rtol=1e-4)


def test_atomic_add_from_two_threads(cache: KernelCache) -> None:
    k = cache.get(ATOMICS, ("int64[1d]", "int64[1d]", "float64[1d]", "int32[1d]"), Options())
    n = 1 << 20
    x = np.random.default_rng(5).integers(0, 1000, n)
    bins, total, count = np.zeros(16, np.int64), np.zeros(1), np.zeros(1, np.int32)
    grid, block = grid1(n, 128)
    nb = nblocks(grid)
    errors: list[BaseException] = []

    def part(lo: int, hi: int) -> None:
        try:
            k.run(lo, hi, grid, block, [x, bins, total, count], no_abort())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=part, args=(0, nb // 2)),
               threading.Thread(target=part, args=(nb // 2, nb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    np.testing.assert_array_equal(bins, np.bincount(x % 16, minlength=16))
    assert total[0] == float(x.sum())
    assert count[0] == n


# --------------------------------------------------------------------------- faults


def test_bounds_miss_on_store_names_buffer_and_index(cache: KernelCache) -> None:
    k = cache.get(COPY, ("float32[1d]", "float32[1d]"), Options())
    x = np.arange(512, dtype=np.float32)
    backing = np.full(512, -1.0, np.float32)
    out = backing[:100]  # memory past the buffer exists: it must stay untouched
    grid, block = grid1(512, 64)
    with pytest.raises(KernelFault) as ei:
        k.run(0, nblocks(grid), grid, block, [x, out], no_abort())
    assert (ei.value.kind, ei.value.param, ei.value.index) == ("bounds", "out", 100)
    assert ei.value.block == 1
    np.testing.assert_array_equal(out, x[:100])
    assert (backing[100:] == -1.0).all()


def test_bounds_miss_on_load(cache: KernelCache) -> None:
    k = cache.get(COPY, ("float32[1d]", "float32[1d]"), Options())
    x = np.arange(70, dtype=np.float32)
    out = np.zeros(128, np.float32)
    grid, block = grid1(128, 64)
    with pytest.raises(KernelFault) as ei:
        k.run(0, 2, grid, block, [x, out], no_abort())
    assert (ei.value.kind, ei.value.param, ei.value.index) == ("bounds", "x", 70)
    assert (out[70:] == 0).all()


SHIFT = ir_of("""
    def shift(x, out, off):
        i = global_id(0)
        if i < out.size:
            out[i] = x[i + off]
""")
SHIFT_T = ("float32[1d]", "float32[1d]", "int64")


def _phase_source(source: str, fn: str) -> str:
    return source.split(f"def {fn}(")[1].split("@njit")[0]


def _fast_and_checked(source: str) -> tuple[str, str]:
    """A one-phase kernel's two thread loops, inlined in ``_grid``: the one run under the
    block's range checks, then the checked one (the ``else`` of those checks)."""
    fast, checked = source.split("def _grid(")[1].split("\n        else:\n", 1)
    return fast, checked


def test_affine_accesses_are_range_checked_once_per_block(cache: KernelCache) -> None:
    # saxpy's accesses are all global_id(0) (+ a scalar offset): the block checks their
    # range once and runs a thread loop without per-element checks.
    for ir, types in ((SAXPY, SAXPY_T), (SHIFT, SHIFT_T)):
        src = cache.get(ir, types, Options()).source
        fast, checked = _fast_and_checked(src)
        assert "_miss1(" not in fast
        assert "_miss1(" in checked  # the fallback keeps its checks
        assert "def _ph" not in src  # small phases are written into the thread loops
    assert "u_off < " in cache.get(SHIFT, SHIFT_T, Options()).source  # offset bounded
    # a gather is not affine: that load keeps its per-element check in the fast variant
    gather = ir_of("""
        def gather(x, idx, out):
            i = global_id(0)
            out[i] = x[idx[i]]
    """)
    src = cache.get(gather, ("float32[1d]", "int64[1d]", "float32[1d]"), Options()).source
    fast, _ = _fast_and_checked(src)
    assert "_miss1(fault, np.int64(0)," in fast and "np.int64(1)" not in fast \
        and "np.int64(2)" not in fast


def test_a_large_phase_stays_a_function_with_both_variants(cache: KernelCache) -> None:
    """Past INLINE_NODES (firmware/lower/passes/variants.py) a phase is compiled as
    functions (numba's SSA work grows faster than linearly inlined): the range-checked
    ``_phf0`` and the checked ``_ph0``, which still compute the same values."""
    chain = "".join(f"\n        {'if' if c == 0 else 'elif'} op == {c}:\n"
                    f"            out[i] = x[i] * {c}.0 + {c}.5 - x[i] / {c + 1}.0"
                    for c in range(24))
    ir = ir_of("def chain(x, out, op):\n    i = global_id(0)\n"
               "    if i < out.size:" + chain + "\n")
    src = cache.get(ir, ("float64[1d]", "float64[1d]", "int64"), Options()).source
    assert "_miss1(" not in _phase_source(src, "_phf0")
    assert "_miss1(" in _phase_source(src, "_ph0")
    assert "if _phf0(" in src and "if _ph0(" in src
    k = cache.get(ir, ("float64[1d]", "float64[1d]", "int64"), Options())
    x = np.arange(300, dtype=np.float64)
    out = np.zeros(300)
    assert k.run(0, 2, (2, 1, 1), (256, 1, 1), [x, out, np.int64(7)], no_abort()) == 2
    np.testing.assert_array_equal(out, x * 7.0 + 7.5 - x / 8.0)

    # without bounds checks there is nothing to hoist
    assert "else:" not in jit.lower(SAXPY, SAXPY_T, Options(boundscheck=False))


POLY = ir_of("""
    def poly(out, x, a):
        i = global_id(0)
        if i < out.shape[0]:
            acc = 0.0
            for j in range(8):
                acc = acc * x[i] + a * j
            out[i] = acc
""")
POLY_T = ("float32[1d]", "float32[1d]", "float32")


def test_a_small_loop_kernel_compiles_as_one_function(cache: KernelCache) -> None:
    """A one-phase kernel with a small loop (INLINE_LOOP_NODES, passes/variants.py) is
    written into ``_grid``'s thread loops, both variants, as a loop-free one is (a first
    compile's cost grows with its functions): its range-checked loop has no per-access
    check, its checked loop faults with the buffer, index and block, and values match."""
    k = cache.get(POLY, POLY_T, Options())
    assert "def _ph" not in k.source
    fast, checked = _fast_and_checked(k.source)
    assert "for u_j in range(" in fast and "_miss1(" not in fast
    assert "_miss1(fault, np.int64(1)," in checked
    x = np.linspace(0, 1, 299, dtype=np.float32)

    def expected(n: int) -> np.ndarray:
        acc = np.zeros(n, np.float32)
        for j in range(8):
            acc = acc * x[:n] + np.float32(0.5) * np.float32(j)
        return acc

    out = np.zeros(299, np.float32)
    grid, block = grid1(299, 64)
    assert k.run(0, nblocks(grid), grid, block, [out, x, np.float32(0.5)], no_abort()) == 5
    np.testing.assert_allclose(out, expected(299), rtol=1e-6)
    out = np.zeros(299, np.float32)  # x shorter than out: thread 290 (block 4) misses
    with pytest.raises(KernelFault) as ei:
        k.run(0, nblocks(grid), grid, block, [out, x[:290], np.float32(0.5)], no_abort())
    assert (ei.value.kind, ei.value.param, ei.value.index, ei.value.block) == \
        ("bounds", "x", 290, 4)
    np.testing.assert_allclose(out[:290], expected(290), rtol=1e-6)
    assert (out[290:] == 0).all()


def test_a_loop_with_a_return_stays_a_function(cache: KernelCache) -> None:
    """Written into the thread loop a thread's ``return`` is a ``continue``, which inside
    a user loop would continue that loop: such a phase stays a function, where the
    ``return`` ends the thread."""
    ir = ir_of("""
        def first_neg(x, out):
            i = global_id(0)
            out[i] = -1
            for j in range(x.shape[0]):
                if x[j] < 0:
                    out[i] = j + i
                    return
                out[i] = -2
    """)
    k = cache.get(ir, ("float32[1d]", "int64[1d]"), Options())
    assert "def _ph0(" in k.source
    x = np.array([1, 2, -3, 4, -5], np.float32)
    out = np.zeros(4, np.int64)
    assert k.run(0, 1, (1, 1, 1), (4, 1, 1), [x, out], no_abort()) == 1
    np.testing.assert_array_equal(out, [2, 3, 4, 5])


def test_affine_miss_in_one_block_still_faults_with_the_index(cache: KernelCache) -> None:
    k = cache.get(SHIFT, SHIFT_T, Options())
    x = np.arange(300, dtype=np.float32)
    out = np.zeros(512, np.float32)
    grid, block = grid1(512, 64)
    with pytest.raises(KernelFault) as ei:  # block 4 reads x[261..324]: x[300] misses
        k.run(0, nblocks(grid), grid, block, [x, out, np.int64(5)], no_abort())
    assert (ei.value.kind, ei.value.param, ei.value.index, ei.value.block) == \
        ("bounds", "x", 300, 4)
    np.testing.assert_array_equal(out[:295], x[5:])  # blocks 0-3 (fast) and block 4's
    assert (out[295:] == 0).all()                     # threads before the miss ran
    out[:] = 0
    with pytest.raises(KernelFault) as ei:  # a negative first index faults in block 0
        k.run(0, nblocks(grid), grid, block, [x, out, np.int64(-1)], no_abort())
    assert (ei.value.param, ei.value.index, ei.value.block) == ("x", -1, 0)
    assert (out == 0).all()
    out[:] = 0  # in bounds everywhere: every block takes the fast path
    assert k.run(0, 4, grid, block, [x, out, np.int64(44)], no_abort()) == 4
    np.testing.assert_array_equal(out[:256], x[44:300])


STRIDED = ir_of("""
    def strided(out, x, sx, n):
        i = global_id(0)
        if i < n:
            out[i] = x[i * sx] + x[3 * i]
""")
STRIDED_T = ("float32[1d]", "float32[1d]", "int64", "int64")


def test_a_strided_access_is_range_checked_per_block(cache: KernelCache) -> None:
    """``x[i * sx]`` (a thread index times a constant or an integer scalar) is checked
    once per block over its first and last thread's indices, under a block-level check
    that the scale is in ``[0, SCALE_LIMIT)``: a negative stride, one past the limit or a
    block whose last index misses runs the checked loop, which faults exactly."""
    from firmware.lower.analysis.affine import SCALE_LIMIT

    k = cache.get(STRIDED, STRIDED_T, Options())
    fast, checked = _fast_and_checked(k.source)
    assert "_miss1(" not in fast and "_miss1(fault, np.int64(1)," in checked
    assert f"0 <= u_sx < {SCALE_LIMIT}" in k.source
    x = np.arange(1024, dtype=np.float32)
    grid, block = grid1(256, 64)

    def run(sx: int, n: int = 256, xs: np.ndarray = x) -> np.ndarray:
        out = np.zeros(256, np.float32)
        assert k.run(0, nblocks(grid), grid, block, [out, xs, np.int64(sx), np.int64(n)],
                     no_abort()) == nblocks(grid)
        return out

    i = np.arange(256)
    for sx in (0, 1, 4):  # in range everywhere: the fast path, the same values
        np.testing.assert_array_equal(run(sx), x[i * sx] + x[3 * i])
    np.testing.assert_array_equal(run(-1, n=1), [x[0] + x[0]] + [0] * 255)  # the checked loop
    for sx, index in ((-1, -1), (5, 1025), (SCALE_LIMIT, SCALE_LIMIT)):
        out = np.zeros(256, np.float32)
        with pytest.raises(KernelFault) as ei:  # negative, past x, past the scale's limit
            k.run(0, nblocks(grid), grid, block, [out, x, np.int64(sx), np.int64(256)],
                  no_abort())
        assert (ei.value.kind, ei.value.param, ei.value.index) == ("bounds", "x", index)
        assert ei.value.block == index // sx // 64 if sx > 0 else ei.value.block == 0
    with pytest.raises(KernelFault) as ei:  # the constant scale's miss: x[3 * 255]
        run(1, xs=x[:700])
    assert (ei.value.param, ei.value.index, ei.value.block) == ("x", 3 * 234, 3)


def test_bounds_miss_on_shared_array_and_negative_index(cache: KernelCache) -> None:
    ir = ir_of("""
        def neg(x, out):
            s = shared_array(8, "int32")
            i = global_id(0)
            s[i % 8] = 1
            if i == 3:
                out[i - 10] = s[0] + x[0]
    """)
    k = cache.get(ir, ("int32[1d]", "int32[1d]"), Options())
    out = np.zeros(16, np.int32)
    with pytest.raises(KernelFault) as ei:
        k.run(0, 1, (1, 1, 1), (8, 1, 1), [np.ones(4, np.int32), out], no_abort())
    assert (ei.value.param, ei.value.index) == ("out", -7)
    assert (out == 0).all()


def test_watchdog_stops_an_infinite_loop(cache: KernelCache) -> None:
    k = cache.get(SPIN, ("float64[1d]",), Options())
    x = np.zeros(1)
    abort = no_abort()
    result: list[BaseException | int] = []

    def go() -> None:
        try:
            result.append(k.run(0, 1, (1, 1, 1), (1, 1, 1), [x], abort))
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    wait_until(lambda: x[0], 30, "the kernel to spin")  # and the GIL free meanwhile
    assert t.is_alive()
    abort[0] = ABORT_WATCHDOG
    t.join(10)
    assert not t.is_alive(), "the kernel did not see the abort word"
    assert isinstance(result[0], KernelFault) and result[0].kind == "watchdog"


def test_preemption_between_blocks_and_resume(cache: KernelCache) -> None:
    k = cache.get(ATOMICS, ("int64[1d]", "int64[1d]", "float64[1d]", "int32[1d]"), Options())
    n = 1 << 21
    x = np.ones(n, np.int64)
    bins, total, count = np.zeros(16, np.int64), np.zeros(1), np.zeros(1, np.int32)
    grid, block = grid1(n, 64)
    nb = nblocks(grid)
    abort = np.array([ABORT_PREEMPT], np.int64)
    # Preempted before it starts: nothing runs, the resume point is block_lo.
    assert k.run(10, nb, grid, block, [x, bins, total, count], abort) == 10
    assert count[0] == 0
    # Preempted while running (as soon as the first atomics land): the running block
    # finishes, and exactly the blocks before the resume point have run.
    abort[0] = 0
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(
        k.run(0, nb, grid, block, [x, bins, total, count], abort)))
    t.start()
    wait_until(lambda: count[0], 30, "the first atomics to land", interval=0)
    abort[0] = ABORT_PREEMPT
    t.join()
    r = result[0]
    assert 0 < r < nb
    assert count[0] == r * 64
    abort[0] = 0
    assert k.run(r, nb, grid, block, [x, bins, total, count], abort) == nb
    assert count[0] == n and total[0] == n


def test_return_before_barrier_and_break_of_uniform_loop(cache: KernelCache) -> None:
    """A block that returns before a barrier skips it; a thread that returns alone before
    one breaks the language's barrier rule (abi/kernel_frontend.py), which the firmware
    checks as the runtime does."""
    ret = ir_of("""
        def ret(out):
            s = shared_array(64, "int64")
            lid = local_id(0)
            s[lid] = lid
            if group_id(0) >= 1:
                return
            barrier()
            out[global_id(0)] = s[63 - lid]
    """)
    k = cache.get(ret, ("int64[1d]",), Options())
    out = np.full(128, -1, np.int64)
    k.run(0, 2, (2, 1, 1), (64, 1, 1), [out], no_abort())
    lid = np.arange(128) % 64
    np.testing.assert_array_equal(out, np.where(np.arange(128) < 64, 63 - lid, -1))
    alone = {**ret, "source": ret["source"].replace("group_id(0) >= 1", "lid >= 32")}
    with pytest.raises(jit.KernelCompileError, match=r"barrier\(\) can run after the `return`"):
        cache.get(alone, ("int64[1d]",), Options())

    brk = ir_of("""
        def brk(n, out):
            lid = local_id(0)
            acc = 0
            for t in range(n):
                if t == 3:
                    break
                acc += t
                barrier()
            out[global_id(0)] = acc + lid * 100
    """)
    k = cache.get(brk, ("int32", "int64[1d]"), Options())
    out = np.zeros(16, np.int64)
    k.run(0, 2, (2, 1, 1), (8, 1, 1), [np.int32(10), out], no_abort())
    np.testing.assert_array_equal(out, 3 + (np.arange(16) % 8) * 100)


def test_run_checks_argument_types(cache: KernelCache) -> None:
    k = cache.get(SAXPY, SAXPY_T, Options())
    x = np.zeros(64, np.float32)
    with pytest.raises(TypeError):  # wrong dtype would be read as float32 by the native code
        k.run(0, 1, (1, 1, 1), (64, 1, 1), [np.float32(1), x.astype(np.float64), x, x],
              no_abort())
    with pytest.raises(TypeError):  # not contiguous
        k.run(0, 1, (1, 1, 1), (64, 1, 1), [np.float32(1), np.zeros(128, np.float32)[::2],
                                            x, x], no_abort())
    with pytest.raises(ValueError):
        k.run(0, 2, (1, 1, 1), (64, 1, 1), [np.float32(1), x, x, x], no_abort())


GATHER = ir_of("""
    def gather(x, idx, out):
        i = global_id(0)
        if i < out.size:
            out[i] = x[idx[i]]
""")


def test_a_bound_launch_checks_once_and_faults_like_run_every_time(cache: KernelCache) -> None:
    """``bind``: the checks of ``run`` when bound, then each call runs the whole grid over
    the very arrays bound, as they are now, and faults as ``run`` does; its one fault
    array is cleared after a fault, so a later clean run does not fault and a later miss
    names its own index."""
    k = cache.get(GATHER, ("float32[1d]", "int64[1d]", "float32[1d]"), Options())
    x, idx = np.arange(100, dtype=np.float32), np.arange(64, dtype=np.int64)
    out = np.zeros(64, np.float32)
    with pytest.raises(TypeError):
        k.bind((1, 1, 1), (64, 1, 1), [x, idx.astype(np.int32), out], no_abort())
    with pytest.raises(ValueError):
        k.bind((1, 1, 1), (1 << 20, 1, 1), [x, idx, out], no_abort())
    launch = k.bind((1, 1, 1), (64, 1, 1), [x, idx, out], no_abort())
    assert launch() == 1 and (out == x[:64]).all()
    for i, bad in ((5, 1000), (7, -3)):
        idx[i] = bad
        with pytest.raises(KernelFault) as ei:
            launch()
        assert (ei.value.kind, ei.value.param, ei.value.index) == ("bounds", "x", bad)
        idx[i] = i
        out[:] = 0
        assert launch() == 1 and (out == x[:64]).all()


# --------------------------------------------------------------------------- the cache


_LOAD_SCRIPT = """
import json, sys, time
import numpy as np
t0 = time.perf_counter()
from firmware.jit import KernelCache, Options
ir = json.loads(sys.argv[2])
c = KernelCache(sys.argv[1])
t1 = time.perf_counter()
k = c.get(ir, tuple(json.loads(sys.argv[3])), Options())
t2 = time.perf_counter()
x = np.arange(1000, dtype=np.float32); y = np.ones(1000, np.float32)
out = np.zeros(1000, np.float32)
k.run(0, 4, (4, 1, 1), (256, 1, 1), [np.float32(2), x, y, out], np.zeros(1, np.int64))
print(json.dumps({"hits": c.hits, "misses": c.misses, "compiles": c.compiles,
                  "ok": bool(np.allclose(out, 2 * x + 1)), "get_s": t2 - t1,
                  "import_s": t1 - t0}))
"""


def _result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_persistent_cache_hit_in_new_process(cache: KernelCache, cache_root: Path) -> None:
    cache.get(SAXPY, SAXPY_T, Options())  # compiled (and saved) in this process
    r = _result(run_script(_LOAD_SCRIPT, str(cache_root), json.dumps(SAXPY),
                           json.dumps(SAXPY_T)))
    assert r == {**r, "hits": 1, "misses": 0, "compiles": 0, "ok": True}
    key = cache.key(SAXPY, SAXPY_T, Options())
    entry = cache.entry_dir(key)
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["key"] == key and (entry / manifest["module"]).exists()
    assert any(p.suffix == ".nbi" for p in (entry / "__pycache__").iterdir())


def test_two_processes_compile_once(tmp_path: Path) -> None:
    procs = [run_script(_LOAD_SCRIPT, str(tmp_path), json.dumps(SAXPY), json.dumps(SAXPY_T))
             for _ in range(2)]
    results = [_result(p) for p in procs]
    assert all(r["ok"] for r in results)
    assert sorted(r["compiles"] for r in results) == [0, 1]
    assert sorted((r["misses"], r["hits"]) for r in results) == [(0, 1), (1, 0)]
    assert not list(tmp_path.glob("*/.tmp-*"))


def test_every_compatibility_input_changes_the_key(cache: KernelCache, cache_root: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    base = cache.key(SAXPY, SAXPY_T, Options())
    other_source = ir_of("""
        def saxpy(a, x, y, out):
            i = global_id(0)
            if i < out.shape[0]:
                out[i] = x[i] * a + y[i]
    """)
    variants = {
        "source": cache.key(other_source, SAXPY_T, Options()),
        "dtype": cache.key(SAXPY, ("float64", "float64[1d]", "float64[1d]", "float64[1d]"),
                           Options()),
        "boundscheck": cache.key(SAXPY, SAXPY_T, Options(boundscheck=False)),
        "fastmath": cache.key(SAXPY, SAXPY_T, Options(fastmath=True)),
        "stepping": KernelCache(cache_root, stepping="B0").key(SAXPY, SAXPY_T, Options()),
        "isa": KernelCache(cache_root, isa="aemu-isa 2.0").key(SAXPY, SAXPY_T, Options()),
    }
    for name, value in [("FIRMWARE_JIT_ABI", jit.FIRMWARE_JIT_ABI + 1)]:
        with monkeypatch.context() as m:
            m.setattr(jit, name, value)
            variants[name] = cache.key(SAXPY, SAXPY_T, Options())
    # a change in the lowering (firmware/lower/): its generated source is hashed into the key
    with monkeypatch.context() as m:
        m.setattr(jit, "lower", lambda ir, types, options: lower(ir, types, options) + "\n")
        variants["generated"] = cache.key(SAXPY, SAXPY_T, Options())
    for mod, label in [(jit.numba, "numba"), (jit.llvmlite, "llvmlite"), (jit.np, "numpy")]:
        with monkeypatch.context() as m:
            m.setattr(mod, "__version__", "0.0.0")
            variants[label] = cache.key(SAXPY, SAXPY_T, Options())
    with monkeypatch.context() as m:
        m.setattr(jit.platform, "python_version", lambda: "3.99.0")
        variants["python"] = cache.key(SAXPY, SAXPY_T, Options())
    with monkeypatch.context() as m:
        m.setattr(jit.numba.config, "CPU_NAME", "some-other-cpu")
        variants["cpu"] = cache.key(SAXPY, SAXPY_T, Options())
    # environment settings that change numba's code generation (NUMBA_OPT=0, ...)
    for setting, value in [("OPT", 0), ("BOUNDSCHECK", 1), ("LOOP_VECTORIZE", 0),
                           ("SLP_VECTORIZE", 1)]:
        with monkeypatch.context() as m:
            m.setattr(jit.numba.config, setting, value)
            variants[f"NUMBA_{setting}"] = cache.key(SAXPY, SAXPY_T, Options())
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants), variants
    assert set(compat_key()) >= {"python", "numba", "llvmlite", "numpy", "firmware_jit_abi",
                                 "isa", "stepping", "cpu", "options", "codegen_env"}

    # Irrelevant inputs: the kernel's flags/name in the module and other kernels.
    moved = {**SAXPY, "uses_atomics": True, "index": 7}
    assert cache.key(moved, SAXPY_T, Options()) == base
    module = {"format": 1, "kernels": {"other": COPY, "saxpy": SAXPY}}
    assert cache.key(module["kernels"]["saxpy"], SAXPY_T, Options()) == base

    # A changed input really recompiles rather than reusing machine code.
    before = cache.compiles
    k = cache.get(SAXPY, SAXPY_T, Options(boundscheck=False))
    assert cache.compiles == before + 1 and k.key == variants["boundscheck"]


@pytest.mark.parametrize("damage", ["truncate_module", "garble_manifest", "numba_cache"])
def test_corrupt_entry_is_rebuilt(tmp_path: Path, damage: str) -> None:
    ir, types = COPY, ("int16[1d]", "int16[1d]")
    KernelCache(tmp_path).get(ir, types, Options())
    c1 = KernelCache(tmp_path)
    key = c1.key(ir, types, Options())
    entry = c1.entry_dir(key)
    if damage == "truncate_module":
        path = entry / f"kernel_{key[:16]}.py"
        path.write_text(path.read_text()[:200])
    elif damage == "garble_manifest":
        (entry / "manifest.json").write_text("{not json")
    else:
        for p in (entry / "__pycache__").glob("*.nb*"):
            p.write_bytes(b"\0garbage")
    c2 = KernelCache(tmp_path)
    k = c2.get(ir, types, Options())
    if damage == "numba_cache":
        assert c2.compiles == 1  # numba's files unreadable: recompiled (entry kept or rebuilt)
    else:
        assert (c2.misses, c2.compiles, c2.hits) == (1, 1, 0)
    x = np.arange(64, dtype=np.int16)
    out = np.zeros(64, np.int16)
    k.run(0, 1, (1, 1, 1), (64, 1, 1), [x, out], no_abort())
    np.testing.assert_array_equal(out, x)
    c3 = KernelCache(tmp_path)
    c3.get(ir, types, Options())
    assert (c3.hits, c3.compiles) == (1, 0)


def test_in_memory_hits(cache: KernelCache) -> None:
    cache.get(SAXPY, SAXPY_T, Options())
    hits, compiles = cache.hits, cache.compiles
    assert cache.get(dict(SAXPY), SAXPY_T, Options()) is cache.get(SAXPY, SAXPY_T, Options())
    assert (cache.hits, cache.compiles) == (hits + 2, compiles)


# --------------------------------------------------------------------------- rejections


@pytest.mark.parametrize("src, why", [
    ("def k(x):\n    import os\n", "imports"),
    ("def k(x):\n    from os import path\n", "imports"),
    ("def k(x):\n    x[0] = x.dtype\n", "attribute"),
    ("def k(x):\n    x[0] = x.__class__\n", "attribute|dunder"),
    ("def k(x):\n    x[0] = len(x)\n", "len"),
    ("def k(x):\n    x[0] = open(1)\n", "open"),
    ("def k(x):\n    global y\n", "global"),
    ("def k(x):\n    f = lambda: 1\n", "lambda"),
    ("def k(x):\n    y = [i for i in range(3)]\n", "comprehension"),
    ("def k(x):\n    with x:\n        pass\n", "with"),
    ("def k(x):\n    try:\n        pass\n    except:\n        pass\n", "try"),
    ("def k(x):\n    yield 1\n", "yield"),
    ("def k(x):\n    def g():\n        pass\n", "nested"),
    ("def k(x):\n    class C:\n        pass\n", "class"),
    ("def k(x):\n    del x\n", "del"),
    ("def k(x):\n    x[0] = y\n", "free name"),
    ("def k(x):\n    f = sqrt\n", "only be called"),
    ("def k(x):\n    x[0] = 'hello'\n", "string"),
    ("def k(x):\n    if global_id(0) > 3:\n        barrier()\n", "barrier"),
    ("def k(x):\n    for i in range(global_id(0)):\n        barrier()\n", "barrier"),
    ("def k(x):\n    y = x[0]\n    while y > 0:\n        barrier()\n", "barrier"),
    ("def k(x):\n    x[0] = global_id(3)\n", "dimension"),
    ("def k(x):\n    y = 1.0 + dynamic_shared('float32')\n", "right side"),
    ("def k(x):\n    t = dynamic_shared('float32', 4)\n", r"dynamic_shared\(\) takes 1 argument"),
    ("def k(x):\n    t = dynamic_shared(4)\n", "dtype of dynamic_shared must be a dtype name"),
    ("import os\ndef k(x):\n    pass\n", "imports are not allowed"),
    ("async def k(x):\n    pass\n", "async functions are not allowed"),
])
def test_rejected_constructs(src: str, why: str, cache: KernelCache) -> None:
    ir = {"name": "k", "params": [{"name": "x", "kind": "buffer", "dtype": None, "ndim": 1}],
          "source": src, "shared_mem": 0}
    with pytest.raises(ValueError, match=why):
        cache.get(ir, ("float32[1d]",), Options())


def test_rejects_mismatched_types(cache: KernelCache) -> None:
    with pytest.raises(ValueError):
        cache.get(SAXPY, ("float32", "float32[1d]", "float32[1d]"), Options())
    with pytest.raises(ValueError):
        cache.get(SAXPY, ("float32[1d]", "float32[1d]", "float32[1d]", "float32[1d]"),
                  Options())
    with pytest.raises(ValueError):
        cache.get(ADD2D, ("float64[1d]", "float64[2d]", "float64[2d]"), Options())


# --------------------------------------------------------------------------- the matrix unit

MMA_MATMUL = ir_of("""
    def matmul(a, b, c, beta):
        i = group_id(1) * 32
        j = group_id(0) * 32
        mma(c, a, b, i, j, 0, min(32, c.shape[0] - i), min(32, c.shape[1] - j), a.shape[1],
            beta)
""", ndims={"a": 2, "b": 2, "c": 2})
#: One mma per block over the whole of k, with the row range a parameter (bounds tests).
TILE = ir_of("""
    def tile(a, b, c, row, tm, tk):
        mma(c, a, b, row, 0, 0, tm, c.shape[1], tk, 0.0)
""", ndims={"a": 2, "b": 2, "c": 2})


def _mm_types(dtype: str) -> tuple[str, ...]:
    return (f"{dtype}[2d]",) * 3 + (dtype,)


def _matmul(k: Any, a: np.ndarray, b: np.ndarray, c: np.ndarray, beta: float) -> None:
    grid = ((c.shape[1] + 31) // 32, (c.shape[0] + 31) // 32, 1)
    assert k.run(0, nblocks(grid), grid, (4, 2, 1), [a, b, c, c.dtype.type(beta)],
                 no_abort()) == nblocks(grid)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("blas", BLAS_PATHS)
def test_mma_matches_numpy(cache_root: Path, dtype: str, blas: str) -> None:
    """Every matrix-unit path (MKL, OpenBLAS, and the loops used without a BLAS) computes
    c = beta * c + a @ b over edge tiles; beta 0 ignores what c held (NaN included)."""
    kc = KernelCache(cache_root, blas=blas)
    dt = matrix.SLOT[dtype]
    uses = {"mkl": kc.blas[matrix.FORTRAN_AT + dt] != 0, "openblas": kc.blas[dt] != 0}
    assert [k for k, on in uses.items() if on] == {"mkl": ["mkl", "openblas"],
                                                   "openblas": ["openblas"], "loops": []}[blas]
    k = kc.get(MMA_MATMUL, _mm_types(dtype), Options())
    rng = np.random.default_rng(7)
    a, b = rng.random((70, 45)).astype(dtype), rng.random((45, 37)).astype(dtype)
    c = np.full((70, 37), np.nan, dtype)
    _matmul(k, a, b, c, 0.0)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(c, a @ b, rtol=tol)
    c0 = rng.random((70, 37)).astype(dtype)
    c = c0.copy()
    _matmul(k, a, b, c, 0.5)
    np.testing.assert_allclose(c, 0.5 * c0 + a @ b, rtol=tol)


def test_mma_bounds_miss_names_operand_and_corner_and_writes_nothing(
        cache: KernelCache) -> None:
    k = cache.get(TILE, ("float32[2d]",) * 3 + ("int64",) * 3, Options())
    a, b = np.ones((8, 4), np.float32), np.ones((4, 5), np.float32)
    c = np.full((8, 5), -1.0, np.float32)
    cases = [((6, 4, 4), "c", (9 * 5 + 4)),   # rows 6..9 of an 8-row c: the far corner
             ((-1, 2, 4), "c", -5),           # a negative row: the tile's start
             ((0, 8, 5), "a", 7 * 4 + 4),     # k = 5 > a's 4 columns
             ((0, 2, -1), "a", 0 * 4 + 0 - 0)]  # a negative extent: a's tile start
    for (row, tm, tk), param, index in cases:
        with pytest.raises(KernelFault) as ei:
            k.run(0, 1, (1, 1, 1), (1, 1, 1),
                  [a, b, c, np.int64(row), np.int64(tm), np.int64(tk)], no_abort())
        assert (ei.value.kind, ei.value.param, ei.value.index) == ("bounds", param, index)
        assert (c == -1.0).all()
    b_short = np.ones((3, 5), np.float32)  # k = 4 rows of b needed, 3 there
    with pytest.raises(KernelFault) as ei:
        k.run(0, 1, (1, 1, 1), (1, 1, 1),
              [a, b_short, c, np.int64(0), np.int64(2), np.int64(4)], no_abort())
    assert (ei.value.param, ei.value.index) == ("b", 3 * 5 + 4)
    assert (c == -1.0).all()


def test_mma_operands_that_alias_c_read_the_old_values(cache: KernelCache) -> None:
    """c and a are one array: one mma reads a's tile before writing c (as from a copy),
    where BLAS itself would read half-written data. (Across blocks, in place is a race,
    as on any device.)"""
    k = cache.get(TILE, ("float64[2d]",) * 3 + ("int64",) * 3, Options())
    rng = np.random.default_rng(3)
    x, b = rng.random((40, 40)), rng.random((40, 40))
    want = x @ b
    k.run(0, 1, (1, 1, 1), (1, 1, 1), [x, b, x, np.int64(0), np.int64(40), np.int64(40)],
          no_abort())
    np.testing.assert_allclose(x, want, rtol=1e-12)


def test_mma_sees_the_watchdog_between_chunks(cache_root: Path) -> None:
    k = KernelCache(cache_root, blas="loops").get(TILE, ("float64[2d]",) * 3
                                                    + ("int64",) * 3, Options())
    n = 2048  # ~8.6e9 multiply-adds as loops: seconds, unless stopped
    a, b, c = np.ones((n, n)), np.ones((n, n)), np.zeros((n, n))
    abort = no_abort()
    result: list[BaseException | int] = []

    def go() -> None:
        try:
            result.append(k.run(0, 1, (1, 1, 1), (1, 1, 1),
                                [a, b, c, np.int64(0), np.int64(n), np.int64(n)], abort))
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    time.sleep(0.1)
    assert not result, "finished before the abort: the test proves nothing"
    abort[0] = ABORT_WATCHDOG
    t.join(10)
    assert not t.is_alive(), "mma did not see the abort word"
    assert isinstance(result[0], KernelFault) and result[0].kind == "watchdog"


@pytest.mark.parametrize("src, types, why", [
    ("def k(a, b, c):\n    mma(c, a, b, 0, 0, 0, 1, 1, 1, 0.0)\n",
     ("int32[2d]",) * 3, "float32 or all float64"),
    ("def k(a, b, c):\n    mma(c, a, b, 0, 0, 0, 1, 1, 1, 0.0)\n",
     ("float32[2d]", "float64[2d]", "float32[2d]"), "float32 or all float64"),
    ("def k(a, b, c):\n    mma(c, a, b, 0, 0, 0, 1, 1, 1)\n", ("float32[2d]",) * 3,
     r"takes 10 to 12 argument\(s\), not 9"),
    ("def k(a, b, c):\n    if global_id(0) == 0:\n        mma(c, a, b, 0, 0, 0, 1, 1, 1, 0.0)\n",
     ("float32[2d]",) * 3, "under control flow that depends on the thread"),
    ("def k(a, b, c):\n    x = mma(c, a, b, 0, 0, 0, 1, 1, 1, 0.0)\n", ("float32[2d]",) * 3,
     "statement|assign"),
])
def test_mma_rejections(src: str, types: tuple[str, ...], why: str, cache: KernelCache) -> None:
    ir = ir_of(src, ndims={"a": 2, "b": 2, "c": 2})
    with pytest.raises(ValueError, match=why):
        cache.get(ir, types, Options())


def test_mma_needs_2d_buffers(cache: KernelCache) -> None:
    ir = ir_of("def k(a, b, c):\n    mma(c, a, b, 0, 0, 0, 1, 1, 1, 0.0)\n")  # 1-D
    with pytest.raises(ValueError, match="the kernel indexes it with 2"):
        cache.get(ir, ("float32[1d]",) * 3, Options())


#: The unit's transposed reads: a stored [k, m] (ta) and b stored [n, k] (tb), the flags and
#: k launch parameters, 32x32 tiles of c.
MMA_LAYOUTS = ir_of("""
    def matmul_t(a, b, c, beta, ta, tb, k):
        i = group_id(1) * 32
        j = group_id(0) * 32
        mma(c, a, b, i, j, 0, min(32, c.shape[0] - i), min(32, c.shape[1] - j), k, beta,
            ta, tb)
""", ndims={"a": 2, "b": 2, "c": 2})
#: One block's whole tile with a's layout flag only (11 arguments: tb defaults to 0).
TILE_TA = ir_of("""
    def tile_ta(a, b, c, row, tm, tk):
        mma(c, a, b, row, 0, 0, tm, c.shape[1], tk, 0.0, 1)
""", ndims={"a": 2, "b": 2, "c": 2})


def _layout_types(dtype: str) -> tuple[str, ...]:
    return (f"{dtype}[2d]",) * 3 + (dtype, "int64", "int64", "int64")


def _stored(x: np.ndarray, transposed: bool) -> np.ndarray:
    """``x`` as the unit's operand: itself, or its transpose's C-order storage."""
    return np.ascontiguousarray(x.T) if transposed else x


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("blas", BLAS_PATHS)
def test_mma_transposed_operands_match_numpy(cache_root: Path, dtype: str,
                                             blas: str) -> None:
    """Every layout (a and/or b stored transposed) over edge tiles, on both paths, equals
    numpy's product of the logical operands; beta scales c as without the flags."""
    k = KernelCache(cache_root, blas=blas).get(MMA_LAYOUTS, _layout_types(dtype),
                                                       Options())
    rng = np.random.default_rng(5)
    a, b, c0 = (rng.random(s).astype(dtype) for s in ((70, 45), (45, 37), (70, 37)))
    tol = 1e-5 if dtype == "float32" else 1e-12
    grid = (2, 3, 1)
    for ta in (0, 1):
        for tb in (0, 1):
            c = c0.copy()
            args = [_stored(a, bool(ta)), _stored(b, bool(tb)), c, c.dtype.type(0.5),
                    np.int64(ta), np.int64(tb), np.int64(45)]
            assert k.run(0, nblocks(grid), grid, (4, 2, 1), args, no_abort()) == nblocks(grid)
            np.testing.assert_allclose(c, 0.5 * c0 + a @ b, rtol=tol, err_msg=f"{ta=} {tb=}")


@pytest.mark.parametrize("blas", BLAS_PATHS)
def test_mma_transposed_tiles_larger_than_a_chunk(cache_root: Path, blas: str) -> None:
    """Transposed reads past the unit's row, column and k chunks (firmware/matrix.py): each
    chunk's offset into a stored-transposed operand is its own."""
    m, n, kk = matrix.ROW_CHUNK + 44, matrix.COL_CHUNK + 76, matrix.K_CHUNK + 88
    k = KernelCache(cache_root, blas=blas).get(MMA_LAYOUTS, _layout_types("float64"),
                                                       Options())
    rng = np.random.default_rng(13)
    a, b = rng.random((m, kk)), rng.random((kk, n))
    c = np.full((m, n), np.nan)
    grid = ((n + 31) // 32, (m + 31) // 32, 1)
    k.run(0, nblocks(grid), grid, (1, 1, 1), [a.T.copy(), b.T.copy(), c, np.float64(0.0),
                                               np.int64(1), np.int64(1), np.int64(kk)],
          no_abort())
    np.testing.assert_allclose(c, a @ b, rtol=1e-10)
    whole = KernelCache(cache_root, blas=blas).get(TILE_TA, ("float64[2d]",) * 3
                                                           + ("int64",) * 3, Options())
    c = np.full((m, n), np.nan)  # one tile over every chunk, a transposed and b not
    whole.run(0, 1, (1, 1, 1), (1, 1, 1), [a.T.copy(), b, c, np.int64(0), np.int64(m),
                                           np.int64(kk)], no_abort())
    np.testing.assert_allclose(c, a @ b, rtol=1e-10)


def test_mma_transposed_bounds_miss_is_in_the_operands_own_storage(cache: KernelCache) -> None:
    """A transposed operand's tile is checked where it is read: a's [k0, k0+tk) rows and
    [row, row+tm) columns. The fault names the operand and the flat index of the corner
    that misses in a's own [k, m] storage, and c is untouched -- as for plain tiles."""
    k = cache.get(TILE_TA, ("float32[2d]",) * 3 + ("int64",) * 3, Options())
    a_t, b = np.ones((4, 8), np.float32), np.ones((4, 5), np.float32)  # a is [k=4, m=8]
    c = np.full((8, 5), -1.0, np.float32)
    cases = [((0, 8, 5), "a", 4 * 8 + 7),     # k = 5 > a's 4 rows: the far corner (4, 7)
             ((6, 4, 4), "c", 9 * 5 + 4),     # rows 6..9 of c (checked first)
             ((-1, 2, 4), "c", -5),           # a negative row: c's tile start
             ((0, 2, -1), "a", 0)]            # a negative extent: a's tile start (0, 0)
    for (row, tm, tk), param, index in cases:
        with pytest.raises(KernelFault) as ei:
            k.run(0, 1, (1, 1, 1), (1, 1, 1),
                  [a_t, b, c, np.int64(row), np.int64(tm), np.int64(tk)], no_abort())
        assert (ei.value.kind, ei.value.param, ei.value.index) == ("bounds", param, index)
        assert (c == -1.0).all()
    a_narrow = np.ones((4, 6), np.float32)  # m = 8 columns of stored a needed, 6 there
    with pytest.raises(KernelFault) as ei:
        k.run(0, 1, (1, 1, 1), (1, 1, 1),
              [a_narrow, b, c, np.int64(0), np.int64(8), np.int64(4)], no_abort())
    assert (ei.value.param, ei.value.index) == ("a", 3 * 6 + 7)
    assert (c == -1.0).all()
    k_b = cache.get(MMA_LAYOUTS, _layout_types("float32"), Options())
    b_t = np.ones((5, 3), np.float32)  # b stored [n=5, k]: k = 4 columns needed, 3 there
    with pytest.raises(KernelFault) as ei:
        k_b.run(0, 1, (1, 1, 1), (1, 1, 1), [np.ones((8, 4), np.float32), b_t, c,
                                             np.float32(0), np.int64(0), np.int64(1),
                                             np.int64(4)], no_abort())
    assert (ei.value.kind, ei.value.param, ei.value.index) == ("bounds", "b", 4 * 3 + 3)
    assert (c == -1.0).all()


def test_mma_transposed_operand_that_aliases_c_reads_the_old_values(
        cache: KernelCache) -> None:
    """c and a stored transposed are one array: c = x.T @ b reads x's tile before writing."""
    k = cache.get(TILE_TA, ("float64[2d]",) * 3 + ("int64",) * 3, Options())
    rng = np.random.default_rng(4)
    x, b = rng.random((40, 40)), rng.random((40, 40))
    want = x.T @ b
    k.run(0, 1, (1, 1, 1), (1, 1, 1), [x, b, x, np.int64(0), np.int64(40), np.int64(40)],
          no_abort())
    np.testing.assert_allclose(x, want, rtol=1e-12)


UNIFORM_LOCALS = ir_of("""
    def k(x, n):
        s = shared_array(64, "float32")
        steps = n // 2
        t = 0
        while t < steps:
            s[local_id(0)] = x[local_id(0)]
            barrier()
            x[local_id(0)] = s[63 - local_id(0)] + 1.0
            barrier()
            t += 1
        for r in range(steps + 1):
            barrier()
            x[local_id(0)] += 100.0
""")


def test_barrier_loops_bounded_by_uniform_locals(cache: KernelCache) -> None:
    """Locals computed from uniform values may steer barrier loops (the front end's rule):
    block-level code reads them as thread 0's values."""
    k = cache.get(UNIFORM_LOCALS, ("float32[1d]", "int64"), Options())
    for n in (0, 2, 4):  # 0, 1 and 2 reversals, then n // 2 + 1 additions of 100
        x = np.arange(64, dtype=np.float32)
        want = x.copy()
        for _ in range(n // 2):
            want = want[::-1] + 1.0
        want += 100.0 * (n // 2 + 1)
        assert k.run(0, 1, (1, 1, 1), (64, 1, 1), [x, np.int64(n)], no_abort()) == 1
        np.testing.assert_array_equal(x, want)


SCALE_ONLY = ir_of("""
    def scale_only(a, b, c, beta):
        mma(c, a, b, 0, 0, 0, c.shape[0], c.shape[1], 0, beta)
""", ndims={"a": 2, "b": 2, "c": 2})


@pytest.mark.parametrize("blas", BLAS_PATHS)
def test_mma_with_empty_k_only_scales_c(cache_root: Path, blas: str) -> None:
    k = KernelCache(cache_root, blas=blas).get(SCALE_ONLY, _mm_types("float64"),
                                                       Options())
    a, b = np.ones((3, 4)), np.ones((4, 5))
    c = np.arange(15.0).reshape(3, 5)
    k.run(0, 1, (1, 1, 1), (1, 1, 1), [a, b, c, np.float64(0.5)], no_abort())
    np.testing.assert_array_equal(c, np.arange(15.0).reshape(3, 5) * 0.5)


# --------------------------------------------------------------------------- dynamic shared

DYN_REVERSE = ir_of("""
    def rev(x):
        t = dynamic_shared("float32")
        bits = dynamic_shared("int32")
        i = local_id(0)
        t[i] = x[group_id(0) * local_size(0) + i]
        barrier()
        x[group_id(0) * local_size(0) + i] = t[local_size(0) - 1 - i]
        barrier()
        if i == 0:
            t[0] = 1.0
            x[group_id(0) * local_size(0)] = float(bits[0])
""")


def test_dynamic_shared_memory_is_sized_by_the_launch_and_aliases(cache: KernelCache) -> None:
    k = cache.get(DYN_REVERSE, ("float32[1d]",), Options())
    x = np.arange(128, dtype=np.float32)
    assert k.run(0, 2, (2, 1, 1), (64, 1, 1), [x], no_abort(), dynamic_shared=64 * 4) == 2
    want = np.concatenate([np.arange(63, -1, -1), np.arange(127, 63, -1)]).astype(np.float32)
    want[[0, 64]] = float(np.float32(1.0).view(np.int32))  # int32 view of the same bytes
    np.testing.assert_array_equal(x, want)


def test_dynamic_shared_memory_too_small_for_the_block_faults(cache: KernelCache) -> None:
    k = cache.get(DYN_REVERSE, ("float32[1d]",), Options())
    x = np.arange(64, dtype=np.float32)
    with pytest.raises(KernelFault) as ei:
        k.run(0, 1, (1, 1, 1), (64, 1, 1), [x], no_abort(), dynamic_shared=40 * 4)
    assert (ei.value.kind, ei.value.param, ei.value.index) == ("bounds", "t", 40)
    with pytest.raises(ValueError, match="negative"):
        k.run(0, 1, (1, 1, 1), (64, 1, 1), [x], no_abort(), dynamic_shared=-4)


def test_ir_shared_mem_must_match_the_shared_arrays(cache: KernelCache) -> None:
    """The driver checks the IR's shared_mem against the device at load; the firmware checks
    that figure against the source, so an IR cannot understate what a block allocates."""
    lying = {**BLOCK_SUM, "shared_mem": 0}
    with pytest.raises(ValueError, match="does not match"):
        cache.get(lying, ("float64[1d]", "float64[1d]"), Options())


@pytest.mark.parametrize("blas", BLAS_PATHS)
def test_mma_tile_larger_than_a_chunk_in_every_dimension(cache_root: Path,
                                                        blas: str) -> None:
    """Rows, columns and k each span several of the unit's chunks (firmware/matrix.py)."""
    m, n, kk = matrix.ROW_CHUNK + 44, matrix.COL_CHUNK * 2 + 76, matrix.K_CHUNK + 88
    k = KernelCache(cache_root, blas=blas).get(SCALE_ONLY_FULL, _mm_types("float64"),
                                                       Options())
    rng = np.random.default_rng(11)
    a, b, c0 = rng.random((m, kk)), rng.random((kk, n)), rng.random((m, n))
    c = c0.copy()
    k.run(0, 1, (1, 1, 1), (1, 1, 1), [a, b, c, np.float64(0.25)], no_abort())
    np.testing.assert_allclose(c, 0.25 * c0 + a @ b, rtol=1e-10)


SCALE_ONLY_FULL = ir_of("""
    def whole(a, b, c, beta):
        mma(c, a, b, 0, 0, 0, c.shape[0], c.shape[1], a.shape[1], beta)
""", ndims={"a": 2, "b": 2, "c": 2})


# --------------------------------------------------------------------------- inline work

STRAIGHT = ir_of("def straight(x):\n    i = global_id(0)\n"
                 + "".join(f"    x[i] = x[i] * 0.5 + {j}.0\n" for j in range(30)))


@pytest.mark.parametrize("ir, types, bounded", [
    (SAXPY, SAXPY_T, True),
    (COPY, ("float32[1d]", "float32[1d]"), True),
    (MATMUL, ("float32[2d]", "float32[2d]", "float32[2d]", "int64"), False),  # for loops
    (SPIN, ("float64[1d]",), False),                                         # while loop
    (UNIFORM_LOCALS, ("float32[1d]", "int64"), False),                       # barrier loops
    (TILE, ("float32[2d]",) * 3 + ("int64",) * 3, False),                    # mma
    (STRAIGHT, ("float64[1d]",), False),                     # no loop, but ~450 nodes
])
def test_bounded_work_says_which_kernels_may_run_inline(ir: dict[str, Any],
                                                        types: tuple[str, ...],
                                                        bounded: bool) -> None:
    """Loop-free, mma-free bodies of at most INLINE_MAX_NODES nodes: their work per thread
    is bounded whatever the arguments, so the scheduler may run them on its control
    thread."""
    work = kernel_check.bounded_work(jit.validate(ir, types))
    assert (work is not None) is bounded
    if work is not None:
        assert 0 < work <= kernel_check.INLINE_MAX_NODES


def test_compiled_kernels_carry_inline_ok(cache: KernelCache) -> None:
    k = cache.get(SAXPY, SAXPY_T, Options())
    assert k.inline_ok is True
    assert k.work_per_thread == kernel_check.bounded_work(jit.validate(SAXPY, SAXPY_T))
    k = cache.get(SPIN, ("float64[1d]",), Options())
    assert (k.inline_ok, k.work_per_thread) == (False, None)
    k = cache.get(TILE, ("float32[2d]",) * 3 + ("int64",) * 3, Options())
    assert (k.inline_ok, k.work_per_thread, k.uses_mma) == (False, None, True)


# --------------------------------------------------------------------------- cache locking


def test_cached_never_waits_for_a_compile(cache: KernelCache) -> None:
    """The scheduler's lookup takes only the table lock: a compile in progress (the build
    lock held, as for seconds by numba) does not delay it."""
    k = cache.get(SAXPY, SAXPY_T, Options())
    held, release = threading.Event(), threading.Event()

    def compiling() -> None:
        with cache._build_lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=compiling)
    t.start()
    try:
        assert held.wait(10)
        assert cache.cached(SAXPY, SAXPY_T, Options()) is k
        assert cache.get(SAXPY, SAXPY_T, Options()) is k  # an in-memory hit: no build lock
        # both answered while the build lock is still held (it is let go only below): a
        # lookup that waited for it would have returned only once the holder gave up
        assert t.is_alive() and not release.is_set()
    finally:
        release.set()
        t.join()


def test_one_compile_for_two_threads_while_cached_stays_prompt(cache: KernelCache) -> None:
    k = cache.get(SAXPY, SAXPY_T, Options())
    fresh = ir_of("""
        def fresh(x, out):
            i = global_id(0)
            if i < out.size:
                out[i] = x[i] * 3.0 - 1.0
    """)
    misses, compiles = cache.misses, cache.compiles
    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(
        cache.get(fresh, ("float64[1d]", "float64[1d]"), Options()))) for _ in range(2)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    slowest = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.perf_counter()
        assert cache.cached(SAXPY, SAXPY_T, Options()) is k
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.005)
    for t in threads:
        t.join()
    compiling = time.perf_counter() - began
    assert len(got) == 2 and got[0] is got[1]
    assert (cache.misses, cache.compiles) == (misses + 1, compiles + 1)
    # A cached() that waited behind the compile would wait about as long as the compile
    # (seconds); one that does not still waits for the GIL, which two compiling threads
    # hold by turns (5 ms a switch; tens of them on a loaded machine). So the bound is
    # relative: a fixed 0.1 s failed under load.
    assert slowest < max(0.1, compiling / 4), \
        f"cached() waited {slowest:.3f} s of a {compiling:.3f} s compile"


# --------------------------------------------------------------------------- fault records


def test_fault_address_fits_a_u64_field() -> None:
    """KernelFault.index is exact (a Python int) or clamped to int64; the device address
    va + index * itemsize is clamped to 64 bits by address() (x[1 << 62] of float64 at a
    high va would otherwise not fit a fault record)."""
    va = 0x7F00_0000_0000
    assert KernelFault("bounds", "x", 1 << 62).address(va, 8) == (1 << 64) - 1
    assert KernelFault("bounds", "x", -(1 << 63)).address(va, 8) == 0
    assert KernelFault("bounds", "x", -2).address(va, 4) == va - 8
    assert KernelFault("watchdog").address(va, 4) == va


def test_the_disk_cache_keeps_its_bound_least_recently_used_out(tmp_path: Path) -> None:
    """Every tenant's distinct kernels land in one cache: it keeps ``max_entries``, and a
    load from disk counts as a use (the entry a new process just loaded stays)."""
    types_ = ("float32[1d]", "float32[1d]")

    def kernel(i: int) -> dict[str, Any]:
        return ir_of(f"""
            def scale(x, out):
                j = global_id(0)
                out[j] = x[j] * {i}.0
        """)

    first = KernelCache(tmp_path, max_entries=2)
    keys = [first.key(kernel(i), types_, Options()) for i in range(3)]
    for i in range(2):
        first.get(kernel(i), types_, Options())
    assert sorted(e.name for e in first.entries()) == sorted(keys[:2])
    for e in first.entries():  # both entries last used long ago
        os.utime(e / "manifest.json", (1_000_000, 1_000_000))

    later = KernelCache(tmp_path, max_entries=2)  # another process: loads kernel 0 from disk
    later.get(kernel(0), types_, Options())
    assert (later.hits, later.misses) == (1, 0)
    later.get(kernel(2), types_, Options())  # a third: kernel 1, the least recently used, goes
    assert sorted(e.name for e in later.entries()) == sorted([keys[0], keys[2]])
    again = KernelCache(tmp_path, max_entries=2)
    again.get(kernel(1), types_, Options())
    assert (again.hits, again.misses) == (0, 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("library_case", ["shipped", "other_identity", "corrupt"])
def test_vendor_library(tmp_path: Path, library_case: str) -> None:
    """A kernel in the vendor library (jit.LIBRARY_DIR, ``make kernels``) is copied into
    the state cache and loaded, not compiled; one built for another identity (here
    another ISA stepping) is never found, and a corrupt one is refused and compiled."""
    ir, types = COPY, ("int16[1d]", "int16[1d]")
    library = tmp_path / "library"
    stepping = "B0" if library_case == "other_identity" else jit.DEFAULT_STEPPING
    built = KernelCache(library, stepping=stepping)
    built.get(ir, types, Options())
    if library_case == "corrupt":
        (entry,) = built.entries()
        (entry / f"kernel_{entry.name[:16]}.py").write_text("garbage = 1\n")
    state = KernelCache(tmp_path / "state", library=library)
    k = state.get(ir, types, Options())
    if library_case == "shipped":
        assert (state.library_hits, state.misses, state.compiles) == (1, 0, 0)
    else:
        assert (state.library_hits, state.misses, state.compiles) == (0, 1, 1)
    x = np.arange(64, dtype=np.int16)
    out = np.zeros(64, np.int16)
    k.run(0, 1, (1, 1, 1), (64, 1, 1), [x, out], no_abort())
    np.testing.assert_array_equal(out, x)
