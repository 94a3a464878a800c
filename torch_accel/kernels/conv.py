"""``unfold`` / ``fold`` (im2col / col2im) for convolutions of 1 to 3 spatial dimensions:
a convolution is then a matrix product on the matrix unit (``mm``/``bmm``), and its input
gradient a product folded back. One kernel serves both directions, padded to three
spatial dimensions (size 1 where a convolution has fewer), so each float dtype costs the
firmware one compile for every convolution shape and its backward.

The columns are ``[C * K, N * L]`` row-major: row ``c * K + k`` (channel, kernel offset
``k`` over ``KD x KH x KW``), column ``n * L + l`` (batch, output position over
``OD x OH x OW``). Channels of one group are consecutive rows, so a grouped convolution
is a batch of products over ``[groups, C / groups * K, N * L]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array

SOURCE = """def unfold(cols, x, fold: 'int64', total: 'int64', nb: 'int64', ch: 'int64',
           d0: 'int64', d1: 'int64', d2: 'int64', o0: 'int64', o1: 'int64', o2: 'int64',
           k0: 'int64', k1: 'int64', k2: 'int64', s0: 'int64', s1: 'int64', s2: 'int64',
           p0: 'int64', p1: 'int64', p2: 'int64', l0: 'int64', l1: 'int64', l2: 'int64'):
    i = global_id(0)
    if i < total:
        r = i
        b2 = r % o2
        r = r // o2
        b1 = r % o1
        r = r // o1
        b0 = r % o0
        r = r // o0
        n = r % nb
        r = r // nb
        a2 = r % k2
        r = r // k2
        a1 = r % k1
        r = r // k1
        a0 = r % k0
        c = r // k0
        z = b0 * s0 - p0 + a0 * l0
        y = b1 * s1 - p1 + a1 * l1
        w = b2 * s2 - p2 + a2 * l2
        inside = 0 <= z < d0 and 0 <= y < d1 and 0 <= w < d2
        j = (((n * ch + c) * d0 + z) * d1 + y) * d2 + w
        if fold == 0:
            v = 0.0
            if inside:
                v = x[j]
            cols[i] = v
        elif inside:
            atomic_add(x, j, cols[i])
"""


def _three(v: Sequence[int], fill: int) -> list[int]:
    """A 1- or 2-D parameter as three, leading dimensions of extent ``fill``."""
    return [fill] * (3 - len(v)) + list(v)


def _launch(fold: int, cols: Array, x: Array, batch: int, channels: int,
            spatial: Sequence[int], out_spatial: Sequence[int], kernel: Sequence[int],
            stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
            stream: runtime.Stream | None) -> None:
    shared.check_same(cols, x)
    total = channels * batch
    for k in (*out_spatial, *kernel):
        total *= k
    if total == 0:
        return
    args = [*_three(spatial, 1), *_three(out_spatial, 1), *_three(kernel, 1),
            *_three(stride, 1), *_three(padding, 0), *_three(dilation, 1)]
    shared.module("conv", SOURCE, cols.device).unfold[shared.grid(total), shared.BLOCK](
        shared.flat(cols), shared.flat(x), fold, total, batch, channels, *args,
        stream=shared.stream_of(cols, stream))


def unfold(cols: Array, x: Array, batch: int, channels: int, spatial: Sequence[int],
           out_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
           padding: Sequence[int], dilation: Sequence[int],
           stream: runtime.Stream | None = None) -> None:
    """im2col: ``cols`` (``[C * K, N * L]``) from the contiguous input ``x``
    (``[N, C, *spatial]``), zero where a kernel offset falls in the padding."""
    _launch(0, cols, x, batch, channels, spatial, out_spatial, kernel, stride, padding,
            dilation, stream)


def fold(x: Array, cols: Array, batch: int, channels: int, spatial: Sequence[int],
         out_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
         padding: Sequence[int], dilation: Sequence[int],
         stream: runtime.Stream | None = None) -> None:
    """col2im, the adjoint of :func:`unfold`: adds each column entry into the input
    element it was read from (atomics, as overlapping windows share elements), so ``x``
    must hold zeros (or what to add to) first."""
    _launch(1, cols, x, batch, channels, spatial, out_spatial, kernel, stride, padding,
            dilation, stream)
