"""Expressions in generated code: the kernel's expression syntax -> numba source text.

User names get a ``u_`` prefix and built-ins become loop variables or ``math`` calls.
Buffer loads are indexed unsigned (``_rt_uindex``: numba then emits no negative-index
wraparound, which would block vectorisation; a negative index is a bounds miss here
anyway). With bounds checks, a load that is always evaluated is *hoisted*: its index goes
to a temporary, checked before the statement (a miss stops the thread at once); a load
under short-circuit evaluation (``and``/``or``, a conditional expression, the tail of a
chained comparison) must not be hoisted, and calls a helper that records the miss and
yields zero, the statement then checking ``fault[0]``. Shifts, powers and ``int()``
become the defined intrinsics (firmware/intrinsics.py: their numba lowering can be LLVM
poison)."""

from __future__ import annotations

import ast
import copy
from typing import Callable

import numpy as np

from abi import hazard
from firmware.kernel_check import DYNAMIC_SHAPE, ID_BUILTINS, MATH_BUILTINS, const_int
from firmware.lower.program import Program
from firmware.lower.syntax import indices, user_name

#: Operators whose numba lowering can be poison: the generated code calls these instead.
DEFINED_BINOPS: dict[type, str] = {ast.LShift: "_rt_shl", ast.RShift: "_rt_shr",
                                   ast.Pow: "_rt_pow"}

#: hoist(name, index texts, out, indent) -> the names of the checked index temporaries
Hoist = Callable[[str, list[str], list[str], str], list[str]]


def page_map(prog: Program, name: str) -> list[str]:
    """The page map and first-page offset arguments of a managed buffer (``[]`` for any
    other): its accesses set ``_pm_x[page] = 1`` so that the firmware migrates exactly
    the pages touched (firmware/managed.py)."""
    return [f"_pm_{name}", f"_po_{name}"] if name in prog.managed else []


def shadow_of(prog: Program, name: str) -> str:
    """The hazard shadow of a shared array in a checked variant (firmware/hazards.py): one
    per static array, one for all the ``dynamic_shared`` arrays (they alias)."""
    shape, _ = prog.kernel.shared[name]
    return "_sw__dyn" if shape == DYNAMIC_SHAPE else f"_sw_{name}"


def hazard_args(prog: Program, name: str, elem: str, line: str,
                how: int = hazard.READ) -> list[str]:
    """The arguments of ``_hz_acc`` (firmware/hazards.py) for an access of element
    ``elem`` (an int64 temporary) of shared array ``name`` at kernel line ``line`` by the
    phase's thread ``_t``, in barrier phase ``_hzep`` (every constant an int64: a literal
    argument compiles a specialisation per value)."""
    shape, dtype = prog.kernel.shared[name]
    isz = np.dtype(dtype).itemsize
    key = f"{elem} * {isz}" if shape == DYNAMIC_SHAPE else elem
    pos = list(prog.kernel.shared).index(name)
    return [shadow_of(prog, name), key, elem, f"np.int64({isz})", "_t", f"np.int64({line})",
            f"np.int64({how})", "_hzep", "_hz", f"np.int64({pos})",
            "(_g2 * _ng1 + _g1) * _ng0 + _g0"]


def subscript(name: str, idx: list[ast.expr], ctx: ast.expr_context) -> ast.Subscript:
    """``u_name[_rt_uindex(i), ...]`` (an index is an integer, used unsigned)."""
    cast = [ast.Call(ast.Name("_rt_uindex", ast.Load()), [i], []) for i in idx]
    sl = ast.Tuple(cast, ast.Load()) if len(cast) > 1 else cast[0]
    return ast.Subscript(ast.Name(user_name(name), ast.Load()), sl, ctx)


class ExprWriter(ast.NodeTransformer):
    """Rewrites one expression (a copy: the visit mutates it) into generated syntax.

    ``uniform`` set: a block-level expression, where a local is read as thread 0's value
    from its per-thread array (``_pt_x[0]``; ``block_locals`` collects those) unless it is
    one of these block-level loop variables. Otherwise thread-level: ``hoist`` checks an
    always-evaluated load's index (None: no hoisting, as at block level), and
    ``unchecked(node)`` says an access's range was checked for the whole block."""

    def __init__(self, prog: Program, *, uniform: tuple[str, ...] | None = None,
                 hoist: Hoist | None = None, out: list[str] | None = None, ind: str = "",
                 unchecked: Callable[[ast.AST], bool] | None = None) -> None:
        self.prog = prog
        self.k = prog.kernel
        self.checked = prog.checked
        self.uniform = uniform
        self.hoist, self.out, self.ind = hoist, out, ind
        self.unchecked = unchecked
        self.cond = 0
        self.cond_loads = False  # loads under short-circuit evaluation: check fault[0]
        self.block_locals: set[str] = set()

    def visit_Name(self, n: ast.Name) -> ast.AST:
        if (self.uniform is not None and n.id in self.k.locals and n.id not in self.k.shared
                and n.id not in self.uniform):
            self.block_locals.add(n.id)
            return ast.parse(f"_pt_{n.id}[0]", mode="eval").body
        return ast.copy_location(ast.Name(user_name(n.id), n.ctx), n)

    def visit_Call(self, n: ast.Call) -> ast.AST:
        name = n.func.id  # type: ignore[attr-defined]
        if name in ID_BUILTINS:
            return ast.Name(f"{ID_BUILTINS[name]}{const_int(n.args[0])}", ast.Load())
        args = [self.visit(a) for a in n.args]
        if name in MATH_BUILTINS:
            return ast.Call(ast.parse(MATH_BUILTINS[name], mode="eval").body, args, [])
        return ast.Call(ast.Name("_rt_int" if name == "int" else name, ast.Load()), args, [])

    def visit_BinOp(self, n: ast.BinOp) -> ast.AST:
        left, right = self.visit(n.left), self.visit(n.right)
        helper = DEFINED_BINOPS.get(type(n.op))
        if helper is not None:
            return ast.Call(ast.Name(helper, ast.Load()), [left, right], [])
        return ast.BinOp(left, n.op, right)

    def _conditional(self, nodes: list[ast.AST]) -> list[ast.AST]:
        self.cond += 1
        try:
            return [self.visit(x) for x in nodes]
        finally:
            self.cond -= 1

    def visit_BoolOp(self, n: ast.BoolOp) -> ast.AST:
        return ast.BoolOp(n.op, [self.visit(n.values[0])] + self._conditional(n.values[1:]))

    def visit_IfExp(self, n: ast.IfExp) -> ast.AST:
        body, orelse = self._conditional([n.body, n.orelse])
        return ast.IfExp(self.visit(n.test), body, orelse)

    def visit_Compare(self, n: ast.Compare) -> ast.AST:
        left = self.visit(n.left)
        first = self.visit(n.comparators[0])
        return ast.Compare(left, n.ops, [first] + self._conditional(n.comparators[1:]))

    def visit_Attribute(self, n: ast.Attribute) -> ast.AST:
        return ast.Attribute(self.visit(n.value), n.attr, ast.Load())

    def visit_Subscript(self, n: ast.Subscript) -> ast.AST:
        if isinstance(n.value, ast.Attribute):  # buf.shape[k]
            return ast.Subscript(self.visit(n.value), n.slice, ast.Load())
        name = n.value.id  # type: ignore[attr-defined]
        idx = [self.visit(i) for i in indices(n)]
        if self.checked and self.unchecked is not None and self.unchecked(n):
            return subscript(name, idx, n.ctx)  # range checked once for the block
        if self.checked and (self.cond or self.hoist is None):
            self.cond_loads = True
            return ast.Call(ast.Name(f"_ld_{name}", ast.Load()),
                            [ast.Name(user_name(name), ast.Load()), *idx,
                             ast.Name("fault", ast.Load()),
                             *[ast.Name(v, ast.Load()) for v in page_map(self.prog, name)],
                             *self.tracked(name, n)], [])
        if self.checked:
            assert self.hoist is not None and self.out is not None
            idx = [ast.Name(v, ast.Load()) for v in self.hoist(
                name, [ast.unparse(i) for i in idx], self.out, self.ind)]
        return subscript(name, idx, n.ctx)


    def tracked(self, name: str, n: ast.AST) -> list[ast.expr]:
        """A checked variant's extra arguments of a shared array's load helper (its
        ``_hz_acc`` call: render.Renderer.load_helper)."""
        if not (self.prog.options.sanitize and name in self.k.shared):
            return []
        return [ast.parse(a, mode="eval").body for a in (
            f"np.int64({getattr(n, 'lineno', 0)})", "_t", "_hzep", "_hz", "_g0", "_g1", "_g2",
            "_ng0", "_ng1", shadow_of(self.prog, name))]


def block_expr(prog: Program, node: ast.AST, uniform: tuple[str, ...]) -> tuple[str, set[str]]:
    """A block-level (uniform) expression's text, and the locals it reads as thread 0's
    (they need per-thread arrays): no loads to check (a load is one that records a miss
    and reads zero, under bounds checks)."""
    w = ExprWriter(prog, uniform=uniform)
    return ast.unparse(w.visit(copy.deepcopy(node))), w.block_locals
