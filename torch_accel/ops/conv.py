"""Convolutions on the device (``convolution_overrideable`` and its backward, what torch's
``_convolution`` calls for a PrivateUse1 tensor; the 1-D case arrives as 2-D): the input
unfolded into columns (im2col, kernels/conv.py), then one matrix product per group on the
matrix unit (``bmm``); the input gradient is the transposed product folded back (col2im),
the weight gradient the product of the output gradient with the columns (unfolded
transposed), the bias gradient a sum. The products' ``[C, N, L]`` and the tensors'
``[N, C, L]`` are exchanged by a row-wise transpose kernel.

float32 and float64 only (the unit's types); transposed convolutions and other dtypes run
torch's CPU convolution through the counted fallback, since the CPU has no
``convolution_overrideable`` of its own to fall back to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_accel import kernels
from torch_accel.ops._tensors import stream, view_of
from torch_accel.ops.copy import contiguous_on_device
from torch_accel.ops._register import implements
from torch_accel.ops.fallback import cpu_fallback

_FLOAT = (torch.float32, torch.float64)


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

    def args(self) -> tuple[Any, ...]:
        return (self.batch, self.channels, self.spatial, self.out_spatial, self.kernel,
                self.stride, self.padding, self.dilation, self.groups)


def _on_device(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> bool:
    return (not transposed and x.dtype in _FLOAT and weight.dtype == x.dtype
            and 3 <= x.dim() <= 5 and x.numel() > 0)


def _columns(x: torch.Tensor, g: _Geometry, transposed: bool = False) -> torch.Tensor:
    """``x`` unfolded, as ``[groups, rows per group, N * L]`` (or, ``transposed``, each
    group's matrix transposed)."""
    shape = (g.groups, g.cols, g.rows) if transposed else (g.groups, g.rows, g.cols)
    cols = torch.empty(shape, dtype=x.dtype, device=x.device)
    kernels.unfold(view_of(cols), view_of(x), *g.args(), transposed=transposed,
                   stream=stream(x.device.index))
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


@implements("convolution_overrideable")
def convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                transposed: bool, output_padding: Sequence[int], groups: int) -> torch.Tensor:
    """``out[n, o] = bias[o] + sum over the group's channels and the kernel``, as
    ``weight [groups, O/groups, rows] @ columns [groups, rows, N * L]``."""
    if not _on_device(x, weight, transposed):
        return cpu_fallback(torch.ops.aten.convolution.default, x, weight, bias, stride,
                            padding, dilation, transposed, output_padding, groups)
    x = contiguous_on_device(x)
    g = _Geometry(x, weight, stride, padding, dilation, groups)
    out = torch.bmm(_grouped(weight, g), _columns(x, g))  # [groups, O/groups, N * L]
    return _swap01(out.reshape(weight.shape[0], g.batch, -1),
                   (g.batch, weight.shape[0], *g.out_spatial), bias)


@implements("convolution_backward_overrideable")
def convolution_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         stride: Sequence[int], padding: Sequence[int],
                         dilation: Sequence[int], transposed: bool,
                         output_padding: Sequence[int], groups: int,
                         output_mask: Sequence[bool]) -> tuple[Any, Any, Any]:
    """The input gradient is ``weight^T @ grad`` folded back onto the input's elements;
    the weight gradient ``grad @ columns^T``; the bias gradient ``grad`` summed over all
    but the channels."""
    if not _on_device(x, weight, transposed):
        bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
        return cpu_fallback(torch.ops.aten.convolution_backward.default, grad, x, weight,
                            bias_sizes, stride, padding, dilation, transposed, output_padding,
                            groups, output_mask)
    x = contiguous_on_device(x)
    g = _Geometry(x, weight, stride, padding, dilation, groups)
    # [N, O, *L] -> [groups, O/groups, N * L], the products' layout
    per_group = _swap01(grad.reshape(g.batch, weight.shape[0], -1),
                        (g.groups, weight.shape[0] // g.groups, g.cols))
    grad_x = grad_w = grad_b = None
    if output_mask[0]:
        grad_cols = torch.bmm(_grouped(weight, g).transpose(1, 2), per_group)
        grad_x = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        kernels.fold(view_of(grad_x), view_of(grad_cols), *g.args(),
                     stream=stream(x.device.index))
    if output_mask[1]:
        grad_w = torch.bmm(per_group, _columns(x, g, transposed=True)).reshape(weight.shape)
    if output_mask[2]:
        # each channel a contiguous row: one block each, where summing over dims 0, 2, ...
        # of ``grad`` would first copy it into that layout
        grad_b = per_group.reshape(weight.shape[0], g.cols).sum(1)
    return grad_x, grad_w, grad_b
