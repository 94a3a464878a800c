"""Uniformity: which expressions are the same for every thread of a block, so that
block-level code can compute them once (range checks, interchanged loops' bounds)."""

from __future__ import annotations

import ast

from firmware.kernel_check import ID_BUILTINS, const_int
from firmware.lower.abi import MAX_BLOCK_THREADS, MAX_DIM
from firmware.lower.expr import block_expr
from firmware.lower.program import Program
from firmware.lower.syntax import user_name

#: |offset| bound of a scalar parameter or a loop bound
OFFSET_LIMIT = 1 << 40
#: Bound on the magnitude of every partial sum of a checked index range: with the
#: per-term bounds (MAX_DIM, MAX_BLOCK_THREADS, OFFSET_LIMIT) the block-level range
#: arithmetic never wraps an int64.
RANGE_LIMIT = 1 << 62

_UNIFORM_IDS = ("group_id", "num_groups", "local_size")


class Uniformity:
    """Uniformity questions about code where the block-level loop variables ``uniform``
    are known (a phase's, Phase.uniform)."""

    def __init__(self, prog: Program, uniform: tuple[str, ...]) -> None:
        self.prog = prog
        self.k = prog.kernel
        self.uniform = uniform

    def expr(self, node: ast.AST) -> str:
        """A uniform expression's block-level text."""
        return block_expr(self.prog, node, self.uniform)[0]

    def loop_var(self, name: str) -> bool:
        """A block-level loop's variable, assigned nowhere else."""
        return name in self.uniform and self.prog.stores.get(name) == 1

    def term(self, e: ast.AST, guards: dict[str, None],
             allow_vars: bool) -> tuple[str, int] | None:
        """``(text, bound)`` when ``e`` is the same integer for every thread of a block
        and ``|e| <= bound`` (a static bound; a scalar parameter's or a block-level loop
        variable's magnitude is checked at block level, ``guards``): int constants,
        never-assigned integer scalar parameters, ``group_id``/``num_groups``/
        ``local_size``, block-level loop variables (``allow_vars``), and sums, differences
        and products of those (products only of signed terms, so numba types them int64)."""
        c = const_int(e)
        if c is not None:
            return (str(c), abs(c)) if abs(c) < OFFSET_LIMIT else None
        lim = OFFSET_LIMIT
        if isinstance(e, ast.Name) and e.id in self.k.scalars and not self.prog.stores.get(e.id):
            dt = self.k.arg_types[self.k.params.index(e.id)].dtype
            if dt in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"):
                guards[f"-{lim} < {user_name(e.id)} < {lim}"] = None
                return user_name(e.id), lim
            return None
        if isinstance(e, ast.Name) and allow_vars and self.loop_var(e.id):
            guards[f"-{lim} < {user_name(e.id)} < {lim}"] = None
            return user_name(e.id), lim
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and len(e.args) == 1 \
                and e.func.id in _UNIFORM_IDS:
            d = const_int(e.args[0])
            if d is None or not 0 <= d <= 2:
                return None
            bound = MAX_BLOCK_THREADS if e.func.id == "local_size" else MAX_DIM
            return f"{ID_BUILTINS[e.func.id]}{d}", bound
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub, ast.Mult)):
            if isinstance(e.op, ast.Mult) and not (self.signed(e.left) and self.signed(e.right)):
                return None
            left = self.term(e.left, guards, allow_vars)
            right = self.term(e.right, guards, allow_vars) if left else None
            if left is None or right is None:
                return None
            op, bound = {ast.Add: ("+", left[1] + right[1]), ast.Sub: ("-", left[1] + right[1]),
                         ast.Mult: ("*", left[1] * right[1])}[type(e.op)]
            return (f"({left[0]} {op} {right[0]})", bound) if bound < RANGE_LIMIT >> 1 \
                else None
        return None

    def signed(self, e: ast.AST) -> bool:
        """Whether a uniform term is typed as a signed integer by numba (not an unsigned
        scalar parameter)."""
        if isinstance(e, ast.Name) and e.id in self.k.scalars:
            return not self.k.arg_types[self.k.params.index(e.id)].dtype.startswith("u")
        return not isinstance(e, ast.Name) or e.id in self.uniform

    def range_arg(self, e: ast.AST) -> bool:
        """Whether a ``range`` argument (or a bound) is the same for every thread of a
        block and can be evaluated at block level before the phase: no locals, no loads,
        no thread ids."""
        k = self.k
        for n in ast.walk(e):
            if isinstance(n, ast.Call):
                if not (isinstance(n.func, ast.Name) and n.func.id in _UNIFORM_IDS):
                    return False
            elif isinstance(n, ast.Subscript):
                if not isinstance(n.value, ast.Attribute):
                    return False  # a loaded value
            elif isinstance(n, ast.Name):
                if not ((n.id in k.scalars and not self.prog.stores.get(n.id))
                        or n.id in k.buffers or self.loop_var(n.id) or n.id in _UNIFORM_IDS):
                    return False
        return True

    def loop_range(self, s: ast.For, guards: dict[str, None]) -> tuple[str, str] | None:
        """``(first, last)`` block-level texts of the values a uniform loop's variable
        takes (``last < first`` when it runs no iteration), or None when the loop is not a
        ``range`` with uniform arguments and a positive step, or its variable is assigned
        anywhere else in the kernel."""
        var = s.target.id  # type: ignore[attr-defined]
        args = s.iter.args  # type: ignore[attr-defined]
        if self.prog.stores.get(var) != 1 or not all(self.range_arg(a) for a in args):
            return None
        lim = OFFSET_LIMIT
        texts = [self.expr(a) for a in args]
        lo, hi = ("0", texts[0]) if len(texts) == 1 else (texts[0], texts[1])
        for t in (lo, hi):
            guards[f"-{lim} < ({t}) < {lim}"] = None
        if len(texts) < 3 or const_int(args[2]) == 1:
            return lo, f"({hi}) - 1"
        step = texts[2]
        if const_int(args[2]) is None:
            guards[f"1 <= ({step}) < {lim}"] = None
        elif const_int(args[2]) < 1:  # type: ignore[operator]
            return None
        return lo, f"({lo}) + (({hi}) - ({lo}) - 1) // ({step}) * ({step})"
