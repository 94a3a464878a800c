"""Convolutions on the device (``convolution_overrideable`` and its backward, what torch's
``_convolution`` calls for a PrivateUse1 tensor; the 1-D case arrives as 2-D): the input
unfolded into columns (im2col, kernels/conv.py), then one matrix product per group on the
matrix unit (``bmm``); the input gradient is the transposed product folded back (col2im),
the weight gradient the product of the output gradient with the columns (unfolded
transposed), the bias gradient a sum. The products' ``[C, N, L]`` and the tensors'
``[N, C, L]`` are exchanged by a row-wise transpose kernel.

A transposed convolution is the input gradient of the convolution it transposes (fold of
``weight^T @ x``), and its backward the forward convolution of the output gradient (the
input gradient) and that convolution's weight gradient with the roles of input and output
gradient exchanged.

A training step's forward keeps its input's columns for the weight gradient
(:class:`_SavedColumns`), so the backward multiplies by them read transposed in place
instead of unfolding the input a second time.

2-D convolutions at unit stride and dilation run on the *plane kernels* (kernels/conv.py:
a thread per output position of a tile of whole output rows, the input padded first):
the unfold and the fold by them, and a thin convolution (at most :data:`DIRECT_ROWS` rows
per group) computed directly into its output, bias included (:func:`_direct`), whose
backward unfolds its input for the weight gradient (it kept no columns).

float32 and float64 only (the unit's types); other dtypes run torch's CPU convolution
through the counted fallback, since the CPU has no ``convolution_overrideable`` of its own
to fall back to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from torch_accel import kernels
from torch_accel.ops._tensors import stream, view_of
from torch_accel.ops.copy import contiguous_on_device
from torch_accel.ops._register import implements
from torch_accel.ops.fallback import cpu_fallback

_FLOAT = (torch.float32, torch.float64)
#: the most rows per group (channels per group times kernel offsets) of a convolution the
#: plane kernel computes directly (:func:`_direct`) rather than as a product: LeNet's first
#: layer (25 rows) took 1.2-1.6 ms so against 4.5 ms by unfold, product and transpose, its
#: second (150 rows) 3.9-4.5 ms against 2.2-3.0 ms (docs/torch.md, "Operators")
DIRECT_ROWS = 32


class _Geometry:
    """A convolution's sizes: ``stride``/``padding``/``dilation`` as one value per spatial
    dimension, and the output's spatial extent."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], groups: int) -> None:
        nd = x.dim() - 2
        per_dim = lambda v: list(v) * nd if len(v) == 1 else list(v)
        self.stride, self.padding = per_dim(stride), per_dim(padding)
        self.dilation = per_dim(dilation)
        self.batch, self.channels = x.shape[0], x.shape[1]
        self.spatial, self.kernel = list(x.shape[2:]), list(weight.shape[2:])
        self.out_spatial = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, p, d, k, st in zip(
            self.spatial, self.padding, self.dilation, self.kernel, self.stride)]
        self.groups = groups
        self.rows = self.channels // groups * math.prod(self.kernel)  # per group
        self.cols = self.batch * math.prod(self.out_spatial)
        #: the plane kernels' block (kernels/conv.py), for a 2-D convolution (1-D arrives
        #: as 2-D) at unit stride and dilation whose plane they tile; else None
        self.tile = (kernels.plane_tile(self.batch, self.out_spatial, weight.device.index)
                     if nd == 2 and set(self.stride + self.dilation) == {1} else None)

    def args(self) -> tuple[Any, ...]:
        return (self.batch, self.channels, self.spatial, self.out_spatial, self.kernel,
                self.stride, self.padding, self.dilation, self.groups)

    def key(self) -> tuple[Any, ...]:
        """What the columns depend on besides the input's elements."""
        return tuple(tuple(a) if isinstance(a, list) else a for a in self.args())


class _SavedColumns:
    """The columns a convolution's forward unfolded, kept for its backward's weight
    gradient (``grad @ columns^T``): unfolding the input again cost a step as much device
    time as the forward's unfold (LeNet's two layers: 4.4 of 32 ms, runtime.profile).

    Kept only when the backward will want them (gradients on, the weight requiring one),
    and only as long as the input: a backward takes them (so they live from the forward
    to its backward, as the input itself does in autograd's graph), the input's death
    drops them, and another forward of the same input replaces them. They are used only
    if the input's version, dtype and the geometry are those they were unfolded from (an
    in-place write to the input since makes the backward unfold again, as it must)."""

    def __init__(self) -> None:
        self._by_input: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def keep(self, x: torch.Tensor, weight: torch.Tensor, g: _Geometry,
             cols: torch.Tensor) -> None:
        if torch.is_grad_enabled() and weight.requires_grad:
            self._by_input[x] = (x._version, x.dtype, g.key(), cols)

    def take(self, x: torch.Tensor, g: _Geometry) -> torch.Tensor | None:
        saved = self._by_input.pop(x, None)
        if saved is None or saved[:3] != (x._version, x.dtype, g.key()):
            return None
        return saved[3]


_saved = _SavedColumns()


def _on_device(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype in _FLOAT and weight.dtype == x.dtype and 3 <= x.dim() <= 5
            and x.numel() > 0)


def _transposed_geometry(x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                         padding: Sequence[int], dilation: Sequence[int],
                         output_padding: Sequence[int], groups: int) -> _Geometry:
    """A transposed convolution is the input gradient of the convolution whose input has
    the transposed one's output shape and whose weight is the same ``weight``
    (``[C_in, C_out / groups, *k]`` is the forward convolution's ``[O, C / groups, *k]``):
    this is that convolution's geometry."""
    nd = x.dim() - 2
    per_dim = lambda v: list(v) * nd if len(v) == 1 else list(v)
    out_spatial = [(i - 1) * st - 2 * p + d * (k - 1) + op + 1 for i, st, p, d, k, op in zip(
        x.shape[2:], per_dim(stride), per_dim(padding), per_dim(dilation), weight.shape[2:],
        per_dim(output_padding))]
    out = torch.empty((x.shape[0], weight.shape[1] * groups, *out_spatial), device="meta")
    return _Geometry(out, weight, stride, padding, dilation, groups)


def _padded(x: torch.Tensor, g: _Geometry) -> torch.Tensor:
    """``x`` contiguous with its padding written out as zeros, what the plane kernels
    read (their every index then stays inside the input)."""
    x = contiguous_on_device(x)
    if not any(g.padding):
        return x
    (ph, pw) = g.padding
    return torch.constant_pad_nd(x, (pw, pw, ph, ph))


def _columns(x: torch.Tensor, g: _Geometry, transposed: bool = False) -> torch.Tensor:
    """``x`` unfolded, as ``[groups, rows per group, N * L]`` (or, ``transposed``, each
    group's matrix transposed); by the plane kernel where it serves (untransposed)."""
    shape = (g.groups, g.cols, g.rows) if transposed else (g.groups, g.rows, g.cols)
    cols = torch.empty(shape, dtype=x.dtype, device=x.device)
    if g.tile is not None and not transposed:
        kernels.unfold_rows(view_of(cols), view_of(_padded(x, g)), g.batch, g.channels,
                            g.kernel, g.out_spatial, g.tile, stream=stream(x.device.index))
        return cols
    kernels.unfold(view_of(cols), view_of(contiguous_on_device(x)), *g.args(),
                   transposed=transposed, stream=stream(x.device.index))
    return cols


def _swap01(t: torch.Tensor, shape: Sequence[int],
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` (``[A, B, ...]``) with its two leading dimensions swapped, plus ``bias[A]``,
    contiguous, as ``shape``."""
    t = contiguous_on_device(t)
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    b = view_of(contiguous_on_device(bias, t.dtype)) if bias is not None else None
    kernels.swap01(view_of(out), view_of(t), t.shape[0], t.shape[1], math.prod(t.shape[2:]),
                   bias=b, stream=stream(t.device.index))
    return out


def _grouped(weight: torch.Tensor, g: _Geometry) -> torch.Tensor:
    return contiguous_on_device(weight).reshape(g.groups, -1, g.rows)


def _direct(x: torch.Tensor, weight: torch.Tensor, g: _Geometry,
            bias: torch.Tensor | None) -> torch.Tensor:
    """The convolution by ``kernels.conv_direct``, from the padded input into the
    output's own layout, bias included: no columns, product or transpose."""
    out = torch.empty((g.batch, weight.shape[0], *g.out_spatial), dtype=x.dtype,
                      device=x.device)
    b = view_of(contiguous_on_device(bias, x.dtype)) if bias is not None else None
    kernels.conv_direct(view_of(out), view_of(_padded(x, g)),
                        view_of(contiguous_on_device(weight)), b, g.batch, g.groups,
                        weight.shape, g.out_spatial, g.tile, stream=stream(x.device.index))
    return out


def _forward(x: torch.Tensor, weight: torch.Tensor, g: _Geometry,
             bias: torch.Tensor | None, keep: bool = False) -> torch.Tensor:
    """``out[n, o] = bias[o] + sum over the group's channels and the kernel``, as
    ``weight [groups, O/groups, rows] @ columns [groups, rows, N * L]``, or directly
    (:func:`_direct`) for a thin product the plane kernels serve; ``keep``: a
    convolution's own forward, whose columns its backward may want."""
    if g.tile is not None and g.rows <= DIRECT_ROWS:
        return _direct(x, weight, g, bias)
    cols = _columns(x, g)
    if keep:
        _saved.keep(x, weight, g, cols)
    out = torch.bmm(_grouped(weight, g), cols)
    return _swap01(out.reshape(weight.shape[0], g.batch, -1),
                   (g.batch, weight.shape[0], *g.out_spatial), bias)


def _per_group(grad: torch.Tensor, weight: torch.Tensor, g: _Geometry) -> torch.Tensor:
    """The forward's output gradient ``[N, O, *L]`` as ``[groups, O/groups, N * L]``, the
    products' layout."""
    return _swap01(grad.reshape(g.batch, weight.shape[0], -1),
                   (g.groups, weight.shape[0] // g.groups, g.cols))


def _input_grad(per_group: torch.Tensor, weight: torch.Tensor, g: _Geometry,
                shape: Sequence[int]) -> torch.Tensor:
    """``weight^T @ grad`` folded back onto the forward input's elements (``shape``)."""
    grad_cols = torch.bmm(_grouped(weight, g).transpose(1, 2), per_group)
    if g.tile is not None and g.tile[:2] == tuple(reversed(g.out_spatial)):  # whole planes
        return _fold_rows(grad_cols, g, shape)
    grad_x = torch.empty(shape, dtype=per_group.dtype, device=per_group.device)
    kernels.fold(view_of(grad_x), view_of(grad_cols), *g.args(),
                 stream=stream(per_group.device.index))
    return grad_x


def _fold_rows(grad_cols: torch.Tensor, g: _Geometry, shape: Sequence[int]) -> torch.Tensor:
    """The fold by ``kernels.fold_rows``: into the padded input's shape, zeroed, then
    the padding cut off."""
    (ph, pw), (h, w) = g.padding, g.spatial
    grad_xp = torch.zeros((g.batch, g.channels, h + 2 * ph, w + 2 * pw),
                          dtype=grad_cols.dtype, device=grad_cols.device)
    kernels.fold_rows(view_of(grad_xp), view_of(grad_cols), g.batch, g.channels, g.kernel,
                      g.out_spatial, g.tile, stream=stream(grad_cols.device.index))
    return contiguous_on_device(grad_xp[:, :, ph:ph + h, pw:pw + w]).reshape(shape)


def _weight_grad(per_group: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 g: _Geometry, saved: torch.Tensor | None = None) -> torch.Tensor:
    """``grad @ columns^T``: the forward's output gradient times its input unfolded,
    ``saved`` (the forward's columns) or unfolded here: by the plane kernel, both read
    transposed in place by the unit, or else unfolded transposed."""
    if saved is None and g.tile is None:
        cols = _columns(x, g, transposed=True)
    else:  # read transposed in place: the kept columns, or the plane kernel's
        cols = (saved if saved is not None else _columns(x, g)).transpose(1, 2)
    return torch.bmm(per_group, cols).reshape(weight.shape)


def _bias_grad(by_channel: torch.Tensor, channels: int) -> torch.Tensor:
    """The output gradient summed per channel, from a layout where each channel's
    elements are one contiguous row (one block each, where summing ``[N, C, *L]`` over
    dims 0, 2, ... would first copy it into that layout)."""
    return by_channel.reshape(channels, -1).sum(1)


@implements("convolution_overrideable")
def convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                transposed: bool, output_padding: Sequence[int], groups: int) -> torch.Tensor:
    """A convolution is :func:`_forward`; a transposed one is the input gradient of the
    convolution it transposes, plus the bias."""
    if not _on_device(x, weight):
        return cpu_fallback(torch.ops.aten.convolution.default, x, weight, bias, stride,
                            padding, dilation, transposed, output_padding, groups)
    if not transposed:
        return _forward(x, weight, _Geometry(x, weight, stride, padding, dilation, groups),
                        bias, keep=True)
    g = _transposed_geometry(x, weight, stride, padding, dilation, output_padding, groups)
    out = _input_grad(_per_group(contiguous_on_device(x), weight, g), weight, g,
                      (g.batch, g.channels, *g.spatial))
    if bias is not None:
        out.add_(bias.reshape(-1, *[1] * len(g.spatial)))
    return out


@implements("convolution_backward_overrideable")
def convolution_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         stride: Sequence[int], padding: Sequence[int],
                         dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int,
                         output_mask: Sequence[bool]) -> tuple[Any, Any, Any]:
    """For a convolution: the input gradient is :func:`_input_grad` of ``grad``, the
    weight gradient ``grad @ columns(x)^T``. A transposed convolution swaps the roles: its
    input gradient is the forward convolution of ``grad``, its weight gradient
    ``x @ columns(grad)^T``. The bias gradient is ``grad`` summed over all but the
    channels."""
    if not _on_device(x, weight):
        bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
        return cpu_fallback(torch.ops.aten.convolution_backward.default, grad, x, weight,
                            bias_sizes, stride, padding, dilation, transposed, output_padding,
                            groups, output_mask)
    grad_x = grad_w = grad_b = None
    if transposed:
        g = _transposed_geometry(x, weight, stride, padding, dilation, output_padding, groups)
        if output_mask[0]:
            grad_x = _forward(grad, weight, g, None)
        if output_mask[1]:
            grad_w = _weight_grad(_per_group(contiguous_on_device(x), weight, g), grad,
                                  weight, g)
        if output_mask[2]:
            grad_b = _bias_grad(_swap01(grad.reshape(g.batch, g.channels, -1),
                                        (g.channels, g.batch, math.prod(g.spatial))),
                                g.channels)
        return grad_x, grad_w, grad_b
    g = _Geometry(x, weight, stride, padding, dilation, groups)
    saved = _saved.take(x, g)
    per_group = _per_group(grad, weight, g)
    if output_mask[0]:
        grad_x = _input_grad(per_group, weight, g, x.shape)
    if output_mask[1]:
        grad_w = _weight_grad(per_group, x, weight, g, saved)
    if output_mask[2]:
        grad_b = _bias_grad(per_group, weight.shape[0])
    return grad_x, grad_w, grad_b
