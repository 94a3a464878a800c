"""``cat`` (and so ``stack``, which torch builds from it): each input copied into its
slice of the result by the strided-copy kernel, converting to the promoted dtype."""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

import torch

from torch_accel.ops import _operands as operands
from torch_accel.ops._register import Unsupported, implements
from torch_accel.ops.copy import strided_into


def _cat_into(out: torch.Tensor | None, tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    # torch skips legacy empty 1-D inputs of any shape
    parts = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]
    if not parts or any(t.device != parts[0].device for t in tensors) \
            or any(t.dim() != parts[0].dim() for t in parts):
        raise Unsupported  # torch's own errors, from the CPU
    dtype = reduce(torch.promote_types, (t.dtype for t in tensors))
    if not operands.supported(dtype):
        raise Unsupported
    dim %= parts[0].dim()
    shape = list(parts[0].shape)
    if any(t.shape[:dim] + t.shape[dim + 1:] != parts[0].shape[:dim] + parts[0].shape[dim + 1:]
           for t in parts):
        raise Unsupported
    shape[dim] = sum(t.shape[dim] for t in parts)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=parts[0].device)
    elif list(out.shape) != shape:
        out.resize_(shape)
    at = 0
    for t in parts:
        if t.shape[dim]:
            strided_into(out.narrow(dim, at, t.shape[dim]), t)
        at += t.shape[dim]
    return out


implements("cat")(lambda tensors, dim=0: _cat_into(None, tensors, dim))
implements("cat.out")(lambda tensors, dim=0, *, out: _cat_into(out, tensors, dim))
