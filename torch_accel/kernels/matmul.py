"""Matrix products on the device's matrix unit (``mma``, docs/kernels.md "The matrix
unit"): ``mm`` and ``bmm`` for float32 and float64. Each block hands one tile of ``out``
to the unit over the whole of ``k`` (the unit checks every tile against its buffer, so
edge tiles are just smaller tiles). ``_config`` cuts ``out`` into near-equal tiles of at
most 1024 x 512, the unit's own chunk: a 1024 mm is 2 blocks of one BLAS call each;
tiles of 256 x 512 (8 blocks of 2 calls) took 1.3-1.4x its BLAS time, each call packing
the right operand again for a quarter of the rows (docs/kernels.md, "The matrix unit").
The unit calls BLAS single-threaded, so a launch's blocks are the only way its product
uses more than one compute engine; a product is cut into tiles for every engine only when
each engine's share pays for its job (docs/torch.md, "Products on both engines": an
MLP's products do not). An operand stored transposed (a ``.t()`` view, as ``linear``'s
weight and every product of a backward pass) is read in place through mma's ``ta``/``tb``
flags, not copied first. Integer products are refused: the unit has no integer GEMM, and
an MLP needs none.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array
from torch_accel.kernels.elementwise import Binary, binary, fill
from torch_accel.kernels.layout import strided_copy

#: a tile's rows and columns at most: the matrix unit's own chunk (one BLAS call per 1024
#: of k, docs/kernels.md "The matrix unit"), so a tile is as few calls as the unit makes,
#: each over as many rows as it can have (BLAS packs the right operand once per call)
MAX_ROWS, MAX_COLS = 1024, 512
#: tiles' rows and columns are multiples of this (64 bytes of float32: a tile's first
#: column starts on a cache line of a row that does)
ALIGN = 16
#: a product is cut into tiles enough for every compute engine to have its share
#: (``_config``) when each share would be at least this many multiply-adds (~0.35 ms of
#: one core's sgemm here): a second engine's job costs CPU time of its own, and on a host
#: with no CPU to spare for it, cutting one 256 x 256 tile over k 1024 in two took 1.21x
#: the firmware CPU and was no faster (docs/torch.md, "Products on both engines")
SHARE_WORK = 1 << 24
#: ...which is a multiple of the engines' number, or at least this many tiles per engine
#: (then the last round of claims leaves an engine idle for at most a fifth of the time)
ROUNDS = 4
#: threads per block of an ``mm`` launch
THREADS = 128

# mma computes c = beta' * c + A @ B; out = beta * out + alpha * A @ B is that with
# beta' = beta / alpha, then the tile scaled by alpha (alpha 0: only c *= beta). ta/tb say
# an operand is stored transposed (a [k, m], b [n, k]): the unit reads it where it lies.
# has_bias first fills the block's tile with bias[n] broadcast over its rows (addmm's and
# linear's bias: one launch less than a broadcast copy into out before the product).
SOURCE = """def mm(c, a, b, beta, alpha, ta, tb, k, bias, has_bias, tile_m, tile_n):
    i = group_id(1) * tile_m
    j = group_id(0) * tile_n
    tm = min(tile_m, c.shape[0] - i)
    tn = min(tile_n, c.shape[1] - j)
    if has_bias != 0:
        for e in range(local_id(0), tm * tn, local_size(0)):
            c[i + e // tn, j + e % tn] = bias[j + e % tn]
        barrier()
    if alpha == 0.0:
        mma(c, a, b, i, j, 0, tm, tn, 0, beta, ta, tb)
    else:
        mma(c, a, b, i, j, 0, tm, tn, k, beta / alpha, ta, tb)
        barrier()
        if alpha != 1.0:
            for e in range(local_id(0), tm * tn, local_size(0)):
                c[i + e // tn, j + e % tn] = c[i + e // tn, j + e % tn] * alpha
"""


def _check(out: Array, a: Array, b: Array) -> None:
    shared.check_same(out, a, b)
    if out.dtype not in (np.float32, np.float64):
        raise TypeError(f"mm/bmm: float32 or float64 only (the matrix unit), got {out.dtype}")


_no_bias: dict[tuple[int, str], runtime.DeviceArray] = {}


def _unused_bias(device: int, dtype: np.dtype) -> runtime.DeviceArray:
    """A one-element ``bias`` for launches without one (never read), per device and dtype."""
    key = (device, dtype.str)
    if key not in _no_bias:
        _no_bias[key] = runtime.empty(1, dtype, device=device)
    return _no_bias[key]


def _mm(out: Array, a: Array, b: Array, beta: float, alpha: float, s: runtime.Stream,
        ta: bool, tb: bool, bias: Array | None = None, k: int | None = None) -> None:
    m, n = out.shape
    if k is None:
        k = a.shape[0] if ta else a.shape[1]
    # each operand's [rows, columns] as stored; its rows may be longer than the matrix's
    # (a leading dimension: the unit reads only the tiles' columns)
    want = {"a": (k, m) if ta else (m, k), "b": (n, k) if tb else (k, n)}
    for name, x in (("a", a), ("b", b)):
        if x.shape[0] != want[name][0] or x.shape[1] < want[name][1]:
            raise ValueError(f"mm shapes {a.shape}{'.T' * ta} @ {b.shape}{'.T' * tb} -> "
                             f"{out.shape} (k {k})")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != out.dtype):
        raise ValueError(f"mm bias {bias.dtype}{tuple(bias.shape)} for a {out.dtype} "
                         f"{tuple(out.shape)} product: one element per column, its dtype")
    if not (m and n):
        return
    if k == 0:  # an empty a or b is an empty allocation (va 0: the launch faults)
        if bias is not None:
            strided_copy(shared.flat(out), bias, (m, n), (0, 1), 0, (n, 1), 0, s)
        if beta == 0.0:
            fill(out, 0.0, s)
        else:
            binary(Binary.mul, out, out, beta, stream=s)
    else:
        config = _config(m, n, k, _engines(out.device))
        shared.module("matmul", SOURCE, out.device).mm[config.grid, config.threads](
            *_mm_args(out, a, b, beta, alpha, ta, tb, k, bias, config), stream=s)


class Config(NamedTuple):
    """An ``mm`` launch's shape: its grid, its block and the tile each block computes."""

    grid: tuple[int, int]
    threads: int
    tile_m: int
    tile_n: int


def _tile(extent: int, parts: int) -> int:
    """The tile length that cuts ``extent`` into at most ``parts`` near-equal pieces, a
    multiple of ``ALIGN`` unless it is all of ``extent``."""
    return min(extent, -(-(-(-extent // parts)) // ALIGN) * ALIGN)


def _config(m: int, n: int, k: int, engines: int) -> Config:
    """The tiles of an ``[m, n]`` product over ``k``: at most ``MAX_ROWS`` x ``MAX_COLS``
    each, near-equal rather than full tiles and a ragged edge (``256 x 784`` is tiles of
    400 and 384 columns, not 512 and 272 that leave an engine idle for half a tile). A
    product worth ``SHARE_WORK`` per engine has the longer tile side cut again until
    every engine gets an equal share of tiles (their count a multiple of ``engines``, or
    ``ROUNDS`` per engine) or no side can be cut: the blocks of a launch are its
    engines' only parallelism (the unit calls BLAS single-threaded)."""
    gm, gn = -(-m // MAX_ROWS), -(-n // MAX_COLS)
    tm, tn = _tile(m, gm), _tile(n, gn)
    if m * n * k >= SHARE_WORK * engines:
        while (tiles := -(-m // tm) * -(-n // tn)) % engines and tiles < ROUNDS * engines:
            if tm >= tn and tm > ALIGN:
                gm += 1
                tm = _tile(m, gm)
            elif tn > ALIGN:
                gn += 1
                tn = _tile(n, gn)
            else:
                break
    return Config((-(-n // tn), -(-m // tm)), THREADS, tm, tn)


def _engines(device: int) -> int:
    """The device's compute engines (its properties: a partition may have fewer), asked
    once per device."""
    return runtime.devices.get(device).part(
        ("torch_accel", "compute_engines"),
        lambda: runtime.get_device_properties(device).compute_engines)


def _mm_args(out: Array, a: Array, b: Array, beta: float, alpha: float, ta: bool, tb: bool,
             k: int, bias: Array | None, config: Config) -> list[object]:
    """The ``mm`` kernel's arguments, in SOURCE's order."""
    return [out, a, b, np.float64(beta), np.float64(alpha), np.int64(ta), np.int64(tb),
            np.int64(k), _unused_bias(out.device, out.dtype) if bias is None else bias,
            np.int64(bias is not None), np.int64(config.tile_m), np.int64(config.tile_n)]


def mm_plan(out: Array, a: Array, b: Array, beta: float, alpha: float, ta: bool, tb: bool,
            bias: Array | None = None) -> runtime.LaunchPlan:
    """The launch :func:`mm` makes for these operands (non-empty, as stored, ``bias`` a
    row or None), checked once to run again on other buffers of the same shapes
    (``runtime.LaunchPlan``: torch_accel's eager products and a compiled graph's launch
    a product so, at a tenth of the host time of the checked call). Its buffers are
    ``out``, ``a``, ``b`` and ``bias`` (``out`` again when there is none: never read)."""
    _check(out, a, b)
    m, n = out.shape
    k = a.shape[0] if ta else a.shape[1]
    if not (m and n and k):
        raise ValueError(f"mm plan of an empty product {tuple(out.shape)} (k {k})")
    kernel = shared.module("matmul", SOURCE, out.device).mm
    config = _config(m, n, k, _engines(out.device))
    args = _mm_args(out, a, b, beta, alpha, ta, tb, k, bias, config)
    if bias is None:
        args[8] = out.view(out.dtype, (n,))  # a stand-in: the plan's fourth buffer is out's
    return kernel.plan(config.grid, config.threads, args)


def mm(out: Array, a: Array, b: Array, beta: float = 0.0, alpha: float = 1.0,
       stream: runtime.Stream | None = None, ta: bool = False, tb: bool = False,
       bias: Array | None = None, k: int | None = None) -> None:
    """``out = beta * out + alpha * A @ B`` for 2-D contiguous ``out [m, n]``, ``a`` and
    ``b``: ``A`` is ``a [m, k]``, or ``a [k, m]`` transposed when ``ta``; ``B`` is ``b [k,
    n]``, or ``b [n, k]`` transposed when ``tb`` (beta 0 ignores what ``out`` held, NaN
    included). An operand's rows may be longer than its matrix's (BLAS's leading
    dimension: a column slice of a wider matrix, given as the wider rows); then ``k``
    says the product's depth. With ``bias`` (1-D ``[n]``, ``out``'s dtype), ``out``
    first holds it on every row: ``out = beta * bias + alpha * A @ B``."""
    _check(out, a, b)
    _mm(out, a, b, beta, alpha, shared.stream_of(out, stream), ta, tb, bias, k)


def bmm(out: Array, a: Array, b: Array, stream: runtime.Stream | None = None,
        ta: bool = False, tb: bool = False) -> None:
    """``out[i] = A[i] @ B[i]`` over 3-D contiguous buffers (``ta``/``tb`` as for
    :func:`mm`, per batch entry): one ``mm`` launch per batch entry on views (``mma``
    takes 2-D operands and one ``k0`` for both, so a batch cannot be folded into the rows
    of one launch)."""
    _check(out, a, b)
    batch, m, n = out.shape
    s = shared.stream_of(out, stream)
    it = a.dtype.itemsize
    a_rows, a_cols = a.shape[1:]
    b_rows, b_cols = b.shape[1:]
    for i in range(batch):
        _mm(out.view(out.dtype, (m, n), i * m * n * it),
            a.view(a.dtype, (a_rows, a_cols), i * a_rows * a_cols * it),
            b.view(b.dtype, (b_rows, b_cols), i * b_rows * b_cols * it), 0.0, 1.0, s, ta, tb)
