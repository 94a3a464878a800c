"""Convolutions on the device (``convolution_overrideable`` and its backward, what torch's
``_convolution`` calls for a PrivateUse1 tensor; the 1-D case arrives as 2-D): the input
unfolded into columns (im2col, kernels/conv.py), then one matrix product per group on the
matrix unit (``bmm``); the input gradient is the transposed product folded back (col2im),
the weight gradient the product of the output gradient with the columns, the bias
gradient a sum.

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
from torch_accel.ops.fallback import cpu_fallback
from torch_accel.ops._register import implements

_FLOAT = (torch.float32, torch.float64)


class _Geometry:
    """A convolution's sizes: ``stride``/``padding``/``dilation`` as one value per spatial
    dimension, and the output's spatial extent."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], groups: int) -> None:
        nd = x.dim() - 2
        per_dim = lambda v: list(v) * nd if len(v) == 1 else list(v)
        self.stride, self.padding, self.dilation = per_dim(stride), per_dim(padding), per_dim(dilation)
        self.batch, self.channels = x.shape[0], x.shape[1]
        self.spatial, self.kernel = list(x.shape[2:]), list(weight.shape[2:])
        self.out_spatial = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, p, d, k, st in zip(
            self.spatial, self.padding, self.dilation, self.kernel, self.stride)]
        self.groups = groups
        self.rows = self.channels // groups * math.prod(self.kernel)  # per group
        self.cols = self.batch * math.prod(self.out_spatial)

    def args(self) -> tuple[Any, ...]:
        return (self.batch, self.channels, self.spatial, self.out_spatial, self.kernel,
                self.stride, self.padding, self.dilation)


def _on_device(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> bool:
    return (not transposed and x.dtype in _FLOAT and weight.dtype == x.dtype
            and 3 <= x.dim() <= 5 and x.numel() > 0)


def _columns(x: torch.Tensor, g: _Geometry) -> torch.Tensor:
    """``x`` unfolded, as ``[groups, rows per group, N * L]``."""
    cols = torch.empty(g.groups, g.rows, g.cols, dtype=x.dtype, device=x.device)
    kernels.unfold(view_of(cols), view_of(x), *g.args(), stream=stream(x.device.index))
    return cols


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
    out = out.reshape(weight.shape[0], g.batch, *g.out_spatial).transpose(0, 1).contiguous()
    if bias is not None:
        out.add_(bias.reshape(1, -1, *[1] * len(g.out_spatial)))
    return out


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
    per_group = grad.transpose(0, 1).reshape(g.groups, -1, g.cols)
    grad_x = grad_w = grad_b = None
    if output_mask[0]:
        grad_cols = torch.bmm(_grouped(weight, g).transpose(1, 2), per_group)
        grad_x = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        kernels.fold(view_of(grad_x), view_of(grad_cols), *g.args(),
                     stream=stream(x.device.index))
    if output_mask[1]:
        grad_w = torch.bmm(per_group, _columns(x, g).transpose(1, 2)).reshape(weight.shape)
    if output_mask[2]:
        grad_b = grad.sum([0, *range(2, grad.dim())])
    return grad_x, grad_w, grad_b
