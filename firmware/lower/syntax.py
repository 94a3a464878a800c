"""Small facts about the kernel's syntax tree that every pass and the renderer ask."""

from __future__ import annotations

import ast
import copy

from firmware.kernel_check import Kernel


def user_name(name: str) -> str:
    """A user name in generated code: the ``u_`` prefix keeps it clear of the generated
    code's own names and modules."""
    return "u_" + name


def indices(n: ast.Subscript) -> list[ast.expr]:
    """The index components of a subscript."""
    return list(n.slice.elts) if isinstance(n.slice, ast.Tuple) else [n.slice]


def call_indices(idx_node: ast.expr) -> list[ast.expr]:
    """The index components of ``atomic_add``'s index argument."""
    return list(idx_node.elts) if isinstance(idx_node, ast.Tuple) else [idx_node]


def names(stmts: list[ast.stmt]) -> set[str]:
    return {n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name)}


def assigned(stmts: list[ast.stmt]) -> set[str]:
    return {n.id for s in stmts for n in ast.walk(s)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def node_count(stmts: list[ast.stmt]) -> int:
    """Syntax-tree nodes (ast.walk's count): the size measure of phases and loop bodies."""
    return sum(1 for s in stmts for _ in ast.walk(s))


def is_access(n: ast.AST, k: Kernel) -> bool:
    """Whether ``n`` reads or writes an element of a buffer or shared array (a subscript
    or an ``atomic_add``)."""
    if isinstance(n, ast.Subscript):
        return isinstance(n.value, ast.Name) and (n.value.id in k.buffers or n.value.id in k.shared)
    return (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "atomic_add"
            and isinstance(n.args[0], ast.Name))


def access_name(n: ast.AST) -> str:
    """The buffer of an access (see is_access)."""
    return (n.value if isinstance(n, ast.Subscript) else n.args[0]).id  # type: ignore


class Origins:
    """Copies of syntax-tree nodes -> the kernel's own nodes they were copied from.

    Analyses key their results on the kernel's nodes; the renderer and the
    unroll-and-jam work on copies (a rewrite mutates what it visits), and look a copy's
    facts up through :meth:`of`. The map holds the copies, so no node id is reused while
    it lives."""

    def __init__(self) -> None:
        self._origin: dict[ast.AST, ast.AST] = {}

    def copy(self, node: ast.AST) -> ast.AST:
        """A deep copy of ``node`` whose every node maps back to its original."""
        new = copy.deepcopy(node)
        for old, dup in zip(ast.walk(node), ast.walk(new)):
            self._origin[dup] = self._origin.get(old, old)
        return new

    def of(self, node: ast.AST) -> ast.AST:
        """The kernel's node that ``node`` is (a copy of)."""
        return self._origin.get(node, node)


class Shift(ast.NodeTransformer):
    """Reads of loop variable ``var`` as ``var + by`` (an unroll-and-jam copy)."""

    def __init__(self, var: str, by: int) -> None:
        self.var, self.by = var, by

    def visit_Name(self, n: ast.Name) -> ast.AST:
        if n.id != self.var or not isinstance(n.ctx, ast.Load):
            return n
        return ast.BinOp(n, ast.Add(), ast.Constant(self.by))
