"""Pass 1: cut the kernel body at every barrier into phases, under a block-level skeleton.

A block's threads run as loops (the CPU-OpenCL / POCL scheme): each phase is a loop over
the block's threads. A ``for``/``while``/``if`` that contains a barrier stays at block
level (it must be uniform across the block) and the phases inside it are thread loops. A
block-collective ``mma`` is a phase of its own, run once per block as thread 0.

Reads: the kernel. Writes: Program.skeleton, .phases (stmts, in_loop, top, uniform),
.uniform_vars."""

from __future__ import annotations

import ast

from firmware.kernel_check import DECLARATIONS, is_mma, structural
from firmware.lower.program import (BlockBarrier, BlockFor, BlockIf, BlockJump, BlockNode,
                                    BlockWhile, Phase, Program, RunCollective, RunPhase)


def is_shared_decl(s: ast.stmt) -> bool:
    """``x = shared_array(...)`` and the like: allocated per block by _grid."""
    return (isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
            and isinstance(s.value.func, ast.Name) and s.value.func.id in DECLARATIONS)


def run(prog: Program) -> None:
    prog.skeleton = _structure(prog, list(prog.kernel.fn.body), False, True)


def _phase(prog: Program, stmts: list[ast.stmt], in_loop: bool, top: bool,
           collective: bool = False) -> int:
    idx = len(prog.phases)
    prog.phases.append(Phase(idx, stmts, in_loop, top, tuple(prog.uniform_vars), collective))
    return idx


def _structure(prog: Program, stmts: list[ast.stmt], in_loop: bool,
               top: bool = False) -> list[BlockNode]:
    """Block-level code: thread loops over phases, with block-level (uniform) control
    flow around the phases that contain barriers (``top``: ``stmts`` is the kernel's
    body)."""
    out: list[BlockNode] = []
    pending: list[ast.stmt] = []

    def flush() -> None:
        if pending:
            out.append(RunPhase(_phase(prog, list(pending), in_loop, top)))
            pending.clear()

    for s in stmts:
        if is_shared_decl(s):
            continue  # hoisted: allocated per block
        if not structural(s, in_loop):
            pending.append(s)
            continue
        flush()
        if is_mma(s):
            out.append(RunCollective(_phase(prog, [s], in_loop, False, collective=True)))
        elif isinstance(s, ast.Expr):
            out.append(BlockBarrier())  # barrier(): the phase boundary is the barrier
        elif isinstance(s, (ast.Break, ast.Continue)):
            out.append(BlockJump(type(s).__name__.lower()))
        elif isinstance(s, ast.If):
            uniform = tuple(prog.uniform_vars)
            out.append(BlockIf(s.test, uniform, _structure(prog, s.body, in_loop),
                               _structure(prog, s.orelse, in_loop) if s.orelse else None))
        elif isinstance(s, ast.For):
            var = s.target.id  # type: ignore[attr-defined]
            if var not in prog.uniform_vars:
                prog.uniform_vars.append(var)
            out.append(BlockFor(s, tuple(prog.uniform_vars), _structure(prog, s.body, True)))
        elif isinstance(s, ast.While):
            out.append(BlockWhile(s.test, tuple(prog.uniform_vars),
                                  _structure(prog, s.body, True)))
    flush()
    return out
