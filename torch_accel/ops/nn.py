"""Neural-network operators and their backwards: softmax and log_softmax, activation
backwards, ``nll_loss`` (so ``cross_entropy``), ``mse_loss``, ``embedding`` (``index_select`` on rows)
and its dense backward. Each reduces over rows of a contiguous ``[rows, n]`` layout, with
the softmax dimension moved last first.

A training step's calls of these (contiguous float tensors, the softmax dimension last, no
class weights) are one launch each, planned (ops/_plans.py): their checked path below
cost 50-100 us of host time a call (views, argument checks, ``torch.empty``), their plan
~15 us (docs/torch.md, "An MLP step, third pass")."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from torch_accel import kernels
from torch_accel.kernels import Backward, Binary, Reduction
from torch_accel.ops import _operands as operands
from torch_accel.ops import _plans
from torch_accel.ops._register import Unsupported, implements
from torch_accel.ops._tensors import stream, view_of
from torch_accel.ops.copy import contiguous_on_device
from torch_accel.ops.elementwise import binary_op
from torch_accel.ops.reduce import mean, sum_

_FLOAT = (torch.float32, torch.float64)


def _last(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[int]]:
    """``x`` with ``dim`` moved last, contiguous, and the permutation that undoes it."""
    if x.dim() == 0:
        return x.reshape(1), []
    dim %= x.dim()
    perm = [d for d in range(x.dim()) if d != dim] + [dim]
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return contiguous_on_device(x.permute(perm)), inverse


def _back(y: torch.Tensor, inverse: list[int], shape: torch.Size) -> torch.Tensor:
    return y.permute(inverse) if inverse else y.reshape(shape)


def _dense(*ts: torch.Tensor) -> bool:
    """Whether ``ts`` are non-empty contiguous float tensors of one dtype and shape: a
    plan's operands, read as flat rows."""
    t0 = ts[0]
    return t0.dtype in _FLOAT and t0.numel() > 0 and all(
        t.is_contiguous() and t.dtype == t0.dtype and t.shape == t0.shape for t in ts)


def _last_dim(x: torch.Tensor, dim: int) -> bool:
    return x.dim() > 0 and dim % x.dim() == x.dim() - 1


def _rows_plan(launch: Callable[..., Any], log: bool, *ts: torch.Tensor
               ) -> _plans.Plan | None:
    """The plan of a softmax kernel (``launch``: its launch maker) over the rows of the
    last dimension of ``ts``, contiguous, result like ``ts[0]``."""
    x = ts[-1]
    n = x.shape[-1]
    views = [view_of(t) for t in ts]
    made = launch(views[-1], *views, x.numel() // n, n, log)
    return _plans.Plan(made.plan(), x.shape, x.dtype, range(-1, len(ts)),
                       _plans.like(ts[0], x.shape, x.dtype))


def _softmax_plan(x: torch.Tensor, dim: int, log: bool) -> _plans.Plan | None:
    if not (_dense(x) and _last_dim(x, dim)):
        return None
    return _rows_plan(kernels.softmax_rows_launch, log, x)


def _softmax(x: torch.Tensor, dim: int, half_to_float: bool, log: bool) -> torch.Tensor:
    if not half_to_float and (planned := _plans.planned(
            _softmax_plan, (dim, log), (x,), (x, dim, log))) is not None:
        return planned
    if x.dtype not in _FLOAT or half_to_float:
        raise Unsupported
    dense, inverse = _last(x, dim)
    n = dense.shape[-1] if dense.dim() else 1
    rows = dense.numel() // n if n else 0
    out = torch.empty_like(dense)
    kernels.softmax_rows(view_of(out), view_of(dense), rows, n, log=log,
                         stream=stream(x.device.index))
    return _back(out, inverse, x.shape)


implements("_softmax")(lambda x, dim, half_to_float: _softmax(x, dim, half_to_float, False))
implements("_log_softmax")(lambda x, dim, half_to_float: _softmax(x, dim, half_to_float, True))


def _softmax_backward_plan(grad: torch.Tensor, y: torch.Tensor, dim: int,
                           log: bool) -> _plans.Plan | None:
    if not (_dense(grad, y) and _last_dim(y, dim)):
        return None
    return _rows_plan(kernels.softmax_backward_rows_launch, log, grad, y)


def _softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int, input_dtype: torch.dtype,
                      log: bool) -> torch.Tensor:
    if y.dtype not in _FLOAT or grad.dtype != y.dtype or input_dtype != y.dtype:
        raise Unsupported
    if (planned := _plans.planned(_softmax_backward_plan, (dim, log), (grad, y),
                                  (grad, y, dim, log))) is not None:
        return planned
    g, inverse = _last(grad, dim)
    yd, _ = _last(y, dim)
    n = yd.shape[-1] if yd.dim() else 1
    out = torch.empty_like(yd)
    kernels.softmax_backward_rows(view_of(out), view_of(g), view_of(yd),
                                  yd.numel() // n if n else 0, n, log=log,
                                  stream=stream(y.device.index))
    return _back(out, inverse, y.shape)


implements("_softmax_backward_data")(
    lambda grad, y, dim, input_dtype: _softmax_backward(grad, y, dim, input_dtype, False))
implements("_log_softmax_backward_data")(
    lambda grad, y, dim, input_dtype: _softmax_backward(grad, y, dim, input_dtype, True))


def _activation_backward_plan(op: Backward, grad: torch.Tensor, x: torch.Tensor,
                              p0: float) -> _plans.Plan | None:
    if not _dense(grad, x):
        return None
    vx = view_of(x)
    launch = kernels.activation_backward_launch(op, vx, view_of(grad), vx, p0)
    return _plans.Plan(launch.plan(), x.shape, x.dtype, (_plans.RESULT, 0, 1),
                       _plans.like(grad, x.shape, x.dtype))


def _activation_backward(op: Backward, grad: torch.Tensor, x: torch.Tensor,
                         p0: float = 0.0) -> torch.Tensor:
    if x.dtype not in _FLOAT or grad.dtype != x.dtype:
        raise Unsupported
    if p0 == p0 and (planned := _plans.planned(
            _activation_backward_plan, (op, p0), (grad, x), (op, grad, x, p0))) is not None:
        return planned
    shape = operands.broadcast(grad, x)
    g, _ = operands.operand(grad, x.dtype, shape, x.device)
    v, _ = operands.operand(x, x.dtype, shape, x.device)
    return operands.result(shape, x.dtype, x.device, None, lambda o: kernels.activation_backward(
        op, o, g, v, p0, stream=stream(x.device.index)))


implements("threshold_backward")(
    lambda grad, x, threshold: _activation_backward(Backward.threshold, grad, x, float(threshold)))
implements("gelu_backward")(
    lambda grad, x, *, approximate="none": _activation_backward(
        Backward.gelu_tanh if approximate == "tanh" else Backward.gelu, grad, x))
implements("sigmoid_backward")(lambda grad, y: _activation_backward(Backward.sigmoid, grad, y))
implements("tanh_backward")(lambda grad, y: _activation_backward(Backward.tanh, grad, y))
implements("silu_backward")(lambda grad, x: _activation_backward(Backward.silu, grad, x))


def _nll_args(logp: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    if (weight is not None or logp.dtype not in _FLOAT or logp.dim() not in (1, 2)
            or target.dtype != torch.int64):
        raise Unsupported  # class weights, K-dimensional losses: the CPU
    lp = contiguous_on_device(logp.reshape(1, -1) if logp.dim() == 1 else logp)
    return lp, contiguous_on_device(target.reshape(-1)), lp.shape[0], lp.shape[1]


def _nll_plannable(logp: torch.Tensor, target: torch.Tensor, reduction: int) -> bool:
    """A batch's loss as a plan takes it: ``[rows, n]`` contiguous float log-probabilities,
    ``rows`` > 0 contiguous int64 targets, a reduction torch has."""
    return logp.dim() == 2 and _dense(logp) and target.dtype == torch.int64 \
        and target.shape == logp.shape[:1] and target.is_contiguous() \
        and reduction in tuple(Reduction)


def _nll_loss_plan(logp: torch.Tensor, target: torch.Tensor, reduction: int,
                   ignore_index: int) -> _plans.Plan | None:
    """The loss (``[rows]`` for reduction none, else 0-d) and its total weight, 0-d, both
    new results of one launch."""
    if not _nll_plannable(logp, target, reduction):
        return None
    rows, n = logp.shape
    shape = (rows,) if reduction == Reduction.none else ()
    loss, total = (torch.empty(s, dtype=logp.dtype, device=logp.device) for s in (shape, ()))
    launch = kernels.nll_loss_launch(view_of(loss), view_of(total), view_of(logp),
                                     view_of(target), rows, n, Reduction(reduction),
                                     ignore_index)
    return _plans.Plan(launch.plan(), shape, logp.dtype,
                       (_plans.RESULT, _plans.RESULT - 1, 0, 1), more=(((), logp.dtype),))


@implements("nll_loss_forward")
def nll_loss_forward(logp: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                     reduction: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    if weight is None and (planned := _plans.planned(
            _nll_loss_plan, (reduction, ignore_index), (logp, target),
            (logp, target, reduction, ignore_index))) is not None:
        return planned
    lp, tg, rows, n = _nll_args(logp, target, weight)
    out = torch.empty(rows if reduction == 0 and logp.dim() == 2 else (), dtype=logp.dtype,
                      device=logp.device)
    # torch's total_weight: the count of targets that are not ignored (no class weights),
    # counted by the loss's own launch; 0 for a batch with reduction none, while one
    # sample's loss is its own sum (its total counts its target whatever the reduction)
    total = torch.empty((), dtype=logp.dtype, device=logp.device)
    red = Reduction.sum if reduction == Reduction.none and logp.dim() == 1 else reduction
    kernels.nll_loss_rows(view_of(out), view_of(lp), view_of(tg), rows, n, red, ignore_index,
                          stream=stream(logp.device.index), total=view_of(total))
    return out, total


def _nll_loss_backward_plan(logp: torch.Tensor, grad: torch.Tensor, target: torch.Tensor,
                            reduction: int, ignore_index: int) -> _plans.Plan | None:
    """The gradient, like ``logp`` (an operand for its shape, not read), from one launch
    on ``grad`` and ``target``."""
    if not (_nll_plannable(logp, target, reduction) and grad.is_contiguous()
            and grad.dtype == logp.dtype
            and grad.numel() == (logp.shape[0] if reduction == Reduction.none else 1)):
        return None
    rows, n = logp.shape
    vlp = view_of(logp)  # the result's stand-in: same shape and dtype
    launch = kernels.nll_loss_backward_launch(vlp, view_of(grad), view_of(target), rows, n,
                                              reduction, ignore_index)
    return _plans.Plan(launch.plan(), logp.shape, logp.dtype, (_plans.RESULT, 1, 2),
                       _plans.like(logp, logp.shape, logp.dtype))


@implements("nll_loss_backward")
def nll_loss_backward(grad: torch.Tensor, logp: torch.Tensor, target: torch.Tensor,
                      weight: torch.Tensor | None, reduction: int, ignore_index: int,
                      total_weight: torch.Tensor) -> torch.Tensor:
    if weight is None and (planned := _plans.planned(
            _nll_loss_backward_plan, (reduction, ignore_index), (logp, grad, target),
            (logp, grad, target, reduction, ignore_index))) is not None:
        return planned
    lp, tg, rows, n = _nll_args(logp, target, weight)
    out = torch.empty_like(lp)
    kernels.nll_loss_backward_rows(view_of(out), view_of(contiguous_on_device(grad.reshape(-1))),
                                   view_of(tg), rows, n, reduction, ignore_index,
                                   stream=stream(logp.device.index))
    return out.reshape(logp.shape)


@implements("index_select")
def index_select(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    if index.device != x.device or index.dtype not in (torch.int64, torch.int32) \
            or not operands.supported(x.dtype) or x.dim() == 0 or index.dim() > 1:
        raise Unsupported
    moved = contiguous_on_device(x.movedim(dim, 0))
    row = math.prod(moved.shape[1:])
    idx = contiguous_on_device(index.reshape(-1))
    out = torch.empty((idx.numel(), *moved.shape[1:]), dtype=x.dtype, device=x.device)
    kernels.index_rows(view_of(out), view_of(moved), view_of(idx), idx.numel(), row,
                       stream=stream(x.device.index))
    return out.movedim(0, dim)


@implements("embedding_dense_backward")
def embedding_dense_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                             padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
    if scale_grad_by_freq or grad.dtype not in _FLOAT or indices.dtype != torch.int64:
        raise Unsupported
    row = grad.shape[-1]
    idx = contiguous_on_device(indices.reshape(-1))
    src = contiguous_on_device(grad.reshape(-1, row))
    if padding_idx >= 0:  # rows of the padding index get no gradient
        keep = (idx != padding_idx).to(grad.dtype).reshape(-1, 1)
        src = contiguous_on_device(src * keep)
    out = torch.zeros(num_weights, row, dtype=grad.dtype, device=grad.device)
    kernels.index_add_rows(view_of(out), view_of(idx), view_of(src), idx.numel(), row,
                           stream=stream(grad.device.index))
    return out


@implements("mse_loss")
def mse_loss(x: torch.Tensor, target: torch.Tensor, reduction: int = 1) -> torch.Tensor:
    """``(x - target) ** 2``, then none/mean/sum (torch's reduction enum 0/1/2)."""
    if x.dtype not in _FLOAT or target.dtype != x.dtype:
        raise Unsupported
    diff = binary_op(Binary.sub, x, target)
    sq = binary_op(Binary.mul, diff, diff)
    return sq if reduction == 0 else mean(sq) if reduction == 1 else sum_(sq)


@implements("mse_loss_backward")
def mse_loss_backward(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
                      reduction: int) -> torch.Tensor:
    """``2 (x - target) grad``, divided by the element count for mean."""
    if x.dtype not in _FLOAT or target.dtype != x.dtype:
        raise Unsupported
    scale = 2.0 / max(math.prod(operands.broadcast(x, target)), 1) if reduction == 1 else 2.0
    diff = binary_op(Binary.sub, x, target)
    return binary_op(Binary.mul, binary_op(Binary.mul, diff, grad), scale)
