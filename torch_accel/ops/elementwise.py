"""Elementwise operators: arithmetic with broadcasting and type promotion, comparisons,
``where``, unary math and activations, fills; each a launch of one op-coded kernel.

Every family registers its functional, in-place and ``out=`` overloads (those aten has):
``add.Tensor``, ``add_.Tensor``, ``add.out``, and the ``.Scalar`` forms. Promotion is
torch's own (``torch.result_type``), an in-place result that cannot be cast to ``self``'s
dtype is refused with torch's message, and dtypes the kernels lack go to the CPU.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

import runtime
from torch_accel import _C, kernels
from torch_accel.kernels import Binary, Compare, Predicate, Unary
from torch_accel.kernels.elementwise import FLOAT_ONLY, INT_ONLY_BINARY
from torch_accel.ops import _operands as operands
from torch_accel.ops import _plans
from torch_accel.ops._register import Unsupported, implements, implements_in_shim
from torch_accel.ops._tensors import stream, view_of

_FLOATING = (torch.float32, torch.float64)
#: the Python numbers a plan takes as a scalar operand (numpy scalars take the full path)
_NUMBERS = (int, float, bool)


# ------------------------------------------------------------------------ binary
class _Pair:
    """Two inputs of an elementwise kernel after torch's rules: numbers for 0-d CPU
    tensors, the device, the promoted dtype and the broadcast shape."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = operands.as_number(a), operands.as_number(b)
        self.device = operands.device_of(self.a, self.b)
        self.result = torch.result_type(self.a, self.b)
        self.shape = operands.broadcast(self.a, self.b)

    def buffers(self, compute: torch.dtype) -> tuple[tuple[Any, int], tuple[Any, int]]:
        """((a's buffer, stride), (b's buffer or number, stride)) in ``compute``; the
        kernels take a number for ``b`` only, so a number ``a`` becomes a buffer."""
        if not operands.supported(compute):
            raise Unsupported
        if operands.is_number(self.a):
            a = (operands.number_buffer(self.a, compute, self.device), 0)
        else:
            a = operands.operand(self.a, compute, self.shape, self.device)
        return a, operands.operand(self.b, compute, self.shape, self.device)


def _binary_compute(op: Binary, result: torch.dtype) -> torch.dtype:
    """The dtype ``op`` computes in for operands promoting to ``result``."""
    if op == Binary.div and not result.is_floating_point:
        return torch.get_default_dtype()
    if result in _FLOATING and op in INT_ONLY_BINARY:
        raise Unsupported
    return result


def _binary_plan(op: Binary, a: torch.Tensor, b: Any, alpha: Any, in_place: bool
                 ) -> _plans.Plan | None:
    """The plan of ``a OP b`` when it is one launch on the operands as they are: one
    dtype throughout (no promotion, no conversion), the same shape (no broadcast, or a
    Python number ``b``), contiguous, not empty."""
    b_tensor = isinstance(b, torch.Tensor)
    if a.numel() == 0 or not a.is_contiguous() or (b_tensor and (
            b.device != a.device or b.dtype != a.dtype or b.shape != a.shape
            or not b.is_contiguous())):
        return None
    try:
        if _binary_compute(op, torch.result_type(a, b)) != a.dtype \
                or not operands.supported(a.dtype):
            return None
        va = view_of(a)  # also the result's stand-in: same dtype and shape
        launch = kernels.binary_launch(op, va, va, view_of(b) if b_tensor else b, alpha)
    except (Unsupported, TypeError):
        return None  # the full path decides (and says why)
    if launch is None:
        return None
    result = 0 if in_place else _plans.RESULT
    return _plans.Plan(launch.plan(), a.shape, a.dtype, (result, 0, 1 if b_tensor else 0),
                       _plans.like(a, a.shape, a.dtype))


def _binary_key(op: Binary, a: Any, b: Any, alpha: Any, in_place: bool
                ) -> tuple[int, tuple[Any, ...]] | None:
    """(device, key) of ``a OP b``'s launch plan; None when the call cannot have one. The
    key's tensors part is one call (``_C._signature``: devices, dtypes, sizes, strides)."""
    b_tensor = isinstance(b, torch.Tensor)
    if b_tensor:
        tensors = _C._signature(a, b)
    elif type(b) in _NUMBERS and b == b:  # (a NaN is never equal to its key)
        tensors = _C._signature(a)
    else:
        return None
    if tensors is None or type(alpha) not in _NUMBERS:
        return None  # not plain tensors (a subclass), or an alpha that is not a number
    device = a.get_device()  # (-1 off accel: a CPU 0-d tensor's ``a``)
    if device < 0:
        return None
    return device, ((Binary, op, type(alpha), _signed(alpha), in_place, tensors) if b_tensor
                    else (Binary, op, type(alpha), _signed(alpha), in_place, tensors, type(b),
                          _signed(b)))


def _signed(x: Any) -> Any:
    """A number as a key: a float zero by its sign too (``-0.0 == 0.0``, but a plan made
    for one writes the other's signs)."""
    return x if x or type(x) is not float else repr(x)


def _binary_planned(op: Binary, a: Any, b: Any, alpha: Any,
                    out: torch.Tensor | None) -> torch.Tensor | None:
    """``a OP b`` through its launch plan (ops/_plans.py); None when the call has none."""
    if out is not None and out is not a:
        return None
    in_place = out is not None
    if (keyed := _binary_key(op, a, b, alpha, in_place)) is None:
        return None
    device, key = keyed
    return _plans.call(device, key, _binary_plan, (op, a, b, alpha, in_place),
                       (a, b) if isinstance(b, torch.Tensor) else (a,), out)


#: the operators whose Tensor, Scalar and in-place overloads are the shim's C++ kernels
#: (csrc/shim.cpp, "hot arithmetic"); a position here is the shim's index of the op
HOT = (Binary.add, Binary.sub, Binary.mul, Binary.div)


def hot_plan(index: int, a: torch.Tensor, b: Any, alpha: Any, in_place: bool
             ) -> tuple[runtime.LaunchPlan, tuple[int, ...]] | None:
    """For the shim's kernel of ``HOT[index]``: the plan of ``a OP b`` (in place: into
    ``a``), from the table the Python kernel uses, as (its launch, where each buffer comes
    from: ``_plans.RESULT`` or an operand's index); None if this kind of call has none.
    The shim keeps the answer under its own key, until ``_plans.epoch`` moves."""
    op = HOT[index]
    if (keyed := _binary_key(op, a, b, alpha, in_place)) is None:
        return None
    device, key = keyed
    plan = _plans.lookup(device, key, _binary_plan, (op, a, b, alpha, in_place))
    return None if plan is None else (plan.launch, plan.sources)


_C._hot_plan(hot_plan, ctypes.addressof(_plans.epoch), runtime.sanitizer)


def binary_op(op: Binary, a: Any, b: Any, alpha: Any = 1,
              out: torch.Tensor | None = None) -> torch.Tensor:
    if (planned := _binary_planned(op, a, b, alpha, out)) is not None:
        return planned
    return _binary_checked(op, a, b, alpha, out)


def _binary_checked(op: Binary, a: Any, b: Any, alpha: Any,
                    out: torch.Tensor | None) -> torch.Tensor:
    """``a OP b`` through torch's rules and the kernel's checked launch (no plan)."""
    p = _Pair(a, b)
    compute = _binary_compute(op, p.result)
    operands.check_cast(compute, out)
    (ab, sa), (bb, sb) = p.buffers(compute)
    return operands.result(p.shape, compute, p.device, out, lambda o: kernels.binary(
        op, o, ab, bb, alpha, a_stride=sa, b_stride=sb, stream=stream(p.device.index)))


def _binary_family(name: str, op: Binary) -> None:
    """Register ``name``'s Tensor/Scalar, in-place and out= overloads on ``op``."""
    overloads = set(getattr(torch.ops.aten, name).overloads())
    inplace = set(getattr(torch.ops.aten, f"{name}_").overloads()) \
        if hasattr(torch.ops.aten, f"{name}_") else set()

    def functional(a: Any, b: Any, *, alpha: Any = 1) -> torch.Tensor:
        # binary_op without its frame: this is every eager ``a + b``
        if (planned := _binary_planned(op, a, b, alpha, None)) is not None:
            return planned
        return _binary_checked(op, a, b, alpha, None)

    def in_place(a: torch.Tensor, b: Any, *, alpha: Any = 1) -> torch.Tensor:
        return binary_op(op, a, b, alpha, out=a)

    def with_out(a: Any, b: Any, *, alpha: Any = 1, out: torch.Tensor) -> torch.Tensor:
        return binary_op(op, a, b, alpha, out=out)

    if "default" in overloads:
        implements(name)(lambda a, b: binary_op(op, a, b))
    if op in HOT:
        implements_in_shim(HOT.index(op), name, functional, in_place,
                           alpha="alpha" in str(getattr(torch.ops.aten, name).Tensor._schema))
    else:
        _register_forms(name, overloads, inplace, functional, in_place)
    if "out" in overloads:
        implements(f"{name}.out")(with_out)


def _register_forms(name: str, overloads: set[str], inplace: set[str],
                    functional: Any, in_place: Any) -> None:
    """Register the Python kernels of ``name``'s Tensor and Scalar overloads (those it
    has) and their in-place forms."""
    for form in ("Tensor", "Scalar"):
        if form in overloads:
            implements(f"{name}.{form}")(functional)
        if form in inplace:
            implements(f"{name}_.{form}")(in_place)


for _name_, _op in (("add", Binary.add), ("sub", Binary.sub), ("mul", Binary.mul),
                    ("div", Binary.div), ("remainder", Binary.remainder),
                    ("maximum", Binary.maximum), ("minimum", Binary.minimum),
                    ("bitwise_and", Binary.bitwise_and), ("bitwise_or", Binary.bitwise_or),
                    ("bitwise_xor", Binary.bitwise_xor), ("floor_divide", Binary.floor_divide)):
    _binary_family(_name_, _op)


@implements("_foreach_add_.List")
def foreach_add_(selves: list[torch.Tensor], others: list[torch.Tensor], *,
                 alpha: Any = 1) -> None:
    """``selves[i] += alpha * others[i]`` (an SGD step: ``_foreach_add_(params, grads,
    alpha=-lr)``): each pair's planned in-place add, in one call from the dispatcher where
    torch's default made one dispatch of ``add_`` per pair; a pair without a plan
    dispatches its ``add_`` as that default does."""
    if len(selves) != len(others):
        raise Unsupported  # the CPU raises torch's error
    for a, b in zip(selves, others):
        if _binary_planned(Binary.add, a, b, alpha, a) is None:
            torch.ops.aten.add_.Tensor(a, b, alpha=alpha)


@implements("div.Tensor_mode", "div.Scalar_mode")
def div_mode(a: Any, b: Any, *, rounding_mode: str | None = None) -> torch.Tensor:
    if rounding_mode is None:
        return binary_op(Binary.div, a, b)
    if rounding_mode == "floor":
        return binary_op(Binary.floor_divide, a, b)
    q = binary_op(Binary.div, a, b)
    result = torch.result_type(operands.as_number(a), operands.as_number(b))
    return unary_op(Unary.trunc, q).to(result)


@implements("pow.Tensor_Tensor", "pow.Tensor_Scalar")
def pow_(a: Any, b: Any) -> torch.Tensor:
    return binary_op(Binary.pow, a, b)


@implements("pow.Scalar")
def pow_scalar(a: Any, b: torch.Tensor) -> torch.Tensor:
    return binary_op(Binary.pow, a, b)


@implements("pow_.Scalar", "pow_.Tensor")
def pow_inplace(a: torch.Tensor, b: Any) -> torch.Tensor:
    return binary_op(Binary.pow, a, b, out=a)


def _logical(op: Binary, a: Any, b: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's logical op in the promoted dtype (0 or 1), then converted to bool."""
    p = _Pair(a, b)
    (ab, sa), (bb, sb) = p.buffers(p.result)
    tmp = torch.empty(p.shape, dtype=p.result, device=p.device)
    kernels.binary(op, view_of(tmp), ab, bb, a_stride=sa, b_stride=sb,
                   stream=stream(p.device.index))
    if out is None:
        return tmp.to(torch.bool)
    if out.shape != p.shape:
        out.resize_(p.shape)
    return out.copy_(tmp)


for _name_, _op in (("logical_and", Binary.logical_and), ("logical_or", Binary.logical_or),
                    ("logical_xor", Binary.logical_xor)):
    implements(f"{_name_}")(lambda a, b, _o=_op: _logical(_o, a, b))
    implements(f"{_name_}.out")(lambda a, b, *, out, _o=_op: _logical(_o, a, b, out))
    implements(f"{_name_}_")(lambda a, b, _o=_op: _logical(_o, a, b, a))


# ---------------------------------------------- optimiser arithmetic (Adam, SGD ...)
def _addc(op: Binary, x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: Any,
          out: torch.Tensor | None) -> torch.Tensor:
    """``x + value * (t1 OP t2)``: two launches."""
    return operands.into(out, binary_op(Binary.add, x, binary_op(op, t1, t2), value))


implements("addcmul")(lambda x, t1, t2, *, value=1: _addc(Binary.mul, x, t1, t2, value, None))
implements("addcmul_")(lambda x, t1, t2, *, value=1: _addc(Binary.mul, x, t1, t2, value, x))
implements("addcmul.out")(
    lambda x, t1, t2, *, value=1, out: _addc(Binary.mul, x, t1, t2, value, out))
implements("addcdiv")(lambda x, t1, t2, *, value=1: _addc(Binary.div, x, t1, t2, value, None))
implements("addcdiv_")(lambda x, t1, t2, *, value=1: _addc(Binary.div, x, t1, t2, value, x))
implements("addcdiv.out")(
    lambda x, t1, t2, *, value=1, out: _addc(Binary.div, x, t1, t2, value, out))


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: Any,
          out: torch.Tensor | None) -> torch.Tensor:
    """torch's formula, exact at both ends: ``start + w * (end - start)`` for ``|w| < 0.5``,
    else ``end + (w - 1) * (end - start)`` (a weight tensor goes to the CPU)."""
    weight = operands.as_number(weight)
    if not operands.is_number(weight):
        raise Unsupported
    step = binary_op(Binary.sub, end, start)
    near_end = abs(weight) >= 0.5
    base, coeff = (end, weight - 1) if near_end else (start, weight)
    return operands.into(out, binary_op(Binary.add, base, binary_op(Binary.mul, step, coeff)))


implements("lerp.Scalar", "lerp.Tensor")(lambda a, b, w: _lerp(a, b, w, None))
implements("lerp_.Scalar", "lerp_.Tensor")(lambda a, b, w: _lerp(a, b, w, a))
implements("lerp.Scalar_out", "lerp.Tensor_out")(lambda a, b, w, *, out: _lerp(a, b, w, out))


# ------------------------------------------------------------------------ compare
def compare_op(op: Compare, a: Any, b: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    p = _Pair(a, b)
    (ab, sa), (bb, sb) = p.buffers(p.result)
    return operands.result(p.shape, torch.bool, p.device, out, lambda o: kernels.compare(
        op, o, ab, bb, a_stride=sa, b_stride=sb, stream=stream(p.device.index)))


for _name_, _op in (("eq", Compare.eq), ("ne", Compare.ne), ("lt", Compare.lt),
                    ("le", Compare.le), ("gt", Compare.gt), ("ge", Compare.ge)):
    implements(f"{_name_}.Tensor", f"{_name_}.Scalar")(lambda a, b, _o=_op: compare_op(_o, a, b))
    implements(f"{_name_}.Tensor_out", f"{_name_}.Scalar_out")(
        lambda a, b, *, out, _o=_op: compare_op(_o, a, b, out))
    implements(f"{_name_}_.Tensor", f"{_name_}_.Scalar")(
        lambda a, b, _o=_op: compare_op(_o, a, b, a))


# -------------------------------------------------------------------------- unary
def _unary_plan(op: Unary, x: torch.Tensor, p0: float, p1: float, in_place: bool
                ) -> _plans.Plan | None:
    """The plan of ``OP(x)`` when it is one launch on ``x`` as it is: computed in its own
    dtype, contiguous, not empty, not bool."""
    if x.numel() == 0 or not x.is_contiguous() or x.dtype == torch.bool \
            or not operands.supported(x.dtype) \
            or (op in FLOAT_ONLY and not x.dtype.is_floating_point):
        return None
    vx = view_of(x)
    try:
        launch = kernels.unary_launch(op, vx, vx, p0, p1)
    except TypeError:
        return None
    if launch is None:
        return None
    return _plans.Plan(launch.plan(), x.shape, x.dtype, (0 if in_place else _plans.RESULT, 0),
                       _plans.like(x, x.shape, x.dtype))


def _unary_planned(op: Unary, x: Any, p0: Any, p1: Any,
                   out: torch.Tensor | None) -> torch.Tensor | None:
    """``OP(x)`` through its launch plan (ops/_plans.py); None when the call has none."""
    if not isinstance(x, torch.Tensor) or (out is not None and out is not x) \
            or type(p0) not in _NUMBERS or type(p1) not in _NUMBERS or p0 != p0 or p1 != p1:
        return None
    tensors = _C._signature(x)
    device = x.get_device()  # (-1 off accel)
    if tensors is None or device < 0:
        return None
    in_place = out is not None
    key = (Unary, op, type(p0), p0, type(p1), p1, in_place, tensors)
    return _plans.call(device, key, _unary_plan, (op, x, p0, p1, in_place), (x,), out)


def unary_op(op: Unary, x: torch.Tensor, p0: float = 0.0, p1: float = 0.0,
             out: torch.Tensor | None = None) -> torch.Tensor:
    if (planned := _unary_planned(op, x, p0, p1, out)) is not None:
        return planned
    compute = x.dtype
    if op in FLOAT_ONLY and not compute.is_floating_point:
        compute = torch.get_default_dtype()
    if not operands.supported(compute) or (compute == torch.bool and op != Unary.bitwise_not):
        raise Unsupported
    operands.check_cast(compute, out)
    xb, _ = operands.operand(x, compute, x.shape, x.device)
    return operands.result(x.shape, compute, x.device, out, lambda o: kernels.unary(
        op, o, xb, p0, p1, stream=stream(x.device.index)))


_UNARY = ("neg", "abs", "exp", "log", "log2", "log10", "log1p", "expm1", "sqrt", "rsqrt",
          "reciprocal", "sin", "cos", "tan", "tanh", "sigmoid", "relu", "silu", "sign",
          "floor", "ceil", "trunc", "bitwise_not")


def _unary_family(name: str, op: Unary) -> None:
    implements(f"{name}")(lambda x, _o=op: unary_op(_o, x))
    if "out" in getattr(torch.ops.aten, name).overloads():
        implements(f"{name}.out")(lambda x, *, out, _o=op: unary_op(_o, x, out=out))
    if hasattr(torch.ops.aten, f"{name}_"):
        implements(f"{name}_")(lambda x, _o=op: unary_op(_o, x, out=x))


for _name_ in _UNARY:
    _unary_family(_name_, Unary[_name_])


@implements("round")
def round_(x: torch.Tensor) -> torch.Tensor:
    return unary_op(Unary.round, x)


@implements("gelu")
def gelu(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    return unary_op(Unary.gelu_tanh if approximate == "tanh" else Unary.gelu, x)


@implements("leaky_relu")
def leaky_relu(x: torch.Tensor, negative_slope: float = 0.01) -> torch.Tensor:
    return unary_op(Unary.leaky_relu, x, float(negative_slope))


@implements("hardtanh")
def hardtanh(x: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0) -> torch.Tensor:
    return unary_op(Unary.clamp, x, min_val, max_val)


@implements("clamp")
def clamp(x: torch.Tensor, min: Any = None, max: Any = None) -> torch.Tensor:  # noqa: A002
    if isinstance(min, torch.Tensor) or isinstance(max, torch.Tensor):
        raise Unsupported
    big = float("inf") if x.dtype.is_floating_point else torch.iinfo(x.dtype).max \
        if x.dtype != torch.bool else 1
    lo = -big if min is None else min
    hi = big if max is None else max
    if x.dtype.is_floating_point is False and (isinstance(lo, float) or isinstance(hi, float)):
        raise Unsupported  # torch promotes an int tensor clamped by floats
    return unary_op(Unary.clamp, x, lo, hi)


@implements("nan_to_num")
def nan_to_num(x: torch.Tensor, nan: float | None = None, posinf: float | None = None,
               neginf: float | None = None) -> torch.Tensor:
    if not x.dtype.is_floating_point or (nan not in (None, 0.0)):
        raise Unsupported
    info = torch.finfo(x.dtype)
    return unary_op(Unary.nan_to_num, x, info.max if posinf is None else posinf,
                    info.min if neginf is None else neginf)


def _predicate(op: Predicate, x: torch.Tensor) -> torch.Tensor:
    if not operands.supported(x.dtype):
        raise Unsupported
    xb, _ = operands.operand(x, x.dtype, x.shape, x.device)
    return operands.result(x.shape, torch.bool, x.device, None, lambda o: kernels.predicate(
        op, o, xb, stream=stream(x.device.index)))


implements("isnan")(lambda x: _predicate(Predicate.isnan, x))
implements("logical_not")(lambda x: _predicate(Predicate.logical_not, x))
implements("signbit")(lambda x: _predicate(Predicate.signbit, x))


# -------------------------------------------------------------------- where, fill
@implements("where.self")
def where(cond: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
    a, b = operands.as_number(a), operands.as_number(b)
    device = operands.device_of(cond, a, b)
    compute = torch.result_type(a, b)
    if not operands.supported(compute):
        raise Unsupported
    shape = operands.broadcast(cond, a, b)
    cb, sc = operands.operand(cond, torch.bool, shape, device)
    ab, sa = (operands.number_buffer(a, compute, device), 0) if operands.is_number(a) else \
        operands.operand(a, compute, shape, device)
    bb, sb = (operands.number_buffer(b, compute, device), 0) if operands.is_number(b) else \
        operands.operand(b, compute, shape, device)
    return operands.result(shape, compute, device, None, lambda o: kernels.where(
        o, cb, ab, bb, cond_stride=sc, a_stride=sa, b_stride=sb, stream=stream(device.index)))


def _fill_plan(x: torch.Tensor, value: Any) -> _plans.Plan | None:
    """The plan of ``x.fill_(value)``: the fill kernel on a contiguous non-empty ``x``."""
    if x.numel() == 0 or not x.is_contiguous() or not operands.supported(x.dtype):
        return None
    launch = kernels.fill_launch(view_of(x), value)
    return _plans.Plan(launch.plan(), x.shape, x.dtype, (0,))


@implements("fill_.Scalar")
def fill_(x: torch.Tensor, value: Any) -> torch.Tensor:
    """A fill with zero bits is a memset packet (the copy engine's, as cudaMemset);
    anything else the fill kernel (planned for a Python number: ``ones_like``'s, as the
    gradient ``backward()`` seeds)."""
    if x.is_contiguous() and not isinstance(value, complex) and value == 0 \
            and math.copysign(1.0, value) > 0:
        if x.numel():
            view_of(x).memset(0, stream=stream(x.device.index))
        return x
    if type(value) in _NUMBERS and value == value and (sig := _C._signature(x)) is not None \
            and (device := x.get_device()) >= 0 and _plans.call(
                device, (_fill_plan, type(value), value, sig), _fill_plan, (x, value), (x,),
                x) is not None:
        return x
    if not operands.supported(x.dtype):
        raise Unsupported
    return operands.result(x.shape, x.dtype, x.device, x, lambda o: kernels.fill(
        o, value, stream=stream(x.device.index)))


@implements("fill_.Tensor")
def fill_tensor(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return fill_(x, value.item())


@implements("zero_")
def zero_(x: torch.Tensor) -> torch.Tensor:
    return fill_(x, 0)


@implements("arange.start_out")
def arange_out(start: Any, end: Any, step: Any = 1, *, out: torch.Tensor) -> torch.Tensor:
    """``start + i * step`` for i below torch's count ``ceil((end - start) / step)``,
    computed in float64 (int64 for integer outputs) and stored, as torch's CPU kernel."""
    if not operands.supported(out.dtype) or out.dtype == torch.bool or step == 0:
        raise Unsupported  # torch's own errors (a zero step, a bool range) from the CPU
    if out.dtype.is_floating_point:
        count = math.ceil((float(end) - float(start)) / float(step))
    else:
        count = -((int(start) - int(end)) // int(step))  # ceil division, exact in ints
    if count < 0:
        raise Unsupported
    if out.numel() != count:
        out.resize_(count)
    return operands.result(out.shape, out.dtype, out.device, out, lambda o: kernels.arange(
        o, start, step, stream=stream(out.device.index)))

