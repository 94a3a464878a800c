"""Type inference, as far as the lowering needs it: whether a local is an integer or a
float. Per-thread arrays are declared before numba types the phase functions, so their
type is this static guess."""

from __future__ import annotations

import ast

from firmware.kernel_check import ID_BUILTINS, Kernel, buffer_dtype


class Kinds:
    """Each local -> 'float' unless every value ever assigned to it is an integer (or
    bool): a conservative type for per-thread arrays, iterated to a fixed point. A
    function of the kernel alone, computed once (every ``if`` of every phase asks, see
    passes/if_convert.py)."""

    def __init__(self, k: Kernel) -> None:
        self.k = k
        self.locals: dict[str, str] = {n: "int" for n in k.locals}
        assigns: list[tuple[str, ast.AST | None, ast.operator | None]] = []
        for n in ast.walk(k.fn):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        assigns.append((t.id, n.value, None))
                    elif isinstance(t, ast.Tuple):
                        for e in t.elts:  # a, b = x, y: be conservative
                            if isinstance(e, ast.Name):
                                assigns.append((e.id, None, None))
            elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
                assigns.append((n.target.id, n.value, n.op))
        changed = True
        while changed:
            changed = False
            for name, value, op in assigns:
                kind = "float" if value is None else self.of(value)
                if isinstance(op, (ast.Div, ast.Pow)):
                    kind = "float"
                if kind == "float" and self.locals.get(name) != "float":
                    self.locals[name] = "float"
                    changed = True

    def local(self, name: str) -> str:
        """A local's kind ('float' for a name it does not know)."""
        return self.locals.get(name, "float")

    def of(self, e: ast.AST) -> str:
        """An expression's kind under the locals' current kinds."""
        k = self.k
        if isinstance(e, ast.Constant):
            return "float" if isinstance(e.value, float) else "int"
        if isinstance(e, ast.Name):
            if e.id in k.scalars:
                return k.arg_types[k.params.index(e.id)].kind
            return self.locals.get(e.id, "int")
        if isinstance(e, ast.BinOp):
            if isinstance(e.op, (ast.Div, ast.Pow)):
                return "float"
            return _join(self.of(e.left), self.of(e.right))
        if isinstance(e, ast.UnaryOp):
            return "int" if isinstance(e.op, ast.Not) else self.of(e.operand)
        if isinstance(e, ast.Compare):
            return "int"
        if isinstance(e, ast.BoolOp):
            return _join(*(self.of(v) for v in e.values))
        if isinstance(e, ast.IfExp):
            return _join(self.of(e.body), self.of(e.orelse))
        if isinstance(e, ast.Subscript):
            if isinstance(e.value, ast.Attribute):
                return "int"
            dtype = buffer_dtype(k, e.value.id)  # type: ignore[attr-defined]
            return "float" if dtype.startswith("float") else "int"
        if isinstance(e, ast.Attribute):
            return "int"
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            f = e.func.id
            if f in ID_BUILTINS or f in ("int", "floor"):
                return "int"
            if f in ("abs", "min", "max"):
                return _join(*(self.of(a) for a in e.args))
        return "float"

    def exact_float(self, name: str) -> bool:
        """Whether a float64 per-thread array is the local's exact numba type: a float
        local that is assigned a float constant somewhere (numba unifies its type to
        float64)."""
        return self.locals.get(name) == "float" and any(
            isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, float)
            and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
            for n in ast.walk(self.k.fn))


def _join(*kinds: str) -> str:
    return "float" if "float" in kinds else "int"
