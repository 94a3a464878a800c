"""Affine analysis: accesses whose every index is affine in a thread index within a phase.

Over a block such an index spans a range computed from the block's ids, the uniform
loops' bounds and the offsets, which the block checks once before the thread loop
(passes/affine.py). A superset of the indices the threads really use is checked (guards
and control flow are ignored), so a block that passes cannot miss; one that does not
runs the per-element checked loop, which faults exactly as without this.

No range arithmetic can wrap: an index adds at most :data:`MAX_OFFSETS` offsets below
2**40 to ``group * local_size`` with every grid and block dimension at most MAX_DIM, so
the checks stay below 2**46; a thread index's scale below :data:`SCALE_LIMIT` (2**20,
and not negative: both checked at block level) keeps them below 2**59."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from firmware.kernel_check import buffer_ndim, const_int
from firmware.lower.analysis.uniformity import RANGE_LIMIT, Uniformity
from firmware.lower.program import Phase, Program
from firmware.lower.syntax import call_indices, indices, user_name

#: Offsets per index (expression length).
MAX_OFFSETS = 16
#: A thread index's scale (``i * sa``) is range-checked per block only below this: the
#: thread index's bound (2**38) times it stays far below RANGE_LIMIT.
SCALE_LIMIT = 1 << 20

#: A uniform loop's variable -> (first, last, guards): its range's block-level texts and
#: the conditions under which they are exact.
Loops = dict[str, tuple[str, str, tuple[str, ...]]]


@dataclass(frozen=True)
class Affine:
    """An index as (at most one) thread index ``("g"|"l", d)``, times ``scale`` when it
    has one (the block-level text of a non-negative uniform factor: ``i * sa``),
    variables of uniform loops (each at most once) and block-uniform offset texts;
    ``bound`` bounds the magnitude of every partial sum of its range (static, or guarded
    at block level)."""

    thread: tuple[str, int] | None
    loops: tuple[str, ...]
    offs: tuple[str, ...]
    bound: int
    scale: str | None = None

    def plus(self, o: "Affine") -> "Affine | None":
        if (self.thread and o.thread) or set(self.loops) & set(o.loops) \
                or len(self.offs) + len(o.offs) > MAX_OFFSETS:
            return None
        return Affine(self.thread or o.thread, self.loops + o.loops, self.offs + o.offs,
                      self.bound + o.bound, self.scale or o.scale)

    def minus(self, o: "Affine") -> "Affine | None":
        if o.thread or o.loops or len(self.offs) + len(o.offs) > MAX_OFFSETS:
            return None
        return Affine(self.thread, self.loops, self.offs + tuple(f"-({x})" for x in o.offs),
                      self.bound + o.bound, self.scale)

    def span(self, loops: Loops) -> tuple[str, str]:
        """Block-level texts of the first and last index the block's threads can use (a
        scale is never negative: the first thread's index is the smallest)."""
        base = list(self.offs)
        last: list[str] = []
        if self.thread is not None:
            kind, d = self.thread
            if self.scale is None:  # (unscaled: the text as it always was, a cache key)
                if kind == "g":
                    base.append(f"_g{d} * _ls{d}")
                last.append(f"_ls{d} - 1")
            else:
                if kind == "g":
                    base.append(f"_g{d} * _ls{d} * {self.scale}")
                last.append(f"(_ls{d} - 1) * {self.scale}")
        first = base + [f"({loops[v][0]})" for v in self.loops]
        last = base + last + [f"({loops[v][1]})" for v in self.loops]
        return " + ".join(first) or "0", " + ".join(last) or "0"


@dataclass(frozen=True)
class Box:
    """The block's index box of a range-checked access: its buffer, first index per
    dimension and extent per dimension (block-level texts), for managed page marks."""

    name: str
    firsts: list[str]
    sizes: list[str]


@dataclass
class PhaseRanges:
    """One phase's result: per top-level statement, in order, the block-level conditions
    its affine accesses need; ``defs_at``: the affine locals known at each top-level
    ``if`` (for passes/if_convert.py's guard hoisting)."""

    stmt_conds: list[tuple[ast.stmt, list[str]]] = field(default_factory=list)
    defs_at: dict[ast.If, dict[str, Affine]] = field(default_factory=dict)


class AffineAnalysis:
    """The affine accesses of every phase, in phase order (locals assigned once at the
    top level of the kernel's body keep their affine value for the rest of the kernel,
    ``carried``; others for the rest of their phase)."""

    def __init__(self, prog: Program) -> None:
        self.prog = prog
        self.k = prog.kernel
        #: range-checked accesses (subscripts and atomic_add calls) -> their box
        self.boxes: dict[ast.AST, Box] = {}
        self.def_guards: dict[str, list[str]] = {}  # affine local -> guards of its value
        self.def_values: dict[str, ast.expr] = {}  # affine locals assigned once -> value
        self.carried: dict[str, Affine] = {}  # ... at the kernel body's top level
        #: phase -> the carried affine locals defined before it (recomputed, not loaded)
        self.carried_before: dict[int, dict[str, Affine]] = {}
        self.phases: dict[int, PhaseRanges] = {}

    def range_checked(self, node: ast.AST) -> bool:
        """Whether an access (a kernel node) has its range checked per block."""
        return node in self.boxes

    # -- per phase ----------------------------------------------------------------------
    def run(self, phase: Phase) -> PhaseRanges:
        """Analyse one phase (phases in order: ``carried`` grows)."""
        uni = Uniformity(self.prog, phase.uniform)
        self.carried_before[phase.index] = dict(self.carried)
        result = PhaseRanges()
        defs: dict[str, Affine] = dict(self.carried)
        for s in phase.stmts:
            conds: dict[str, None] = {}
            self.mark(uni, s, defs, {}, conds)
            result.stmt_conds.append((s, list(conds)))
            if isinstance(s, ast.If):
                result.defs_at[s] = dict(defs)
            if isinstance(s, ast.Assign) and len(s.targets) == 1 \
                    and isinstance(s.targets[0], ast.Name):
                v = s.targets[0].id
                if v in self.k.locals and self.prog.stores.get(v) == 1:
                    guards: dict[str, None] = {}
                    r = self.affine(uni, s.value, defs, guards, {})
                    if r is not None:
                        defs[v] = r
                        self.def_guards[v] = list(guards)  # for the accesses that use v
                        self.def_values[v] = s.value
                    carried = self.affine(uni, s.value, self.carried, {}, {}, allow_vars=False)
                    if phase.top and carried is not None:
                        self.carried[v] = carried
        self.phases[phase.index] = result
        return result

    def affine(self, uni: Uniformity, e: ast.AST, defs: dict[str, Affine],
               guards: dict[str, None], loops: Loops, allow_vars: bool = True) -> Affine | None:
        """``e`` as a thread index (``global_id(d)``/``local_id(d)``, at most one) plus
        variables of uniform loops in ``loops`` (each at most once) plus uniform offsets,
        directly or through locals in ``defs``; None when it is not of that form."""
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) \
                and e.func.id in ("global_id", "local_id") and len(e.args) == 1:
            d = const_int(e.args[0])
            if d is not None and 0 <= d <= 2:
                return Affine(("g" if e.func.id == "global_id" else "l", d), (), (), 1 << 38)
            return None
        if isinstance(e, ast.Name) and e.id in loops:
            for g in loops[e.id][2]:
                guards[g] = None
            return Affine(None, (e.id,), (), 1 << 41)
        if isinstance(e, ast.Name) and e.id in defs:
            for g in self.def_guards.get(e.id, ()):
                guards[g] = None
            return defs[e.id]
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Mult):
            return self.scaled(uni, e, defs, guards, loops, allow_vars)
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
            left = self.affine(uni, e.left, defs, guards, loops, allow_vars)
            right = self.affine(uni, e.right, defs, guards, loops, allow_vars) if left else None
            if left is None or right is None:
                return None
            return left.plus(right) if isinstance(e.op, ast.Add) else left.minus(right)
        term = uni.term(e, guards, allow_vars)
        return Affine(None, (), (term[0],), term[1]) if term else None

    def scaled(self, uni: Uniformity, e: ast.BinOp, defs: dict[str, Affine],
               guards: dict[str, None], loops: Loops, allow_vars: bool) -> Affine | None:
        """``thread index * scale`` (either order; the thread index alone, directly or
        through a local), the scale an int constant or an integer scalar parameter in
        ``[0, SCALE_LIMIT)`` (checked at block level): a strided operand's ``x[i * sx]``.
        Any other product is a uniform term or not affine."""
        for index, factor in ((e.left, e.right), (e.right, e.left)):
            own: dict[str, None] = {}
            a = self.affine(uni, index, defs, own, loops, allow_vars)
            if a is None or a.thread is None or a.loops or a.offs or a.scale is not None:
                continue
            scale = self._scale(factor, own)
            if scale is not None:
                guards.update(own)
                return Affine(a.thread, (), (), a.bound * SCALE_LIMIT, scale)
        term = uni.term(e, guards, allow_vars)
        return Affine(None, (), (term[0],), term[1]) if term else None

    def _scale(self, e: ast.AST, guards: dict[str, None]) -> str | None:
        c = const_int(e)
        if c is not None:
            return str(c) if 0 <= c < SCALE_LIMIT else None
        k = self.k
        if isinstance(e, ast.Name) and e.id in k.scalars and not self.prog.stores.get(e.id):
            if k.arg_types[k.params.index(e.id)].dtype in ("int8", "int16", "int32", "int64"):
                guards[f"0 <= {user_name(e.id)} < {SCALE_LIMIT}"] = None
                return user_name(e.id)
        return None

    def mark(self, uni: Uniformity, s: ast.stmt, defs: dict[str, Affine], loops: Loops,
             conds: dict[str, None]) -> None:
        """One statement, with the ranges of the uniform loops around it: the accesses of
        ``s`` outside its nested statements, then those statements (a uniform loop's body
        with its variable's range)."""
        k = self.k
        nested = [c for f in ("body", "orelse") for c in getattr(s, f, [])]
        inner = {id(n) for c in nested for n in ast.walk(c)}
        for n in ast.walk(s):
            if id(n) in inner:
                continue
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
                name, idx = n.value.id, indices(n)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                    and n.func.id == "atomic_add" and isinstance(n.args[0], ast.Name):
                name, idx = n.args[0].id, call_indices(n.args[1])
            else:
                continue
            if name not in k.buffers and name not in k.shared:
                continue
            if len(idx) != buffer_ndim(k, name):
                continue
            guards: dict[str, None] = {}
            ranges = [self.affine(uni, i, defs, guards, loops) for i in idx]
            if any(r is None or r.bound >= RANGE_LIMIT for r in ranges):
                continue
            if name in k.buffers and k.arg_types[k.buffers[name]].managed \
                    and any(r.scale not in (None, "0", "1") for r in ranges):  # type: ignore[union-attr]
                continue  # its box would mark pages between the strided elements
            spans = [r.span(loops) for r in ranges]  # type: ignore[union-attr]
            for c in list(guards) + _access_conds(name, spans):
                conds[c] = None
            self.boxes[n] = Box(name, [lo for lo, _ in spans],
                                [f"({hi}) - ({lo}) + 1" for lo, hi in spans])
        if isinstance(s, ast.For):
            guards = {}
            rng = uni.loop_range(s, guards)
            if rng is not None:
                loops = {**loops, s.target.id: (*rng, tuple(guards))}  # type: ignore[attr-defined]
        for c in nested:
            self.mark(uni, c, defs, loops, conds)

    _FLIP = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE}

    def holds_for_block(self, uni: Uniformity, test: ast.expr,
                        defs: dict[str, Affine]) -> list[str] | None:
        """Block-level conditions under which the guard ``test`` of a phase's top-level
        ``if`` is true for every thread of the block, or None when it is not a bounds
        guard: comparisons (``< <= > >=``, joined by ``and``) of a position in the grid
        (an affine index with a global id or a group id in it: ``i = global_id(0)``,
        ``row = group_id(1) * 16 + ty``, or a block-level loop's variable: ``t + tx`` of
        a tile loop) with a uniform bound (``n``, ``x.size``). The index grows with the
        thread index, so the block's first and last values decide. Guards on local ids
        alone (``if t < s`` of a tree reduction) hold for some threads of every block and
        are left alone."""
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            parts = [self.holds_for_block(uni, v, defs) for v in test.values]
            if any(p is None for p in parts):
                return None
            return [c for p in parts for c in p]  # type: ignore[union-attr]
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1
                and type(test.ops[0]) in self._FLIP):
            return None
        op, left, right = type(test.ops[0]), test.left, test.comparators[0]
        guards: dict[str, None] = {}
        a = self.affine(uni, left, defs, guards, {})
        if a is None or not uni.range_arg(right):
            guards = {}
            a = self.affine(uni, right, defs, guards, {})
            if a is None or not uni.range_arg(left):
                return None
            op, right = self._FLIP[op], left
        moving = {user_name(v) for v in uni.uniform}  # block-level loops: a tile's position
        if a.thread is None or a.scale is not None or a.bound >= RANGE_LIMIT or not (
                a.thread[0] == "g" or any("_g" in o or set(re.findall(r"\w+", o)) & moving
                                          for o in a.offs)):
            return None
        first, last = a.span({})
        bound = uni.expr(right)
        text = {ast.Lt: f"({last}) < ({bound})", ast.LtE: f"({last}) <= ({bound})",
                ast.Gt: f"({first}) > ({bound})", ast.GtE: f"({first}) >= ({bound})"}[op]
        return [*guards, text]


def _access_conds(name: str, spans: list[tuple[str, str]]) -> list[str]:
    """Block-level conditions under which every index of an affine access with these
    spans is inside ``name``'s shape."""
    u = user_name(name)
    out = []
    for dim, (lo, hi) in enumerate(spans):
        out.append(f"({lo}) >= 0")
        out.append(f"({hi}) < {u}.shape[{dim}]")
    return out
