"""Lowering: one validated kernel + argument types + :class:`Options` -> the text of a
Python module that numba compiles (firmware/jit.py writes, imports and caches it).

Why the generated code looks the way it does
--------------------------------------------
* One entry point, ``_grid(block_lo, block_hi, gx, gy, gz, bx, by, bz, abort, fault,
  *args)``, runs a *range of blocks*, so the engines can split a launch across threads
  and preempt it between blocks: it returns the first block it did not run.
* A block's threads run as loops (the CPU-OpenCL / POCL scheme). The kernel body is cut at
  every ``barrier()`` into *phases*; each phase is a loop over the block's threads. A
  small phase without loops is written into that loop (a user ``return``, "this thread is
  done", is a ``continue``); any other is its own ``@njit`` function called in the loop
  (LLVM inlines it), where a ``return`` at any loop depth is a plain ``return``: every
  function is a compile unit of its own to numba, seconds of a first launch
  (docs/kernels.md, "Compile time"). Locals that
  live across phases become per-thread arrays; a ``for``/``while``/``if`` that contains a
  barrier stays at block level (it must be uniform across the block) and the phases inside
  it are thread loops.
* Bounds checks are explicit generated code, not numba's ``boundscheck`` (whose failure is
  an exception with no buffer name, and which numba's cache does not key on): a miss
  records the buffer's position, its shape and the index per dimension in the fault array
  (layout: :data:`FAULT_NDIM` and below) and stops the launch; firmware/jit.py computes the
  flat index from those in Python ints, so no report can wrap around.
* No range arithmetic that guards memory can wrap: indices are int64 by ``_rt_index``
  (firmware/intrinsics.py: a uint64 beyond int64 saturates, a float does not compile) and
  are compared unsigned against the shape; the block-level range checks of affine
  accesses add at most ``_Lowering._MAX_OFFSETS`` offsets below 2**40 to ``group *
  local_size`` with every grid and block dimension at most :data:`MAX_DIM` (checked by
  ``CompiledKernel.run`` before any compiled code runs), so they stay below 2**46;
  mma's checks are in firmware/matrix.py. Operations whose numba lowering can be LLVM
  poison (out-of-range shifts, float-to-int conversions, numba's integer power) go through
  the defined versions in firmware/intrinsics.py, including the conversion of a value
  stored into an integer buffer.
* Every user loop reads the abort word once per iteration with an atomic load (a plain
  load of a value the loop never writes may be hoisted out of the loop by LLVM, which would
  make a ``while True:`` kernel unkillable).
* ``atomic_add`` is a real LLVM ``atomicrmw add``/``fadd`` (a numba ``@intrinsic``):
  blocks of one launch run on several engine threads at once, so
  :attr:`CompiledKernel.needs_serial` is always False.
* ``error_model="numpy"``: a division by zero gives inf/nan/0 as on a GPU instead of
  raising inside the engine thread.
* Buffer elements are indexed with uint64 indices (``_rt_uindex``): with a signed index
  numba emits Python's negative-index wraparound, which stops LLVM vectorising and made a
  bounds-free saxpy ~4x slower; here a negative index is a bounds miss (checked) or undefined
  (``boundscheck=False``, the caller's choice of an unsafe kernel).
* Cost (16 Mi float32 saxpy, 2-core machine): ``boundscheck=False`` runs as fast as a
  plain numba loop (~6.5 vs 7 ms); with checks ~18 ms, because a check that can stop the
  thread is an early exit that LLVM will not vectorise. So an access whose every index is
  affine in a thread index within a phase (``global_id(d)``/``local_id(d)`` plus/minus int
  constants or never-assigned int scalar parameters, directly or through a local assigned
  once) has its index range over the block checked once before the thread loop: in range,
  the block runs the phase's ``_phf`` variant without those checks; otherwise the checked
  ``_ph`` loop, which faults exactly as before. Checked saxpy: ~6.6-7 ms instead of ~18.
* Vectorised phases (docs/kernels.md, "Vectorised phases"): a phase with a ``range`` loop
  whose bounds are uniform across the block gets a third variant, ``_phv``, one call per
  block: that loop runs outside the thread loops (innermost over ``local_id(0)``), so LLVM
  vectorises across threads. The range checks of affine accesses cover the variables of such
  loops (their range is computed at block level) and uniform products (``group_id(1) * 16``),
  and ``_phv`` runs only when every access of the phase passed them, so it cannot fault; a
  block that fails runs the checked per-thread loop, whose fault record is the old one.
  Locals living across its thread loops are per-thread arrays of their exact numba type or
  affine locals recomputed per thread; stored buffers are accessed in one thread loop
  outside the interchanged loops, so every buffer sees its accesses in the old order.
  An interchanged loop with a constant step and a small one-loop body runs 4 iterations
  per pass of the thread loops (unroll-and-jam, each thread's order kept).
* In every phase after the one defining it, a local assigned once at the kernel's top
  level with an affine value is recomputed from the thread's ids rather than loaded from
  its per-thread array; in a block's range-checked variant, ``if c: t = x else: t = y``
  of float loads and arithmetic is a select (a load the guard skips is in range there),
  so the thread loop can vectorise (docs/kernels.md, "Tile loads and register blocking").
* ``shared_array``: allocated (zeroed) once per block at block level, passed to the
  phases. Bounds misses on it report the local's name as ``param``. ``dynamic_shared``
  arrays are views of one zeroed block of the launch's dynamic bytes (``_dyn``, a
  ``_grid`` argument), each with its own dtype: they alias, as CUDA's ``extern
  __shared__`` arrays do.
* Per-thread arrays for locals live across phases are float64 unless every value ever
  assigned to the local is an integer/bool (then int64): a conservative static guess,
  since the phase functions are typed by numba only after the arrays are declared.
* Loops with an ``else`` clause are rejected (the contract does not list them).
* A buffer in managed memory (argument type suffix ``@managed``) adds two trailing
  arguments, its page map ``_pm_x`` (a uint8 per 64 KiB page) and its first byte's offset
  in its page ``_po_x``: a checked access marks its page once the check passed, a phase's
  range-checked affine accesses mark the block's index box once before the thread loop
  (a store per element would sit in the loop the range check keeps free of checks; not
  measured), unchecked code and mma operands mark the whole buffer; firmware/managed.py
  migrates what is marked. Other buffers' code is unchanged.

The abort word
--------------
``abort`` is an int64 array of one element, written by other threads:

* ``0`` -- run;
* :data:`ABORT_PREEMPT` (1) -- stop at the next block boundary: the running block finishes
  and :meth:`CompiledKernel.run` returns the first block not run, so the launch can resume;
* any other nonzero value (:data:`ABORT_WATCHDOG` = 2, :data:`ABORT_KILL` = 3) -- stop as
  soon as possible, also inside a running block's loops. Stopped between blocks, ``run``
  returns the resume block like a preemption; stopped inside a block (not resumable), it
  raises :class:`KernelFault` with kind ``"watchdog"`` (value 2) or ``"abort"``.
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from firmware import matrix
from firmware.kernel_check import (DECLARATIONS, DYNAMIC_SHAPE, ID_BUILTINS, MATH_BUILTINS,
                                   MAX_NDIM, Kernel, KernelCompileError, buffer_dtype,
                                   buffer_ndim, calls_mma, const_int, contains, is_mma, reject,
                                   structural, validate)

#: Values of the abort word (see "The abort word" above).
ABORT_PREEMPT = 1
ABORT_WATCHDOG = 2
ABORT_KILL = 3

#: fault[0] values written by generated code.
FAULT_BOUNDS = 1
FAULT_ABORT = 2
#: The rest of the fault array after a bounds miss: fault[1] is the buffer's position
#: (parameters, then shared arrays), fault[FAULT_NDIM] its number of dimensions n, then n
#: int64 indices from fault[FAULT_INDEX] and the n dimensions of its shape from
#: fault[FAULT_SHAPE]. FAULT_WORDS is the array's length.
FAULT_NDIM = 2
FAULT_INDEX = 3
FAULT_SHAPE = FAULT_INDEX + MAX_NDIM
FAULT_WORDS = FAULT_SHAPE + MAX_NDIM
#: Largest grid or block dimension of a launch (the launch ABI packs each in 21 bits),
#: and most threads per block (64x the 1024 of this ISA's devices): the generated code's
#: block-level arithmetic and per-thread arrays rely on these bounds, which
#: CompiledKernel.run checks before any compiled code runs.
MAX_DIM = (1 << 21) - 1
MAX_BLOCK_THREADS = 1 << 16

_AUG_SYMBOL: dict[type, str] = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
    ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
    ast.LShift: "<<", ast.RShift: ">>"}
#: Operators whose numba lowering can be poison: the generated code calls these instead.
_DEFINED_BINOPS: dict[type, str] = {ast.LShift: "_rt_shl", ast.RShift: "_rt_shr",
                                    ast.Pow: "_rt_pow"}


@dataclass(frozen=True)
class Options:
    """Code-generation options; each is part of the cache key (numba's own cache index
    does not key on them)."""

    boundscheck: bool = True
    fastmath: bool = False


# --------------------------------------------------------------------------- lowering


def _u(name: str) -> str:
    return "u_" + name


class _Rewrite(ast.NodeTransformer):
    """Expression rewriting: user names get a ``u_`` prefix (so they never collide with
    the generated code's names or modules) and built-ins become loop variables or ``math``
    calls. Buffer loads are indexed unsigned (``_rt_uindex``: numba then emits no
    negative-index wraparound, which would block vectorisation; a negative index is a
    bounds miss here anyway). With bounds checks, a load that is always evaluated is *hoisted*: its index
    goes to a temporary, checked before the statement (a miss stops the thread at once);
    a load under short-circuit evaluation (``and``/``or``, a conditional expression, the
    tail of a chained comparison) must not be hoisted, and calls a helper that records the
    miss and yields zero, the statement then checking ``fault[0]``. Shifts, powers and
    ``int()`` become the defined intrinsics (see the module doc)."""

    def __init__(self, low: "_Lowering") -> None:
        self.low = low
        self.k = low.k
        self.checked = low.checked
        self.pre: list[str] | None = None  # hoisted lines, when hoisting
        self.ind = ""
        self.cond = 0
        self.cond_loads = False
        self.block_level = False

    def visit_Name(self, n: ast.Name) -> ast.AST:
        if (self.block_level and n.id in self.k.locals and n.id not in self.k.shared
                and n.id not in self.low.uniform_vars):
            self.low.block_locals.add(n.id)
            return ast.parse(f"_pt_{n.id}[0]", mode="eval").body
        return ast.copy_location(ast.Name(_u(n.id), n.ctx), n)

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
        helper = _DEFINED_BINOPS.get(type(n.op))
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
        idx = [self.visit(i) for i in _indices(n)]
        if self.checked and self.low.fast and getattr(n, "_aff", False):
            return _subscript(name, idx, n.ctx)  # range checked once for the block
        if self.checked and (self.cond or self.pre is None):
            self.cond_loads = True
            return ast.Call(ast.Name(f"_ld_{name}", ast.Load()),
                            [ast.Name(_u(name), ast.Load()), *idx,
                             ast.Name("fault", ast.Load()),
                             *[ast.Name(v, ast.Load()) for v in self.low.page_map(name)]], [])
        if self.checked:
            assert self.pre is not None
            idx = [ast.Name(v, ast.Load()) for v in self.low.hoist_index(
                name, [ast.unparse(i) for i in idx], self.pre, self.ind)]
        return _subscript(name, idx, n.ctx)


def _indices(n: ast.Subscript) -> list[ast.expr]:
    return list(n.slice.elts) if isinstance(n.slice, ast.Tuple) else [n.slice]


def _subscript(name: str, idx: list[ast.expr], ctx: ast.expr_context) -> ast.Subscript:
    """``u_name[_rt_uindex(i), ...]`` (an index is an integer, used unsigned; see the
    module doc)."""
    cast = [ast.Call(ast.Name("_rt_uindex", ast.Load()), [i], []) for i in idx]
    sl = ast.Tuple(cast, ast.Load()) if len(cast) > 1 else cast[0]
    return ast.Subscript(ast.Name(_u(name), ast.Load()), sl, ctx)


def _names(stmts: list[ast.stmt]) -> set[str]:
    return {n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name)}


def _assigned(stmts: list[ast.stmt]) -> set[str]:
    return {n.id for s in stmts for n in ast.walk(s)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _is_access(n: ast.AST, k: Kernel) -> bool:
    """Whether ``n`` reads or writes an element of a buffer or shared array (a subscript
    or an ``atomic_add``)."""
    if isinstance(n, ast.Subscript):
        return isinstance(n.value, ast.Name) and (n.value.id in k.buffers or n.value.id in k.shared)
    return (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "atomic_add"
            and isinstance(n.args[0], ast.Name))


def _access_name(n: ast.AST) -> str:
    """The buffer of an access (see _is_access)."""
    return (n.value if isinstance(n, ast.Subscript) else n.args[0]).id  # type: ignore


@dataclass(frozen=True)
class _Affine:
    """An index as (at most one) thread index ``("g"|"l", d)``, variables of uniform loops
    (each at most once) and block-uniform offset texts; ``bound`` bounds the magnitude of
    every partial sum of its range (static, or guarded at block level)."""

    thread: tuple[str, int] | None
    loops: tuple[str, ...]
    offs: tuple[str, ...]
    bound: int

    def plus(self, o: "_Affine") -> "_Affine | None":
        if (self.thread and o.thread) or set(self.loops) & set(o.loops) \
                or len(self.offs) + len(o.offs) > _Lowering._MAX_OFFSETS:
            return None
        return _Affine(self.thread or o.thread, self.loops + o.loops, self.offs + o.offs,
                       self.bound + o.bound)

    def minus(self, o: "_Affine") -> "_Affine | None":
        if o.thread or o.loops or len(self.offs) + len(o.offs) > _Lowering._MAX_OFFSETS:
            return None
        return _Affine(self.thread, self.loops, self.offs + tuple(f"-({x})" for x in o.offs),
                       self.bound + o.bound)

    def span(self, loops: dict[str, tuple[str, str, tuple[str, ...]]]) -> tuple[str, str]:
        """Block-level texts of the first and last index the block's threads can use."""
        base = list(self.offs)
        last: list[str] = []
        if self.thread is not None:
            kind, d = self.thread
            if kind == "g":
                base.append(f"_g{d} * _ls{d}")
            last.append(f"_ls{d} - 1")
        first = base + [f"({loops[v][0]})" for v in self.loops]
        last = base + last + [f"({loops[v][1]})" for v in self.loops]
        return " + ".join(first) or "0", " + ".join(last) or "0"


@dataclass
class _Segment:
    """A vectorised phase's statements run as one thread loop, inside the interchanged
    loops ``loop_vars``; ``remat``: the affine locals it recomputes per thread."""

    stmts: list[ast.stmt]
    loop_vars: tuple[str, ...]
    remat: list[str] = field(default_factory=list)


@dataclass
class _VLoop:
    """An interchanged uniform loop of a vectorised phase, around its body's items."""

    loop: ast.For
    items: list[Any]


class _Shift(ast.NodeTransformer):
    """Reads of loop variable ``var`` as ``var + by`` (an unroll-and-jam copy)."""

    def __init__(self, var: str, by: int) -> None:
        self.var, self.by = var, by

    def visit_Name(self, n: ast.Name) -> ast.AST:
        if n.id != self.var or not isinstance(n.ctx, ast.Load):
            return n
        return ast.BinOp(n, ast.Add(), ast.Constant(self.by))


def _segments(items: list[Any]) -> list[_Segment]:
    return [s for it in items
            for s in ([it] if isinstance(it, _Segment) else _segments(it.items))]


class _Lowering:
    """Generates the module text for one validated kernel."""

    def __init__(self, k: Kernel, options: Options) -> None:
        self.per_thread_order: list[str] = []
        self.k = k
        self.opt = options
        self.checked = options.boundscheck
        self.tmp = 0
        self.phases: list[tuple[list[ast.stmt], bool]] = []  # (stmts, inside a block loop)
        self.uniform_vars: list[str] = []
        self.block_locals: set[str] = set()  # locals read by block-level code (as thread 0's)
        self.returns = contains(k.fn.body, lambda n: isinstance(n, ast.Return))
        self.fast = False  # generating a phase's block-range-checked variant
        #: what thread-level code runs to stop the launch (a fault or the abort word) and
        #: to end the thread's phase (its ``return``): in a phase function, returns; in a
        #: phase inlined into the block's thread loop (see inline_phase), ``return _blk``
        #: and ``continue``
        self.stop = "return 1"
        self.done = "return 0"
        self.fast_phases: set[int] = set()
        #: phases written into the block's thread loops, by their placeholder line's
        #: token: (phase, range-checked variant)
        self.inline_sites: dict[str, tuple[int, bool]] = {}
        self.def_guards: dict[str, list[str]] = {}
        self.def_values: dict[str, ast.expr] = {}  # affine locals assigned once -> value
        self.carried: dict[str, _Affine] = {}  # ... at the kernel body's top level
        #: phase -> the carried affine locals defined before it (recomputed, not loaded)
        self.carried_before: dict[int, dict[str, _Affine]] = {}
        self.vector_phases: dict[int, list[Any]] = {}  # phase -> its vectorised form
        self.vector_locals: set[str] = set()  # locals vectorised phases keep per thread
        self._kinds: dict[str, str] | None = None  # infer_kinds, once per kernel
        self.stores: dict[str, int] = {}
        self.loads: dict[str, int] = {}
        #: managed buffer parameters (their accesses mark pages: see page_map)
        self.managed = [p for p, t in zip(k.params, k.arg_types) if t.managed]
        for n in ast.walk(k.fn):
            if isinstance(n, ast.Name):
                count = self.stores if isinstance(n.ctx, ast.Store) else self.loads
                count[n.id] = count.get(n.id, 0) + 1

    # -- helpers --------------------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        self.tmp += 1
        return f"_{prefix}{self.tmp}"

    def expr(self, node: ast.AST) -> str:
        """A block-level (uniform) expression: no loads to check; a local is read as thread
        0's value from its per-thread array (see _uniform_expr)."""
        rw = _Rewrite(self)
        rw.block_level = True
        return ast.unparse(rw.visit(copy.deepcopy(node)))

    def hexpr(self, node: ast.AST, ind: str, out: list[str]) -> tuple[str, bool]:
        """A thread-level expression: hoisted checks go to ``out``; returns the text and
        whether it loads under short-circuit evaluation (then ``fault`` needs a check)."""
        rw = _Rewrite(self)
        rw.pre, rw.ind = out, ind
        text = ast.unparse(rw.visit(copy.deepcopy(node)))
        return text, rw.cond_loads

    def pos_of(self, name: str) -> int:
        if name in self.k.buffers:
            return self.k.buffers[name]
        return len(self.k.params) + list(self.k.shared).index(name)

    # -- managed memory: which 64 KiB pages the launch touched -----------------------------
    def page_map(self, name: str) -> list[str]:
        """The page map and first-page offset arguments of a managed buffer (``[]`` for
        any other): its accesses set ``_pm_x[page] = 1`` so that the firmware migrates
        exactly the pages touched (firmware/managed.py)."""
        return [f"_pm_{name}", f"_po_{name}"] if name in self.managed else []

    def mark(self, name: str, ivars: list[str], ind: str, array: str = "") -> list[str]:
        """Mark the page of one checked (in-range) access of a managed buffer (``array``:
        the buffer's name where it is not ``u_<name>``)."""
        if name not in self.managed:
            return []
        isz = np.dtype(buffer_dtype(self.k, name)).itemsize
        return [f"{ind}_mark({', '.join(self.page_map(name))}, {isz}, "
                f"{array or _u(name)}.shape, ({', '.join(ivars)},))"]

    def box_marks(self, stmts: list[ast.stmt], ind: str) -> list[str]:
        """Mark, once per block, the pages of the block's index box of every affine access
        of a managed buffer in the phase (its range check passed): exact for an affine
        access every thread makes; a superset when a guard skips some threads."""
        out: dict[str, None] = {}
        for s in stmts:
            for n in ast.walk(s):
                box = getattr(n, "_box", None)
                if box is None or box[0] not in self.managed:
                    continue
                name, firsts, sizes = box
                isz = np.dtype(buffer_dtype(self.k, name)).itemsize
                lo = ", ".join(f"np.int64({f})" for f in firsts)
                out[f"{ind}_mark_box({', '.join(self.page_map(name))}, {isz}, "
                    f"{_u(name)}.shape, ({lo},), ({', '.join(sizes)},))"] = None
        return list(out)

    def whole_marks(self) -> list[str]:
        """Managed buffers whose accesses are not marked one by one -- every access when
        the code is unchecked, the matrix unit's operands -- are marked whole (a superset
        of the pages touched) when the launch's code starts."""
        mma_operands = {a.id for n in ast.walk(self.k.fn) if isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Name) and n.func.id == "mma"
                        for a in n.args[:3] if isinstance(a, ast.Name)}
        return [f"    _pm_{p}[:] = 1" for p in self.managed
                if not self.checked or p in mma_operands]

    # -- phase functions: thread-level code ------------------------------------------------
    def hoist_index(self, name: str, idx: list[str], out: list[str], ind: str) -> list[str]:
        """Evaluate an access's indices into int64 temporaries and check them (unsigned
        compare: a negative index is a miss too); a miss records the fault and stops the
        thread."""
        u = _u(name)
        ivars = []
        for i in idx:
            v = self.fresh("k")
            out.append(f"{ind}{v} = _rt_index({i})")
            ivars.append(v)
        conds = " or ".join(f"_rt_oob({v}, {u}.shape[{d}])" for d, v in enumerate(ivars))
        out += [f"{ind}if {conds}:",
                f"{ind}    {_miss_call(self.pos_of(name), ivars, u)}",
                f"{ind}    {self.stop}"]
        # see intrinsics._rt_opaque; new names, as every temporary here: a variable
        # assigned twice costs numba's SSA pass work in every block of the function
        hidden = [f"{v}o" for v in ivars]
        out += [f"{ind}{h} = _rt_opaque({v})" for h, v in zip(hidden, ivars)]
        out += self.mark(name, hidden, ind)
        return hidden

    def fault_check(self, ind: str) -> list[str]:
        return [f"{ind}if fault[0] != 0:", f"{ind}    {self.stop}"]

    def abort_check(self, ind: str, stop: str) -> list[str]:
        return [f"{ind}if _rt_abort_word(abort) > {ABORT_PREEMPT}:",
                f"{ind}    fault[0] = {FAULT_ABORT}", f"{ind}    {stop}"]

    def access(self, name: str, idx_nodes: list[ast.expr], ind: str,
               out: list[str], node: ast.AST | None = None) -> tuple[list[str], bool]:
        """The index texts of a store/atomic target (checked when bounds-checking,
        unless ``node`` is an access whose range the block checked already)."""
        texts, loads = [], False
        for i in idx_nodes:
            t, c = self.hexpr(i, ind, out)
            texts.append(t)
            loads = loads or c
        if not self.checked:
            return texts, loads
        if self.fast and getattr(node, "_aff", False):
            if loads:
                out += self.fault_check(ind)
            return texts, False
        if loads:
            out += self.fault_check(ind)
            loads = False
        return self.hoist_index(name, texts, out, ind), loads

    def target(self, t: ast.expr, ind: str, out: list[str]) -> str:
        if isinstance(t, ast.Subscript):
            name = t.value.id  # type: ignore[attr-defined]
            idx, _ = self.access(name, _indices(t), ind, out, t)
            return ast.unparse(_subscript(name, [ast.parse(i, mode="eval").body for i in idx],
                                          ast.Store()))
        return ast.unparse(_Rewrite(self).visit(copy.deepcopy(t)))

    def conversion(self, t: ast.expr) -> str:
        """``"_rt_int"`` when ``t`` is an element of an integer buffer (a float stored there
        would go through numba's poison-prone fptosi), else ``""``."""
        if isinstance(t, ast.Subscript):
            t = t.value
        if not (isinstance(t, ast.Name) and (t.id in self.k.buffers or t.id in self.k.shared)):
            return ""
        dtype = buffer_dtype(self.k, t.id)
        return "" if dtype == "bool" or dtype.startswith("float") else "_rt_int"

    def stmt(self, s: ast.stmt, ind: str, writeback: list[str]) -> list[str]:
        out: list[str] = []
        if isinstance(s, ast.Assign):
            value, loads = self.hexpr(s.value, ind, out)
            if loads:
                out += self.fault_check(ind)
            if len(s.targets) == 1:
                tgt = self.target(s.targets[0], ind, out)
                return out + [f"{ind}{tgt} = {self.conversion(s.targets[0])}({value})"]
            v = self.fresh("v")
            out.append(f"{ind}{v} = {value}")
            for t in s.targets:
                tgt = self.target(t, ind, out)
                out.append(f"{ind}{tgt} = {self.conversion(t)}({v})")
            return out
        if isinstance(s, ast.AugAssign):
            op = _AUG_SYMBOL[type(s.op)]
            value, loads = self.hexpr(s.value, ind, out)
            if loads:
                out += self.fault_check(ind)
            tgt = self.target(s.target, ind, out)
            helper = _DEFINED_BINOPS.get(type(s.op))
            conv = self.conversion(s.target)
            if helper is None and not conv:
                return out + [f"{ind}{tgt} {op}= {value}"]
            new = f"{helper}({tgt}, {value})" if helper else f"{tgt} {op} ({value})"
            return out + [f"{ind}{tgt} = {conv}({new})"]
        if is_mma(s):  # its own phase, run by thread 0 (see collective())
            return self.mma(s.value, ind)  # type: ignore[arg-type]
        if isinstance(s, ast.Expr):  # atomic_add (barrier() is structural)
            call = s.value
            assert isinstance(call, ast.Call) and call.func.id == "atomic_add"  # type: ignore
            name = call.args[0].id  # type: ignore[attr-defined]
            idx_node = call.args[1]
            idx = list(idx_node.elts) if isinstance(idx_node, ast.Tuple) else [idx_node]
            if len(idx) != buffer_ndim(self.k, name):
                raise reject(s, f"atomic_add index of {name!r} needs "
                                f"{buffer_ndim(self.k, name)} components")
            value, loads = self.hexpr(call.args[2], ind, out)
            if loads:
                out += self.fault_check(ind)
            ivars, _ = self.access(name, idx, ind, out, call)
            v = self.fresh("v")
            out.append(f"{ind}{v} = {self.conversion(call.args[0])}({value})")
            out.append(f"{ind}_rt_atomic_add({_u(name)}, ({', '.join(ivars)},), {v})")
            return out
        if isinstance(s, ast.If) and self.fast and getattr(s, "_always", False):
            return self.block(s.body, ind, writeback)  # true for the block (holds_for_block)
        if isinstance(s, ast.If) and self.selectable(s):
            return self.select(s, ind)
        if isinstance(s, ast.If):
            test, loads = self.hexpr(s.test, ind, out)
            if loads:
                c = self.fresh("c")
                out += [f"{ind}{c} = {test}"] + self.fault_check(ind)
                test = c
            out.append(f"{ind}if {test}:")
            out += self.block(s.body, ind + "    ", writeback)
            if s.orelse:
                out.append(f"{ind}else:")
                out += self.block(s.orelse, ind + "    ", writeback)
            return out
        if isinstance(s, ast.For):
            names = []
            any_loads = False
            for a in s.iter.args:  # type: ignore[attr-defined]
                text, loads = self.hexpr(a, ind, out)
                any_loads = any_loads or loads
                r = self.fresh("r")
                out.append(f"{ind}{r} = {text}")
                names.append(r)
            if any_loads:
                out += self.fault_check(ind)
            out.append(f"{ind}for {_u(s.target.id)} in range({', '.join(names)}):")  # type: ignore
            out += self.abort_check(ind + "    ", self.stop)
            return out + self.block(s.body, ind + "    ", writeback)
        if isinstance(s, ast.While):
            inner = ind + "    "
            out = [f"{ind}while True:"] + self.abort_check(inner, self.stop)
            test, loads = self.hexpr(s.test, inner, out)
            if loads:
                out += self.fault_check(inner)
            out += [f"{inner}if not ({test}):", f"{inner}    break"]
            return out + self.block(s.body, inner, writeback)
        if isinstance(s, ast.Return):
            out = [f"{ind}_done[_t] = 1"] if self.returns else []
            return out + [f"{ind}{w}" for w in writeback] + [f"{ind}{self.done}"]
        if isinstance(s, (ast.Break, ast.Continue, ast.Pass)):
            return [f"{ind}{type(s).__name__.lower()}"]
        raise reject(s, f"{type(s).__name__} cannot be lowered")

    def selectable(self, s: ast.If) -> bool:
        """Whether ``if c: t = x else: t = y`` may run as ``t = x if c else y`` with both
        values computed first (a select, which LLVM vectorises; a branch around a load it
        cannot): in a block's range-checked variant, where every load of ``x`` and ``y`` is
        an access whose range the block checked whatever the guards (so a load the guard
        would have skipped is in range), the values are loads, names, constants, ``+ - *``
        of them, both float (an int and a uint64 would unify to float64), and the target
        is the same local or block-checked element in both."""
        return self.fast and self.checked and self.diamond(s)

    def diamond(self, s: ast.If) -> bool:
        """The form selectable() takes, wherever the code is (see there)."""
        if not (len(s.body) == 1 and len(s.orelse) == 1):
            return False
        a, b = s.body[0], s.orelse[0]
        if not (isinstance(a, ast.Assign) and isinstance(b, ast.Assign)
                and len(a.targets) == 1 and len(b.targets) == 1
                and ast.dump(a.targets[0]) == ast.dump(b.targets[0])):
            return False
        t = a.targets[0]
        if not (isinstance(t, ast.Name) or (getattr(t, "_aff", False)
                                            and getattr(b.targets[0], "_aff", False))):
            return False
        kinds = self.infer_kinds()
        return all(self.speculable(v) and self.kind(v, kinds) == "float"
                   for v in (a.value, b.value))

    def speculable(self, e: ast.AST) -> bool:
        """An expression without effects or faults: constants, names, thread ids,
        block-checked loads, ``buf.shape[k]``, unary minus and ``+ - *``."""
        for n in ast.walk(e):
            if isinstance(n, ast.Subscript):
                if not (isinstance(n.value, ast.Attribute) or getattr(n, "_aff", False)):
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

    def select(self, s: ast.If, ind: str) -> list[str]:
        """A selectable ``if`` (see selectable): both values, then one assignment."""
        out: list[str] = []
        a, b = s.body[0], s.orelse[0]
        assert isinstance(a, ast.Assign) and isinstance(b, ast.Assign)
        values = []
        for v in (a.value, b.value):
            text, _ = self.hexpr(v, ind, out)  # block-checked loads: nothing to check
            name = self.fresh("s")
            out.append(f"{ind}{name} = {text}")
            values.append(name)
        test, loads = self.hexpr(s.test, ind, out)
        if loads:
            c = self.fresh("c")
            out += [f"{ind}{c} = {test}"] + self.fault_check(ind)
            test = c
        tgt = self.target(a.targets[0], ind, out)
        conv = self.conversion(a.targets[0])
        return out + [f"{ind}{tgt} = {conv}({values[0]} if {test} else {values[1]})"]

    def mma(self, call: ast.Call, ind: str) -> list[str]:
        """The matrix unit's call: operands, then the seven scalar arguments evaluated
        (with thread 0's locals; the six integer ones as int64 through ``_rt_index``, which
        firmware/matrix.py's range checks rely on), then the BLAS entry point for the
        dtype."""
        out: list[str] = []
        names = [a.id for a in call.args[:3]]  # type: ignore[attr-defined]
        values = []
        for i, a in enumerate(call.args[3:]):
            text, loads = self.hexpr(a, ind, out)
            if loads:
                out += self.fault_check(ind)
            values.append(text if i == 6 else f"_rt_index({text})")  # beta stays a number
        slot = matrix.SLOT[buffer_dtype(self.k, names[0])]
        args = ([_u(n) for n in names] + values
                + [f"_blas[{slot}]", "abort", "fault"] + [str(self.pos_of(n)) for n in names])
        return out + [f"{ind}if _mma({', '.join(args)}) != 0:", f"{ind}    {self.stop}"]

    def block(self, stmts: list[ast.stmt], ind: str, writeback: list[str]) -> list[str]:
        out: list[str] = []
        for s in stmts:
            out += self.stmt(s, ind, writeback)
        return out or [f"{ind}pass"]

    # -- block-level structure ---------------------------------------------------------------
    def is_shared_decl(self, s: ast.stmt) -> bool:
        return (isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                and isinstance(s.value.func, ast.Name) and s.value.func.id in DECLARATIONS)

    def structure(self, stmts: list[ast.stmt], ind: str, in_loop: bool,
                  top: bool = False) -> list[str]:
        """Block-level code: thread loops over phases, with block-level (uniform) control
        flow around the phases that contain barriers (``top``: ``stmts`` is the kernel's
        body)."""
        out: list[str] = []
        pending: list[ast.stmt] = []

        def flush() -> None:
            if pending:
                out.extend(self.thread_loop(list(pending), ind, in_loop, top))
                pending.clear()

        for s in stmts:
            if self.is_shared_decl(s):
                continue  # hoisted: allocated per block
            if not structural(s, in_loop):
                pending.append(s)
                continue
            flush()
            if is_mma(s):
                out.extend(self.collective(s, ind, in_loop))
                continue
            if isinstance(s, ast.Expr):
                continue  # barrier(): the phase boundary is the barrier
            if isinstance(s, (ast.Break, ast.Continue)):
                out.append(f"{ind}{type(s).__name__.lower()}")
            elif isinstance(s, ast.If):
                out.append(f"{ind}if {self.expr(s.test)}:")
                out += self.structure(s.body, ind + "    ", in_loop) or [f"{ind}    pass"]
                if s.orelse:
                    out.append(f"{ind}else:")
                    out += self.structure(s.orelse, ind + "    ", in_loop) or [f"{ind}    pass"]
            elif isinstance(s, ast.For):
                var = s.target.id  # type: ignore[attr-defined]
                if var not in self.uniform_vars:
                    self.uniform_vars.append(var)
                rng = ", ".join(self.expr(a) for a in s.iter.args)  # type: ignore
                out.append(f"{ind}for {_u(var)} in range({rng}):")
                out += self.abort_check(ind + "    ", "return _blk")
                out += self.structure(s.body, ind + "    ", True)
            elif isinstance(s, ast.While):
                out.append(f"{ind}while {self.expr(s.test)}:")
                out += self.abort_check(ind + "    ", "return _blk")
                out += self.structure(s.body, ind + "    ", True)
        flush()
        return out

    def thread_loop(self, stmts: list[ast.stmt], ind: str, in_loop: bool, top: bool
                    ) -> list[str]:
        """A phase: vectorised when it can be (``_phv``, under the block's range checks,
        the checked per-thread loop otherwise), else a loop over the threads calling the
        per-thread phase function (``_phf`` under the range checks of its affine accesses,
        when it has any)."""
        idx = len(self.phases)
        self.phases.append((stmts, in_loop))
        before = dict(self.carried)
        self.carried_before[idx] = before
        conds = self.affine_ranges(stmts, top)
        if not self.checked:
            conds = []
        plan = self.vector_plan(stmts, in_loop, before)
        if plan is not None:
            self.vector_phases[idx] = plan
            call = [f"{ind}if _phv{idx}(@VARGS@) != 0:", f"{ind}    return _blk"]
            if not conds:
                return call
            return ([f"{ind}if {' and '.join(conds)}:"] + self.box_marks(stmts, ind + "    ")
                    + [f"    {c}" for c in call]
                    + [f"{ind}else:"] + self.thread_loop_text(f"_ph{idx}", idx, ind + "    "))
        if not conds:
            return self.thread_loop_text(f"_ph{idx}", idx, ind)
        self.fast_phases.add(idx)
        return ([f"{ind}if {' and '.join(conds)}:"] + self.box_marks(stmts, ind + "    ")
                + self.thread_loop_text(f"_phf{idx}", idx, ind + "    ")
                + [f"{ind}else:"]
                + self.thread_loop_text(f"_ph{idx}", idx, ind + "    "))

    def collective(self, s: ast.stmt, ind: str, in_loop: bool) -> list[str]:
        """A block-collective statement (mma) as a phase of its own that runs once per
        block, as thread 0: its arguments are uniform, so thread 0's locals are the
        block's. Skipped when the block has returned (only a uniform return can precede
        it: the barrier rule)."""
        idx = len(self.phases)
        self.phases.append(([s], in_loop))
        skip = [f"{ind}if not _done[0]:"] if self.returns and idx > 0 else []
        inner = ind + "    " if skip else ind
        return skip + [f"{inner}_l0 = 0", f"{inner}_l1 = 0", f"{inner}_l2 = 0", f"{inner}_t = 0",
                       f"{inner}if _ph{idx}(@ARGS@) != 0:", f"{inner}    return _blk"]

    #: Largest phase (syntax-tree nodes) written into the thread loops. Numba's SSA and
    #: liveness passes grow faster than linearly with a function's blocks times its
    #: variables, so past a size a phase is cheaper as a function of its own; measured
    #: (first compile, CPU seconds, function -> inlined): ``where`` (73 nodes) 2.0-2.3 ->
    #: 1.3-1.4, ``binary_f`` (352) 2.9-3.9 -> 3.0-3.6, ``unary_f`` (1,209) 6.5-7.5 ->
    #: 9.3-9.5. A phase with a loop stays a function too: inlined, the loop's exits (the
    #: abort check's ``return _blk``) leave four loops at once, and LLVM optimised such
    #: loops worse (bench ``kernels``, old and new lowering in consecutive runs: softmax
    #: rows 1.73x -> 3.15x numpy, tiled gemm 30x -> 117x).
    _INLINE_NODES = 250

    def thread_loop_text(self, fn: str, idx: int, ind: str) -> list[str]:
        """The loop over the block's threads running phase ``idx`` (``fn``: its checked
        ``_ph`` or range-checked ``_phf`` variant). Inlined (see inline_phase) when the
        phase is small and has no loop (_INLINE_NODES; without loops, a thread's
        ``return`` is a ``continue`` of the thread loop). The inlined body is written once
        the per-thread arrays are known (module()), so this leaves a placeholder line."""
        stmts, _ = self.phases[idx]
        if sum(1 for s in stmts for _ in ast.walk(s)) <= self._INLINE_NODES and not contains(
                stmts, lambda n: isinstance(n, (ast.For, ast.While))):
            token = f"@INLINE{len(self.inline_sites)}@"
            self.inline_sites[token] = (idx, fn.startswith("_phf"))
            return [ind + token]
        inner = ind + " " * 12
        return self.threads(ind, [f"{inner}if {fn}(@ARGS@) != 0:", f"{inner}    return _blk"],
                            idx)

    def threads(self, ind: str, body: list[str], idx: int) -> list[str]:
        """Loops over the block's threads around ``body`` (indented ``ind`` + 12), which
        phase ``idx``'s threads that have returned skip."""
        inner = ind + " " * 12
        skip = [f"{inner}if _done[_t]:", f"{inner}    continue"] \
            if self.returns and idx > 0 else []
        return [f"{ind}for _l2 in range(_ls2):",
                f"{ind}    for _l1 in range(_ls1):",
                f"{ind}        for _l0 in range(_ls0):",
                f"{inner}_t = (_l2 * _ls1 + _l1) * _ls0 + _l0",
                *skip, *body]

    def inline_phase(self, line: str, pt: dict[str, str]) -> list[str]:
        """A placeholder of thread_loop_text as the thread loop with the phase's code in
        it: a fault or abort returns the block from ``_grid``, a thread's ``return`` is
        ``continue``. Numba compiles each ``@njit`` function on its own (typing, lowering,
        wrappers, an LLVM module, re-optimised in every caller): one function fewer per
        phase variant halved ``where``'s first compile (docs/kernels.md, "Compile time")."""
        ind = line[:len(line) - len(line.lstrip())]
        idx, fast = self.inline_sites[line.strip()]
        saved = self.fast, self.stop, self.done
        self.fast, self.stop, self.done = fast, "return _blk", "continue"
        try:
            body = self.phase_body(self.phases[idx][0], pt, ind + " " * 12,
                                   *self.recomputed(idx, ind + " " * 12))
        finally:
            self.fast, self.stop, self.done = saved
        return self.threads(ind, body, idx)

    def recomputed(self, idx: int, ind: str) -> tuple[frozenset[str], tuple[str, ...]]:
        """The affine locals phase ``idx`` recomputes from the thread's ids instead of
        loading them from their per-thread arrays (those defined once at the kernel's top
        level in an earlier phase, ``tx = local_id(0)``, ``row = group_id(1) * 16 + ty``),
        as phase_body's ``keep`` and ``pre``. The loop over the threads then sees them as
        functions of ``_l0``, so LLVM can vectorise it (tiled ``gemm``'s tile loads:
        docs/kernels.md, "Vectorised phases")."""
        before = self.carried_before.get(idx, {})
        stmts = self.phases[idx][0]
        used = (_names(stmts) & self.k.locals) - _assigned(stmts)
        pre: list[str] = []
        names = self.remat(used, set(before), list(before))
        for n in names:
            text, _ = self.hexpr(self.def_values[n], ind, pre)
            pre.append(f"{ind}{_u(n)} = ({text})")
        return frozenset(names), tuple(pre)

    def phase_body(self, stmts: list[ast.stmt], pt: dict[str, str], ind: str,
                   keep: frozenset[str] = frozenset(), pre: tuple[str, ...] = ()) -> list[str]:
        """One thread's code of a phase: the global ids it uses, ``pre``, its per-thread
        locals (but ``keep``) loaded from their arrays, the statements, and what it
        assigned written back (also before a ``return``)."""
        used = (_names(stmts) & set(pt)) - keep
        assigned = (_assigned(stmts) & set(pt)) - keep
        writeback = [f"_pt_{n}[_t] = {_u(n)}" for n in sorted(assigned)]
        code = [*pre, *[f"{ind}{_u(n)} = _pt_{n}[_t]" for n in sorted(used)]]
        code += self.block(stmts, ind, writeback) + [f"{ind}{w}" for w in writeback]
        text = "\n".join(code)
        return [f"{ind}_gid{d} = _g{d} * _ls{d} + _l{d}" for d in range(3)
                if f"_gid{d}" in text] + code

    # -- block-level range checks of affine accesses -----------------------------------------
    _OFFSET_LIMIT = 1 << 40  # |offset| bound of a scalar parameter or a loop bound
    _MAX_OFFSETS = 16  # offsets per index (expression length)
    #: Bound on the magnitude of every partial sum of a checked index range: with the
    #: per-term bounds below (MAX_DIM, MAX_BLOCK_THREADS, _OFFSET_LIMIT) the block-level
    #: range arithmetic never wraps an int64.
    _RANGE_LIMIT = 1 << 62

    def uniform_term(self, e: ast.AST, guards: dict[str, None],
                     allow_vars: bool) -> tuple[str, int] | None:
        """``(text, bound)`` when ``e`` is the same integer for every thread of a block
        and ``|e| <= bound`` (a static bound; a scalar parameter's or a block-level loop
        variable's magnitude is checked at block level, ``guards``): int constants,
        never-assigned integer scalar parameters, ``group_id``/``num_groups``/
        ``local_size``, block-level loop variables (``allow_vars``), and sums, differences
        and products of those (products only of signed terms, so numba types them int64)."""
        c = const_int(e)
        if c is not None:
            return (str(c), abs(c)) if abs(c) < self._OFFSET_LIMIT else None
        lim = self._OFFSET_LIMIT
        if isinstance(e, ast.Name) and e.id in self.k.scalars and not self.stores.get(e.id):
            dt = self.k.arg_types[self.k.params.index(e.id)].dtype
            if dt in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"):
                guards[f"-{lim} < {_u(e.id)} < {lim}"] = None
                return _u(e.id), lim
            return None
        if isinstance(e, ast.Name) and allow_vars and e.id in self.uniform_vars \
                and self.stores.get(e.id) == 1:
            guards[f"-{lim} < {_u(e.id)} < {lim}"] = None
            return _u(e.id), lim
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and len(e.args) == 1 \
                and e.func.id in ("group_id", "num_groups", "local_size"):
            d = const_int(e.args[0])
            if d is None or not 0 <= d <= 2:
                return None
            bound = MAX_BLOCK_THREADS if e.func.id == "local_size" else MAX_DIM
            return f"{ID_BUILTINS[e.func.id]}{d}", bound
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub, ast.Mult)):
            if isinstance(e.op, ast.Mult) and not (self.signed(e.left) and self.signed(e.right)):
                return None
            left = self.uniform_term(e.left, guards, allow_vars)
            right = self.uniform_term(e.right, guards, allow_vars) if left else None
            if left is None or right is None:
                return None
            op, bound = {ast.Add: ("+", left[1] + right[1]), ast.Sub: ("-", left[1] + right[1]),
                         ast.Mult: ("*", left[1] * right[1])}[type(e.op)]
            return (f"({left[0]} {op} {right[0]})", bound) if bound < self._RANGE_LIMIT >> 1 \
                else None
        return None

    def signed(self, e: ast.AST) -> bool:
        """Whether a uniform term is typed as a signed integer by numba (not an unsigned
        scalar parameter)."""
        if isinstance(e, ast.Name) and e.id in self.k.scalars:
            return not self.k.arg_types[self.k.params.index(e.id)].dtype.startswith("u")
        return not isinstance(e, ast.Name) or e.id in self.uniform_vars

    def affine(self, e: ast.AST, defs: dict[str, "_Affine"], guards: dict[str, None],
               loops: dict[str, tuple[str, str, tuple[str, ...]]], allow_vars: bool = True) -> "_Affine | None":
        """``e`` as a thread index (``global_id(d)``/``local_id(d)``, at most one) plus
        variables of uniform loops in ``loops`` (each at most once) plus uniform offsets,
        directly or through locals in ``defs``; None when it is not of that form."""
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) \
                and e.func.id in ("global_id", "local_id") and len(e.args) == 1:
            d = const_int(e.args[0])
            if d is not None and 0 <= d <= 2:
                return _Affine(("g" if e.func.id == "global_id" else "l", d), (), (), 1 << 38)
            return None
        if isinstance(e, ast.Name) and e.id in loops:
            for g in loops[e.id][2]:
                guards[g] = None
            return _Affine(None, (e.id,), (), 1 << 41)
        if isinstance(e, ast.Name) and e.id in defs:
            for g in self.def_guards.get(e.id, ()):
                guards[g] = None
            return defs[e.id]
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
            left = self.affine(e.left, defs, guards, loops, allow_vars)
            right = self.affine(e.right, defs, guards, loops, allow_vars) if left else None
            if left is None or right is None:
                return None
            return left.plus(right) if isinstance(e.op, ast.Add) else left.minus(right)
        term = self.uniform_term(e, guards, allow_vars)
        return _Affine(None, (), (term[0],), term[1]) if term else None

    def uniform_range_arg(self, e: ast.AST) -> bool:
        """Whether a ``range`` argument is the same for every thread of a block and can be
        evaluated at block level before the phase: no locals, no loads, no thread ids."""
        k = self.k
        for n in ast.walk(e):
            if isinstance(n, ast.Call):
                if not (isinstance(n.func, ast.Name)
                        and n.func.id in ("group_id", "num_groups", "local_size")):
                    return False
            elif isinstance(n, ast.Subscript):
                if not isinstance(n.value, ast.Attribute):
                    return False  # a loaded value
            elif isinstance(n, ast.Name):
                if not ((n.id in k.scalars and not self.stores.get(n.id)) or n.id in k.buffers
                        or (n.id in self.uniform_vars and self.stores.get(n.id) == 1)
                        or n.id in ("group_id", "num_groups", "local_size")):
                    return False
        return True

    def loop_range(self, s: ast.For, guards: dict[str, None]) -> tuple[str, str] | None:
        """``(first, last)`` block-level texts of the values a uniform loop's variable
        takes (``last < first`` when it runs no iteration), or None when the loop is not a
        ``range`` with uniform arguments and a positive step, or its variable is assigned
        anywhere else in the kernel."""
        var = s.target.id  # type: ignore[attr-defined]
        args = s.iter.args  # type: ignore[attr-defined]
        if self.stores.get(var) != 1 or not all(self.uniform_range_arg(a) for a in args):
            return None
        lim = self._OFFSET_LIMIT
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

    def access_conds(self, name: str, ranges: list["_Affine"], loops: dict[str, tuple[str, str, tuple[str, ...]]]
                     ) -> list[str]:
        """Block-level conditions under which every index of an affine access is inside
        ``name``'s shape."""
        u = _u(name)
        out = []
        for dim, r in enumerate(ranges):
            lo, hi = r.span(loops)
            out.append(f"({lo}) >= 0")
            out.append(f"({hi}) < {u}.shape[{dim}]")
        return out

    def affine_ranges(self, stmts: list[ast.stmt], top: bool) -> list[str]:
        """Mark the phase's accesses whose every index is affine (see :meth:`affine`):
        over a block such an index spans a range computed from the block's ids, the
        uniform loops' bounds and the offsets, which the block checks once before the
        thread loop. Returns those block-level conditions (empty: no fast variant). A
        superset of the indices the threads really use is checked (guards and control flow
        are ignored), so a block that passes cannot miss; one that does not runs the
        per-element checked loop, which faults exactly as without this. Locals assigned
        once in the kernel, at the top level of its body, keep their affine value for the
        rest of the kernel (``self.carried``); others for the rest of the phase."""
        defs: dict[str, _Affine] = dict(self.carried)
        conds: dict[str, None] = {}
        for s in stmts:
            self.mark_affine(s, defs, {}, conds)
            # a diamond is better left a select (gemm's tile loads: 151-230 against 223-274
            # ms with the guard checked per block instead, one core, same run)
            held = self.holds_for_block(s.test, defs) \
                if isinstance(s, ast.If) and not self.diamond(s) else None
            if held is not None:
                s._always = True  # type: ignore[attr-defined]
                for c in held:
                    conds[c] = None
            if isinstance(s, ast.Assign) and len(s.targets) == 1 \
                    and isinstance(s.targets[0], ast.Name):
                v = s.targets[0].id
                if v in self.k.locals and self.stores.get(v) == 1:
                    guards: dict[str, None] = {}
                    r = self.affine(s.value, defs, guards, {})
                    if r is not None:
                        defs[v] = r
                        self.def_guards[v] = list(guards)  # for the accesses that use v
                        self.def_values[v] = s.value
                    carried = self.affine(s.value, self.carried, {}, {}, allow_vars=False)
                    if top and carried is not None:
                        self.carried[v] = carried
        return list(conds)

    _FLIP = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE}

    def holds_for_block(self, test: ast.expr, defs: dict[str, "_Affine"]) -> list[str] | None:
        """Block-level conditions under which the guard ``test`` of a phase's top-level
        ``if`` is true for every thread of the block, or None when it is not a bounds guard:
        comparisons (``< <= > >=``, joined by ``and``) of a position in the grid (an
        affine index with a global id or a group id in it: ``i = global_id(0)``,
        ``row = group_id(1) * 16 + ty``, or a block-level loop's variable: ``t + tx`` of
        a tile loop) with a uniform bound (``n``, ``x.size``). The
        index grows with the thread index, so the block's first and last values decide.
        A block where it holds runs the range-checked variant without the ``if`` (the
        guard of ``if i < n: x[i] += y[i]`` blocked vectorisation: a masked store, 4.5x the
        unguarded loop's time); a block where it holds only for some threads -- the grid's
        edge -- runs the checked per-thread variant. Guards on local ids alone
        (``if t < s`` of a tree reduction) hold for some threads of every block and are
        left alone."""
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            parts = [self.holds_for_block(v, defs) for v in test.values]
            if any(p is None for p in parts):
                return None
            return [c for p in parts for c in p]  # type: ignore[union-attr]
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1
                and type(test.ops[0]) in self._FLIP):
            return None
        op, left, right = type(test.ops[0]), test.left, test.comparators[0]
        guards: dict[str, None] = {}
        a = self.affine(left, defs, guards, {})
        if a is None or not self.uniform_range_arg(right):
            guards = {}
            a = self.affine(right, defs, guards, {})
            if a is None or not self.uniform_range_arg(left):
                return None
            op, right = self._FLIP[op], left
        moving = {_u(v) for v in self.uniform_vars}  # block-level loops: a tile's position
        if a.thread is None or a.bound >= self._RANGE_LIMIT or not (
                a.thread[0] == "g" or any("_g" in o or set(re.findall(r"\w+", o)) & moving
                                          for o in a.offs)):
            return None
        first, last = a.span({})
        bound = self.expr(right)
        text = {ast.Lt: f"({last}) < ({bound})", ast.LtE: f"({last}) <= ({bound})",
                ast.Gt: f"({first}) > ({bound})", ast.GtE: f"({first}) >= ({bound})"}[op]
        return [*guards, text]

    def mark_affine(self, s: ast.stmt, defs: dict[str, "_Affine"],
                    loops: dict[str, tuple[str, str, tuple[str, ...]]], conds: dict[str, None]) -> None:
        """affine_ranges for one statement, with the ranges of the uniform loops around it:
        the accesses of ``s`` outside its nested statements, then those statements (a
        uniform loop's body with its variable's range)."""
        k = self.k
        nested = [c for f in ("body", "orelse") for c in getattr(s, f, [])]
        inner = {id(n) for c in nested for n in ast.walk(c)}
        for n in ast.walk(s):
            if id(n) in inner:
                continue
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
                name, idx, node = n.value.id, _indices(n), n
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) \
                    and n.func.id == "atomic_add" and isinstance(n.args[0], ast.Name):
                name, node = n.args[0].id, n
                idx = list(n.args[1].elts) if isinstance(n.args[1], ast.Tuple) \
                    else [n.args[1]]
            else:
                continue
            if name not in k.buffers and name not in k.shared:
                continue
            if len(idx) != buffer_ndim(k, name):
                continue
            guards: dict[str, None] = {}
            ranges = [self.affine(i, defs, guards, loops) for i in idx]
            if any(r is None or r.bound >= self._RANGE_LIMIT for r in ranges):
                continue
            here = list(guards) + self.access_conds(name, ranges, loops)  # type: ignore[arg-type]
            node._aff = True  # type: ignore[attr-defined]
            # the block's index box, for a managed buffer's page marks (box_marks)
            spans = [r.span(loops) for r in ranges]  # type: ignore[union-attr]
            node._box = (name, [lo for lo, _ in spans],  # type: ignore[attr-defined]
                         [f"({hi}) - ({lo}) + 1" for lo, hi in spans])
            for c in here:
                conds[c] = None
        if isinstance(s, ast.For):
            guards = {}
            rng = self.loop_range(s, guards)
            if rng is not None:
                loops = {**loops, s.target.id: (*rng, tuple(guards))}  # type: ignore[attr-defined]
        for c in nested:
            self.mark_affine(c, defs, loops, conds)

    # -- vectorised phases -------------------------------------------------------------------
    def interchangeable(self, s: ast.stmt) -> bool:
        """Whether a phase's loop can run outside the thread loop (see "Vectorised phases"
        in docs/kernels.md): a ``range`` loop with uniform bounds (loop_range), no
        break/continue of its own, and a variable read only in its body (so no thread
        needs its value after the loop)."""
        if not isinstance(s, ast.For) or self.loop_range(s, {}) is None:
            return False
        if any(structural(c, True) for c in s.body):
            return False
        var = s.target.id  # type: ignore[attr-defined]
        inside = sum(1 for c in s.body for n in ast.walk(c)
                     if isinstance(n, ast.Name) and n.id == var and isinstance(n.ctx, ast.Load))
        return inside == self.loads.get(var, 0)

    def split(self, stmts: list[ast.stmt], loop_vars: tuple[str, ...]) -> list[Any]:
        """A phase's statements as segments (thread loops) and interchanged loops around
        further segments."""
        items: list[Any] = []
        seg: list[ast.stmt] = []
        for s in stmts:
            if not self.interchangeable(s):
                seg.append(s)
                continue
            if seg:
                items.append(_Segment(seg, loop_vars))
                seg = []
            var = s.target.id  # type: ignore[attr-defined]
            items.append(_VLoop(s, self.split(s.body, loop_vars + (var,))))
        if seg:
            items.append(_Segment(seg, loop_vars))
        return items

    def vector_plan(self, stmts: list[ast.stmt], in_loop: bool,
                    before: dict[str, "_Affine"]) -> list[Any] | None:
        """The vectorised form of a phase, or None when it keeps the per-thread form:
        it must have an interchangeable loop, no ``return``/atomics, every access range
        checked per block (so the vectorised variant cannot fault: a block that fails the
        check runs the per-thread checked loop, whose fault records are the old ones),
        every block-shared or global buffer it stores into accessed in one segment outside
        the interchanged loops (so each buffer sees its accesses in the old order), and
        every local that lives across segments recomputable (an affine local assigned
        once) or a per-thread array of its exact numba type."""
        if contains(stmts, lambda n: isinstance(n, ast.Return) or (
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                and n.func.id in ("atomic_add", "mma"))):
            return None
        if self.checked and any(not getattr(n, "_aff", False) for s in stmts for n in ast.walk(s)
                                if _is_access(n, self.k)):
            return None
        items = self.split(stmts, ())
        if not any(isinstance(i, _VLoop) for i in items):
            return None
        segs = _segments(items)
        if not self.stores_confined(segs):
            return None
        order = list(before) + [s.targets[0].id for s in stmts  # type: ignore[attr-defined]
                                if isinstance(s, ast.Assign) and len(s.targets) == 1
                                and isinstance(s.targets[0], ast.Name)
                                and self.def_values.get(s.targets[0].id) is s.value]
        avail = set(before)
        users: dict[str, list[_Segment]] = {}
        for seg in segs:
            used = (_names(seg.stmts) & self.k.locals) - set(self.k.shared) - set(seg.loop_vars)
            seg.remat = self.remat(used - _assigned(seg.stmts), avail, order)
            for n in used - set(seg.remat):
                users.setdefault(n, []).append(seg)
            if not seg.loop_vars:
                avail |= {n for s in seg.stmts if isinstance(s, ast.Assign)
                          for n in _assigned([s]) if n in order}
        kinds = self.infer_kinds()
        assigned = _assigned(stmts)
        for n, where in users.items():
            if n in assigned and (len(where) > 1 or where[0].loop_vars):
                if not (in_loop or self.exact_float(n, kinds)):
                    return None
                self.vector_locals.add(n)
        return items

    def remat(self, used: set[str], avail: set[str], order: list[str]) -> list[str]:
        """The affine locals a segment recomputes (those it uses, and what their
        definitions use), in definition order."""
        need = used & avail
        while True:
            more = {d for n in need for d in _names([ast.Expr(self.def_values[n])])
                    if d in avail} - need
            if not more:
                return [n for n in order if n in need]
            need |= more

    def exact_float(self, name: str, kinds: dict[str, str]) -> bool:
        """Whether a float64 per-thread array is the local's exact numba type: a float
        local that is assigned a float constant somewhere (numba unifies its type to
        float64)."""
        return kinds.get(name) == "float" and any(
            isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, float)
            and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
            for n in ast.walk(self.k.fn))

    def stores_confined(self, segs: list["_Segment"]) -> bool:
        """Whether every buffer the phase stores into is accessed in one segment that is
        outside the interchanged loops (then its accesses happen in the old order). The
        ``dynamic_shared`` arrays are one buffer: they alias."""
        where: dict[str, set[int]] = {}
        stored: set[str] = set()
        for i, seg in enumerate(segs):
            for s in seg.stmts:
                for n in ast.walk(s):
                    if _is_access(n, self.k):
                        name = _access_name(n)
                        if self.k.shared.get(name, (None,))[0] == DYNAMIC_SHAPE:
                            name = "dynamic_shared()"
                        where.setdefault(name, set()).add(i)
                        if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store):
                            stored.add(name)
        return all(len(where[b]) == 1 and not segs[next(iter(where[b]))].loop_vars
                   for b in stored)

    def vector_params(self) -> list[str]:
        """A vectorised phase's parameters: a phase's, less the thread's own indices."""
        return [p for p in self.phase_params() if p not in ("_l0", "_l1", "_l2", "_t")]

    def vector_function(self, i: int, items: list[Any], pt: dict[str, str]) -> list[str]:
        """``_phv<i>``: the phase for a whole block, interchanged loops outside, thread
        loops (innermost over ``local_id(0)``) inside; only run when the block's range
        checks passed (or without bounds checks), so its accesses are unchecked."""
        lines = ["", "@njit(**_NJI)", f"def _phv{i}({', '.join(self.vector_params())}):"]
        self.fast = True
        try:
            lines += self.vector_items(items, "    ", pt, i)
        finally:
            self.fast = False
        return lines + ["    return 0", ""]

    def vector_items(self, items: list[Any], ind: str, pt: dict[str, str], idx: int
                     ) -> list[str]:
        out: list[str] = []
        for it in items:
            if isinstance(it, _Segment):
                out += self.segment(it, ind, pt, idx)
                continue
            s = it.loop
            names = []
            for a in s.iter.args:
                text, _ = self.hexpr(a, ind, out)  # uniform: no loads
                r = self.fresh("r")
                out.append(f"{ind}{r} = {text}")
                names.append(r)
            var = _u(s.target.id)
            jam = self.jammed(it)
            if jam is None:
                out.append(f"{ind}for {var} in range({', '.join(names)}):")
                out += self.abort_check(ind + "    ", self.stop)
                out += self.vector_items(it.items, ind + "    ", pt, idx)
                continue
            # unroll-and-jam: JAM iterations per pass of the thread loops, the rest after
            lo, hi = (names[0], names[1]) if len(names) > 1 else ("0", names[0])
            step = const_int(s.iter.args[2]) if len(names) == 3 else 1
            split = self.fresh("r")
            out.append(f"{ind}{split} = {lo} + len(range({', '.join(names)})) "
                       f"// {self._JAM} * {self._JAM * step}")
            for rng, seg in ((f"{lo}, {split}, {self._JAM * step}", jam),
                             (f"{split}, {hi}, {step}", it.items[0])):
                out.append(f"{ind}for {var} in range({rng}):")
                out += self.abort_check(ind + "    ", self.stop)
                out += self.segment(seg, ind + "    ", pt, idx)
        return out

    #: Iterations of an interchanged loop run per pass of the thread loops (unroll-and-jam),
    #: and the largest loop body (syntax-tree nodes) so unrolled.
    _JAM = 4
    _JAM_NODES = 80

    def jammed(self, it: "_VLoop") -> "_Segment | None":
        """The segment running ``_JAM`` iterations of an interchanged loop whose body is one
        small thread loop and whose step is a constant: the body once per iteration, the
        loop variable ``v`` read as ``v + m * step``. Each thread still runs its
        iterations in order (the same arithmetic, bit for bit); what changes is that its
        per-thread locals (``gemm``'s accumulator) are loaded and stored once per
        ``_JAM`` iterations instead of every one (docs/kernels.md, "Vectorised phases")."""
        s = it.loop
        if len(it.items) != 1 or not isinstance(it.items[0], _Segment):
            return None
        if len(s.iter.args) == 3 and not const_int(s.iter.args[2]):  # type: ignore
            return None  # a step that is not a constant (or is 0: range raises)
        seg = it.items[0]
        if sum(1 for st in seg.stmts for _ in ast.walk(st)) > self._JAM_NODES:
            return None
        step = const_int(s.iter.args[2]) if len(s.iter.args) == 3 else 1  # type: ignore
        var = s.target.id  # type: ignore[attr-defined]
        stmts: list[ast.stmt] = []
        for m in range(self._JAM):
            for st in copy.deepcopy(seg.stmts):
                stmts.append(_Shift(var, m * step).visit(st) if m else st)
        return _Segment(stmts, seg.loop_vars, seg.remat)

    def segment(self, seg: "_Segment", ind: str, pt: dict[str, str], idx: int) -> list[str]:
        """One thread loop of a vectorised phase: recomputed affine locals, per-thread
        locals loaded from and written back to their arrays, the statements."""
        inner = ind + "            "
        pre: list[str] = []
        for n in seg.remat:
            text, _ = self.hexpr(self.def_values[n], inner, pre)
            pre.append(f"{inner}{_u(n)} = ({text})")
        keep = frozenset(seg.loop_vars) | frozenset(seg.remat)
        return self.threads(ind, self.phase_body(seg.stmts, pt, inner, keep, tuple(pre)), idx)

    def phase_args(self) -> str:
        return ", ".join(self.phase_params())

    def phase_params(self) -> list[str]:
        return (["_l0", "_l1", "_l2", "_g0", "_g1", "_g2", "_ls0", "_ls1", "_ls2",
                 "_ng0", "_ng1", "_ng2", "_t", *(["_done"] if self.returns else []),
                 "abort", "fault", "_blas"]
                + [_u(v) for v in self.uniform_vars]
                + [_u(s) for s in self.k.shared]
                + [f"_pt_{v}" for v in self.per_thread_order]
                + [_u(p) for p in self.k.params]
                + [a for p in self.managed for a in self.page_map(p)])

    # -- per-thread locals -----------------------------------------------------------------
    def per_thread(self) -> dict[str, str]:
        """Locals that must survive from one phase to another (or from one iteration of a
        block-level loop to the next) -> 'int' or 'float' (their per-thread array type)."""
        exclude = set(self.k.params) | set(self.k.shared) | set(self.uniform_vars)
        count: dict[str, int] = {}
        result: set[str] = set()
        for stmts, in_loop in self.phases:
            for name in _names(stmts) - exclude:
                if name not in self.k.locals:
                    continue
                count[name] = count.get(name, 0) + 1
                if in_loop:
                    result.add(name)
        result |= {n for n, c in count.items() if c > 1}
        result |= self.block_locals | self.vector_locals
        kinds = self.infer_kinds()
        return {n: kinds.get(n, "float") for n in sorted(result)}

    def infer_kinds(self) -> dict[str, str]:
        """'float' unless every value ever assigned to the local is an integer (or bool):
        a conservative type for per-thread arrays, iterated to a fixed point. A function of
        the kernel alone, computed once (every ``if`` of every phase asks, see diamond)."""
        if self._kinds is not None:
            return self._kinds
        k = self.k
        kinds: dict[str, str] = {n: "int" for n in k.locals}
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
                kind = "float" if value is None else self.kind(value, kinds)
                if isinstance(op, (ast.Div, ast.Pow)):
                    kind = "float"
                if kind == "float" and kinds.get(name) != "float":
                    kinds[name] = "float"
                    changed = True
        self._kinds = kinds
        return kinds

    def kind(self, e: ast.AST, kinds: dict[str, str]) -> str:
        k = self.k
        if isinstance(e, ast.Constant):
            return "float" if isinstance(e.value, float) else "int"
        if isinstance(e, ast.Name):
            if e.id in k.scalars:
                return k.arg_types[k.params.index(e.id)].kind
            return kinds.get(e.id, "int")
        if isinstance(e, ast.BinOp):
            if isinstance(e.op, (ast.Div, ast.Pow)):
                return "float"
            return _join(self.kind(e.left, kinds), self.kind(e.right, kinds))
        if isinstance(e, ast.UnaryOp):
            return "int" if isinstance(e.op, ast.Not) else self.kind(e.operand, kinds)
        if isinstance(e, ast.Compare):
            return "int"
        if isinstance(e, ast.BoolOp):
            return _join(*(self.kind(v, kinds) for v in e.values))
        if isinstance(e, ast.IfExp):
            return _join(self.kind(e.body, kinds), self.kind(e.orelse, kinds))
        if isinstance(e, ast.Subscript):
            if isinstance(e.value, ast.Attribute):
                return "int"
            return "float" if buffer_dtype(k, e.value.id).startswith("float") else "int"  # type: ignore
        if isinstance(e, ast.Attribute):
            return "int"
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name):
            f = e.func.id
            if f in ID_BUILTINS or f in ("int", "floor"):
                return "int"
            if f in ("abs", "min", "max"):
                return _join(*(self.kind(a, kinds) for a in e.args))
        return "float"

    # -- the module --------------------------------------------------------------------------
    def module(self) -> str:
        k = self.k
        body = [s for s in k.fn.body]
        uses_mma = calls_mma(body)
        block_code = self.structure(body, "        ", False, True)
        pt = self.per_thread()
        self.per_thread_order = list(pt)
        # Calls were emitted before the uniform loop variables and per-thread arrays were
        # all known: fill in the (now final) argument list.
        block_code = [out for line in block_code for out in (
            self.inline_phase(line, pt) if line.strip() in self.inline_sites else
            [line.replace("@ARGS@", self.phase_args())
             .replace("@VARGS@", ", ".join(self.vector_params()))])]
        nj = (f"dict(nogil=True, cache=True, fastmath={self.opt.fastmath}, "
              f"boundscheck=False, error_model='numpy')")
        lines = [
            f'"""Generated by firmware.jit from kernel {k.fn.name!r}. '
            'Do not edit: the manifest checksums this file."""',
            "import math",
            "import numpy as np",
            "from numba import njit",
            "from firmware.intrinsics import (_rt_abort_word, _rt_atomic_add, _rt_floor, "
            "_rt_index, _rt_int, _rt_oob, _rt_opaque, _rt_pow, _rt_shl, _rt_shr, _rt_uindex)",
            *(["from firmware.matrix import _rt_gemm, _rt_span"] if uses_mma else []),
            "",
            f"_NJ = {nj}",
            # every function but _grid is called from compiled code only: no CPython or C
            # wrapper (numba builds both per function, ~0.2 s of each first compile)
            "_NJI = dict(_NJ, no_cpython_wrapper=True, no_cfunc_wrapper=True)",
            "",
            "",
        ]
        ndims = {buffer_ndim(k, n) for n in [*k.buffers, *k.shared]} | ({2} if uses_mma else set())
        for n in sorted(ndims):
            lines += _miss_helper(n)
        if uses_mma:
            lines += matrix.helper_source(ABORT_PREEMPT, FAULT_ABORT).splitlines()
        if self.managed:
            lines += _MARK_HELPERS.splitlines()
        loaded = {n.value.id for n in ast.walk(k.fn)  # type: ignore[attr-defined]
                  if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)}
        if self.checked:
            for name in sorted(loaded):
                lines += self.load_helper(name)
        # phase functions
        inlined = {idx for idx, _ in self.inline_sites.values()}
        for i, (stmts, _in_loop) in enumerate(self.phases):
            if i not in inlined:
                lines += self.phase_function(i, stmts, pt)
            if i in self.vector_phases:
                lines += self.vector_function(i, self.vector_phases[i], pt)
            if i in self.fast_phases and i not in inlined:
                self.fast = True
                try:
                    lines += self.phase_function(i, stmts, pt, "_phf")
                finally:
                    self.fast = False
        # the grid function
        sig = ["block_lo", "block_hi", "_ng0", "_ng1", "_ng2", "_ls0", "_ls1", "_ls2",
               "abort", "fault", "_blas", "_dyn"] + [_u(p) for p in k.params] \
            + [a for p in self.managed for a in self.page_map(p)]
        lines += ["", "@njit(**_NJ)", f"def _grid({', '.join(sig)}):",
                  "    _nt = _ls0 * _ls1 * _ls2",
                  # which threads returned: only a kernel with a return needs it (an
                  # allocation's numba implementation costs ~0.4 s of a first compile)
                  *(["    _done = np.zeros(max(_nt, 1), np.uint8)"] if self.returns else []),
                  *self.whole_marks()]
        for name, kind in pt.items():
            dt = "np.float64" if kind == "float" else "np.int64"
            lines.append(f"    _pt_{name} = np.zeros(max(_nt, 1), {dt})")
        for v in self.uniform_vars:
            lines.append(f"    {_u(v)} = 0")
        lines += ["    for _blk in range(block_lo, block_hi):",
                  "        if _rt_abort_word(abort) != 0:",
                  "            return _blk",
                  "        _g0 = _blk % _ng0",
                  "        _g1 = (_blk // _ng0) % _ng1",
                  "        _g2 = _blk // (_ng0 * _ng1)"]
        if self.returns and len(self.phases) > 1:
            lines.append("        _done[:] = 0")
        if any(shape == DYNAMIC_SHAPE for shape, _ in k.shared.values()):
            lines.append("        _dsh = np.zeros(_dyn, np.uint8)")  # the launch's bytes
        for name, (shape, dtype) in k.shared.items():
            np_dt = "np.bool_" if dtype == "bool" else f"np.{dtype}"
            if shape == DYNAMIC_SHAPE:  # whole elements of the launch's dynamic bytes
                size = np.dtype(dtype).itemsize
                lines.append(f"        {_u(name)} = _dsh[:_dyn // {size} * {size}].view({np_dt})")
            else:
                # a 1-D array by its length: np.zeros of an int is the per-thread arrays'
                # implementation, already compiled (each signature costs ~0.3 s once)
                dims = shape[0] if len(shape) == 1 else shape
                lines.append(f"        {_u(name)} = np.zeros({dims!r}, {np_dt})")
        lines += block_code
        lines += ["    return block_hi", ""]
        return "\n".join(lines)

    def load_helper(self, name: str) -> list[str]:
        """A load under short-circuit evaluation: a miss is recorded and reads zero."""
        ndim = buffer_ndim(self.k, name)
        dtype = buffer_dtype(self.k, name)
        zero = "False" if dtype == "bool" else f"np.{dtype}(0)"
        ivars = [f"i{d}" for d in range(ndim)]
        conds = " or ".join(f"_rt_oob(j{d}, a.shape[{d}])" for d in range(ndim))
        js = [f"j{d}" for d in range(ndim)]
        sub = ", ".join(f"_rt_uindex(_rt_opaque(j{d}))" for d in range(ndim))
        pm = self.page_map(name)
        return ["", "@njit(**_NJI)",
                f"def _ld_{name}(a, {', '.join(ivars)}, {', '.join(['fault', *pm])}):",
                *[f"    j{d} = _rt_index(i{d})" for d in range(ndim)],
                f"    if {conds}:",
                f"        {_miss_call(self.pos_of(name), js, 'a')}",
                f"        return {zero}",
                *self.mark(name, [", ".join(js)], "    ", "a"),
                f"    return a[{sub}]", ""]

    def phase_function(self, i: int, stmts: list[ast.stmt], pt: dict[str, str],
                       prefix: str = "_ph") -> list[str]:
        return ["", "@njit(**_NJI)", f"def {prefix}{i}({', '.join(self.phase_params())}):",
                *self.phase_body(stmts, pt, "    ", *self.recomputed(i, "    ")),
                "    return 0", ""]


#: The page-marking helpers of a module with managed buffers: a flat element index of a
#: C-order buffer -> its byte -> its 64 KiB page (``po``: the buffer's first byte's offset
#: in its first page); a box of indices is marked row by row (rows are contiguous).
_MARK_HELPERS = """
@njit(**_NJI)
def _mark(pm, po, isz, shape, idx):
    flat = 0
    for d in range(len(idx)):
        flat = flat * shape[d] + idx[d]
    pm[(po + flat * isz) >> 16] = 1


@njit(**_NJ)
def _mark_box(pm, po, isz, shape, lo, n):
    last = len(lo) - 1
    rows = 1
    for d in range(last):
        rows *= n[d]
    for r in range(rows):
        q = r
        flat = lo[last]
        stride = 1
        for d in range(last - 1, -1, -1):
            stride *= shape[d + 1]
            flat += (lo[d] + q % n[d]) * stride
            q //= n[d]
        pm[(po + flat * isz) >> 16:((po + (flat + n[last]) * isz - 1) >> 16) + 1] = 1
"""


def _miss_helper(ndim: int) -> list[str]:
    """``_miss<ndim>(fault, pos, j0.., s0..)``: record a bounds miss (the first one only)
    of buffer ``pos`` at index ``j`` of shape ``s`` (layout: FAULT_NDIM and below). One per
    number of dimensions, of scalars: numba compiles a helper taking tuples, or a literal
    position, once per distinct call (~0.2 s each, measured), this once per module."""
    js = [f"j{d}" for d in range(ndim)]
    ss = [f"s{d}" for d in range(ndim)]
    return ["", "@njit(**_NJI)", f"def _miss{ndim}(fault, pos, {', '.join(js + ss)}):",
            "    if fault[0] == 0:", f"        fault[0] = {FAULT_BOUNDS}",
            "        fault[1] = pos", f"        fault[{FAULT_NDIM}] = {ndim}",
            *[f"        fault[{FAULT_INDEX + d}] = j{d}" for d in range(ndim)],
            *[f"        fault[{FAULT_SHAPE + d}] = s{d}" for d in range(ndim)], ""]


def _miss_call(pos: int, ivars: list[str], array: str) -> str:
    """The call of the miss helper for an access of ``array`` at ``ivars`` (``pos`` goes
    as an int64, not a literal: see _miss_helper)."""
    shape = [f"{array}.shape[{d}]" for d in range(len(ivars))]
    return f"_miss{len(ivars)}(fault, np.int64({pos}), {', '.join(ivars + shape)})"


def _join(*kinds: str) -> str:
    return "float" if "float" in kinds else "int"


def lower_kernel(k: Kernel, options: Options) -> str:
    """The text of the generated module for an already validated kernel. Raises only
    :class:`KernelCompileError`: the lowering recurses over the syntax tree, whose depth
    validate() bounds; should Python's limits still be reached, that is the kernel's
    error, not the firmware's."""
    try:
        return _Lowering(k, options).module()
    except (RecursionError, MemoryError) as exc:
        raise KernelCompileError(f"kernel {k.fn.name!r} is too large to lower "
                                 f"({type(exc).__name__})") from None


def lower(ir: dict[str, Any], arg_types: tuple[str, ...], options: Options) -> str:
    """Validate and lower one kernel: the text of the generated module."""
    return lower_kernel(validate(ir, tuple(arg_types)), options)
