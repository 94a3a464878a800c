"""A looping kernel's work per thread, bounded at launch from the launch's own values.

A kernel with ``for`` loops has no static bound on its work (``kernel_check.bounded_work``
says None), so every launch of it went to a compute engine: ~0.1 ms of hand-off (an
engine's wake-up, its completion, the control loop's wake-up) for a softmax over 64 rows
of 10 that computes for a few microseconds. But most such loops are ``range`` loops whose
bounds are the launch's scalars, ids and constants (``for j in range(n)``, ``for r in
range(local_id(0), rows, 256)``): once the launch's values are known, so is an upper bound
of the trips, and with it of the work. :class:`LoopWork` computes that bound; the firmware
runs the launch inline when it is within the inline budget (firmware/launches.py), else on
an engine as before.

The bound is an upper bound whatever the kernel does: every statement counts its
syntax-tree nodes once per trip of each enclosing loop, an ``if`` counts its test and the
larger of its arms (only the arm it takes when the launch's values decide its test: a
comparison of two values the intervals below keep apart, or of a float scalar with a
constant, such as ``mm``'s ``if has_bias != 0`` and ``if alpha != 1.0``, whose untaken
epilogue loops would otherwise count as much as a 256 x 400 tile's product), a ``break``
or ``return`` only makes the real work smaller. A ``range``
argument is bounded by interval arithmetic over the launch's signed integer scalars, the
ids (``local_id(d)`` in ``[0, block[d] - 1]``...), constants and locals assigned once (in
scope, before the loop) and a buffer's ``shape[d]`` (the launch's own), using ``+ - *``,
``//`` by a known positive value, unary minus, ``min`` and ``max``. An ``mma`` counts its
tile's multiply-adds (one node per ``MACS_PER_NODE`` of them, and ``MMA_CALL_NODES``
for the call), shared among the block's threads since the block issues it once: the
products of a small training step (an MLP's 784-256 layer: 12.8 M multiply-adds, ~0.2 ms
of one core's BLAS) then run inline instead of paying an engine's hand-off (0.14-0.31 ms
and as much firmware CPU as the product itself, docs/launch.md).
Anything else -- a ``while`` loop, an ``mma`` whose tile sizes no launch's values bound, a
step that is not a known positive value, a bound read from memory, a float, an unsigned
scalar, a value of magnitude ``VALUE_LIMIT`` or more, a kernel of more than
``MAX_KERNEL_NODES`` nodes -- leaves the work unbounded (None): the launch goes to an
engine. The magnitude limit means that none of the int64 arithmetic the kernel does on
those values can wrap, so the kernel's trips are those the intervals bound.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Sequence
from typing import Any

from abi.kernel_lang import MMA_TILE_SIZES
from firmware.kernel_check import Kernel, is_mma

#: Values of a range bound's arithmetic at or above this magnitude leave the work
#: unbounded (the kernel's int64 arithmetic on them could wrap: the intervals would lie).
VALUE_LIMIT = 1 << 40
#: Per-thread work at or above this is unbounded too (it is far past any inline budget).
WORK_LIMIT = 1 << 40

#: Kernels of more syntax-tree nodes than this are not bounded (their launches go to an
#: engine): evaluating a plan costs the control loop ~50 us per 1,000 nodes on a launch
#: whose shape and scalars it has not seen, which a tenant can vary at will (the torch
#: backend's looping kernels have at most ~650).
MAX_KERNEL_NODES = 1024
#: launch shapes and scalars a kernel's bound remembers (LoopWork._seen) before it starts over
SEEN_LIMIT = 64
#: An ``mma``'s work in bounded nodes: one per this many multiply-adds of its tile, and
#: ``MMA_CALL_NODES`` per call. One core's sgemm runs a multiply-add of an MLP's 784-256
#: products in 12-17 ps (MKL, OpenBLAS; 29 ps measured under load), a bounded node takes
#: 100-170 ps (docs/launch.md, "Looping kernels inline"): six per node is the node's
#: cheapest against the slowest multiply-add seen, so the budget admits products up to
#: ~20 M multiply-adds (~0.3-0.6 ms of BLAS, as long as the budget's other launches run).
#: The call's checks and BLAS's own set-up: ~1-2 us.
MACS_PER_NODE = 6
MMA_CALL_NODES = 10_000

_SIGNED = frozenset({"int8", "int16", "int32", "int64"})
_FLOATS = frozenset({"float32", "float64"})

Interval = tuple[int, int]
Fn = Callable[[dict], "Interval | None"]


class LoopWork:
    """The work per thread of one kernel's launches: :meth:`per_thread`. The body is
    compiled once into a plan (node counts, the range bounds as closures), so that a
    launch evaluates only the loops' bounds."""

    def __init__(self, plan: list, scalars: dict[str, int],
                 shapes: dict[str, int] | None = None,
                 floats: dict[str, int] | None = None) -> None:
        self._plan = plan
        #: signed integer scalar parameter never assigned -> its position in the values
        self._scalars = scalars
        #: float scalar parameter never assigned that an ``if`` compares -> its position
        #: (decides the test; never a range bound)
        self._floats = floats or {}
        #: buffer parameter whose ``shape`` the body reads -> its position in the values
        self._shapes = shapes or {}
        #: (grid, block, those scalars) -> the bound: a launch that goes to an engine is
        #: bounded again every time (~8 us), and a program repeats its few shapes
        self._seen: dict[tuple, int | None] = {}

    @classmethod
    def of(cls, k: Kernel) -> LoopWork | None:
        """The kernel's bound, or None when no launch of it can be bounded (a ``while``
        loop, ``mma``, a ``range`` whose arguments or step no launch's values bound, more
        than ``MAX_KERNEL_NODES`` nodes)."""
        stores: dict[str, int] = {}
        nodes = 0
        for n in ast.walk(k.fn):
            nodes += 1
            if nodes > MAX_KERNEL_NODES:
                return None
            if isinstance(n, ast.While):
                return None
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                stores[n.id] = stores.get(n.id, 0) + 1
        scalars = {p: i for i, (p, t) in enumerate(zip(k.params, k.arg_types))
                   if p in k.scalars and t.dtype in _SIGNED and not stores.get(p)}
        floats = {p: i for i, (p, t) in enumerate(zip(k.params, k.arg_types))
                  if p in k.scalars and t.dtype in _FLOATS and not stores.get(p)}
        buffers = {p: i for p, i in k.buffers.items() if not stores.get(p)}
        compiler = _Compiler(stores, set(scalars), set(buffers), set(floats))
        plan = compiler.stmts(k.fn.body)
        if plan is None:
            return None
        return cls(plan, scalars, {p: buffers[p] for p in sorted(compiler.shapes_read)},
                   {p: floats[p] for p in sorted(compiler.floats_read)})

    def per_thread(self, grid: Sequence[int], block: Sequence[int],
                   values: Sequence[Any]) -> int | None:
        """An upper bound of the syntax-tree nodes one thread of this launch evaluates,
        or None when the launch's values do not bound it."""
        key = (*grid, *block, *(int(values[i]) for i in self._scalars.values()),
               *(values[i].shape for i in self._shapes.values()),
               *(float(values[i]) for i in self._floats.values()))
        if key in self._seen:
            return self._seen[key]
        if len(self._seen) >= SEEN_LIMIT:
            self._seen.clear()
        work = self._seen[key] = self._evaluate(grid, block, values)
        return work

    def _evaluate(self, grid: Sequence[int], block: Sequence[int],
                  values: Sequence[Any]) -> int | None:
        env: dict = {}
        for d in range(3):
            g, b = grid[d], block[d]
            env["local_id", d] = (0, b - 1)
            env["group_id", d] = (0, g - 1)
            env["global_id", d] = (0, g * b - 1)
            env["local_size", d] = (b, b)
            env["num_groups", d] = (g, g)
        env["threads"] = block[0] * block[1] * block[2]
        for name, i in self._shapes.items():
            for d, extent in enumerate(values[i].shape):
                env["shape", name, d] = (extent, extent)
        for name, i in self._scalars.items():
            v = int(values[i])
            if abs(v) < VALUE_LIMIT:  # else unknown: a range bound using it is unbounded
                env[name] = (v, v)
        for name, i in self._floats.items():
            f = float(values[i])
            env[name] = (f, f)
        return _run(self._plan, env)


# A plan is a list of steps: an int (nodes evaluated once), ("let", name, fn),
# ("if", nodes, body, orelse, test), ("for", nodes, var, start, stop, step, body, orelse),
# ("mma", nodes, tm, tn, tk).


def _run(plan: list, env: dict) -> int | None:
    env = dict(env)  # a body's assignments are not seen outside it
    total = 0
    for step in plan:
        if type(step) is int:
            total += step
            continue
        kind = step[0]
        if kind == "mma":
            sizes = [f(env) for f in step[2:]]
            if any(r is None for r in sizes):
                return None
            macs = 1
            for r in sizes:
                macs *= max(0, r[1])  # type: ignore[index]
            block_work = -(-macs // MACS_PER_NODE) + MMA_CALL_NODES
            total += step[1] + -(-block_work // env["threads"])  # the block issues it once
        elif kind == "let":
            r = step[2](env)
            if r is not None:
                env[step[1]] = r
        elif kind == "if":
            taken = step[4](env)
            arms = (step[2],) if taken is True else (step[3],) if taken is False \
                else (step[2], step[3])
            works = [_run(arm, env) for arm in arms]
            if None in works:
                return None
            total += step[1] + max(works)  # type: ignore[type-var]  # one arm runs
        else:
            _, nodes, var, start_fn, stop_fn, step_fn, body_plan, orelse_plan = step
            start, stop = start_fn(env), stop_fn(env)
            stride = step_fn(env)
            if start is None or stop is None or stride is None \
                    or stride[0] != stride[1] or stride[0] < 1:
                return None  # unknown, or a step that is not a known positive value
            trips = max(0, -(-(stop[1] - start[0]) // stride[0]))
            inner = dict(env)
            if var is not None and trips:
                inner[var] = (start[0], stop[1] - 1)
            else:
                inner.pop(var, None)
            body, orelse = _run(body_plan, inner), _run(orelse_plan, env)
            if body is None or orelse is None:
                return None
            total += nodes + trips * (body + 1) + orelse
        if total >= WORK_LIMIT:
            return None
    return total


class _Compiler:
    """The body as a plan: node counts, and closures for what a launch must evaluate."""

    def __init__(self, stores: dict[str, int], scalars: set[str],
                 buffers: set[str], floats: set[str]) -> None:
        self.stores = stores
        self.scalars = scalars
        self.buffers = buffers  # never assigned: their shapes are the launch's
        self.floats = floats  # never assigned: compared by an ``if`` test only
        self.shapes_read: set[str] = set()
        self.floats_read: set[str] = set()

    def stmts(self, body: list[ast.stmt]) -> list | None:
        plan: list = []
        for s in body:
            if isinstance(s, ast.For):
                step = self.loop(s)
                if step is None:
                    return None
                plan.append(step)
            elif is_mma(s):
                step = self.mma(s)
                if step is None:
                    return None
                plan.append(step)
            elif isinstance(s, ast.If):
                then, orelse = self.stmts(s.body), self.stmts(s.orelse)
                if then is None or orelse is None:
                    return None
                plan.append(("if", _nodes(s.test) + 1, then, orelse, self.test(s.test)))
            else:
                if isinstance(s, ast.Assign) and len(s.targets) == 1 \
                        and isinstance(s.targets[0], ast.Name) \
                        and self.stores.get(s.targets[0].id) == 1:
                    fn = self.expr(s.value)
                    if fn is not None:
                        plan.append(("let", s.targets[0].id, fn))
                if plan and type(plan[-1]) is int:
                    plan[-1] += _nodes(s)
                else:
                    plan.append(_nodes(s))
        return plan

    def loop(self, s: ast.For) -> tuple | None:
        it = s.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                and it.func.id == "range" and 1 <= len(it.args) <= 3
                and isinstance(s.target, ast.Name)):
            return None
        args = [self.expr(a) for a in it.args]
        if any(a is None for a in args):
            return None
        zero, one = _const(0), _const(1)
        start, stop, step = ((zero, args[0], one) if len(args) == 1 else
                             (args[0], args[1], one) if len(args) == 2 else tuple(args))
        body, orelse = self.stmts(s.body), self.stmts(s.orelse)
        if body is None or orelse is None:
            return None
        var = s.target.id if self.stores.get(s.target.id) == 1 else None
        return ("for", _nodes(it) + 1, var, start, stop, step, body, orelse)

    def mma(self, s: ast.stmt) -> tuple | None:
        """An ``mma`` statement: its tile's sizes (positional, as kernel_check requires)."""
        call = s.value  # type: ignore[attr-defined]
        if call.keywords or len(call.args) <= max(MMA_TILE_SIZES):
            return None
        sizes = [self.expr(call.args[i]) for i in MMA_TILE_SIZES]
        if any(f is None for f in sizes):
            return None
        return ("mma", _nodes(s), *sizes)

    def test(self, e: ast.expr) -> Callable[[dict], bool | None]:
        """An ``if`` test as a function of the launch's environment: True or False when
        the launch's values decide it (a comparison of two operands whose intervals
        settle it), else None (both arms may run)."""
        if not (isinstance(e, ast.Compare) and len(e.ops) == 1
                and type(e.ops[0]) in _DECIDE):
            return _undecided
        left, right = self.operand(e.left), self.operand(e.comparators[0])
        if left is None or right is None:
            return _undecided
        decide = _DECIDE[type(e.ops[0])]

        def fn(env: dict) -> bool | None:
            a, b = left(env), right(env)
            return None if a is None or b is None else decide(a, b)
        return fn

    def operand(self, e: ast.expr) -> Fn | None:
        """A comparison's operand: an integer expression :meth:`expr` bounds, a float
        scalar parameter or a finite float constant (compared exactly, never computed
        with: float arithmetic has no intervals here)."""
        if isinstance(e, ast.Name) and e.id in self.floats:
            name = e.id
            self.floats_read.add(name)
            return lambda env: env.get(name)
        if isinstance(e, ast.Constant) and type(e.value) is float and math.isfinite(e.value):
            return _const(e.value)  # type: ignore[arg-type]
        return self.expr(e)

    def expr(self, e: ast.AST) -> Fn | None:
        """``e``'s interval as a function of the launch's environment, or None when no
        launch bounds it."""
        if isinstance(e, ast.Constant):
            return _const(e.value) if type(e.value) is int and abs(e.value) < VALUE_LIMIT \
                else None
        if isinstance(e, ast.Name):
            if e.id in self.scalars or self.stores.get(e.id) == 1:
                name = e.id
                return lambda env: env.get(name)
            return None
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub):
            f = self.expr(e.operand)
            return None if f is None else _lift1(f, lambda r: (-r[1], -r[0]))
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and not e.keywords:
            return self.call(e)
        if isinstance(e, ast.Subscript):
            return self.shape(e)
        if isinstance(e, ast.BinOp):
            a, b = self.expr(e.left), self.expr(e.right)
            if a is None or b is None:
                return None
            if isinstance(e.op, ast.Add):
                return _lift2(a, b, lambda x, y: (x[0] + y[0], x[1] + y[1]))
            if isinstance(e.op, ast.Sub):
                return _lift2(a, b, lambda x, y: (x[0] - y[1], x[1] - y[0]))
            if isinstance(e.op, ast.Mult):
                return _lift2(a, b, _times)
            if isinstance(e.op, ast.FloorDiv):
                return _lift2(a, b, _floordiv)
        return None

    def shape(self, e: ast.Subscript) -> Fn | None:
        """``buf.shape[d]`` of a buffer parameter: the launch's extent."""
        v, d = e.value, e.slice
        if not (isinstance(v, ast.Attribute) and v.attr == "shape"
                and isinstance(v.value, ast.Name) and v.value.id in self.buffers
                and isinstance(d, ast.Constant) and type(d.value) is int and d.value >= 0):
            return None
        name, key = v.value.id, ("shape", v.value.id, d.value)
        self.shapes_read.add(name)
        return lambda env: env.get(key)

    def call(self, e: ast.Call) -> Fn | None:
        name = e.func.id  # type: ignore[attr-defined]
        if name in _IDS:
            d = e.args[0] if len(e.args) == 1 else None
            if isinstance(d, ast.Constant) and type(d.value) is int and 0 <= d.value <= 2:
                key = (name, d.value)
                return lambda env: env[key]
            return None
        if name in ("min", "max") and len(e.args) >= 2:
            parts = [self.expr(a) for a in e.args]
            if any(p is None for p in parts):
                return None
            pick = min if name == "min" else max

            def fn(env: dict) -> Interval | None:
                rs = [p(env) for p in parts]  # type: ignore[misc]
                if any(r is None for r in rs):
                    return None
                return pick(r[0] for r in rs), pick(r[1] for r in rs)  # type: ignore[index]
            return fn
        return None


_IDS = ("local_id", "group_id", "global_id", "local_size", "num_groups")


def _undecided(env: dict) -> None:
    return None


def _less(a: Interval, b: Interval) -> bool | None:
    """Whether every value of ``a`` is below every one of ``b`` (True), none is (False)."""
    return True if a[1] < b[0] else False if a[0] >= b[1] else None


def _equal(a: Interval, b: Interval) -> bool | None:
    """Equal points (True), disjoint intervals (False); a NaN point compares unequal to
    everything, as in the kernel."""
    if a[0] == a[1] == b[0] == b[1]:
        return True
    return False if a[1] < b[0] or b[1] < a[0] or a[0] != a[0] or b[0] != b[0] else None


def _not(r: bool | None) -> bool | None:
    return None if r is None else not r


#: comparison -> its decision over two intervals (True, False, or None: undecided)
_DECIDE: dict[type, Callable[[Interval, Interval], bool | None]] = {
    ast.Lt: _less,
    ast.GtE: lambda a, b: _not(_less(a, b)),
    ast.Gt: lambda a, b: _less(b, a),
    ast.LtE: lambda a, b: _not(_less(b, a)),
    ast.Eq: _equal,
    ast.NotEq: lambda a, b: _not(_equal(a, b)),
}


def _const(v: int) -> Fn:
    r = (v, v)
    return lambda env: r


def _bounded(r: Interval | None) -> Interval | None:
    return None if r is None or max(-r[0], r[1]) >= VALUE_LIMIT else r


def _lift1(f: Fn, op: Callable[[Interval], Interval]) -> Fn:
    def fn(env: dict) -> Interval | None:
        r = f(env)
        return None if r is None else _bounded(op(r))
    return fn


def _lift2(f: Fn, g: Fn, op: Callable[[Interval, Interval], Interval | None]) -> Fn:
    def fn(env: dict) -> Interval | None:
        a = f(env)
        if a is None:
            return None
        b = g(env)
        return None if b is None else _bounded(op(a, b))
    return fn


def _times(a: Interval, b: Interval) -> Interval:
    products = (a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1])
    return min(products), max(products)


def _floordiv(a: Interval, b: Interval) -> Interval | None:
    """Division by a known positive value only (floor division is then monotonic)."""
    if b[0] != b[1] or b[0] < 1:
        return None
    return a[0] // b[0], a[1] // b[0]


def _nodes(node: ast.AST) -> int:
    """Syntax-tree nodes of a simple statement or an expression."""
    return sum(1 for _ in ast.walk(node))
