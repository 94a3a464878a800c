"""``unfold`` / ``fold`` (im2col / col2im) for convolutions of 1 to 3 spatial dimensions:
a convolution is then a matrix product on the matrix unit (``mm``/``bmm``), and its input
gradient a product folded back. One kernel serves both directions, padded to three
spatial dimensions (size 1 where a convolution has fewer), one thread per output plane
of one column row, so each float dtype costs the firmware one compile for every
convolution shape and its backward.

The columns are ``[C * K, N * L]`` row-major: row ``c * K + k`` (channel, kernel offset
``k`` over ``KD x KH x KW``), column ``n * L + l`` (batch, output position over
``OD x OH x OW``). Channels of one group are consecutive rows, so a grouped convolution
is a batch of products over ``[groups, C / groups * K, N * L]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array

SOURCE = """def unfold(cols, x, fold: 'int64', total: 'int64', nb: 'int64', ch: 'int64',
           d0: 'int64', d1: 'int64', d2: 'int64', o0: 'int64', o1: 'int64', o2: 'int64',
           k0: 'int64', k1: 'int64', k2: 'int64', s0: 'int64', s1: 'int64', s2: 'int64',
           p0: 'int64', p1: 'int64', p2: 'int64', l0: 'int64', l1: 'int64', l2: 'int64',
           ckg: 'int64', rs: 'int64', qs: 'int64'):
    i = global_id(0)
    if i < total:
        per_row = nb * o0
        plane = o1 * o2
        rg = i // per_row
        q = i % per_row
        b0 = q % o0
        n = q // o0
        a2 = rg % k2
        r = rg // k2
        a1 = r % k1
        r = r // k1
        a0 = r % k0
        c = r // k0
        at = rg // ckg * ckg * per_row * plane + rg % ckg * rs + q * plane * qs
        z = b0 * s0 - p0 + a0 * l0
        deep = 0 <= z < d0
        src = ((n * ch + c) * d0 + z) * d1
        for b1 in range(o1):
            y = b1 * s1 - p1 + a1 * l1
            row = deep and 0 <= y < d1
            base = (src + y) * d2
            for b2 in range(o2):
                w = b2 * s2 - p2 + a2 * l2
                inside = row and 0 <= w < d2
                if fold == 0:
                    v = 0.0
                    if inside:
                        v = x[base + w]
                    cols[at + b2 * qs] = v
                elif inside:
                    atomic_add(x, base + w, cols[at + b2 * qs])
            at += o2 * qs

def swap01(out, src, bias, has_bias: 'int64', total: 'int64', a: 'int64', b: 'int64',
           n: 'int64'):
    i = global_id(0)
    if i < total:
        ai = i % a
        bi = i // a
        add = 0.0
        if has_bias != 0:
            add = bias[ai]
        for e in range(n):
            out[i * n + e] = src[(ai * b + bi) * n + e] + add
"""


def _three(v: Sequence[int], fill: int) -> list[int]:
    """A 1- or 2-D parameter as three, leading dimensions of extent ``fill``."""
    return [fill] * (3 - len(v)) + list(v)


def _launch(fold: int, cols: Array, x: Array, batch: int, channels: int,
            spatial: Sequence[int], out_spatial: Sequence[int], kernel: Sequence[int],
            stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
            groups: int, transposed: bool, stream: runtime.Stream | None) -> None:
    shared.check_same(cols, x)
    # one thread per (column row, batch, output depth) walks its [OH, OW] plane: the
    # firmware runs a thread's loops as compiled code, and the integer divisions that
    # place a thread cost more than the element copies they would place one by one
    # (a thread per output row made LeNet's unfolds 5.8-10.8 ns an element)
    depth, rows_out, cols_out = _three(out_spatial, 1)
    total = channels * batch * depth * math.prod(kernel)
    if total == 0 or rows_out * cols_out == 0:
        return
    rows = channels // groups * math.prod(kernel)  # per group
    rs, qs = (1, rows) if transposed else (batch * math.prod(out_spatial), 1)
    args = [*_three(spatial, 1), *_three(out_spatial, 1), *_three(kernel, 1),
            *_three(stride, 1), *_three(padding, 0), *_three(dilation, 1), rows, rs, qs]
    shared.module("conv", SOURCE, cols.device).unfold[shared.grid(total), shared.BLOCK](
        shared.flat(cols), shared.flat(x), fold, total, batch, channels, *args,
        stream=shared.stream_of(cols, stream))


def unfold(cols: Array, x: Array, batch: int, channels: int, spatial: Sequence[int],
           out_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
           padding: Sequence[int], dilation: Sequence[int], groups: int = 1,
           transposed: bool = False, stream: runtime.Stream | None = None) -> None:
    """im2col: ``cols`` (``[groups, C / groups * K, N * L]``, or with ``transposed``
    each group's matrix transposed, ``[groups, N * L, C / groups * K]``, as a weight
    gradient's product wants it) from the contiguous input ``x`` (``[N, C, *spatial]``),
    zero where a kernel offset falls in the padding."""
    _launch(0, cols, x, batch, channels, spatial, out_spatial, kernel, stride, padding,
            dilation, groups, transposed, stream)


def fold(x: Array, cols: Array, batch: int, channels: int, spatial: Sequence[int],
         out_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
         padding: Sequence[int], dilation: Sequence[int], groups: int = 1,
         stream: runtime.Stream | None = None) -> None:
    """col2im, the adjoint of :func:`unfold`: adds each column entry into the input
    element it was read from (atomics, as overlapping windows share elements), so ``x``
    must hold zeros (or what to add to) first."""
    _launch(1, cols, x, batch, channels, spatial, out_spatial, kernel, stride, padding,
            dilation, groups, False, stream)


def swap01(out: Array, src: Array, a: int, b: int, n: int, bias: Array | None = None,
           stream: runtime.Stream | None = None) -> None:
    """``out [b, a, n] = src [a, b, n] + bias[a]`` (``bias`` of ``a`` elements, or none):
    transposed in its two leading dimensions, one thread per row of ``n``. It turns the
    products' ``[C, N, L]`` into a tensor's ``[N, C, L]`` (adding a convolution's bias on
    the way, which a broadcast add would first expand to the output's size), where the
    strided copy's thread per element costs far more."""
    shared.check_same(out, src, *([bias] if bias is not None else []))
    if a * b * n:
        shared.module("conv", SOURCE, out.device).swap01[shared.grid(a * b), shared.BLOCK](
            shared.flat(out), shared.flat(src), shared.flat(bias if bias is not None else src),
            int(bias is not None), a * b, a, b, n, stream=shared.stream_of(out, stream))
