"""Numba intrinsics the generated kernel modules import: their meaning is part of
jit.FIRMWARE_JIT_ABI (bump it when one changes: cached machine code inlines them).

Besides the abort word and real atomics, they give a defined result to every operation
whose plain numba lowering can yield LLVM *poison* -- a value the optimiser may assume to
be anything, so that a bounds check of an index computed from it may be folded away:

* ``_rt_index``: every buffer index and every integer argument of ``mma`` goes through it
  to int64 (a uint64 of 2**63 or more saturates to 2**63-1, which no buffer reaches); a
  float is a compile error, as in numpy, instead of an unchecked ``fptoui``;
* ``_rt_int`` / ``_rt_floor``: the language's ``int()`` and ``floor()`` of a float
  saturate to the int64 range, NaN giving 0 (numba's ``fptosi`` is poison out of range);
* ``_rt_shl`` / ``_rt_shr``: a shift count outside ``[0, width)`` shifts every bit out (0,
  or the sign for ``>>`` of a signed value), as PTX's shifts clamp; LLVM's is poison;
* ``_rt_pow``: integer ``**`` by squaring in wrapping int64 arithmetic (numba's falls back
  to ``math.pow`` for exponents above 65536 and converts the float, inf included, back to
  an integer); a negative exponent gives 0 unless the base is 1 or -1.
"""

from __future__ import annotations

import operator
from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


# Imported by the generated modules: their meaning is covered by FIRMWARE_JIT_ABI.


@intrinsic
def _rt_abort_word(typingctx: Any, ary: Any) -> Any:
    """``abort[0]`` as an atomic (monotonic) load, so that LLVM never hoists it out of a
    loop: the watchdog writes it from another thread."""
    if not (isinstance(ary, types.Array) and ary.ndim == 1 and ary.dtype == types.int64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty = signature.args[0]
        arr = context.make_array(aryty)(context, builder, args[0])
        zero = context.get_constant(types.intp, 0)
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, [zero], wraparound=False)
        return builder.load_atomic(ptr, "monotonic", 8)

    return types.int64(ary), codegen


@intrinsic
def _rt_atomic_add(typingctx: Any, ary: Any, idx: Any, val: Any) -> Any:
    """``ary[idx] += val`` as one LLVM ``atomicrmw`` (``add`` for integers, ``fadd`` for
    floats; x86 lowers a float one to a compare-exchange loop). ``idx`` is a tuple with
    one integer per dimension, already bounds-checked by the generated code; a value for
    an integer buffer has been through ``_rt_int`` (no float-to-int poison)."""
    if not (isinstance(ary, types.Array) and isinstance(idx, types.BaseTuple)
            and len(idx) == ary.ndim and all(isinstance(t, types.Integer) for t in idx)
            and isinstance(ary.dtype, (types.Integer, types.Float))
            and isinstance(val, (types.Number, types.Boolean))):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty, idxty, valty = signature.args
        arr = context.make_array(aryty)(context, builder, args[0])
        raw = cgutils.unpack_tuple(builder, args[1], len(idxty))
        indices = [context.cast(builder, v, t, types.intp) for v, t in zip(raw, idxty)]
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, indices,
                                       wraparound=False)
        value = context.cast(builder, args[2], valty, aryty.dtype)
        op = "fadd" if isinstance(aryty.dtype, types.Float) else "add"
        builder.atomic_rmw(op, ptr, value, "seq_cst")
        return context.get_dummy_value()

    return types.none(ary, idx, val), codegen


@intrinsic
def _rt_index(typingctx: Any, v: Any) -> Any:
    """An integer (or bool) as an int64 index: exact, except that a uint64 of 2**63 or
    more saturates to 2**63-1 (out of range of any buffer either way). Not defined for
    floats: typing fails, so the kernel does not compile."""
    if not isinstance(v, (types.Integer, types.Boolean)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return _index_codegen(context, builder, signature.args[0], args[0])

    return types.int64(v), codegen


def _index_codegen(context: Any, builder: Any, vt: Any, v: Any) -> Any:
    """``v`` of integer type ``vt`` widened to 64 bits, a uint64 above int64's range
    saturating to 2**63-1."""
    wide = context.cast(builder, v, vt, types.int64)
    if isinstance(vt, types.Integer) and not vt.signed and vt.bitwidth == 64:
        top = ir.Constant(wide.type, _INT64_MAX)
        return builder.select(builder.icmp_unsigned(">", wide, top), top, wide)
    return wide


@intrinsic
def _rt_uindex(typingctx: Any, v: Any) -> Any:
    """``np.uint64(_rt_index(v))`` as one call: the element index of an access (unsigned,
    so numba emits no negative-index wraparound). One intrinsic instead of a numpy
    constructor around another halves what numba types per access (compile time)."""
    if not isinstance(v, (types.Integer, types.Boolean)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return _index_codegen(context, builder, signature.args[0], args[0])

    return types.uint64(v), codegen


@intrinsic
def _rt_oob(typingctx: Any, i: Any, n: Any) -> Any:
    """Whether int64 index ``i`` misses extent ``n``: an unsigned ``i >= n``, so a
    negative index misses too (the check of every checked access, one call)."""
    if not (isinstance(i, types.Integer) and isinstance(n, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        a = context.cast(builder, args[0], signature.args[0], types.int64)
        b = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.icmp_unsigned(">=", a, b)

    return types.boolean(i, n), codegen


@intrinsic
def _rt_opaque(typingctx: Any, v: Any) -> Any:
    """``v`` unchanged, as a value the optimiser cannot see through (an empty inline asm).

    A checked access uses its index through this: LLVM would otherwise fold a constant
    index into the address, and for an index whose byte range ends exactly at 2**63 (say
    ``x[2**60 - 1]`` of a float64 buffer, refused by the check at run time) the assertion
    build of LLVM that numba ships aborts the process compiling it -- one tenant's kernel
    source killing the firmware. The check has proved the index in range, so hiding it
    costs nothing but the folding (the fast, range-checked-per-block path does not use it)."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ty = args[0].type
        return builder.asm(ir.FunctionType(ty, [ty]), "", "=r,0", [args[0]],
                           side_effect=False)

    return v(v), codegen


def _float_to_int64(builder: Any, x: Any) -> Any:
    """``x`` (an LLVM float or double) as a saturating int64: NaN is 0, beyond the range
    the nearest bound. Only in-range values reach ``fptosi``, so nothing is poison."""
    i64 = ir.IntType(64)
    lo, hi = ir.Constant(x.type, float(_INT64_MIN)), ir.Constant(x.type, -float(_INT64_MIN))
    in_range = builder.and_(builder.fcmp_ordered(">=", x, lo), builder.fcmp_ordered("<", x, hi))
    value = builder.fptosi(builder.select(in_range, x, ir.Constant(x.type, 0.0)), i64)
    bound = builder.select(builder.fcmp_ordered(">=", x, hi), ir.Constant(i64, _INT64_MAX),
                           builder.select(builder.fcmp_ordered("<", x, lo),
                                          ir.Constant(i64, _INT64_MIN), ir.Constant(i64, 0)))
    return builder.select(in_range, value, bound)


def _to_int(v: Any, floor: bool) -> Any:
    """Typing and code of ``_rt_int`` (``floor`` False) and ``_rt_floor``: an integer is
    itself, a bool 0 or 1, a float (floored first for ``_rt_floor``) a saturating int64."""
    if isinstance(v, types.Integer):
        t = types.unliteral(v)
        return t(t), lambda context, builder, signature, args: args[0]
    if not isinstance(v, (types.Boolean, types.Float)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vt = signature.args[0]
        if isinstance(vt, types.Boolean):
            return context.cast(builder, args[0], vt, types.int64)
        x = args[0]
        if floor:
            x = builder.call(builder.module.declare_intrinsic("llvm.floor", [x.type]), [x])
        return _float_to_int64(builder, x)

    return types.int64(v), codegen


@intrinsic
def _rt_int(typingctx: Any, v: Any) -> Any:
    """The language's ``int(v)``; also what a value stored into an integer buffer goes
    through (numba would convert a float with a poison-prone ``fptosi``)."""
    return _to_int(v, floor=False)


@intrinsic
def _rt_floor(typingctx: Any, v: Any) -> Any:
    """The language's ``floor(v)``: an integer, like ``math.floor``."""
    return _to_int(v, floor=True)


def _shift(typingctx: Any, a: Any, b: Any, op: Any) -> Any:
    """Typing and code of the defined shifts: numba's own result type for ``a op b`` (the
    wider of the left operand and a 64-bit integer of its signedness)."""
    sig = typingctx.resolve_function_type(op, (a, b), {})
    if sig is None or not isinstance(sig.return_type, types.Integer):
        return None
    rt = sig.return_type

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        at, bt = signature.args
        val = context.cast(builder, args[0], at, rt)
        amt = context.cast(builder, args[1], bt, rt)
        width = ir.Constant(val.type, rt.bitwidth)
        ok = builder.icmp_unsigned("<", amt, width)  # a negative count is huge unsigned
        zero = ir.Constant(val.type, 0)
        if op is operator.rshift and rt.signed:  # out of range: every bit is the sign
            return builder.ashr(val, builder.select(ok, amt, ir.Constant(val.type,
                                                                         rt.bitwidth - 1)))
        shifted = (builder.shl if op is operator.lshift else builder.lshr)(
            val, builder.select(ok, amt, zero))
        return builder.select(ok, shifted, zero)

    return rt(a, b), codegen


@intrinsic
def _rt_shl(typingctx: Any, a: Any, b: Any) -> Any:
    """``a << b``; a count outside ``[0, width)`` gives 0."""
    return _shift(typingctx, a, b, operator.lshift)


@intrinsic
def _rt_shr(typingctx: Any, a: Any, b: Any) -> Any:
    """``a >> b``; a count outside ``[0, width)`` gives 0, or -1 for a negative signed a."""
    return _shift(typingctx, a, b, operator.rshift)


def _int_pow(base: int, exp: int) -> int:
    """Integer power by squaring in int64 (compiled by numba; wraps like every int64
    operation of the language); at most 63 squarings."""
    if exp < 0:
        if base == 1:
            return 1
        if base == -1:
            return -1 if exp & 1 else 1
        return 0
    result = 1
    while exp != 0:
        if exp & 1:
            result *= base
        exp >>= 1
        base *= base
    return result


@intrinsic
def _rt_pow(typingctx: Any, a: Any, b: Any) -> Any:
    """``a ** b``: numba's own for floats; for two integers :func:`_int_pow` in int64,
    converted to numba's result type for the operands."""
    sig = typingctx.resolve_function_type(operator.pow, (a, b), {})
    if sig is None:
        return None
    rt = sig.return_type
    integral = all(isinstance(t, (types.Integer, types.Boolean)) for t in (a, b)) \
        and isinstance(rt, types.Integer)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if not integral:
            cast = [context.cast(builder, v, t, s)
                    for v, t, s in zip(args, signature.args, sig.args)]
            return context.get_function(operator.pow, sig)(builder, cast)
        wide = [context.cast(builder, v, t, types.int64) for v, t in zip(args, signature.args)]
        r = context.compile_internal(builder, _int_pow,
                                     types.int64(types.int64, types.int64), wide)
        return context.cast(builder, r, types.int64, rt)

    return rt(a, b), codegen
