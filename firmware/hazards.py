"""What a kernel's checked variant (``Options.sanitize``) calls: shared-memory race
detection between the barriers of a block (compute-sanitizer racecheck's job).

Each shared array has a shadow of ``SHADOW_COLS`` int64 words per element (per byte
offset for the ``dynamic_shared`` arrays, which alias), allocated once per ``_grid`` call
(a range of blocks on one engine). ``ep`` is the barrier phase: ``_grid`` starts it at 1,
adds one at every ``barrier()`` and at every block, so it never repeats within a call and
the shadow needs no clearing. Per element, for the current phase: the last write or
atomic (thread, line, mode) and up to two distinct reading threads. An access by thread
``t`` conflicts with another thread's access of the same phase when at least one writes
and they are not both atomics. Within a phase every thread's accesses are seen whatever
order the threads ran in, so a racing pair is found however this run ordered them.

Approximations (docs/sanitizer.md): after two different threads' atomics, a plain access
by the first of them is compared with the first only; the aliasing ``dynamic_shared``
arrays are compared by their elements' first byte, so two different-width views that
overlap without sharing a first byte are not compared.

The first hazard of a launch claims the record (abi/hazard.py) with an atomic
fetch-and-add of its count: blocks of a launch run on several engines at once."""

from __future__ import annotations

from typing import Any

from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from abi import hazard as H

#: shadow words per element: write phase, write thread, write line*4 + mode, read
#: phase, first reader, its line, second reader (-1: none), its line
SHADOW_COLS = 8

_NJ = dict(nogil=True, cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True)


@intrinsic
def _fetch_add(typingctx: Any, ary: Any, val: Any) -> Any:
    """``old = ary[0]; ary[0] += val; return old`` as one LLVM ``atomicrmw add``."""
    if not (isinstance(ary, types.Array) and ary.dtype == types.int64
            and isinstance(val, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aryty, valty = signature.args
        arr = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr,
                                       [context.get_constant(types.intp, 0)],
                                       wraparound=False)
        value = context.cast(builder, args[1], valty, types.int64)
        return builder.atomic_rmw("add", ptr, value, "seq_cst")

    return types.int64(ary, val), codegen


@njit(**_NJ)
def _report(hz: Any, pos: int, elem: int, byte: int, blk: int, t1: int, line1: int,
            mode1: int, t2: int, line2: int, mode2: int) -> None:
    if _fetch_add(hz, 1) != 0:
        return  # the launch's first hazard is recorded already
    hz[H.ARRAY] = pos
    hz[H.ELEMENT] = elem
    hz[H.BYTE] = byte
    hz[H.BLOCK] = blk
    hz[H.FIRST] = t1
    hz[H.FIRST + 1] = line1
    hz[H.FIRST + 2] = mode1
    hz[H.SECOND] = t2
    hz[H.SECOND + 1] = line2
    hz[H.SECOND + 2] = mode2
    hz[H.KIND] = H.KIND_RACE


@njit(**_NJ)
def _hz_acc(sw: Any, key: int, elem: int, isz: int, t: int, line: int, mode: int, ep: int,
            hz: Any, pos: int, blk: int) -> None:
    """Thread ``t``'s access (``mode``: abi/hazard.py READ .. READ_WRITE) at ``line`` to
    element ``elem`` of shared array ``pos`` (shadow row ``key``) in phase ``ep`` of
    block ``blk``: check it against the phase's other accesses, then record it."""
    row = sw[key]
    writes = mode != H.READ
    if row[0] == ep and row[1] != t:
        was = row[2] & 3
        if not (mode == H.ATOMIC and was == H.ATOMIC):
            _report(hz, pos, elem, elem * isz, blk, row[1], row[2] >> 2, was, t, line, mode)
    if writes and row[3] == ep:
        if row[4] != t:
            _report(hz, pos, elem, elem * isz, blk, row[4], row[5], H.READ, t, line, mode)
        elif row[6] >= 0 and row[6] != t:
            _report(hz, pos, elem, elem * isz, blk, row[6], row[7], H.READ, t, line, mode)
    if writes:
        if not (row[0] == ep and row[1] != t and mode == H.ATOMIC and row[2] & 3 == H.ATOMIC):
            row[0] = ep
            row[1] = t
            row[2] = line * 4 + mode
    elif row[3] != ep:
        row[3] = ep
        row[4] = t
        row[5] = line
        row[6] = -1
    elif row[4] != t and row[6] < 0:
        row[6] = t
        row[7] = line
