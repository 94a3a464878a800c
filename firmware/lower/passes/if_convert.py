"""Pass 3: if-conversion, for the range-checked variants.

* A *diamond*, ``if c: t = x else: t = y`` whose values are float loads and arithmetic,
  is written as a select ``t = x if c else y`` with both values computed first (LLVM
  vectorises a select, not a branch around a load): in range-checked code every load of
  ``x`` and ``y`` is an access whose range the block checked whatever the guards, so a
  load the guard would have skipped is in range (docs/kernels.md, "Tile loads and
  register blocking").
* A phase's top-level ``if`` whose test holds for every thread of a block (a bounds guard
  ``if i < n``: analysis/affine.py, holds_for_block) is dropped in a block that passed its
  condition, added to the phase's range checks (the guard of ``if i < n: x[i] += y[i]``
  blocked vectorisation: a masked store, 4.5x the unguarded loop's time). A diamond is
  better left a select (gemm's tile loads: 151-230 against 223-274 ms with the guard
  checked per block instead, one core, same run).

Reads: Program.affine, .kinds, .phases. Writes: Program.selects, .always,
Phase.range_conds (the affine accesses' conditions and the hoisted guards', in statement
order)."""

from __future__ import annotations

import ast

from firmware.kernel_check import ID_BUILTINS
from firmware.lower.analysis.uniformity import Uniformity
from firmware.lower.program import Program


def run(prog: Program) -> None:
    assert prog.affine is not None
    for phase in prog.phases:
        if phase.collective:
            continue
        for s in phase.stmts:
            for n in ast.walk(s):
                if isinstance(n, ast.If) and diamond(prog, n):
                    prog.selects.add(n)
        ranges = prog.affine.phases[phase.index]
        uni = Uniformity(prog, phase.uniform)
        conds: dict[str, None] = {}
        for s, access_conds in ranges.stmt_conds:
            conds.update(dict.fromkeys(access_conds))
            if isinstance(s, ast.If) and s not in prog.selects:
                held = prog.affine.holds_for_block(uni, s.test, ranges.defs_at[s])
                if held is not None:
                    prog.always.add(s)
                    conds.update(dict.fromkeys(held))
        phase.range_conds = list(conds)


def diamond(prog: Program, s: ast.If) -> bool:
    """Whether ``s`` is a diamond that may become a select (see the module doc): both
    values loads, names, constants, ``+ - *`` of them, both float (an int and a uint64
    would unify to float64), and the target the same local or range-checked element in
    both."""
    assert prog.affine is not None and prog.kinds is not None
    if not (len(s.body) == 1 and len(s.orelse) == 1):
        return False
    a, b = s.body[0], s.orelse[0]
    if not (isinstance(a, ast.Assign) and isinstance(b, ast.Assign)
            and len(a.targets) == 1 and len(b.targets) == 1
            and ast.dump(a.targets[0]) == ast.dump(b.targets[0])):
        return False
    t = a.targets[0]
    if not (isinstance(t, ast.Name) or (prog.affine.range_checked(t)
                                        and prog.affine.range_checked(b.targets[0]))):
        return False
    return all(_speculable(prog, v) and prog.kinds.of(v) == "float" for v in (a.value, b.value))


def _speculable(prog: Program, e: ast.AST) -> bool:
    """An expression without effects or faults: constants, names, thread ids,
    range-checked loads, ``buf.shape[k]``, unary minus and ``+ - *``."""
    assert prog.affine is not None
    for n in ast.walk(e):
        if isinstance(n, ast.Subscript):
            if not (isinstance(n.value, ast.Attribute) or prog.affine.range_checked(n)):
                return False
        elif isinstance(n, ast.BinOp):
            if not isinstance(n.op, (ast.Add, ast.Sub, ast.Mult)):
                return False
        elif isinstance(n, ast.UnaryOp):
            if not isinstance(n.op, (ast.USub, ast.UAdd)):
                return False
        elif isinstance(n, ast.Call):
            if not (isinstance(n.func, ast.Name) and n.func.id in ID_BUILTINS):
                return False
        elif not isinstance(n, (ast.Constant, ast.Name, ast.Attribute, ast.Tuple,
                                ast.expr_context, ast.operator, ast.unaryop)):
            return False
    return True
