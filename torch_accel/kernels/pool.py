"""2-D pooling: max (with the flat index of each maximum in its plane, as torch returns
it) and average, forward and backward, with fixed windows or adaptive ones, as one kernel
of four modes (one compile per float dtype). One thread per output row walks its
windows; the backwards add into the input gradient with atomics, as windows may overlap.

Two kernels serve the max pooling of nearly every small CNN (LeNet's: 2x2 windows, stride
2) leaner, as a LeNet step spent 5 of its ~26 ms of device time pooling (runtime.profile):

* ``max2x2``, the forward of 2x2 windows at stride 2 without padding or dilation, reads
  each window's four elements straight: the firmware checks every loop iteration (its
  abort word) and every index of the general kernel's window loops, which made a 2x2
  window cost as much as 5 ns an element (1.7 ms against 0.7 ms for LeNet's first pool);
* ``max_back_rows``, the backward of any max pooling whose windows do not share input
  rows (a row stride at least the window's height), gives each output row's thread the
  input rows from its window's top to the next window's: it zeroes them and adds its
  row's gradients at their indices, so neither a memset of the input gradient nor
  atomics are needed. The indices must be those the forward gave (what autograd
  passes).

An adaptive window is torch's: output row ``p`` of ``oh`` covers input rows
``floor(p * h / oh)`` to ``ceil((p + 1) * h / oh)`` (columns alike), without padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array

SOURCE = """def pool2d(out, idx, x, g, back: 'int64', avg: 'int64', total: 'int64', h: 'int64',
           w: 'int64', oh: 'int64', ow: 'int64', kh: 'int64', kw: 'int64', sh: 'int64',
           sw: 'int64', ph: 'int64', pw: 'int64', dh: 'int64', dw: 'int64',
           incl: 'int64', div: 'int64', adaptive: 'int64'):
    i = global_id(0)
    if i < total:
        p = i % oh
        base = i // oh * h * w
        hs = p * sh - ph
        nh = kh
        if adaptive != 0:
            hs = p * h // oh
            nh = ((p + 1) * h + oh - 1) // oh - hs
        for q in range(ow):
            o = i * ow + q
            ws = q * sw - pw
            nw = kw
            if adaptive != 0:
                ws = q * w // ow
                nw = ((q + 1) * w + ow - 1) // ow - ws
            if avg == 0:
                if back == 0:
                    best = -1.0e300 * 1.0e300
                    at = -1
                    for a in range(nh):
                        y = hs + a * dh
                        for b in range(nw):
                            c = ws + b * dw
                            if 0 <= y < h and 0 <= c < w:
                                v = x[base + y * w + c]
                                if at < 0 or v > best or v != v:
                                    best = v
                                    at = y * w + c
                    out[o] = best
                    idx[o] = at
                else:
                    atomic_add(x, base + idx[o], g[o])
            else:
                he = min(hs + nh, h + ph)
                we = min(ws + nw, w + pw)
                cnt = (he - hs) * (we - ws)
                y0 = max(hs, 0)
                c0 = max(ws, 0)
                he = min(he, h)
                we = min(we, w)
                if incl == 0:
                    cnt = (he - y0) * (we - c0)
                if div != 0:
                    cnt = div
                if back == 0:
                    s = 0.0
                    for yy in range(y0, he):
                        for cc in range(c0, we):
                            s += x[base + yy * w + cc]
                    out[o] = s / cnt
                else:
                    v = g[o] / cnt
                    for yy in range(y0, he):
                        for cc in range(c0, we):
                            atomic_add(x, base + yy * w + cc, v)


def max2x2(out, idx, x, total: 'int64', h: 'int64', w: 'int64', oh: 'int64', ow: 'int64'):
    i = global_id(0)
    if i < total:
        p = i % oh
        base = (i - p) * h * w // oh
        top = 2 * p * w
        for q in range(ow):
            at = top + 2 * q
            best = x[base + at]
            v = x[base + at + 1]
            if v > best or v != v:
                best = v
                at = top + 2 * q + 1
            v = x[base + top + w + 2 * q]
            if v > best or v != v:
                best = v
                at = top + w + 2 * q
            v = x[base + top + w + 2 * q + 1]
            if v > best or v != v:
                best = v
                at = top + w + 2 * q + 1
            out[i * ow + q] = best
            idx[i * ow + q] = at


def max2x2_plane(out, idx, x, w: 'int64'):
    lx = global_id(0)
    ly = global_id(1)
    p = global_id(2)
    top = 2 * ly * w + 2 * lx
    best = x[p, 2 * ly, 2 * lx]
    v = x[p, 2 * ly, 2 * lx + 1]
    take = v > best or v != v
    best = v if take else best
    at = top + 1 if take else top
    v = x[p, 2 * ly + 1, 2 * lx]
    take = v > best or v != v
    best = v if take else best
    at = top + w if take else at
    v = x[p, 2 * ly + 1, 2 * lx + 1]
    take = v > best or v != v
    best = v if take else best
    at = top + w + 1 if take else at
    out[p, ly, lx] = best
    idx[p, ly, lx] = at


def max2x2_back_plane(gx, g, idx, w: 'int64'):
    lx = global_id(0)
    ly = global_id(1)
    p = global_id(2)
    v = g[p, ly, lx]
    at = idx[p, ly, lx] - 2 * ly * w - 2 * lx
    gx[p, 2 * ly, 2 * lx] = v if at == 0 else 0.0
    gx[p, 2 * ly, 2 * lx + 1] = v if at == 1 else 0.0
    gx[p, 2 * ly + 1, 2 * lx] = v if at == w else 0.0
    gx[p, 2 * ly + 1, 2 * lx + 1] = v if at == w + 1 else 0.0


def max_back_rows(gx, g, idx, total: 'int64', h: 'int64', w: 'int64', oh: 'int64',
                  ow: 'int64', sh: 'int64', ph: 'int64'):
    i = global_id(0)
    if i < total:
        # rows from this window's top to the next one's, the first from row 0 and the
        # last to row h ((p + 1) // oh is 1 for it alone); p without %, and each bound
        # assigned once, so that the firmware can bound a launch's work from its
        # arguments and run a small one inline (firmware/launch_work.py)
        p = i - i // oh * oh
        plane = (i - p) * h * w // oh
        y0 = max(p * sh - ph, 0)
        y1 = min((p + 1) * sh - ph + (p + 1) // oh * h, h)
        for e in range(y0 * w, y1 * w):
            gx[plane + e] = 0.0
        for q in range(ow):
            gx[plane + idx[i * ow + q]] += g[i * ow + q]
"""


def _launch(back: int, avg: int, out: Array, idx: Array, x: Array, g: Array,
            spatial: Sequence[int], out_spatial: Sequence[int], planes: int,
            kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
            dilation: Sequence[int], count_include_pad: bool, divisor: int,
            stream: runtime.Stream | None, adaptive: bool = False) -> None:
    # a thread per output row: placing a thread (its divisions) costs more than a
    # small window (a thread per element: 143 ns an output of a 2x2 max pool)
    total = planes * out_spatial[0]
    if total == 0 or out_spatial[1] == 0 or x.nbytes == 0:
        return
    shared.module("pool", SOURCE, x.device).pool2d[shared.grid(total), shared.BLOCK](
        shared.flat(out), shared.flat(idx), shared.flat(x), shared.flat(g), back, avg, total,
        *spatial, *out_spatial, *kernel, *stride, *padding, *dilation,
        int(count_include_pad), divisor, int(adaptive), stream=shared.stream_of(x, stream))


def max_pool2d(out: Array, indices: Array, x: Array, planes: int, spatial: Sequence[int],
               out_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
               padding: Sequence[int], dilation: Sequence[int],
               stream: runtime.Stream | None = None) -> None:
    """Each window's maximum (NaN wins, as in torch) and its flat index in the plane
    (``indices`` int64), over ``planes`` contiguous ``[h, w]`` planes; 2x2 windows at
    stride 2 that the input holds whole by ``max2x2``."""
    whole = 2 * out_spatial[0] <= spatial[0] and 2 * out_spatial[1] <= spatial[1]
    if (list(kernel), list(stride), list(padding), list(dilation)) != \
            ([2, 2], [2, 2], [0, 0], [1, 1]) or not whole:
        _launch(0, 0, out, indices, x, out, spatial, out_spatial, planes, kernel, stride,
                padding, dilation, False, 0, stream)
        return
    total = planes * out_spatial[0]
    if total == 0 or out_spatial[1] == 0:
        return
    tile = shared.plane_tile(planes, out_spatial, x.device)
    if tile is not None:
        _plane_launch("max2x2_plane", tile, planes, out_spatial,
                      shared.shaped(out, (planes, *out_spatial)),
                      shared.shaped(indices, (planes, *out_spatial)),
                      shared.shaped(x, (planes, *spatial)), spatial[1], stream=stream)
        return
    shared.module("pool", SOURCE, x.device).max2x2[shared.grid(total), shared.BLOCK](
        shared.flat(out), shared.flat(indices), shared.flat(x), total, *spatial,
        *out_spatial, stream=shared.stream_of(x, stream))


def _plane_launch(name: str, tile: tuple[int, int, int], planes: int,
                  out_spatial: Sequence[int], *args: object,
                  stream: runtime.Stream | None) -> None:
    """A plane kernel (``_shared.plane_tile``) of 2x2 windows at stride 2: a thread per
    output position, each index affine in the thread ids (``2 * ly``), so that a block
    is range-checked once (LeNet's first pooling, 64 x 6 planes of 14 x 14 outputs:
    0.31 against 1.24 ms by ``max2x2``'s thread per output row, load ~14)."""
    out = args[0]
    shared.module("pool", SOURCE, out.device).get_kernel(name)[  # type: ignore[attr-defined]
        shared.plane_grid(planes, out_spatial, tile), tile](
        *args, stream=shared.stream_of(out, stream))  # type: ignore[arg-type]


def halves(kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
           dilation: Sequence[int], spatial: Sequence[int], out_spatial: Sequence[int]) -> bool:
    """Whether a max pooling's windows are 2x2 at stride 2 and tile its input exactly
    (every input element in one window), so that its backward writes the input gradient
    whole, window by window (:func:`max_pool2d_backward`'s ``halves``)."""
    return ((list(kernel), list(stride), list(padding), list(dilation))
            == ([2, 2], [2, 2], [0, 0], [1, 1])
            and [2 * o for o in out_spatial] == list(spatial))


def disjoint_rows(kernel: Sequence[int], stride: Sequence[int],
                  dilation: Sequence[int]) -> bool:
    """Whether a max pooling's windows share no input row (each starts at or below the
    previous one's last row), so :func:`max_pool2d_backward` can run without a zeroed
    input gradient or atomics (``rows``)."""
    return stride[0] >= (kernel[0] - 1) * dilation[0] + 1


def max_pool2d_backward(grad_x: Array, grad: Array, indices: Array, planes: int,
                        spatial: Sequence[int], out_spatial: Sequence[int],
                        rows: tuple[int, int] | None = None, halves: bool = False,
                        stream: runtime.Stream | None = None) -> None:
    """Adds each output gradient at its maximum's index into ``grad_x``: zeroed first
    by the caller, or, with ``rows`` (the pooling's row stride and row padding, for
    windows that share no row: :func:`disjoint_rows`), written whole here; ``halves``
    (2x2 windows tiling the input, :func:`halves`) too, window by window."""
    tile = shared.plane_tile(planes, out_spatial, grad_x.device) if halves else None
    if tile is not None:
        _plane_launch("max2x2_back_plane", tile, planes, out_spatial,
                      shared.shaped(grad_x, (planes, *spatial)),
                      shared.shaped(grad, (planes, *out_spatial)),
                      shared.shaped(indices, (planes, *out_spatial)), spatial[1],
                      stream=stream)
        return
    if rows is None:
        one = (1, 1)
        _launch(1, 0, grad, indices, grad_x, grad, spatial, out_spatial, planes, one, one,
                (0, 0), one, False, 0, stream)
        return
    total = planes * out_spatial[0]
    if total == 0 or out_spatial[1] == 0 or grad_x.nbytes == 0:
        return
    shared.module("pool", SOURCE, grad_x.device).max_back_rows[
        shared.grid(total), shared.BLOCK](
        shared.flat(grad_x), shared.flat(grad), shared.flat(indices), total, *spatial,
        *out_spatial, *rows, stream=shared.stream_of(grad_x, stream))


def avg_pool2d(out: Array, x: Array, planes: int, spatial: Sequence[int],
               out_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
               padding: Sequence[int], count_include_pad: bool, divisor: int,
               stream: runtime.Stream | None = None) -> None:
    """Window means with torch's divisor: ``divisor`` when non-zero (negative too, as
    torch allows), else the window's size within the padded input
    (``count_include_pad``) or within the input."""
    _launch(0, 1, out, _no_index(x.device), x, out, spatial, out_spatial, planes, kernel,
            stride, padding, (1, 1), count_include_pad, divisor, stream)


def avg_pool2d_backward(grad_x: Array, grad: Array, planes: int, spatial: Sequence[int],
                        out_spatial: Sequence[int], kernel: Sequence[int],
                        stride: Sequence[int], padding: Sequence[int],
                        count_include_pad: bool, divisor: int,
                        stream: runtime.Stream | None = None) -> None:
    """Spreads each output gradient over its window, divided as the forward divided,
    into ``grad_x`` (zeroed first)."""
    _launch(1, 1, grad, _no_index(grad.device), grad_x, grad, spatial, out_spatial, planes,
            kernel, stride, padding, (1, 1), count_include_pad, divisor, stream)


def adaptive_max_pool2d(out: Array, indices: Array, x: Array, planes: int,
                        spatial: Sequence[int], out_spatial: Sequence[int],
                        stream: runtime.Stream | None = None) -> None:
    """Each adaptive window's maximum and its flat index, as :func:`max_pool2d` (its
    backward is :func:`max_pool2d_backward`)."""
    one = (1, 1)
    _launch(0, 0, out, indices, x, out, spatial, out_spatial, planes, one, one, (0, 0), one,
            False, 0, stream, adaptive=True)


def adaptive_avg_pool2d(out: Array, x: Array, planes: int, spatial: Sequence[int],
                        out_spatial: Sequence[int], stream: runtime.Stream | None = None
                        ) -> None:
    """Each adaptive window's mean."""
    one = (1, 1)
    _launch(0, 1, out, _no_index(x.device), x, out, spatial, out_spatial, planes, one, one,
            (0, 0), one, True, 0, stream, adaptive=True)


def adaptive_avg_pool2d_backward(grad_x: Array, grad: Array, planes: int,
                                 spatial: Sequence[int], out_spatial: Sequence[int],
                                 stream: runtime.Stream | None = None) -> None:
    """Spreads each output gradient evenly over its adaptive window, into ``grad_x``
    (zeroed first)."""
    one = (1, 1)
    _launch(1, 1, grad, _no_index(grad.device), grad_x, grad, spatial, out_spatial, planes,
            one, one, (0, 0), one, True, 0, stream, adaptive=True)


_INDEX: dict[int, runtime.DeviceArray] = {}


def _no_index(device: int) -> runtime.DeviceArray:
    """The int64 buffer the average modes name for ``idx`` and never read (a launch
    needs a real buffer there, and the kernel's dtypes fixed to compile once)."""
    if device not in _INDEX:
        _INDEX[device] = runtime.empty(1, np.int64, device=device)
    return _INDEX[device]
