"""2-D pooling on the device (kernels/pool.py): ``max_pool2d_with_indices``,
``avg_pool2d``, ``adaptive_max_pool2d`` and ``_adaptive_avg_pool2d`` and their backwards,
float32 and float64 over contiguous inputs; other dtypes run on the CPU. Output sizes (ceil_mode included) come from torch's meta kernels,
so they follow torch's rules exactly."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from torch_accel import kernels
from torch_accel.ops._register import Unsupported, implements
from torch_accel.ops._tensors import stream, view_of
from torch_accel.ops.copy import contiguous_on_device

_FLOAT = (torch.float32, torch.float64)


def _pair(v: Sequence[int], default: Sequence[int]) -> list[int]:
    v = list(v) or list(default)
    return v * 2 if len(v) == 1 else v


def _input(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in _FLOAT or x.dim() not in (3, 4):
        raise Unsupported
    return contiguous_on_device(x)


def _meta(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


def _planes(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-2])


@implements("max_pool2d_with_indices")
def max_pool2d_with_indices(x: torch.Tensor, kernel_size: Sequence[int],
                            stride: Sequence[int] = (), padding: Sequence[int] = (0,),
                            dilation: Sequence[int] = (1,), ceil_mode: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    x = _input(x)
    shape = torch.ops.aten.max_pool2d_with_indices(_meta(x), kernel_size, stride, padding,
                                                   dilation, ceil_mode)[0].shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    idx = torch.empty(shape, dtype=torch.int64, device=x.device)
    kernel = _pair(kernel_size, ())
    kernels.max_pool2d(view_of(out), view_of(idx), view_of(x), _planes(x), x.shape[-2:],
                       shape[-2:], kernel, _pair(stride, kernel), _pair(padding, ()),
                       _pair(dilation, ()), stream=stream(x.device.index))
    return out, idx


@implements("max_pool2d_with_indices_backward")
def max_pool2d_with_indices_backward(grad: torch.Tensor, x: torch.Tensor,
                                     kernel_size: Sequence[int], stride: Sequence[int],
                                     padding: Sequence[int], dilation: Sequence[int],
                                     ceil_mode: bool, indices: torch.Tensor) -> torch.Tensor:
    kernel = _pair(kernel_size, ())
    stride, dilation, padding = _pair(stride, kernel), _pair(dilation, ()), _pair(padding, ())
    disjoint = kernels.disjoint_rows(kernel, stride, dilation)
    return _max_backward(grad, x, indices, (stride[0], padding[0]) if disjoint else None,
                         kernels.halves(kernel, stride, padding, dilation, x.shape[-2:],
                                        grad.shape[-2:]))


def _max_backward(grad: torch.Tensor, x: torch.Tensor, indices: torch.Tensor,
                  rows: tuple[int, int] | None, halves: bool = False) -> torch.Tensor:
    """The input gradient of a max pooling from its indices; ``rows`` (row stride, row
    padding) for windows that share no input row, which the kernel writes whole, as it
    does for 2x2 windows tiling the input (``halves``)."""
    if grad.dtype != x.dtype:
        raise Unsupported
    x, grad, indices = _input(x), _input(grad), contiguous_on_device(indices)
    if grad.numel() == 0:
        rows = None  # nothing to place: the whole gradient is zero
    grad_x = (torch.zeros if rows is None else torch.empty)(x.shape, dtype=x.dtype,
                                                            device=x.device)
    kernels.max_pool2d_backward(view_of(grad_x), view_of(grad), view_of(indices), _planes(x),
                                x.shape[-2:], grad.shape[-2:], rows=rows, halves=halves,
                                stream=stream(x.device.index))
    return grad_x


@implements("avg_pool2d")
def avg_pool2d(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int] = (),
               padding: Sequence[int] = (0,), ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None
               ) -> torch.Tensor:
    x = _input(x)
    shape = torch.ops.aten.avg_pool2d(_meta(x), kernel_size, stride, padding, ceil_mode,
                                      count_include_pad, divisor_override).shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    kernel = _pair(kernel_size, ())
    kernels.avg_pool2d(view_of(out), view_of(x), _planes(x), x.shape[-2:], shape[-2:], kernel,
                       _pair(stride, kernel), _pair(padding, ()), count_include_pad,
                       divisor_override or 0, stream=stream(x.device.index))
    return out


@implements("avg_pool2d_backward")
def avg_pool2d_backward(grad: torch.Tensor, x: torch.Tensor, kernel_size: Sequence[int],
                        stride: Sequence[int], padding: Sequence[int], ceil_mode: bool,
                        count_include_pad: bool, divisor_override: int | None) -> torch.Tensor:
    if grad.dtype != x.dtype:
        raise Unsupported
    x, grad = _input(x), _input(grad)
    grad_x = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    kernel = _pair(kernel_size, ())
    kernels.avg_pool2d_backward(view_of(grad_x), view_of(grad), _planes(x), x.shape[-2:],
                                grad.shape[-2:], kernel, _pair(stride, kernel),
                                _pair(padding, ()), count_include_pad, divisor_override or 0,
                                stream=stream(x.device.index))
    return grad_x


@implements("adaptive_max_pool2d")
def adaptive_max_pool2d(x: torch.Tensor, output_size: Sequence[int]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    x = _input(x)
    shape = torch.ops.aten.adaptive_max_pool2d(_meta(x), output_size)[0].shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    idx = torch.empty(shape, dtype=torch.int64, device=x.device)
    kernels.adaptive_max_pool2d(view_of(out), view_of(idx), view_of(x), _planes(x),
                                x.shape[-2:], shape[-2:], stream=stream(x.device.index))
    return out, idx


@implements("adaptive_max_pool2d_backward")
def adaptive_max_pool2d_backward(grad: torch.Tensor, x: torch.Tensor,
                                 indices: torch.Tensor) -> torch.Tensor:
    return _max_backward(grad, x, indices, None)  # adaptive windows may share rows


@implements("_adaptive_avg_pool2d")
def adaptive_avg_pool2d(x: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    x = _input(x)
    shape = torch.ops.aten._adaptive_avg_pool2d(_meta(x), output_size).shape
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    kernels.adaptive_avg_pool2d(view_of(out), view_of(x), _planes(x), x.shape[-2:],
                                shape[-2:], stream=stream(x.device.index))
    return out


@implements("_adaptive_avg_pool2d_backward")
def adaptive_avg_pool2d_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if grad.dtype != x.dtype:
        raise Unsupported
    x, grad = _input(x), _input(grad)
    grad_x = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    kernels.adaptive_avg_pool2d_backward(view_of(grad_x), view_of(grad), _planes(x),
                                         x.shape[-2:], grad.shape[-2:],
                                         stream=stream(x.device.index))
    return grad_x
