"""A hostile IR corpus against the firmware's JIT (firmware/jit.py), at the unit level.

Module IR reaches the firmware from user space (docs/kernels.md): the firmware must treat
every field as adversarial. Each case here either fails cleanly at validate/compile time
with :class:`KernelCompileError`, or runs on small buffers carved out of a larger array
and stops with a :class:`KernelFault` whose index is a well-defined Python int -- and in
every case the bytes around the kernel's buffers (canaries) are unchanged, and an mma that
misses leaves ``c`` untouched. Nothing else may escape the JIT: no RecursionError,
MemoryError, OverflowError, TypeError, struct.error.

Numba compiles are slow on the 2-core test machines: the run-time cases are grouped into
a few kernels that take the hostile values as scalar arguments (one ``sel`` argument picks
the access), compiled once per module by one KernelCache.
"""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from firmware import jit
from firmware.jit import INDEX_MAX, INDEX_MIN, KernelCache, KernelCompileError, KernelFault, Options
from firmware.kernel_check import MAX_NODES, MAX_SOURCE_CHARS, SHARED_LIMIT
from firmware.lower import MAX_BLOCK_THREADS, MAX_DIM
from test_jit_unit import BLAS_PATHS, ir_of

I64_MAX = (1 << 63) - 1
I64_MIN = -(1 << 63)
U64_MAX = (1 << 64) - 1
CANARY = 12345.0
GUARD = 64  # canary elements on each side of a buffer


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="module")
def cache(cache_root: Path) -> KernelCache:
    return KernelCache(cache_root)


class Guarded:
    """Buffers carved out of one larger array, each between GUARD canary elements."""

    def __init__(self, *shapes: tuple[int, ...]) -> None:
        sizes = [int(np.prod(s)) for s in shapes]
        self.backing = np.full(sum(sizes) + GUARD * (len(shapes) + 1), CANARY)
        self.arrays: list[np.ndarray] = []
        self.guards: list[slice] = [slice(0, GUARD)]
        at = GUARD
        for shape, size in zip(shapes, sizes):
            a = self.backing[at:at + size].reshape(shape)
            assert a.flags.c_contiguous and a.base is not None
            a[...] = 0.0
            self.arrays.append(a)
            at += size
            self.guards.append(slice(at, at + GUARD))
            at += GUARD

    def intact(self) -> bool:
        return all((self.backing[g] == CANARY).all() for g in self.guards)


def no_abort() -> np.ndarray:
    return np.zeros(1, np.int64)


def well_defined(f: KernelFault) -> None:
    assert type(f.index) is int and INDEX_MIN <= f.index <= INDEX_MAX
    assert isinstance(f.saturated, bool)
    assert 0 <= f.address(1 << 40, 8) < 1 << 64 and 0 <= f.address(0, 8) < 1 << 64


def run_fault(k: Any, args: list[Any], block: tuple[int, int, int] = (1, 1, 1),
              dynamic_shared: int = 0) -> KernelFault:
    with pytest.raises(KernelFault) as ei:
        k.run(0, 1, (1, 1, 1), block, args, no_abort(), dynamic_shared)
    well_defined(ei.value)
    return ei.value


# --------------------------------------------------------------------------- 1-D accesses

IDX = ir_of("""
    def idx(x, out, i, u, f, sel):
        if sel == 0:
            out[0] = x[i]
        elif sel == 1:
            out[i] = 1.0
        elif sel == 2:
            out[0] = x[u]
        elif sel == 3:
            out[u] = 1.0
        elif sel == 4:
            out[0] = x[i] if f > 0.0 else 0.0
        elif sel == 5:
            atomic_add(out, i, 1.0)
        elif sel == 6:
            out[int(f)] = 1.0
        elif sel == 7:
            out[1 << i] = 1.0
        elif sel == 8:
            out[2 ** i] = 1.0
        elif sel == 9:
            for t in range(0, 4, i):
                out[t] = 1.0
        elif sel == 10:
            out[global_id(0) + i] = 1.0
        elif sel == 11:
            out[floor(f)] = 1.0
""")
IDX_T = ("float64[1d]", "float64[1d]", "int64", "uint64", "float64", "int64")


def idx_args(g: Guarded, sel: int, i: int = 0, u: int = 0, f: float = 0.0) -> list[Any]:
    x, out = g.arrays
    return [x, out, np.int64(i), np.uint64(u), np.float64(f), np.int64(sel)]


@pytest.fixture(scope="module")
def idx(cache: KernelCache) -> Any:
    return cache.get(IDX, IDX_T, Options())


# (sel, i, u, f) -> (param, index, saturated): every miss, with the index it must report
IDX_MISSES = [
    ((0, 1 << 62, 0, 0.0), ("x", 1 << 62, False)),
    ((0, -1, 0, 0.0), ("x", -1, False)),
    ((0, I64_MAX, 0, 0.0), ("x", I64_MAX, True)),
    ((0, I64_MIN, 0, 0.0), ("x", I64_MIN, False)),
    ((0, 8, 0, 0.0), ("x", 8, False)),
    ((1, 1 << 62, 0, 0.0), ("out", 1 << 62, False)),
    ((1, -1, 0, 0.0), ("out", -1, False)),
    ((1, I64_MIN, 0, 0.0), ("out", I64_MIN, False)),
    ((2, 0, U64_MAX, 0.0), ("x", I64_MAX, True)),       # a uint64 saturates: never wraps to -1
    ((2, 0, 1 << 63, 0.0), ("x", I64_MAX, True)),
    ((2, 0, 8, 0.0), ("x", 8, False)),
    ((3, 0, U64_MAX, 0.0), ("out", I64_MAX, True)),
    ((4, I64_MAX, 0, 1.0), ("x", I64_MAX, True)),       # a load under a conditional
    ((4, -1, 0, 1.0), ("x", -1, False)),
    ((5, 1 << 62, 0, 0.0), ("out", 1 << 62, False)),    # atomic_add
    ((5, -8, 0, 0.0), ("out", -8, False)),
    ((6, 0, 0, float("inf")), ("out", I64_MAX, True)),  # int() of a float saturates
    ((6, 0, 0, float("-inf")), ("out", I64_MIN, False)),
    ((6, 0, 0, 1e300), ("out", I64_MAX, True)),
    ((6, 0, 0, -1.5), ("out", -1, False)),
    ((7, 3, 0, 0.0), ("out", 8, False)),
    ((7, 62, 0, 0.0), ("out", 1 << 62, False)),
    ((8, 63, 0, 0.0), ("out", I64_MIN, False)),         # 2 ** 63 wraps in int64, defined
    ((8, 62, 0, 0.0), ("out", 1 << 62, False)),
    ((10, 1 << 62, 0, 0.0), ("out", 1 << 62, False)),   # an affine index, hostile offset
    ((10, I64_MAX, 0, 0.0), ("out", I64_MAX, True)),
    ((10, -1, 0, 0.0), ("out", -1, False)),
    ((11, 0, 0, -0.5), ("out", -1, False)),
    ((11, 0, 0, float("inf")), ("out", I64_MAX, True)),
]


@pytest.mark.parametrize("case, want", IDX_MISSES, ids=[f"sel{c[0]}-{c[1]}-{c[2]}-{c[3]}"
                                                        for c, _ in IDX_MISSES])
def test_hostile_1d_index_faults_with_a_defined_index(idx: Any, case: tuple[Any, ...],
                                                      want: tuple[str, int, bool]) -> None:
    g = Guarded((8,), (8,))
    x, out = g.arrays
    x[:] = np.arange(8.0)
    f = run_fault(idx, idx_args(g, *case))
    assert (f.kind, f.param, f.index, f.saturated) == ("bounds", *want)
    assert g.intact() and (out == 0).all() and (x == np.arange(8.0)).all()


@pytest.mark.parametrize("sel, i, f", [
    (6, 0, float("nan")),  # int(NaN) is 0
    (7, 64, 0.0),          # shift counts outside [0, 64) shift everything out
    (7, -1, 0.0),
    (7, 1 << 40, 0.0),
    (8, 1000, 0.0),        # 2 ** 1000 wraps to 0 (no math.pow, no inf-to-int)
    (8, -1, 0.0),          # a negative exponent of 2 is 0
    (8, 1 << 62, 0.0),
    (11, 0, float("nan")),
])
def test_operations_with_undefined_numba_results_are_defined(idx: Any, sel: int, i: int,
                                                             f: float) -> None:
    g = Guarded((8,), (8,))
    assert idx.run(0, 1, (1, 1, 1), (1, 1, 1), idx_args(g, sel, i=i, f=f), no_abort()) == 1
    out = g.arrays[1]
    assert out[0] == 1.0 and (out[1:] == 0).all() and g.intact()


def test_range_step_of_zero_is_a_fault_not_an_exception(idx: Any) -> None:
    g = Guarded((8,), (8,))
    with pytest.raises(KernelFault) as ei:
        idx.run(0, 1, (1, 1, 1), (1, 1, 1), idx_args(g, 9, i=0), no_abort())
    assert ei.value.kind == "error" and ei.value.index is None
    assert g.intact() and (g.arrays[1] == 0).all()


def test_affine_offset_in_range_still_takes_the_fast_path(idx: Any) -> None:
    g = Guarded((8,), (8,))
    assert idx.run(0, 1, (1, 1, 1), (4, 1, 1), idx_args(g, 10, i=3), no_abort()) == 1
    np.testing.assert_array_equal(g.arrays[1], [0, 0, 0, 1, 1, 1, 1, 0])
    assert g.intact()


# --------------------------------------------------------------------------- 2-D accesses

IDX2 = ir_of("""
    def idx2(x, out, i, j, sel):
        if sel == 0:
            out[0, 0] = x[i, j]
        elif sel == 1:
            out[i, j] = 1.0
        elif sel == 2:
            atomic_add(out, (i, j), 1.0)
        elif sel == 3:
            out[0, 0] = x[i, j] if i != 7 else 0.0
""", {"x": 2, "out": 2})
IDX2_T = ("float64[2d]", "float64[2d]", "int64", "int64", "int64")


@pytest.mark.parametrize("sel", [0, 1, 2, 3])
@pytest.mark.parametrize("i, j, want", [
    (1 << 62, 1 << 62, (INDEX_MAX, True)),        # the flat product overflows int64: clamped
    (-(1 << 62), -(1 << 62), (INDEX_MIN, True)),
    (I64_MAX, I64_MAX, (INDEX_MAX, True)),
    (I64_MIN, 0, (INDEX_MIN, True)),
    (0, 5, (5, False)),
    (3, 0, (15, False)),
    (1, -1, (4, False)),                          # row-major: the element it would touch
    (-1, 0, (-5, False)),
])
def test_hostile_2d_index_faults_with_an_exact_or_clamped_flat_index(
        cache: KernelCache, sel: int, i: int, j: int, want: tuple[int, bool]) -> None:
    k = cache.get(IDX2, IDX2_T, Options())
    g = Guarded((3, 5), (3, 5))
    f = run_fault(k, [*g.arrays, np.int64(i), np.int64(j), np.int64(sel)])
    assert (f.param, f.index, f.saturated) == ("out" if sel in (1, 2) else "x", *want)
    assert g.intact() and (g.arrays[1] == 0).all()


# --------------------------------------------------------------------------- mma

TILE = ir_of("""
    def tile(a, b, c, row, col, k0, tm, tn, tk, beta):
        mma(c, a, b, row, col, k0, tm, tn, tk, beta)
""", {"a": 2, "b": 2, "c": 2})


def tile_types(int_type: str) -> tuple[str, ...]:
    return ("float64[2d]",) * 3 + (int_type,) * 6 + ("float64",)


@pytest.fixture(scope="module", params=BLAS_PATHS)
def tiles(request: pytest.FixtureRequest, cache_root: Path) -> dict[str, Any]:
    """The tile kernel with int64 and with uint64 arguments, and with both operands stored
    transposed ("transposed", int64), on each matrix-unit path (a KernelCache after the
    first loads the first one's machine code: the BLAS pointers are arguments, not code)."""
    kc = KernelCache(cache_root, blas=request.param)
    return {**{t: kc.get(TILE, tile_types(t), Options()) for t in ("int64", "uint64")},
            "transposed": kc.get(TILE_T, tile_types("int64"), Options())}


def mma_operands() -> tuple[Guarded, np.ndarray]:
    g = Guarded((4, 3), (3, 5), (4, 5))
    a, b, c = g.arrays
    rng = np.random.default_rng(5)
    a[...], b[...], c[...] = rng.random((4, 3)), rng.random((3, 5)), rng.random((4, 5))
    return g, c.copy()


# (row, col, k0, tm, tn, tk) -> (operand, index, saturated); a is 4x3, b 3x5, c 4x5
MMA_MISSES = [
    ((I64_MAX, 0, 0, 1, 5, 3), ("c", INDEX_MAX, True)),       # an origin near 2**63
    ((1, 0, 0, I64_MAX, 5, 3), ("c", INDEX_MAX, True)),       # r0 + nr wraps in int64
    ((2, 0, 0, I64_MAX - 1, 5, 3), ("c", INDEX_MAX, True)),
    ((0, 1 << 62, 0, 1, 1 << 62, 3), ("c", INDEX_MAX, True)),  # c0 + nc == 2**63
    ((0, 0, 0, 1 << 62, 1 << 62, 3), ("c", INDEX_MAX, True)),
    ((0, 0, I64_MAX - 1, 4, 5, 5), ("a", INDEX_MAX, True)),   # k0 near 2**63
    ((0, 0, 1, 4, 5, I64_MAX), ("a", INDEX_MAX, True)),
    ((-1, 0, 0, 2, 5, 3), ("c", -5, False)),                  # negative: the start corner
    ((0, 0, 0, I64_MIN, 5, 3), ("c", 0, False)),
    ((I64_MIN, I64_MIN, 0, 1, 1, 1), ("c", INDEX_MIN, True)),
    ((0, 0, 0, 4, 5, 4), ("a", 3 * 3 + 3, False)),            # k = 4 > a's 3 columns
    ((0, 0, 1, 4, 5, 3), ("a", 3 * 3 + 3, False)),
    ((0, 0, -(1 << 62), 4, 5, 3), ("a", -(1 << 62), False)),
]


@pytest.mark.parametrize("args, want", MMA_MISSES, ids=[str(a) for a, _ in MMA_MISSES])
def test_mma_tile_wrap_around_is_a_miss_and_c_is_untouched(
        tiles: dict[str, Any], args: tuple[int, ...], want: tuple[str, int, bool]) -> None:
    g, c0 = mma_operands()
    f = run_fault(tiles["int64"], [*g.arrays, *map(np.int64, args), np.float64(1.0)])
    assert (f.kind, f.param, f.index, f.saturated) == ("bounds", *want)
    assert g.intact()
    np.testing.assert_array_equal(g.arrays[2], c0)


@pytest.mark.parametrize("args, want", [
    ((U64_MAX, 0, 0, 1, 5, 3), ("c", INDEX_MAX, True)),       # saturated to 2**63 - 1
    ((0, 0, 0, U64_MAX, 5, 3), ("c", INDEX_MAX, True)),
    ((0, 1 << 63, 0, 1, 1, 3), ("c", INDEX_MAX, True)),
    ((0, 0, U64_MAX, 4, 5, 1), ("a", INDEX_MAX, True)),
    ((0, 0, 0, 4, 5, U64_MAX), ("a", INDEX_MAX, True)),
    ((0, 0, 0, 4, U64_MAX, 3), ("c", INDEX_MAX, True)),
])
def test_mma_uint64_arguments_saturate_and_miss(tiles: dict[str, Any], args: tuple[int, ...],
                                                want: tuple[str, int, bool]) -> None:
    g, c0 = mma_operands()
    f = run_fault(tiles["uint64"], [*g.arrays, *map(np.uint64, args), np.float64(1.0)])
    assert (f.param, f.index, f.saturated) == want
    assert g.intact()
    np.testing.assert_array_equal(g.arrays[2], c0)


@pytest.mark.parametrize("beta", [float("nan"), float("inf"), -float("inf"), 1e308])
def test_mma_with_non_finite_beta_touches_only_c(tiles: dict[str, Any], beta: float) -> None:
    g, c0 = mma_operands()
    a, b, c = g.arrays
    tiles["int64"].run(0, 1, (1, 1, 1), (1, 1, 1),
                       [a, b, c, *map(np.int64, (0, 0, 0, 4, 5, 3)), np.float64(beta)],
                       no_abort())
    with np.errstate(all="ignore"):
        want = beta * c0 + a @ b
    np.testing.assert_array_equal(np.isnan(c), np.isnan(want))
    assert g.intact()


def test_mma_over_an_operand_with_no_columns_only_scales_c(tiles: dict[str, Any]) -> None:
    """k = 0 with a of shape (4, 0): BLAS still needs lda >= 1, and must not read a."""
    g = Guarded((3, 5), (4, 5))
    b, c = g.arrays
    c[...] = np.arange(20.0).reshape(4, 5)
    a = np.zeros((4, 0))
    tiles["int64"].run(0, 1, (1, 1, 1), (1, 1, 1),
                       [a, b[:0], c, *map(np.int64, (0, 0, 0, 4, 5, 0)), np.float64(0.5)],
                       no_abort())
    np.testing.assert_array_equal(c, np.arange(20.0).reshape(4, 5) * 0.5)
    assert g.intact()


#: Both operands stored transposed (mma's layout flags): a is [k, m], b is [n, k].
TILE_T = ir_of("""
    def tile_t(a, b, c, row, col, k0, tm, tn, tk, beta):
        mma(c, a, b, row, col, k0, tm, tn, tk, beta, 1, 1)
""", {"a": 2, "b": 2, "c": 2})

# The misses of MMA_MISSES through transposed operands: c's, and the saturated ones, are
# the same; a's corners are indices of its [k=3, m=4] storage (rows k0.., columns row..).
MMA_MISSES_T = [(args, want) for args, want in MMA_MISSES if want[0] == "c" or want[2]] + [
    ((0, 0, 0, 4, 5, 4), ("a", 3 * 4 + 3, False)),            # k = 4 > stored a's 3 rows
    ((0, 0, 1, 4, 5, 3), ("a", 3 * 4 + 3, False)),
    ((0, 0, -(1 << 62), 4, 5, 3), ("a", INDEX_MIN, True)),    # row -(2**62) of 4 columns
    ((0, 0, 0, 4, 5, 2), None),                               # inside: no miss
]


@pytest.mark.parametrize("args, want", MMA_MISSES_T, ids=[str(a) for a, _ in MMA_MISSES_T])
def test_mma_transposed_tile_wrap_around_is_a_miss_and_c_is_untouched(
        tiles: dict[str, Any], args: tuple[int, ...],
        want: tuple[str, int, bool] | None) -> None:
    """Transposed reads are range-checked as plain ones are (int64 arithmetic that cannot
    wrap, the corner saturating), on both matrix-unit paths, the canaries around every
    operand intact."""
    k = tiles["transposed"]
    g = Guarded((3, 4), (5, 3), (4, 5))
    a_t, b_t, c = g.arrays
    rng = np.random.default_rng(6)
    a_t[...], b_t[...], c[...] = rng.random((3, 4)), rng.random((5, 3)), rng.random((4, 5))
    c0 = c.copy()
    if want is None:
        k.run(0, 1, (1, 1, 1), (1, 1, 1), [*g.arrays, *map(np.int64, args), np.float64(1.0)],
              no_abort())
        np.testing.assert_allclose(c, c0 + a_t[:2].T @ b_t[:, :2].T, rtol=1e-12)
    else:
        f = run_fault(k, [*g.arrays, *map(np.int64, args), np.float64(1.0)])
        assert (f.kind, f.param, f.index, f.saturated) == ("bounds", *want)
        np.testing.assert_array_equal(c, c0)
    assert g.intact()


def test_mma_with_a_float_tile_argument_does_not_compile(cache: KernelCache) -> None:
    """A NaN row would pass any float comparison and become a wild BLAS offset."""
    with pytest.raises(KernelCompileError, match="_rt_index"):
        cache.get(TILE, ("float64[2d]",) * 3 + ("float64",) + ("int64",) * 5 + ("float64",),
                  Options())


# --------------------------------------------------------------------------- shared memory

SHARED = ir_of("""
    def sh(x, i, n):
        s = shared_array(8, "float64")
        d = dynamic_shared("float64")
        if n < 0:
            s[i] = 1.0
        else:
            d[n] = 2.0
        x[0] = s[0] + d[0]
""")


@pytest.mark.parametrize("i, n, want", [
    (8, -1, ("s", 8)), (-1, -1, ("s", -1)), (1 << 62, -1, ("s", 1 << 62)),
    (I64_MAX, -1, ("s", I64_MAX)),
    (0, 2, ("d", 2)), (0, 1 << 62, ("d", 1 << 62)), (0, I64_MAX, ("d", I64_MAX)),
])
def test_shared_and_dynamic_shared_indices(cache: KernelCache, i: int, n: int,
                                           want: tuple[str, int]) -> None:
    k = cache.get(SHARED, ("float64[1d]", "int64", "int64"), Options())
    g = Guarded((4,))
    f = run_fault(k, [g.arrays[0], np.int64(i), np.int64(n)], dynamic_shared=16)
    assert (f.param, f.index) == want
    assert g.intact() and (g.arrays[0] == 0).all()


def test_launch_limits_are_checked_before_compiled_code_runs(idx: Any) -> None:
    g = Guarded((8,), (8,))
    args = idx_args(g, 1)
    for grid, block in [((MAX_DIM + 1, 1, 1), (1, 1, 1)), ((1, 1, 1), (1, 1, MAX_DIM + 1)),
                        ((1, 1, 1), (MAX_BLOCK_THREADS, 2, 1)), ((1 << 62, 1, 1), (1, 1, 1))]:
        with pytest.raises(ValueError):
            idx.run(0, 1, grid, block, args, no_abort())
    with pytest.raises(ValueError):
        idx.run(0, 1, (1, 1, 1), (1, 1, 1), args, no_abort(), dynamic_shared=SHARED_LIMIT + 1)
    assert g.intact()


# --------------------------------------------------------------------------- rejected IR

X = {"name": "x", "kind": "buffer", "dtype": None, "ndim": 1}
N = {"name": "n", "kind": "scalar", "dtype": None}
GOOD = {"params": [X], "source": "def k(x):\n    x[0] = 1.0\n", "shared_mem": 0}


def with_field(**fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(GOOD), **fields}


def with_param(**fields: Any) -> dict[str, Any]:
    return with_field(params=[{**X, **fields}])


def src(body: str, params: list[dict[str, Any]] | None = None,
        shared_mem: Any = 0) -> dict[str, Any]:
    return {"params": params or [X], "source": "def k(x):\n" + body, "shared_mem": shared_mem}


REJECTED: dict[str, tuple[Any, tuple[Any, ...]]] = {
    # the IR's fields, each of the wrong type or out of range
    "ir-not-a-dict": (["def k(x): pass"], ("float64[1d]",)),
    "ir-none": (None, ("float64[1d]",)),
    "source-int": (with_field(source=42), ("float64[1d]",)),
    "source-list": (with_field(source=["def k(x):\n    pass\n"]), ("float64[1d]",)),
    "source-dict": (with_field(source={"a": 1}), ("float64[1d]",)),
    "source-missing": ({"params": [X], "shared_mem": 0}, ("float64[1d]",)),
    "params-dict": (with_field(params={"x": X}), ("float64[1d]",)),
    "params-str": (with_field(params="x"), ("float64[1d]",)),
    "params-none": (with_field(params=None), ("float64[1d]",)),
    "param-not-dict": (with_field(params=["x"]), ("float64[1d]",)),
    "param-list": (with_field(params=[["x", "buffer"]]), ("float64[1d]",)),
    "param-name-int": (with_param(name=7), ("float64[1d]",)),
    "param-name-dict": (with_param(name={"x": 1}), ("float64[1d]",)),
    "kind-list": (with_param(kind=["buffer"]), ("float64[1d]",)),
    "kind-dict": (with_param(kind={"buffer": 1}), ("float64[1d]",)),
    "kind-unknown": (with_param(kind="pointer"), ("float64[1d]",)),
    "dtype-dict": (with_param(dtype={"float64": 1}), ("float64[1d]",)),
    "dtype-list": (with_param(dtype=["float64"]), ("float64[1d]",)),
    "dtype-int": (with_param(dtype=9), ("float64[1d]",)),
    "dtype-other": (with_param(dtype="float32"), ("float64[1d]",)),
    "ndim-negative": (with_param(ndim=-1), ("float64[1d]",)),
    "ndim-huge": (with_param(ndim=1 << 70), ("float64[1d]",)),
    "ndim-bool": (with_param(ndim=True), ("float64[1d]",)),
    "ndim-float": (with_param(ndim=1.0), ("float64[1d]",)),
    "ndim-str": (with_param(ndim="1"), ("float64[1d]",)),
    "ndim-mismatch": (with_param(ndim=2), ("float64[1d]",)),
    "shared-float": (with_field(shared_mem=0.0), ("float64[1d]",)),
    "shared-bool": (with_field(shared_mem=False), ("float64[1d]",)),
    "shared-huge": (with_field(shared_mem=1 << 80), ("float64[1d]",)),
    "shared-negative": (with_field(shared_mem=-8), ("float64[1d]",)),
    "shared-str": (with_field(shared_mem="0"), ("float64[1d]",)),
    "shared-nan": (with_field(shared_mem=float("nan")), ("float64[1d]",)),
    "shared-claim": (with_field(shared_mem=1 << 62), ("float64[1d]",)),
    # argument types
    "types-short": (GOOD, ()),
    "types-none": (GOOD, (None,)),
    "types-dict": (GOOD, ({"x": 1},)),
    "types-rank": (GOOD, ("float64[9d]",)),
    "types-negative-rank": (GOOD, ("float64[-1d]",)),
    "types-huge-rank": (GOOD, ("float64[" + "1" * 5000 + "d]",)),
    "types-long": (GOOD, ("x" * 100_000,)),
    "types-scalar": (GOOD, ("float64",)),
    # shared_array shapes
    "shape-negative": (src('    s = shared_array(-1, "float32")\n'), ("float64[1d]",)),
    "shape-zero": (src('    s = shared_array(0, "float32")\n'), ("float64[1d]",)),
    "shape-bool": (src('    s = shared_array(True, "float32")\n'), ("float64[1d]",)),
    "shape-float": (src('    s = shared_array(8.0, "float32")\n'), ("float64[1d]",)),
    "shape-str": (src('    s = shared_array("8", "float32")\n'), ("float64[1d]",)),
    "shape-expr": (src('    s = shared_array(1 << 40, "float32")\n'), ("float64[1d]",)),
    "shape-huge": (src(f'    s = shared_array({1 << 62}, "float32")\n', shared_mem=1 << 64),
                   ("float64[1d]",)),
    "shape-huge-2d": (src(f'    s = shared_array(({1 << 40}, {1 << 40}), "float64")\n',
                          shared_mem=8 << 80), ("float64[1d]",)),
    "shape-mixed": (src('    s = shared_array((4, -4), "float32")\n'), ("float64[1d]",)),
    "shape-9d": (src('    s = shared_array((1, 1, 1, 1, 1, 1, 1, 1, 1), "uint8")\n',
                     shared_mem=1), ("float64[1d]",)),
    "shape-over-limit": (src(f'    s = shared_array({SHARED_LIMIT + 1}, "uint8")\n',
                             shared_mem=SHARED_LIMIT + 1), ("float64[1d]",)),
    "shape-understated": (src('    s = shared_array(1024, "float64")\n', shared_mem=8),
                          ("float64[1d]",)),
    "shared-dtype-dict": (src('    s = shared_array(8, {"a": 1})\n'), ("float64[1d]",)),
    # constants and sources
    "const-2**64": (src("    x[0] = 18446744073709551616\n"), ("float64[1d]",)),
    "const-digits": (src("    x[0] = " + "9" * 5000 + "\n"), ("float64[1d]",)),
    "nul-byte": (src("    x[0] = 1\x00\n"), ("float64[1d]",)),
    "parens-1000": (src("    x[0] = " + "(" * 1000 + "1" + ")" * 1000 + "\n"), ("float64[1d]",)),
    "unary-1000": (src("    x[0] = " + "-" * 1000 + "1\n"), ("float64[1d]",)),
    "unary-20000": (src("    x[0] = " + "-" * 20000 + "1\n"), ("float64[1d]",)),
    "not-1000": (src("    x[0] = " + "not " * 1000 + "1\n"), ("float64[1d]",)),
    "sum-500": (src("    x[0] = " + " + ".join(["x[0]"] * 500) + "\n"), ("float64[1d]",)),
    "ifs-150": (src("".join("    " * (d + 1) + "if x[0]:\n" for d in range(150))
                    + "    " * 151 + "pass\n"), ("float64[1d]",)),
    "loops-25": (src("".join("    " * (d + 1) + f"for i{d} in range(1):\n" for d in range(25))
                     + "    " * 26 + "x[0] = 1.0\n"), ("float64[1d]",)),
    "too-long": (src("    x[0] = 1.0\n" + "    pass\n" * (MAX_SOURCE_CHARS // 9)),
                 ("float64[1d]",)),
    "too-many-nodes": (src("    x[0] = 1.0\n" * (MAX_NODES // 6)), ("float64[1d]",)),
    "shape-of-a-load": (src("    x[0] = x[0].shape[0]\n"), ("float64[1d]",)),
    "shape-of-a-scalar": ({"params": [X, N], "shared_mem": 0,
                           "source": "def k(x, n):\n    x[0] = n.shape[0]\n"},
                          ("float64[1d]", "int64")),
    "float-index": (src("    x[0.5] = 1.0\n"), ("float64[1d]",)),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_hostile_ir_is_a_clean_compile_error(cache: KernelCache, name: str) -> None:
    ir, types = REJECTED[name]
    if name != "float-index":  # that one validates; numba's typing rejects it
        for check in (lambda: jit.validate(ir, types),
                      lambda: jit.lower(ir, types, Options()),
                      lambda: cache.key(ir, types, Options())):
            with pytest.raises(KernelCompileError):
                check()
    assert cache.cached(ir, types, Options()) is None
    with pytest.raises(KernelCompileError):
        cache.get(ir, types, Options())


#: a constant index whose byte range ends exactly at 2**63, for each element size: the
#: assertion build of LLVM that numba ships aborted the compiling process on these (the
#: module corpus found it: one tenant's kernel killed the firmware)
_BYTE_RANGE_AT_2_63 = [("uint8", (1 << 63) - 1), ("int16", (1 << 62) - 1),
                       ("float32", (1 << 61) - 1), ("float64", (1 << 60) - 1)]
_COMPILE_IN_A_CHILD = """
import sys
from pathlib import Path
import numpy as np
from firmware import jit
dtype, index, cache = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
src = (f"def k(x):\\n    x[{index}] = 1\\n    x[0] = x[{index}]\\n"
       f"    atomic_add(x, {index}, 1)\\n")
ir = {"params": [{"name": "x", "kind": "buffer", "dtype": None, "ndim": 1}],
      "source": src, "shared_mem": 0, "uses_atomics": True}
k = jit.KernelCache(cache).get(ir, (f"{dtype}[1d]",))
x = np.zeros(8, dtype)
try:
    k.run(0, 1, (1, 1, 1), (1, 1, 1), [x], np.zeros(1, np.int64))
except jit.KernelFault as f:
    print(f.kind, f.index, int(x.sum()))
"""


@pytest.mark.parametrize("dtype,index", _BYTE_RANGE_AT_2_63, ids=[d for d, _ in _BYTE_RANGE_AT_2_63])
def test_constant_index_ending_at_2_63_compiles_and_faults(dtype: str, index: int,
                                                           tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _COMPILE_IN_A_CHILD, dtype, str(index),
                          str(tmp_path)],
                         capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]  # an LLVM assertion aborts: -6
    assert out.stdout.split() == ["bounds", str(index), "0"]


def test_a_kernel_numba_refuses_keeps_nothing_of_its_callers(tmp_path) -> None:
    """numba keeps a failed typing's exception (its dispatcher's failed-compile cache), and
    an exception keeps the frames it passed through, each with its caller's: up to the
    engine job that asked for the kernel, whose launch holds the tenant's buffers. A
    pinned buffer's mapping, and its descriptor, then stayed in the firmware after its
    context was gone, until the cyclic garbage collector happened to run
    (docs/containment.md, finding 25). The caller's objects must go by reference counting
    alone."""
    ir, types = REJECTED["float-index"]
    cache = KernelCache(tmp_path)

    class Buffers:  # what the caller's frame holds: a launch's views, say
        pass

    def ask() -> weakref.ref:
        held = Buffers()
        try:
            cache.get(ir, types, Options())
        except KernelCompileError:
            pass
        else:
            raise AssertionError("float index compiled")
        return weakref.ref(held)

    gc.collect()
    gc.disable()
    try:
        gone = [ask()() is None for _ in range(2)]  # compiled, then numba's cached failure
    finally:
        gc.enable()
    assert gone == [True, True]
