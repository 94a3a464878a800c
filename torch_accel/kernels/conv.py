"""``unfold`` / ``fold`` (im2col / col2im) for convolutions of 1 to 3 spatial dimensions:
a convolution is then a matrix product on the matrix unit (``mm``/``bmm``), and its input
gradient a product folded back. Each direction is padded to three spatial dimensions
(size 1 where a convolution has fewer), so each float dtype costs the firmware one compile
per kernel for every convolution shape and its backward.

The columns are ``[C * K, N * L]`` row-major: row ``c * K + k`` (channel, kernel offset
``k`` over ``KD x KH x KW``), column ``n * L + l`` (batch, output position over
``OD x OH x OW``). Channels of one group are consecutive rows, so a grouped convolution
is a batch of products over ``[groups, C / groups * K, N * L]``; a weight gradient's
product takes each group's matrix transposed, ``[groups, N * L, C / groups * K]``.

Each kernel gives a thread a long run of work in the order its writes are contiguous, and
never an integer division per element: the firmware runs a thread's loops as compiled
code, and the divisions that place a thread cost more than a short row of element copies
(a thread per output row and atomics for the fold made LeNet's step spend 42 of its 90 ms
of device time here).

The *plane kernels* (``unfold_rows``, ``fold_rows``, ``conv_direct``) serve 2-D
convolutions at unit stride and dilation from the input padded first: a thread per output
position of a tile of whole rows (``_shared.plane_tile``), every buffer indexed dimension
by dimension so that each index is affine in the thread ids. The firmware range-checks
such a block once and runs its threads as one vectorised loop per statement; the loops
over channels and kernel offsets are block-level loops around a ``barrier()``, as a phase
storing inside a loop would not be vectorised (docs/kernels.md, "Vectorised phases").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array

_GEOMETRY = """nb: 'int64', ch: 'int64',
           d0: 'int64', d1: 'int64', d2: 'int64', o0: 'int64', o1: 'int64', o2: 'int64',
           k0: 'int64', k1: 'int64', k2: 'int64', s0: 'int64', s1: 'int64', s2: 'int64',
           p0: 'int64', p1: 'int64', p2: 'int64', l0: 'int64', l1: 'int64', l2: 'int64'"""

SOURCE = f"""def unfold(cols, x, total: 'int64', {_GEOMETRY}):
    i = global_id(0)
    if i < total:
        per_row = nb * o0
        nl = per_row * o1 * o2
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
        at = rg * nl + q * o1 * o2
        z = b0 * s0 - p0 + a0 * l0
        deep = 0 <= z < d0
        src = ((n * ch + c) * d0 + z) * d1
        for b1 in range(o1):
            y = b1 * s1 - p1 + a1 * l1
            row = deep and 0 <= y < d1
            base = (src + y) * d2
            for b2 in range(o2):
                w = b2 * s2 - p2 + a2 * l2
                v = 0.0
                if row and 0 <= w < d2:
                    v = x[base + w]
                cols[at + b2] = v
            at += o2


def unfold_t(cols, x, total: 'int64', {_GEOMETRY}, cg: 'int64'):
    i = global_id(0)
    if i < total:
        per_group = nb * o0 * o1
        g = i // per_group
        q = i % per_group
        b1 = q % o1
        r = q // o1
        b0 = r % o0
        n = r // o0
        rows = cg * k0 * k1 * k2
        at = (g * per_group * o2 + q * o2) * rows
        for b2 in range(o2):
            for cl in range(cg):
                plane = (n * ch + g * cg + cl) * d0
                for a0 in range(k0):
                    z = b0 * s0 - p0 + a0 * l0
                    for a1 in range(k1):
                        y = b1 * s1 - p1 + a1 * l1
                        row = 0 <= z < d0 and 0 <= y < d1
                        base = ((plane + z) * d1 + y) * d2
                        for a2 in range(k2):
                            w = b2 * s2 - p2 + a2 * l2
                            v = 0.0
                            if row and 0 <= w < d2:
                                v = x[base + w]
                            cols[at] = v
                            at += 1


def fold(x, cols, total: 'int64', {_GEOMETRY}):
    i = global_id(0)
    if i < total:
        c = i % ch
        n = i // ch
        xb = i * d0 * d1 * d2
        for e in range(d0 * d1 * d2):
            x[xb + e] = 0.0
        nl = nb * o0 * o1 * o2
        for a0 in range(k0):
            for a1 in range(k1):
                for a2 in range(k2):
                    at = (((c * k0 + a0) * k1 + a1) * k2 + a2) * nl + n * o0 * o1 * o2
                    for b0 in range(o0):
                        z = b0 * s0 - p0 + a0 * l0
                        for b1 in range(o1):
                            y = b1 * s1 - p1 + a1 * l1
                            if 0 <= z < d0 and 0 <= y < d1:
                                base = xb + (z * d1 + y) * d2
                                for b2 in range(o2):
                                    w = b2 * s2 - p2 + a2 * l2
                                    if 0 <= w < d2:
                                        x[base + w] += cols[at + b2]
                            at += o2


def unfold_rows(cols, xp, ch: 'int64', kh: 'int64', kw: 'int64'):
    lx = global_id(0)
    ly = global_id(1)
    n = global_id(2)
    for c in range(ch):
        for ky in range(kh):
            for kx in range(kw):
                cols[c, ky, kx, n, ly, lx] = xp[n, c, ly + ky, lx + kx]
                barrier()


def fold_rows(gxp, cols, ch: 'int64', kh: 'int64', kw: 'int64'):
    lx = local_id(0)
    ly = local_id(1)
    n = global_id(2)
    for c in range(ch):
        for ky in range(kh):
            for kx in range(kw):
                gxp[n, c, ly + ky, lx + kx] += cols[c, ky, kx, n, ly, lx]
                barrier()


def conv_direct(out, xp, w, bias, has_bias: 'int64', groups: 'int64', og: 'int64',
                cg: 'int64', kh: 'int64', kw: 'int64'):
    lx = global_id(0)
    ly = global_id(1)
    n = global_id(2)
    for g in range(groups):
        for o in range(og):
            acc = 0.0
            if has_bias != 0:
                acc = bias[g, o]
            for c in range(cg):
                for ky in range(kh):
                    for kx in range(kw):
                        acc += w[g, o, c, ky, kx] * xp[n, g, c, ly + ky, lx + kx]
            out[n, g, o, ly, lx] = acc
            barrier()


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


def _geometry(batch: int, channels: int, spatial: Sequence[int],
              out_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
              padding: Sequence[int], dilation: Sequence[int]) -> list[int]:
    """The kernels' shared geometry arguments, every spatial one padded to three."""
    return [batch, channels, *_three(spatial, 1), *_three(out_spatial, 1),
            *_three(kernel, 1), *_three(stride, 1), *_three(padding, 0),
            *_three(dilation, 1)]


def unfold(cols: Array, x: Array, batch: int, channels: int, spatial: Sequence[int],
           out_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
           padding: Sequence[int], dilation: Sequence[int], groups: int = 1,
           transposed: bool = False, stream: runtime.Stream | None = None) -> None:
    """im2col: ``cols`` (``[groups, C / groups * K, N * L]``, or with ``transposed``
    each group's matrix transposed, ``[groups, N * L, C / groups * K]``, as a weight
    gradient's product wants it) from the contiguous input ``x`` (``[N, C, *spatial]``),
    zero where a kernel offset falls in the padding.

    Not transposed, a thread writes one row's ``[OH, OW]`` plane of one (batch, output
    depth); transposed, a thread writes the ``OW x C / groups * K`` run of one (group,
    batch, output depth, output row)."""
    shared.check_same(cols, x)
    depth, rows_out, cols_out = _three(out_spatial, 1)
    if transposed:
        total = groups * batch * depth * rows_out
        extra = [channels // groups]
    else:
        total = channels * math.prod(kernel) * batch * depth
        extra = []
    if total == 0 or rows_out * cols_out == 0:
        return
    module = shared.module("conv", SOURCE, cols.device)
    launch = module.unfold_t if transposed else module.unfold
    launch[shared.grid(total), shared.BLOCK](
        shared.flat(cols), shared.flat(x), total,
        *_geometry(batch, channels, spatial, out_spatial, kernel, stride, padding, dilation),
        *extra, stream=shared.stream_of(cols, stream))


def fold(x: Array, cols: Array, batch: int, channels: int, spatial: Sequence[int],
         out_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
         padding: Sequence[int], dilation: Sequence[int], groups: int = 1,
         stream: runtime.Stream | None = None) -> None:
    """col2im, the adjoint of :func:`unfold` (untransposed columns): each element of
    ``x`` is the sum of the column entries read from it (``x`` is overwritten, zero where
    no window reads). A thread owns one ``[N, C]`` plane of ``x``, zeroes it and walks
    every kernel offset's columns into it, so overlapping windows need no atomics and
    ``x`` needs no memset first. ``groups`` does not
    change the layout: row ``c * K + k`` is channel ``c``'s in every group."""
    shared.check_same(cols, x)
    total = batch * channels
    if total == 0 or math.prod(out_spatial) == 0:
        return
    shared.module("conv", SOURCE, x.device).fold[shared.grid(total), shared.BLOCK](
        shared.flat(x), shared.flat(cols), total,
        *_geometry(batch, channels, spatial, out_spatial, kernel, stride, padding, dilation),
        stream=shared.stream_of(x, stream))


def unfold_rows(cols: Array, xp: Array, batch: int, channels: int, kernel: Sequence[int],
                out_spatial: Sequence[int], tile: tuple[int, int, int],
                stream: runtime.Stream | None = None) -> None:
    """:func:`unfold` of a 2-D convolution at unit stride and dilation from its input
    padded already (``xp``, ``[N, C, OH + KH - 1, OW + KW - 1]``): each block's thread
    copies its output position's element for every channel and kernel offset in turn (a
    phase each, between barriers), so a phase is one contiguous copy per tile row."""
    shared.check_same(cols, xp)
    (kh, kw), (oh, ow) = kernel, out_spatial
    shared.module("conv", SOURCE, cols.device).unfold_rows[
        shared.plane_grid(batch, out_spatial, tile), tile](
        shared.shaped(cols, (channels, kh, kw, batch, oh, ow)),
        shared.shaped(xp, (batch, channels, oh + kh - 1, ow + kw - 1)), channels, kh, kw,
        stream=shared.stream_of(cols, stream))


def fold_rows(gxp: Array, cols: Array, batch: int, channels: int, kernel: Sequence[int],
              out_spatial: Sequence[int], tile: tuple[int, int, int],
              stream: runtime.Stream | None = None) -> None:
    """:func:`fold` of :func:`unfold_rows`' columns, added into ``gxp`` (the padded
    input's shape, zeroed by the caller): each block holds whole output planes
    (``tile``, from ``_shared.plane_tile``, must cover the plane), so the windows that
    overlap are added in order by one block, phase after phase, without atomics."""
    shared.check_same(cols, gxp)
    (kh, kw), (oh, ow) = kernel, out_spatial
    if tile[:2] != (ow, oh):
        raise ValueError(f"fold_rows needs whole {oh} x {ow} planes in a block, not {tile}")
    shared.module("conv", SOURCE, cols.device).fold_rows[
        shared.plane_grid(batch, out_spatial, tile), tile](
        shared.shaped(gxp, (batch, channels, oh + kh - 1, ow + kw - 1)),
        shared.shaped(cols, (channels, kh, kw, batch, oh, ow)), channels, kh, kw,
        stream=shared.stream_of(gxp, stream))


def conv_direct(out: Array, xp: Array, weight: Array, bias: Array | None, batch: int,
                groups: int, weight_shape: Sequence[int], out_spatial: Sequence[int],
                tile: tuple[int, int, int], stream: runtime.Stream | None = None) -> None:
    """A 2-D convolution at unit stride and dilation, straight from its padded input
    ``xp`` (``[N, C, OH + KH - 1, OW + KW - 1]``) and ``weight`` (``weight_shape``,
    ``[O, C / groups, KH, KW]``) into ``out`` (``[N, O, OH, OW]``), plus ``bias[O]``: a
    thread per output position accumulates every channel and kernel offset of one output
    channel (a phase per output channel), the firmware running a block's threads as one
    vector loop per offset. For thin products (few channels times kernel offsets), where
    the unfold, the product and the transpose cost more than the multiply-adds."""
    shared.check_same(out, xp, weight, *([bias] if bias is not None else []))
    o, cg, kh, kw = weight_shape
    oh, ow = out_spatial
    og = o // groups
    shared.module("conv", SOURCE, out.device).conv_direct[
        shared.plane_grid(batch, out_spatial, tile), tile](
        shared.shaped(out, (batch, groups, og, oh, ow)),
        shared.shaped(xp, (batch, groups, cg, oh + kh - 1, ow + kw - 1)),
        shared.shaped(weight, (groups, og, cg, kh, kw)),
        shared.shaped(bias if bias is not None else weight, (groups, og)),
        int(bias is not None), groups, og, cg, kh, kw, stream=shared.stream_of(out, stream))


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
