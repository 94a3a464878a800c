"""Batch norm on the device: ``native_batch_norm`` and its backward (what ``nn.BatchNorm*``
and ``F.batch_norm`` reach for an accel tensor), composed of the device's reductions and
elementwise kernels, float32 and float64. Other dtypes run torch's CPU kernel through the
counted fallback, which copies the running statistics back (fallback.UNDECLARED_WRITES).

The statistics are torch's: the batch mean and biased variance over every dimension but
the channels (two passes, as the CPU's kernel), ``running_* = (1 - momentum) * running_*
+ momentum * batch_*`` with the unbiased variance, updated in place on the device; saved
are the batch mean and ``1 / sqrt(var + eps)``. Evaluation normalises by the running
statistics and saves nothing (0-element tensors, as the CPU)."""

from __future__ import annotations

import torch

from torch_accel.ops._register import Unsupported, implements

_FLOAT = (torch.float32, torch.float64)


def _check(x: torch.Tensor, *others: torch.Tensor | None) -> None:
    if x.dtype not in _FLOAT or x.dim() < 2 or any(
            t is not None and (t.dtype != x.dtype or t.device != x.device) for t in others):
        raise Unsupported


def _per_channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A ``[C]`` tensor shaped to broadcast against ``x`` (``[N, C, ...]``)."""
    return t.reshape([1, -1] + [1] * (x.dim() - 2))


def _reduced(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


@implements("native_batch_norm")
def batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
               training: bool, momentum: float, eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(x, weight, bias, running_mean, running_var)
    dims = _reduced(x)
    if training:
        n = x.numel() // x.size(1)
        mean = x.sum(dims) / n
        centred = x - _per_channel(mean, x)
        var = (centred * centred).sum(dims) / n
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean * momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_(var * (momentum * n / max(n - 1, 1)))
        out = centred * _per_channel(invstd, x)
        saved = (mean, invstd)
    else:
        if running_mean is None or running_var is None:
            raise RuntimeError("running_mean and running_var must be defined in evaluation mode")
        invstd = torch.rsqrt(running_var + eps)
        out = (x - _per_channel(running_mean, x)) * _per_channel(invstd, x)
        nothing = torch.empty(0, dtype=x.dtype, device=x.device)
        saved = (nothing, nothing.clone())
    if weight is not None:
        out = out * _per_channel(weight, x)
    if bias is not None:
        out = out + _per_channel(bias, x)
    return (out, *saved)


@implements("native_batch_norm_backward")
def batch_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                        running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                        save_mean: torch.Tensor | None, save_invstd: torch.Tensor | None,
                        train: bool, eps: float, output_mask: list[bool]
                        ) -> tuple[torch.Tensor | None, ...]:
    _check(x, grad, weight, running_mean, running_var, save_mean, save_invstd)
    dims = _reduced(x)
    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean, invstd = running_mean, torch.rsqrt(running_var + eps)
    if mean is None or invstd is None:
        raise Unsupported  # torch's own error, from the CPU
    xhat = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    grad_bias = grad.sum(dims)
    grad_weight = (grad * xhat).sum(dims)
    scale = invstd if weight is None else invstd * weight
    if train:
        n = x.numel() // x.size(1)
        inner = grad - _per_channel(grad_bias / n, x) - xhat * _per_channel(grad_weight / n, x)
        grad_x = inner * _per_channel(scale, x)
    else:
        grad_x = grad * _per_channel(scale, x)
    return (grad_x if output_mask[0] else None,
            grad_weight if output_mask[1] else None,
            grad_bias if output_mask[2] else None)
