"""Matrix products on the device's matrix unit (``mma``, docs/kernels.md "The matrix
unit"): ``mm`` and ``bmm`` for float32 and float64. Each block hands one 256x256 tile of
``out`` to the unit over the whole of ``k`` (the unit checks every tile against its
buffer, so edge tiles are just smaller tiles). 128x128 tiles made a 1024 mm 64 BLAS calls
each repacking its operands: 1.77x torch's CPU mm against 1.2x with 256x256 (medians of
six rounds, same run, loaded machine); 256 still gives a 512 x 512 product four blocks
for the engines to share. Integer products are refused: the unit
has no integer GEMM, and an MLP needs none.
"""

from __future__ import annotations

import numpy as np

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array
from torch_accel.kernels.elementwise import Binary, binary, fill

TILE = 256

# mma computes c = beta' * c + a @ b; out = beta * out + alpha * a @ b is that with
# beta' = beta / alpha, then the tile scaled by alpha (alpha 0: only c *= beta)
SOURCE = f"""def mm(c, a, b, beta, alpha):
    i = group_id(1) * {TILE}
    j = group_id(0) * {TILE}
    tm = min({TILE}, c.shape[0] - i)
    tn = min({TILE}, c.shape[1] - j)
    if alpha == 0.0:
        mma(c, a, b, i, j, 0, tm, tn, 0, beta)
    else:
        mma(c, a, b, i, j, 0, tm, tn, a.shape[1], beta / alpha)
        barrier()
        if alpha != 1.0:
            for e in range(local_id(0), tm * tn, local_size(0)):
                c[i + e // tn, j + e % tn] = c[i + e // tn, j + e % tn] * alpha
"""


def _check(out: Array, a: Array, b: Array) -> None:
    shared.check_same(out, a, b)
    if out.dtype not in (np.float32, np.float64):
        raise TypeError(f"mm/bmm: float32 or float64 only (the matrix unit), got {out.dtype}")


def _mm(out: Array, a: Array, b: Array, beta: float, alpha: float,
        s: runtime.Stream) -> None:
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k or tuple(out.shape) != (m, n):
        raise ValueError(f"mm shapes {a.shape} @ {b.shape} -> {out.shape}")
    if not (m and n):
        return
    if k == 0:  # an empty a or b is an empty allocation (va 0: the launch faults)
        if beta == 0.0:
            fill(out, 0.0, s)
        else:
            binary(Binary.mul, out, out, beta, stream=s)
    else:
        shared.module("matmul", SOURCE, out.device).mm[(-(-n // TILE), -(-m // TILE)), 128](
            out, a, b, np.float64(beta), np.float64(alpha), stream=s)


def mm(out: Array, a: Array, b: Array, beta: float = 0.0, alpha: float = 1.0,
       stream: runtime.Stream | None = None) -> None:
    """``out = beta * out + alpha * a @ b`` for 2-D contiguous ``a [m, k]``, ``b [k, n]``,
    ``out [m, n]`` (beta 0 ignores what ``out`` held, NaN included)."""
    _check(out, a, b)
    _mm(out, a, b, beta, alpha, shared.stream_of(out, stream))


def bmm(out: Array, a: Array, b: Array, stream: runtime.Stream | None = None) -> None:
    """``out[i] = a[i] @ b[i]`` over 3-D contiguous buffers: one ``mm`` launch per batch
    entry on views (``mma`` takes 2-D operands and one ``k0`` for both, so a batch cannot
    be folded into the rows of one launch)."""
    _check(out, a, b)
    batch, m, k = a.shape
    n = b.shape[2]
    s = shared.stream_of(out, stream)
    it = a.dtype.itemsize
    for i in range(batch):
        _mm(out.view(out.dtype, (m, n), i * m * n * it), a.view(a.dtype, (m, k), i * m * k * it),
            b.view(b.dtype, (k, n), i * k * n * it), 0.0, 1.0, s)
