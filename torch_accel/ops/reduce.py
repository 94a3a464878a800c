"""Reductions: ``sum``, ``mean``, ``prod``, ``amax``/``amin``, ``argmax``/``argmin``,
``max``/``min`` (whole and ``.dim``), ``any``/``all``, over any set of dimensions.

The reduced dimensions are moved last (a view), the tensor made contiguous as
``[rows, n]``, and the device's row reduction runs once (floats accumulate in float64,
ints in int64); a reduction over a short run of leading dimensions of a contiguous tensor
(a bias gradient's sum over the batch) reads its columns in place instead of copying.
Reductions of nothing that torch refuses (a max of no elements) go to the CPU, which
raises torch's own error. A float ``sum`` or ``mean`` of short rows or columns of a
contiguous tensor (a bias gradient's) is one launch, planned (ops/_plans.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from torch_accel import kernels
from torch_accel.kernels import Reduce
from torch_accel.kernels.reduce import SHORT, short_launch
from torch_accel.ops import _operands as operands
from torch_accel.ops import _plans
from torch_accel.ops._register import Unsupported, implements
from torch_accel.ops._tensors import stream, view_of
from torch_accel.ops.copy import contiguous_on_device

_EXTREMES = (Reduce.amax, Reduce.amin, Reduce.argmax, Reduce.argmin)
#: what a reduction of no elements is (torch's)
_EMPTY_VALUE = {Reduce.sum: 0, Reduce.prod: 1, Reduce.mean: float("nan"),
                Reduce.any: False, Reduce.all: True}


def _dims(x: torch.Tensor, dim: int | Sequence[int] | None) -> list[int]:
    if x.dim() == 0:
        return []  # a 0-d tensor reduces over itself, whatever dim says
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % x.dim() for d in dims})


def _short_plan(op: Reduce, x: torch.Tensor, dim: int | Sequence[int] | None, keepdim: bool
                ) -> _plans.Plan | None:
    """The plan of a float ``op`` (sum, mean) over ``dim`` of a contiguous ``x`` in its
    own dtype when those dimensions lead (columns, a bias gradient's) or trail (rows) it
    and span at most :data:`SHORT` elements: one launch, a thread per row or column."""
    dims = _dims(x, dim)
    if not (x.is_contiguous() and x.dtype in (torch.float32, torch.float64) and x.numel()
            and 0 < len(dims) < x.dim()):
        return None
    lead = list(range(len(dims)))
    if dims != lead and dims != list(range(x.dim() - len(dims), x.dim())):
        return None
    kept = [d for d in range(x.dim()) if d not in dims]
    rows, n = math.prod(x.shape[d] for d in kept), math.prod(x.shape[d] for d in dims)
    shape = tuple(1 if d in dims else x.shape[d] for d in range(x.dim())) if keepdim \
        else tuple(x.shape[d] for d in kept)
    if n > SHORT or rows * x.element_size() < 8:
        return None
    # a stand-in for the result, whose first 8 bytes are also finish's unread index
    stand_in = torch.empty(rows, dtype=x.dtype, device=x.device)
    res = view_of(stand_in)
    launch = short_launch(op, res, view_of(x), rows, n, dims == lead,
                          index=res.view(np.int64, (1,), 0))
    return _plans.Plan(launch.plan(), shape, x.dtype, (_plans.RESULT, 0, _plans.RESULT))


def _short_planned(op: Reduce, x: torch.Tensor, dim: int | Sequence[int] | None,
                   keepdim: bool) -> torch.Tensor | None:
    """``op(x, dim, keepdim)`` in ``x``'s dtype through its plan (:func:`_short_plan`),
    keyed on the arguments as given; None when it has none."""
    if not isinstance(keepdim, bool):
        return None
    key = (op, tuple(dim) if isinstance(dim, list) else dim, keepdim)
    return _plans.planned(_short_plan, key, (x,), (op, x, dim, keepdim))


def reduce_op(op: Reduce, x: torch.Tensor, dim: int | Sequence[int] | None, keepdim: bool,
              compute: torch.dtype, out_dtype: torch.dtype,
              out: torch.Tensor | None = None) -> torch.Tensor:
    if not operands.supported(compute, out_dtype):
        raise Unsupported
    dims = _dims(x, dim)
    kept = [d for d in range(x.dim()) if d not in dims]
    rows = math.prod(x.shape[d] for d in kept)
    n = math.prod(x.shape[d] for d in dims)
    if n == 0 and op in _EXTREMES:
        raise Unsupported  # torch's error for a reduction of no elements
    shape = [1 if d in dims else x.shape[d] for d in range(x.dim())] if keepdim \
        else [x.shape[d] for d in kept]
    if n == 0:  # nothing to read (an empty storage has no device address to launch on)
        res = torch.full(shape, _EMPTY_VALUE[op], dtype=out_dtype, device=x.device)
        return operands.into(out, res)
    flat = torch.empty(rows, dtype=out_dtype, device=x.device)
    # reduced dimensions leading a contiguous x (a bias gradient's sum over the batch):
    # its columns, read in place, when they are short
    moved = x.permute(*kept, *dims) if x.dim() else x
    columns = (0 < len(dims) < x.dim() and dims == list(range(len(dims))) and n <= SHORT
               and x.dtype == compute and x.is_contiguous() and not moved.is_contiguous())
    dense = x if columns else contiguous_on_device(moved, compute)
    kernels.reduce_rows(op, view_of(flat), view_of(dense), rows, n, stream=stream(x.device.index),
                        columns=columns)
    res = flat.reshape(shape)
    return operands.into(out, res)


def _sum_dtype(x: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.int64 if not x.dtype.is_floating_point else x.dtype


@implements("sum")
def sum_(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    d = _sum_dtype(x, dtype)
    return reduce_op(Reduce.sum, x, None, False, d if d.is_floating_point else torch.int64, d)


@implements("sum.dim_IntList")
def sum_dim(x: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    if dtype is None and (planned := _short_planned(Reduce.sum, x, dim, keepdim)) is not None:
        return planned
    d = _sum_dtype(x, dtype)
    return reduce_op(Reduce.sum, x, dim, keepdim, d if d.is_floating_point else torch.int64, d)


@implements("sum.IntList_out")
def sum_out(x: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *,
            dtype: torch.dtype | None = None, out: torch.Tensor) -> torch.Tensor:
    d = dtype or out.dtype
    return reduce_op(Reduce.sum, x, dim, keepdim, d if d.is_floating_point else torch.int64, d,
                     out)


def _mean_dtype(x: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    d = dtype or x.dtype
    if not d.is_floating_point:
        raise Unsupported  # torch's "mean(): could not infer output dtype" error
    return d


@implements("mean")
def mean(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    d = _mean_dtype(x, dtype)
    return reduce_op(Reduce.mean, x, None, False, d, d)


@implements("mean.dim")
def mean_dim(x: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    if dtype is None and (planned := _short_planned(Reduce.mean, x, dim, keepdim)) is not None:
        return planned
    d = _mean_dtype(x, dtype)
    return reduce_op(Reduce.mean, x, dim, keepdim, d, d)


@implements("prod")
def prod(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    d = _sum_dtype(x, dtype)
    return reduce_op(Reduce.prod, x, None, False, d if d.is_floating_point else torch.int64, d)


@implements("prod.dim_int")
def prod_dim(x: torch.Tensor, dim: int, keepdim: bool = False, *,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    d = _sum_dtype(x, dtype)
    return reduce_op(Reduce.prod, x, dim, keepdim, d if d.is_floating_point else torch.int64, d)


def _extreme(op: Reduce, x: torch.Tensor, dim: Sequence[int] | int | None,
             keepdim: bool) -> torch.Tensor:
    if x.dtype == torch.bool:
        raise Unsupported
    return reduce_op(op, x, dim, keepdim, x.dtype, x.dtype)


implements("amax")(lambda x, dim=(), keepdim=False: _extreme(Reduce.amax, x, dim, keepdim))
implements("amin")(lambda x, dim=(), keepdim=False: _extreme(Reduce.amin, x, dim, keepdim))
implements("max")(lambda x: _extreme(Reduce.amax, x, None, False))
implements("min")(lambda x: _extreme(Reduce.amin, x, None, False))


def _arg(op: Reduce, x: torch.Tensor, dim: int | None, keepdim: bool) -> torch.Tensor:
    if x.dtype == torch.bool:
        raise Unsupported
    if dim is None:
        res = reduce_op(op, x.reshape(-1), 0, False, x.dtype, torch.int64)
        return res.reshape([1] * x.dim()) if keepdim else res
    return reduce_op(op, x, dim, keepdim, x.dtype, torch.int64)


implements("argmax")(lambda x, dim=None, keepdim=False: _arg(Reduce.argmax, x, dim, keepdim))
implements("argmin")(lambda x, dim=None, keepdim=False: _arg(Reduce.argmin, x, dim, keepdim))


@implements("max.dim")
def max_dim(x: torch.Tensor, dim: int, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return _extreme(Reduce.amax, x, dim, keepdim), _arg(Reduce.argmax, x, dim, keepdim)


@implements("min.dim")
def min_dim(x: torch.Tensor, dim: int, keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return _extreme(Reduce.amin, x, dim, keepdim), _arg(Reduce.argmin, x, dim, keepdim)


def _logical(op: Reduce, x: torch.Tensor, dim: Sequence[int] | int | None,
             keepdim: bool) -> torch.Tensor:
    if x.dtype == torch.uint8:
        raise Unsupported  # torch keeps uint8 for any/all of uint8
    return reduce_op(op, x, dim, keepdim, x.dtype, torch.bool)


implements("any")(lambda x: _logical(Reduce.any, x, None, False))
implements("all")(lambda x: _logical(Reduce.all, x, None, False))
implements("any.dim", "any.dims")(
    lambda x, dim=None, keepdim=False: _logical(Reduce.any, x, dim, keepdim))
implements("all.dim", "all.dims")(
    lambda x, dim=None, keepdim=False: _logical(Reduce.all, x, dim, keepdim))
