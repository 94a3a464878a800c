"""Pass 5: choose each phase's variants and where its code goes.

* ``_phv`` (Phase.vector): run when the block's range checks pass (always, without
  bounds checks); otherwise the checked per-thread loop.
* ``_phf`` (Phase.fast): a phase with range conditions and no vector form has a
  range-checked per-thread variant beside the checked ``_ph``.
* Inlined (Phase.inline): a phase with a per-thread loop that is small
  (:data:`INLINE_NODES`) and has no loop is written into the block's thread loop (a
  thread's ``return`` is a ``continue``) instead of a function of its own: numba compiles
  each ``@njit`` function on its own (typing, lowering, wrappers, an LLVM module,
  re-optimised in every caller), and one function fewer per phase variant halved
  ``where``'s first compile (docs/kernels.md, "Compile time"). So is the one phase of a
  kernel without barriers whose loops are small (:data:`INLINE_LOOP_NODES`), have no
  vector form and hold no ``return`` (a ``continue`` there would continue the user's
  loop): a user's small loop kernel compiles as ``_grid`` and its miss helper.

A checked variant (``Options.sanitize``: ACCEL_SANITIZE's launches) keeps only the checked
per-thread ``_ph``, whose every shared-memory access it tracks (firmware/hazards.py).

Reads: Phase.range_conds, .vector. Writes: Phase.inline, Phase.fast."""

from __future__ import annotations

import ast

from firmware.kernel_check import contains
from firmware.lower.program import Program
from firmware.lower.syntax import node_count

#: Largest phase (syntax-tree nodes) written into the thread loops. Numba's SSA and
#: liveness passes grow faster than linearly with a function's blocks times its
#: variables, so past a size a phase is cheaper as a function of its own; measured
#: (first compile, CPU seconds, function -> inlined): ``where`` (73 nodes) 2.0-2.3 ->
#: 1.3-1.4, ``binary_f`` (352) 2.9-3.9 -> 3.0-3.6, ``unary_f`` (1,209) 6.5-7.5 ->
#: 9.3-9.5. A phase with a loop stays a function too: inlined, the loop's exits (the
#: abort check's ``return _blk``) leave four loops at once, and LLVM optimised such
#: loops worse (bench ``kernels``, old and new lowering in consecutive runs: softmax
#: rows 1.73x -> 3.15x numpy, tiled gemm 30x -> 117x).
INLINE_NODES = 250
#: Largest phase with loops written into the thread loops, in a kernel of one phase (no
#: barriers) when it has no vector form: below the loop kernels measured slower inlined
#: (softmax rows: 137 nodes; the tiled gemm's loop phase has a vector form), so of the
#: library's kernels only ``sleep`` changes. A user's small loop kernel (bench
#: ``first_use``'s ``user_poly``, 63 nodes) was four compile units (``_grid``, ``_ph0``,
#: ``_phf0``, ``_miss1``) and is two, and its launches ran no slower inlined
#: (docs/kernels.md, "Compile time", has the figures).
INLINE_LOOP_NODES = 96


def run(prog: Program) -> None:
    for phase in prog.phases:
        if phase.collective or prog.options.sanitize:  # sanitize: the checked _ph only
            continue
        checks = bool(range_conds(prog, phase.index))
        per_thread_loop = phase.vector is None or checks
        size = node_count(phase.stmts)
        phase.inline = per_thread_loop and (
            (size <= INLINE_NODES and not contains(phase.stmts, _is_loop))
            or (size <= INLINE_LOOP_NODES and len(prog.phases) == 1 and phase.vector is None
                and not any(contains(loop.body, lambda n: isinstance(n, ast.Return))
                            for loop in _loops(phase.stmts))))
        phase.fast = phase.vector is None and checks


def _is_loop(n: ast.AST) -> bool:
    return isinstance(n, (ast.For, ast.While))


def _loops(stmts: list[ast.stmt]) -> list[ast.For | ast.While]:
    """Every loop in ``stmts``, at any depth."""
    return [n for s in stmts for n in ast.walk(s) if _is_loop(n)]  # type: ignore[misc]


def range_conds(prog: Program, index: int) -> list[str]:
    """The block-level conditions of phase ``index``'s range-checked variants (none
    without bounds checks: the variants then run unconditionally, or not at all; none in
    a checked variant, which has no range-checked variants)."""
    return prog.phases[index].range_conds if prog.checked and not prog.options.sanitize \
        else []
