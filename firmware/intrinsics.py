"""Numba intrinsics the generated kernel modules import: their meaning is part of
jit.FIRMWARE_JIT_ABI (bump it when one changes: cached machine code inlines them)."""

from __future__ import annotations

from typing import Any

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


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
    one integer per dimension, already bounds-checked by the generated code."""
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
