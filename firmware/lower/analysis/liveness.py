"""Liveness across phases: which locals must survive from one phase to another (they
become per-thread arrays), and which affine locals a phase recomputes from the thread's
ids instead of loading them."""

from __future__ import annotations

import ast

from firmware.lower.expr import block_expr
from firmware.lower.program import (BlockFor, BlockIf, BlockNode, BlockWhile, Phase,
                                    Program)
from firmware.lower.syntax import assigned, names


def block_locals(prog: Program, nodes: list[BlockNode]) -> set[str]:
    """Locals that block-level code reads (as thread 0's value, from their per-thread
    array): those in the tests and ranges of the block-level control flow."""
    out: set[str] = set()
    for n in nodes:
        exprs: list[ast.expr] = []
        if isinstance(n, (BlockIf, BlockWhile)):
            exprs = [n.test]
        elif isinstance(n, BlockFor):
            exprs = list(n.loop.iter.args)  # type: ignore[attr-defined]
        for e in exprs:
            out |= block_expr(prog, e, n.uniform)[1]  # type: ignore[union-attr]
        if isinstance(n, (BlockIf, BlockFor, BlockWhile)):
            out |= block_locals(prog, n.body)
        if isinstance(n, BlockIf) and n.orelse is not None:
            out |= block_locals(prog, n.orelse)
    return out


def live_across_phases(prog: Program) -> set[str]:
    """Locals that must survive from one phase to another (or from one iteration of a
    block-level loop to the next), those block-level code reads, and those vectorised
    phases keep per thread."""
    k = prog.kernel
    exclude = set(k.params) | set(k.shared) | set(prog.uniform_vars)
    count: dict[str, int] = {}
    result: set[str] = set()
    for phase in prog.phases:
        for name in names(phase.stmts) - exclude:
            if name not in k.locals:
                continue
            count[name] = count.get(name, 0) + 1
            if phase.in_loop:
                result.add(name)
    result |= {n for n, c in count.items() if c > 1}
    return result | block_locals(prog, prog.skeleton) | prog.vector_locals


def remat(prog: Program, used: set[str], avail: set[str], order: list[str]) -> list[str]:
    """The affine locals code recomputes (those it uses, and what their definitions
    use), in definition order."""
    assert prog.affine is not None
    values = prog.affine.def_values
    need = used & avail
    while True:
        more = {d for n in need for d in names([ast.Expr(values[n])]) if d in avail} - need
        if not more:
            return [n for n in order if n in need]
        need |= more


def recomputed(prog: Program, phase: Phase) -> list[str]:
    """The affine locals ``phase`` recomputes from the thread's ids instead of loading
    them from their per-thread arrays: those defined once at the kernel's top level in an
    earlier phase (``tx = local_id(0)``, ``row = group_id(1) * 16 + ty``). The loop over
    the threads then sees them as functions of ``_l0``, so LLVM can vectorise it (tiled
    ``gemm``'s tile loads: docs/kernels.md, "Vectorised phases")."""
    assert prog.affine is not None
    before = prog.affine.carried_before.get(phase.index, {})
    used = (names(phase.stmts) & prog.kernel.locals) - assigned(phase.stmts)
    return remat(prog, used, set(before), list(before))
