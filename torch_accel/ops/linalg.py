"""Matrix products on the device's matrix unit: ``mm``, ``addmm``, ``bmm``, and ``mv``,
``addmv`` and ``dot`` as thin tiles (``linear`` and ``matmul`` decompose into them).
float32 and float64; an operand stored transposed (``w.t()``, as ``linear`` and every
backward pass hand them) is read in place by the unit (mma's ``ta``/``tb``), and so is a
2-D column slice (BLAS's leading dimension); other non-contiguous operands are copied
contiguous first; other dtypes run on the CPU."""

from __future__ import annotations

from typing import Any

import torch

from torch_accel import _C, kernels
from torch_accel.ops import _operands as operands
from torch_accel.ops import _plans
from torch_accel.ops._register import Unsupported, implements
from torch_accel.ops._tensors import storage_of, stream, view_of
from torch_accel.ops.copy import contiguous_on_device, strided_into

_FLOAT = (torch.float32, torch.float64)


def _float(*ts: torch.Tensor) -> None:
    """Refuse what the unit cannot take (float32/float64 of one dtype), to the CPU."""
    operands.device_of(*ts)  # refuses two devices, whatever the dtype
    dtype = ts[0].dtype
    if dtype not in _FLOAT or any(t.dtype != dtype for t in ts):
        raise Unsupported


def _operand(t: torch.Tensor) -> tuple[Any, bool]:
    """``t`` (matrices in its last two dimensions) as the unit reads it, and whether it
    is stored transposed: itself when contiguous, its transpose's storage when that is
    contiguous, a matrix's (or its transpose's) rows spaced further apart than its
    columns (a column slice) as the wider rows, all without a copy; else a contiguous
    copy."""
    stored = _stored(t)
    if stored is not None:
        return stored
    for x, transposed in ((t, False), (t.transpose(-2, -1), True)):
        rows = _wide_rows(x) if x.dim() == 2 else None
        if rows is not None:
            return rows, transposed
    return _view(contiguous_on_device(t)), False


def _wide_rows(t: torch.Tensor) -> Any | None:
    """A 2-D ``t`` of unit column stride whose rows are ``ld`` > its width apart, as the
    ``[rows, ld]`` window of its storage from its first element (the unit reads only the
    matrix's columns of it); None when the storage does not hold the whole window."""
    rows, cols = t.shape
    ld, unit = t.stride()
    if unit != 1 or ld < cols or rows == 0:
        return None
    if t.storage_offset() + rows * ld > t.untyped_storage().nbytes() // t.element_size():
        return None
    storage = storage_of(t)
    return storage.view(storage.dtype, (rows, ld), t.storage_offset() * t.element_size())


def _view(t: torch.Tensor) -> Any:
    return view_of(t).view(view_of(t).dtype, tuple(t.shape))


def _check(ok: bool) -> None:
    if not ok:
        raise Unsupported  # the CPU raises torch's own shape error


def _shares_storage(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


def _direct_out(out: torch.Tensor | None, shape: tuple[int, int], a: torch.Tensor,
                b: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the unit can write the product straight into ``out``: contiguous, the
    result's shape and device, and read by no operand (``bias`` may be ``out``
    itself, as ``addmm_`` passes it). Otherwise the product is made apart and copied in."""
    if out is None or not out.is_contiguous() or tuple(out.shape) != shape \
            or out.device != a.device:
        return False
    if _shares_storage(out, a) or _shares_storage(out, b):
        return False
    return bias is None or not _shares_storage(out, bias) or _same_view(out, bias)


def _same_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` are the same elements of one storage, laid out alike."""
    return _shares_storage(x, y) and x.shape == y.shape and x.stride() == y.stride() \
        and x.storage_offset() == y.storage_offset() and x.dtype == y.dtype


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
             beta: Any = 0, alpha: Any = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """``beta * bias + alpha * a @ b`` on the unit (``bias`` broadcast into the output
    first; beta 0 ignores it, NaN included), into ``out`` if given. A compiled graph calls
    every product with ``out=``: writing it there directly saves a device copy per
    product."""
    if (planned := _planned(a, b, bias, beta, alpha, out)) is not None:
        return planned
    operands.device_of(bias, a, b)
    _float(a, b)
    _check(out is None or out.dtype == a.dtype)  # torch's "Expected out tensor to have dtype"
    shape = (a.shape[0], b.shape[1])
    direct = _direct_out(out, shape, a, b, bias)
    res = out if direct else torch.empty(shape, dtype=a.dtype, device=a.device)
    beta = float(beta) if bias is not None else 0.0
    row = None  # a bias of one row, as linear's: the kernel fills res with it
    if beta != 0 and not _same_view(res, bias):
        bias = bias.to(a.dtype)
        if bias.dim() == 2 and bias.shape[0] == 1:
            bias = bias[0]
        if bias.dim() == 1 and bias.shape[0] == shape[1] and bias.is_contiguous():
            row = view_of(bias)
        else:
            strided_into(res, bias)
    (va, ta), (vb, tb) = _operand(a), _operand(b)
    kernels.mm(_view(res), va, vb, beta=beta, alpha=float(alpha),
               stream=stream(a.device.index), ta=ta, tb=tb, bias=row, k=a.shape[1])
    return res if direct else operands.into(out, res)


def _planned(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, beta: Any,
             alpha: Any, out: torch.Tensor | None) -> torch.Tensor | None:
    """``beta * bias + alpha * a @ b`` through its launch plan (ops/_plans.py), the training
    loop's case: operands read as stored (contiguous or transposed), a bias of one row
    (``linear``'s) or none, nothing empty, into a new result or straight into ``out``. Its
    key is the operands' signature (``_C._signature``), so a call costs no more Python
    than an elementwise one: through the checked path below a product cost ~100 us of
    host time, planned ~10 us (docs/torch.md, "Where an eager op's time goes"). None: the
    call has no plan, and the path below decides."""
    if type(alpha) not in (int, float) or alpha != alpha:
        return None
    if bias is not None and type(beta) in (int, float) and beta == 0 \
            and bias.device == a.device:
        bias = None  # beta 0 ignores the bias, NaN included
    if bias is None:
        sig, tensors, beta = _C._signature(a, b), (a, b), 0.0
    elif type(beta) in (int, float) and beta == beta:
        sig, tensors, beta = _C._signature(a, b, bias), (a, b, bias), float(beta)
    else:
        return None
    device = a.get_device()
    if sig is None or device < 0 or (out is not None and not (
            out.dtype == a.dtype and _direct_out(out, (a.shape[0], b.shape[1]), a, b, bias)
            and (bias is None or not _shares_storage(bias, out)))):
        return None
    return _plans.call(device, (_planned, sig, beta, type(alpha), alpha), _product_plan,
                       (a, b, bias, beta, alpha), tensors, out)


def _product_plan(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, beta: float,
                  alpha: Any) -> _plans.Plan | None:
    """The unit's launch for this kind of call (see :func:`_planned`), or None."""
    dtype = a.dtype
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or dtype not in _FLOAT \
            or b.dtype != dtype or b.device != a.device:
        return None
    shape = (a.shape[0], b.shape[1])
    if 0 in shape or a.shape[1] == 0:
        return None
    if bias is not None and not (bias.dim() in (1, 2) and bias.shape[-1] == shape[1]
                                 and bias.numel() == shape[1] and bias.is_contiguous()
                                 and bias.dtype == dtype and bias.device == a.device):
        return None
    stored = [_stored(t) for t in (a, b)]
    if None in stored:
        return None
    (va, ta), (vb, tb) = stored
    stand_in = torch.empty(shape, dtype=dtype, device=a.device)  # the result's shape
    launch = kernels.mm_plan(_view(stand_in), va, vb, beta, float(alpha), ta, tb,
                             view_of(bias).view(view_of(bias).dtype, (shape[1],))
                             if bias is not None else None)
    return _plans.Plan(launch, shape, dtype,
                       (_plans.RESULT, 0, 1, 2 if bias is not None else _plans.RESULT))


def _stored(t: torch.Tensor) -> tuple[Any, bool] | None:
    """A matrix as the unit reads it without a copy, and whether that is its transpose
    (mma's ``ta``/``tb``): contiguous one way or the other; None otherwise (the checked
    path copies it, or reads a column slice)."""
    if t.is_contiguous():
        return _view(t), False
    flipped = t.transpose(-2, -1)
    return (_view(flipped), True) if flipped.is_contiguous() else None


@implements("mm", "mm.out")
def mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    _check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0])
    return _product(a, b, out=out)


@implements("addmm", "addmm.out")
def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1,
          alpha: Any = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    _check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and bias.dim() <= 2)
    return _product(a, b, bias, beta, alpha, out)


@implements("bmm")
def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check(a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1])
    _float(a, b)
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    (va, ta), (vb, tb) = _operand(a), _operand(b)
    kernels.bmm(_view(out), va, vb, stream=stream(a.device.index), ta=ta, tb=tb)
    return out


@implements("mv")
def mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A matrix-vector product is an ``[m, k] @ [k, 1]`` tile on the unit."""
    _check(a.dim() == 2 and v.dim() == 1 and a.shape[1] == v.shape[0])
    return mm(a, v.reshape(-1, 1)).reshape(-1)


@implements("addmv")
def addmv(bias: torch.Tensor, a: torch.Tensor, v: torch.Tensor, *, beta: Any = 1,
          alpha: Any = 1) -> torch.Tensor:
    _check(a.dim() == 2 and v.dim() == 1 and a.shape[1] == v.shape[0] and bias.dim() <= 1)
    column = bias.reshape(-1, 1) if bias.dim() == 1 else bias
    return addmm(column, a, v.reshape(-1, 1), beta=beta, alpha=alpha).reshape(-1)


@implements("dot")
def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check(a.dim() == 1 and b.dim() == 1 and a.shape == b.shape)
    return mm(a.reshape(1, -1), b.reshape(-1, 1)).reshape(())


def _out_form(fn: Any) -> Any:
    """The ``out=`` overload of a product: computed, then moved into ``out``."""
    return lambda *args, out, **kwargs: operands.into(out, fn(*args, **kwargs))


for _name_, _fn in (("bmm", bmm), ("addmv", addmv)):
    implements(f"{_name_}.out")(_out_form(_fn))
