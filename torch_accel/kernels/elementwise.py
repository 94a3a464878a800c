"""Elementwise kernels: binary arithmetic, comparisons, unary math, predicates, ``where``
and ``fill``/``arange``, each one kernel per dtype with the operation chosen by an int
scalar ``op`` (a compile costs seconds; a uniform branch costs nothing measurable).

Operands are flat buffers read at ``i * stride`` (stride 0: a one-element buffer acts as
a scalar) or a Python scalar for ``b``. Arithmetic on float32 runs in float64 and is
rounded once when stored: for ``+ - * /`` that is the correctly rounded float32 result
(float64 has more than twice float32's bits), so results equal torch's. Bool buffers run
through the uint8 kernels (their bytes are 0 or 1) with the bool ops mapped onto logical
ones (``add`` is ``or``, ``mul`` is ``and``, as in torch).

Python-scalar ``b``: passed as a kernel scalar (``b_stride`` is ignored), no device
buffer is allocated for it.
"""

from __future__ import annotations

import enum

import numpy as np

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.kernels._shared import Array, Launch


class Binary(enum.IntEnum):
    """``binary`` op codes."""

    add = 0  # a + alpha * b
    sub = 1  # a - alpha * b
    mul = 2
    div = 3  # true division (floats only: ints reach it converted to float)
    floor_divide = 4  # Python/torch: floor(a / b), sign of the divisor for the remainder
    remainder = 5
    pow = 6
    maximum = 7  # NaN propagating
    minimum = 8
    bitwise_and = 9  # ints and bool
    bitwise_or = 10
    bitwise_xor = 11
    logical_and = 12
    logical_or = 13
    logical_xor = 14
    lshift = 15  # ints
    rshift = 16


class Compare(enum.IntEnum):
    """``compare`` op codes (into a bool buffer)."""

    eq = 0
    ne = 1
    lt = 2
    le = 3
    gt = 4
    ge = 5


class Unary(enum.IntEnum):
    """``unary`` op codes; those marked float take float input only."""

    neg = 0
    abs = 1
    square = 2
    sign = 3
    relu = 4
    clamp = 5  # max(min(x, p1), p0); hardtanh is clamp
    bitwise_not = 6  # ints (bool: logical not)
    exp = 7  # float from here on
    log = 8
    log2 = 9
    log10 = 10
    log1p = 11
    expm1 = 12
    sqrt = 13
    rsqrt = 14
    reciprocal = 15
    sin = 16
    cos = 17
    tan = 18
    tanh = 19
    sigmoid = 20
    gelu = 21  # exact, 0.5 x (1 + erf(x / sqrt 2))
    gelu_tanh = 22
    silu = 23
    floor = 24
    ceil = 25
    trunc = 26
    round = 27  # half to even
    leaky_relu = 28  # slope p0
    elu = 29  # alpha p0
    softplus = 30  # log1p(exp(x)), x itself above 20
    nan_to_num = 31  # NaN 0, +inf p0, -inf p1


class Predicate(enum.IntEnum):
    """``predicate`` op codes (into a bool buffer)."""

    isnan = 0
    isinf = 1
    isfinite = 2
    logical_not = 3
    signbit = 4


FLOAT_ONLY = frozenset(u for u in Unary if u >= Unary.exp)
INT_ONLY_BINARY = frozenset({Binary.bitwise_and, Binary.bitwise_or, Binary.bitwise_xor,
                             Binary.lshift, Binary.rshift})
#: bool ``binary`` ops and the uint8 op computing each on 0/1 bytes
BOOL_BINARY = {Binary.add: Binary.logical_or, Binary.mul: Binary.logical_and,
               Binary.maximum: Binary.logical_or, Binary.minimum: Binary.logical_and,
               Binary.bitwise_and: Binary.bitwise_and, Binary.bitwise_or: Binary.bitwise_or,
               Binary.bitwise_xor: Binary.bitwise_xor, Binary.logical_and: Binary.logical_and,
               Binary.logical_or: Binary.logical_or, Binary.logical_xor: Binary.logical_xor}

#: float64 limit below which floor() of a double is exact in int64 (above it every
#: double is an integer already); floor() of the language returns an int64
_BIG = "4503599627370496.0"


def erf_source(z: str, out: str) -> str:
    """Kernel statements setting ``out`` to erf(``z``) (float64; the language has no
    erf): Taylor series for |z| < 2 (40 terms, error ~1e-15) and the Chebyshev-fitted
    erfc of Numerical Recipes beyond (relative error below 1.2e-7 of erfc <= 0.0047)."""
    return f"""_ez = {z}
_ea = abs(_ez)
if _ea < 2.0:
    _ez2 = _ez * _ez
    _et = _ez
    _es = _ez
    for _ek in range(1, 40):
        _et = -_et * _ez2 / _ek
        _es += _et / (2 * _ek + 1)
    {out} = _es * 1.1283791670955126
else:
    _eu = 1.0 / (1.0 + 0.5 * _ea)
    _ec = _eu * exp(-_ea * _ea - 1.26551223 + _eu * (1.00002368 + _eu * (0.37409196 + _eu * (0.09678418 + _eu * (-0.18628806 + _eu * (0.27886807 + _eu * (-1.13520398 + _eu * (1.48851587 + _eu * (-0.82215223 + _eu * 0.17087277)))))))))
    {out} = 1.0 - _ec if _ez > 0 else _ec - 1.0"""


def _floor(v: str) -> str:
    """A float floor that stays a float (NaN, inf and huge values are their own floor)."""
    return f"(float(floor({v})) if abs({v}) < {_BIG} else {v})"


_BINARY_OPS = {
    Binary.add: "out[i] = x + alpha * y",
    Binary.sub: "out[i] = x - alpha * y",
    Binary.mul: "out[i] = x * y",
    Binary.div: "out[i] = x / y",
    Binary.floor_divide: "out[i] = x // y",
    Binary.remainder: "out[i] = x % y",
    Binary.pow: "out[i] = x ** y",
    Binary.maximum: "out[i] = x if x > y or x != x else y",
    Binary.minimum: "out[i] = x if x < y or x != x else y",
    Binary.bitwise_and: "out[i] = x & y",
    Binary.bitwise_or: "out[i] = x | y",
    Binary.bitwise_xor: "out[i] = x ^ y",
    Binary.logical_and: "out[i] = 1 if x != 0 and y != 0 else 0",
    Binary.logical_or: "out[i] = 1 if x != 0 or y != 0 else 0",
    Binary.logical_xor: "out[i] = 1 if (x != 0) != (y != 0) else 0",
    Binary.lshift: "out[i] = x << y",
    Binary.rshift: "out[i] = x >> y",
}

_UNARY_OPS = {
    Unary.neg: "out[i] = -v",
    Unary.abs: "out[i] = abs(v)",
    Unary.square: "out[i] = v * v",
    Unary.sign: "out[i] = v * 0 if v == 0 or v != v else (1 if v > 0 else -1)",
    Unary.relu: "out[i] = v if v > 0 or v != v else 0",
    Unary.clamp: "out[i] = p0 if v < p0 else (p1 if v > p1 else v)",
    Unary.bitwise_not: "out[i] = ~v",
    Unary.exp: "out[i] = exp(v)",
    Unary.log: "out[i] = log(v)",
    Unary.log2: "out[i] = log(v) * 1.4426950408889634",
    Unary.log10: "out[i] = log(v) * 0.4342944819032518",
    # Goldberg's log1p and Kahan's expm1: exact where 1 + v rounds, no erf-like series
    Unary.log1p: "u = 1.0 + v\nout[i] = v if u == 1.0 else log(u) * v / (u - 1.0)",
    Unary.expm1: "u = exp(v)\nout[i] = v if u == 1.0 else (-1.0 if u - 1.0 == -1.0 else "
                 "(u if u > 1e300 else (u - 1.0) * v / log(u)))",
    Unary.sqrt: "out[i] = sqrt(v)",
    Unary.rsqrt: "out[i] = 1.0 / sqrt(v)",
    Unary.reciprocal: "out[i] = 1.0 / v",
    Unary.sin: "out[i] = sin(v)",
    Unary.cos: "out[i] = cos(v)",
    Unary.tan: "out[i] = sin(v) / cos(v)",
    Unary.tanh: "out[i] = tanh(v)",
    Unary.sigmoid: "out[i] = 1.0 / (1.0 + exp(-v))",
    Unary.gelu: erf_source("v * 0.7071067811865476", "e") + "\nout[i] = 0.5 * v * (1.0 + e)",
    Unary.gelu_tanh: "out[i] = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))",
    Unary.silu: "out[i] = v / (1.0 + exp(-v))",
    Unary.floor: f"out[i] = {_floor('v')}",
    Unary.ceil: f"out[i] = -{_floor('(-v)')}",
    Unary.trunc: f"out[i] = {_floor('v')} if v >= 0 else -{_floor('(-v)')}",
    Unary.round: f"f = {_floor('v')}\nd = v - f\nout[i] = f + 1.0 if d > 0.5 or (d == 0.5 and "
                 "f - 2.0 * float(floor(f * 0.5)) != 0.0) else f",
    Unary.leaky_relu: "out[i] = v if v > 0 else v * p0",
    Unary.elu: "out[i] = v if v > 0 else p0 * (exp(v) - 1.0)",
    Unary.softplus: "out[i] = v if v > 20.0 else log(1.0 + exp(v))",
    Unary.nan_to_num: "out[i] = 0.0 if v != v else (p0 if v > 1e308 else (p1 if v < -1e308 "
                      "else v))",
}

_PREDICATES = {
    Predicate.isnan: "out[i] = v != v",
    Predicate.isinf: "out[i] = v > 1.7976931348623157e308 or v < -1.7976931348623157e308",
    Predicate.isfinite: "out[i] = v == v and abs(v) <= 1.7976931348623157e308",
    Predicate.logical_not: "out[i] = v == 0",
    Predicate.signbit: "out[i] = v < 0 or (v == 0 and 1.0 / v < 0)",
}

_COMPARE = {Compare.eq: "out[i] = x == y", Compare.ne: "out[i] = x != y",
            Compare.lt: "out[i] = x < y", Compare.le: "out[i] = x <= y",
            Compare.gt: "out[i] = x > y", Compare.ge: "out[i] = x >= y"}

_OPERANDS = """    i = global_id(0)
    if i < n:
        x = a[i * sa]
        if sb < 0:
            y = bs
        else:
            y = b[i * sb]
"""


#: The ops a training step runs most (the optimiser's and the layers' arithmetic, the
#: common activations), each family's in a lean kernel of its own (``arith_*``,
#: ``unary_hot_*``): the firmware runs a launch inline on its scheduler, without handing
#: it to an engine, only when the kernel's body is loop-free and at most 256 syntax-tree
#: nodes (firmware/kernel_check.py ``bounded_work``). ``binary_f`` (305 nodes) and
#: ``unary_f`` (erf's loop) are neither, and an engine's hand-off cost a 4 Ki ``a + b``
#: ~175 us of device time against ~25 us inline (docs/torch.md "Where an eager op's time
#: goes"). The other ops keep the full kernels; the op codes are the same in both.
ARITH = frozenset({Binary.add, Binary.sub, Binary.mul, Binary.div, Binary.maximum,
                   Binary.minimum})
HOT_UNARY = frozenset({Unary.neg, Unary.abs, Unary.relu, Unary.exp, Unary.log, Unary.sqrt,
                       Unary.rsqrt, Unary.reciprocal, Unary.sigmoid, Unary.tanh, Unary.silu})

#: ``a + alpha * b`` (``sub``: ``-alpha``) on float operands read element by element,
#: the commonest arithmetic of a training step (an optimiser's update, a gradient's
#: accumulation, a residual), in a kernel of its own without ``arith_f``'s op chain and
#: stride branches: 39 syntax-tree nodes against 188. The firmware bounds a loop-free
#: launch's work as its threads times its nodes (every branch counted) and runs it inline
#: up to ``INLINE_WORK`` (firmware/launches.py, 2**25), so ``arith_f`` went to an engine
#: past ~178 K elements, this kernel past ~860 K: an MLP's 784 x 256 weight update paid
#: the engine hand-off and the engines' per-block cost (docs/torch.md, "An MLP step,
#: fourth pass"). Same arithmetic as ``arith_f``: float64 (``alpha`` is a float64
#: scalar), rounded once when stored; ``x + (-alpha) * y`` is exactly ``x - alpha * y``.
_AXPY_OPS = frozenset({Binary.add, Binary.sub})
_AXPY = """def axpy_f(out, a, b, alpha, n: 'int64'):
    i = global_id(0)
    if i < n:
        out[i] = a[i] + alpha * b[i]
"""


def _source() -> str:
    ind = " " * 8
    float_bin = {k: v for k, v in _BINARY_OPS.items() if k not in INT_ONLY_BINARY}
    int_bin = {k: v for k, v in _BINARY_OPS.items() if k != Binary.div}
    int_un = {k: v for k, v in _UNARY_OPS.items() if k not in FLOAT_ONLY}
    float_un = {k: v for k, v in _UNARY_OPS.items() if k != Unary.bitwise_not}
    hot_f = {k: v for k, v in float_un.items() if k in HOT_UNARY}
    arith_f = shared.dispatch_store({k: v for k, v in float_bin.items() if k in ARITH}, ind, "0.0")
    arith_i = shared.dispatch({k: v for k, v in int_bin.items() if k in ARITH}, ind)
    parts = [f"def arith_f(out, a, b, bs, op: 'int64', alpha, n: 'int64', sa: 'int64', "
             f"sb: 'int64'):\n{_OPERANDS}{arith_f}\n",
             f"def arith_i(out, a, b, bs, op: 'int64', alpha, n: 'int64', sa: 'int64', "
             f"sb: 'int64'):\n{_OPERANDS}{arith_i}\n",
             _AXPY,
             f"def unary_hot_f(out, x, op: 'int64', p0, p1, n: 'int64'):\n"
             f"    i = global_id(0)\n    if i < n:\n        v = x[i]\n"
             f"{shared.dispatch_store(hot_f, ind, '0.0')}\n"]
    float_pred = dict(_PREDICATES)
    int_pred = {Predicate.logical_not: _PREDICATES[Predicate.logical_not],
                Predicate.isnan: "out[i] = False", Predicate.isinf: "out[i] = False",
                Predicate.isfinite: "out[i] = True", Predicate.signbit: "out[i] = v < 0"}
    # float and bool results: one store after the op chain (dispatch_store); the integer
    # kernels store per op, as a uint64 and an int64 result would unify to float64
    for k, bops, uops, pops in (("f", shared.dispatch_store(float_bin, ind, "0.0"),
                                 shared.dispatch_store(float_un, ind, "0.0"),
                                 shared.dispatch_store(float_pred, ind, "False")),
                                ("i", shared.dispatch(int_bin, ind), shared.dispatch(int_un, ind),
                                 shared.dispatch(int_pred, ind))):
        parts.append(f"def binary_{k}(out, a, b, bs, op: 'int64', alpha, n: 'int64', "
                     f"sa: 'int64', sb: 'int64'):\n{_OPERANDS}{bops}\n")
        parts.append(f"def unary_{k}(out, x, op: 'int64', p0, p1, n: 'int64'):\n"
                     f"    i = global_id(0)\n    if i < n:\n        v = x[i]\n{uops}\n")
        parts.append(f"def predicate_{k}(out, x, op: 'int64', n: 'int64'):\n"
                     f"    i = global_id(0)\n    if i < n:\n        v = x[i]\n{pops}\n")
    parts.append(f"def compare(out, a, b, bs, op: 'int64', n: 'int64', sa: 'int64', "
                 f"sb: 'int64'):\n{_OPERANDS}{shared.dispatch_store(_COMPARE, ind, 'False')}\n")
    parts.append("""def where(out, c, a, b, n: 'int64', sc: 'int64', sa: 'int64', sb: 'int64'):
    i = global_id(0)
    if i < n:
        if c[i * sc] != 0:
            out[i] = a[i * sa]
        else:
            out[i] = b[i * sb]
""")
    parts.append("""def arange(out, start, step, n: 'int64'):
    i = global_id(0)
    if i < n:
        out[i] = start + i * step
""")
    return "\n".join(parts)


SOURCE = _source()


def _mod(device: int) -> runtime.Module:
    return shared.module("elementwise", SOURCE, device)


def _operand_b(b: Array | float | int | bool, a: Array, b_stride: int
               ) -> tuple[Array, np.generic, int]:
    """(buffer, scalar, stride) for operand ``b``: a Python scalar becomes the kernel's
    scalar (stride -1 selects it; ``a`` stands in for the unused buffer)."""
    if isinstance(b, (int, float, bool, np.generic)):
        return shared.as_bytes_if_bool(shared.flat(a)), shared.scalar(b, a.dtype), -1
    return shared.as_bytes_if_bool(shared.flat(b)), shared.scalar(0, a.dtype), b_stride


def binary_launch(op: Binary | str, out: Array, a: Array, b: Array | float | int | bool,
                  alpha: float | int = 1, a_stride: int = 1, b_stride: int = 1
                  ) -> Launch | None:
    """The launch of :func:`binary` (None: no elements)."""
    op = Binary[op] if isinstance(op, str) else Binary(op)
    shared.check_same(out, a, *([b] if not isinstance(b, (int, float, bool, np.generic)) else []))
    n = shared.size(out)
    if n == 0:
        return None
    dt = out.dtype
    if dt == np.bool_:
        if op not in BOOL_BINARY:
            raise TypeError(f"{op.name} is not defined for bool")
        op = BOOL_BINARY[op]
    elif dt.kind == "f" and op in INT_ONLY_BINARY:
        raise TypeError(f"{op.name} needs integer operands")
    elif dt.kind != "f" and op == Binary.div:
        raise TypeError("div of integers: convert the operands to float first")
    if op in _AXPY_OPS and dt.kind == "f" and a_stride == 1 and b_stride == 1 \
            and not isinstance(b, (int, float, bool, np.generic)):
        k = _mod(out.device).get_kernel("axpy_f")
        return Launch(k, shared.grid(n), shared.BLOCK, (
            shared.flat(out), shared.flat(a), shared.flat(b),
            shared.scalar(alpha if op == Binary.add else -alpha, dt), n))
    bb, bs, sb = _operand_b(b, a, b_stride)
    k = _mod(out.device).get_kernel(
        f"{'arith' if op in ARITH else 'binary'}_{shared.kind(dt)}")
    return Launch(k, shared.grid(n), shared.BLOCK, (
        shared.as_bytes_if_bool(shared.flat(out)), shared.as_bytes_if_bool(shared.flat(a)), bb,
        bs, int(op), shared.scalar(alpha, dt), n, a_stride, sb))


def binary(op: Binary | str, out: Array, a: Array, b: Array | float | int | bool,
           alpha: float | int = 1, a_stride: int = 1, b_stride: int = 1,
           stream: runtime.Stream | None = None) -> None:
    """``out[i] = a[i * a_stride] OP b[i * b_stride]`` for ``i < out.size``, one dtype."""
    launch = binary_launch(op, out, a, b, alpha, a_stride, b_stride)
    if launch is not None:
        launch(shared.stream_of(out, stream))


def _into_bool(codes: type[enum.IntEnum], op: enum.IntEnum | str, out: Array,
               what: str) -> tuple[enum.IntEnum, int]:
    """(op code, element count) of a kernel writing a bool buffer."""
    if out.dtype != np.bool_:
        raise TypeError(f"{what} writes a bool buffer")
    return (codes[op] if isinstance(op, str) else codes(op)), shared.size(out)


def compare(op: Compare | str, out: Array, a: Array, b: Array | float | int | bool,
            a_stride: int = 1, b_stride: int = 1, stream: runtime.Stream | None = None) -> None:
    """``out[i] = a[i * a_stride] CMP b[i * b_stride]`` into a bool buffer."""
    op, n = _into_bool(Compare, op, out, "compare")
    if n == 0:
        return
    bb, bs, sb = _operand_b(b, a, b_stride)
    _mod(out.device).compare[shared.grid(n), shared.BLOCK](
        shared.flat(out), shared.as_bytes_if_bool(shared.flat(a)), bb, bs, int(op), n, a_stride, sb,
        stream=shared.stream_of(out, stream))


def unary_launch(op: Unary | str, out: Array, x: Array, p0: float = 0.0, p1: float = 0.0
                 ) -> Launch | None:
    """The launch of :func:`unary` (None: no elements)."""
    op = Unary[op] if isinstance(op, str) else Unary(op)
    shared.check_same(out, x)
    n = shared.size(out)
    if n == 0:
        return None
    dt = out.dtype
    if dt.kind != "f" and op in FLOAT_ONLY:
        raise TypeError(f"{op.name} needs float input")
    if dt == np.bool_:
        if op != Unary.bitwise_not:
            raise TypeError(f"{op.name} is not defined for bool here")
        return Launch(_mod(out.device).predicate_i, shared.grid(n), shared.BLOCK, (
            shared.flat(out), shared.as_bytes_if_bool(shared.flat(x)),
            int(Predicate.logical_not), n))
    kind = shared.kind(dt)
    name = "unary_hot_f" if kind == "f" and op in HOT_UNARY else f"unary_{kind}"
    return Launch(_mod(out.device).get_kernel(name), shared.grid(n), shared.BLOCK, (
        shared.flat(out), shared.flat(x), int(op), shared.scalar(p0, dt), shared.scalar(p1, dt),
        n))


def unary(op: Unary | str, out: Array, x: Array, p0: float = 0.0, p1: float = 0.0,
          stream: runtime.Stream | None = None) -> None:
    """``out[i] = OP(x[i])`` (``p0``/``p1``: clamp bounds, leaky_relu slope, elu alpha,
    nan_to_num's +inf/-inf replacements); one dtype; see :data:`FLOAT_ONLY`."""
    launch = unary_launch(op, out, x, p0, p1)
    if launch is not None:
        launch(shared.stream_of(out, stream))


def predicate(op: Predicate | str, out: Array, x: Array,
              stream: runtime.Stream | None = None) -> None:
    """``out[i] = OP(x[i])`` into a bool buffer (isnan, isinf, isfinite, logical_not,
    signbit)."""
    op, n = _into_bool(Predicate, op, out, "predicate")
    if n == 0:
        return
    k = _mod(out.device).get_kernel(f"predicate_{shared.kind(x.dtype)}")
    k[shared.grid(n), shared.BLOCK](shared.flat(out), shared.as_bytes_if_bool(shared.flat(x)),
                                    int(op), n, stream=shared.stream_of(out, stream))


def where(out: Array, cond: Array, a: Array, b: Array, cond_stride: int = 1,
          a_stride: int = 1, b_stride: int = 1, stream: runtime.Stream | None = None) -> None:
    """``out[i] = a[i * a_stride] if cond[i * cond_stride] else b[i * b_stride]``."""
    shared.check_same(out, a, b)
    n = shared.size(out)
    if n == 0:
        return
    _mod(out.device).where[shared.grid(n), shared.BLOCK](
        shared.as_bytes_if_bool(shared.flat(out)), shared.as_bytes_if_bool(shared.flat(cond)),
        shared.as_bytes_if_bool(shared.flat(a)), shared.as_bytes_if_bool(shared.flat(b)), n,
        cond_stride, a_stride, b_stride, stream=shared.stream_of(out, stream))


def arange_launch(out: Array, start: float | int, step: float | int) -> Launch | None:
    """The launch of :func:`arange` (None: no elements)."""
    n = shared.size(out)
    if n == 0:
        return None
    dt = out.dtype
    return Launch(_mod(out.device).arange, shared.grid(n), shared.BLOCK, (
        shared.as_bytes_if_bool(shared.flat(out)), shared.scalar(start, dt),
        shared.scalar(step, dt), n))


def arange(out: Array, start: float | int, step: float | int,
           stream: runtime.Stream | None = None) -> None:
    """``out[i] = start + i * step`` (computed in float64 or int64, then stored)."""
    launch = arange_launch(out, start, step)
    if launch is not None:
        launch(shared.stream_of(out, stream))


def fill_launch(out: Array, value: float | int | bool) -> Launch | None:
    """The launch of :func:`fill` (None: no elements)."""
    return arange_launch(out, value, 0)


def fill(out: Array, value: float | int | bool, stream: runtime.Stream | None = None) -> None:
    """Every element ``value``: ``arange`` with step 0 (one kernel fewer to compile)."""
    arange(out, value, 0, stream)
