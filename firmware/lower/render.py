"""The renderer: a lowered :class:`~firmware.lower.program.Program` -> the text of the
Python module numba compiles (firmware/jit.py writes, imports and caches it).

Why the generated code looks the way it does
--------------------------------------------
* One entry point, ``_grid(block_lo, block_hi, gx, gy, gz, bx, by, bz, abort, fault,
  *args)``, runs a *range of blocks*, so the engines can split a launch across threads
  and preempt it between blocks: it returns the first block it did not run.
* A block's threads run as loops over phases (passes/split_phases.py). A phase is its own
  ``@njit`` function called in the loop (LLVM inlines it), where a ``return`` at any loop
  depth is a plain ``return``, or is written into the loop (passes/variants.py), where a
  user ``return``, "this thread is done", is a ``continue``: every function is a compile
  unit of its own to numba, seconds of a first launch (docs/kernels.md, "Compile time").
  Locals that live across phases become per-thread arrays (passes/per_thread.py).
* Bounds checks are explicit generated code, not numba's ``boundscheck`` (whose failure is
  an exception with no buffer name, and which numba's cache does not key on): a miss
  records the buffer's position, its shape and the index per dimension in the fault array
  (layout: abi.FAULT_NDIM and below) and stops the launch; firmware/jit.py computes the
  flat index from those in Python ints, so no report can wrap around.
* No range arithmetic that guards memory can wrap: indices are int64 by ``_rt_index``
  (firmware/intrinsics.py: a uint64 beyond int64 saturates, a float does not compile) and
  are compared unsigned against the shape; the block-level range checks are bounded
  (analysis/affine.py); mma's checks are in firmware/matrix.py. Operations whose numba
  lowering can be LLVM poison (out-of-range shifts, float-to-int conversions, numba's
  integer power) go through the defined versions in firmware/intrinsics.py, including the
  conversion of a value stored into an integer buffer.
* Every user loop reads the abort word once per iteration with an atomic load (a plain
  load of a value the loop never writes may be hoisted out of the loop by LLVM, which would
  make a ``while True:`` kernel unkillable).
* ``atomic_add`` is a real LLVM ``atomicrmw add``/``fadd`` (a numba ``@intrinsic``):
  blocks of one launch run on several engine threads at once.
* ``error_model="numpy"``: a division by zero gives inf/nan/0 as on a GPU instead of
  raising inside the engine thread.
* Buffer elements are indexed with uint64 indices (``_rt_uindex``): with a signed index
  numba emits Python's negative-index wraparound, which stops LLVM vectorising and made a
  bounds-free saxpy ~4x slower; here a negative index is a bounds miss (checked) or undefined
  (``boundscheck=False``, the caller's choice of an unsafe kernel).
* Cost (16 Mi float32 saxpy, 2-core machine): ``boundscheck=False`` runs as fast as a
  plain numba loop (~6.5 vs 7 ms); with checks ~18 ms, because a check that can stop the
  thread is an early exit that LLVM will not vectorise. Hence the range-checked variants
  (passes/affine.py, passes/if_convert.py, passes/vectorise.py): a block whose range
  checks pass runs ``_phf`` or ``_phv`` without per-access checks; otherwise the checked
  ``_ph`` loop, which faults exactly as before.
* In every phase after the one defining it, a local assigned once at the kernel's top
  level with an affine value is recomputed from the thread's ids rather than loaded from
  its per-thread array (analysis/liveness.py, recomputed), so the thread loop can
  vectorise (docs/kernels.md, "Tile loads and register blocking").
* ``shared_array``: allocated (zeroed) once per block at block level, passed to the
  phases. Bounds misses on it report the local's name as ``param``. ``dynamic_shared``
  arrays are views of one zeroed block of the launch's dynamic bytes (``_dyn``, a
  ``_grid`` argument), each with its own dtype: they alias, as CUDA's ``extern
  __shared__`` arrays do.
* Loops with an ``else`` clause are rejected (the contract does not list them).
* A buffer in managed memory (argument type suffix ``@managed``) adds two trailing
  arguments, its page map ``_pm_x`` (a uint8 per 64 KiB page) and its first byte's offset
  in its page ``_po_x``: a checked access marks its page once the check passed, a phase's
  range-checked affine accesses mark the block's index box once before the thread loop
  (a store per element would sit in the loop the range check keeps free of checks; not
  measured), unchecked code and mma operands mark the whole buffer; firmware/managed.py
  migrates what is marked. Other buffers' code is unchanged.
* The checked variant (``Options.sanitize``, ACCEL_SANITIZE's launches) adds a trailing
  ``_grid`` argument, the launch's hazard record ``_hz`` (abi/hazard.py), a shadow per
  shared array allocated once per call, the barrier phase ``_hzep`` (bumped per block and
  at each ``BlockBarrier``), and after each in-range shared access an ``_hz_acc`` call with
  its mode and kernel line (firmware/hazards.py). Without it none of this is written.

Modes
-----
Thread-level code is written in one of the :class:`Mode` s: whether the block's range
checks passed (range-checked accesses unchecked, hoisted guards dropped, diamonds as
selects) and what stops the launch and ends a thread's phase -- in a phase function
``return 1``/``return 0``, in a phase written into ``_grid``'s thread loop
``return _blk``/``continue``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import numpy as np

from abi import hazard, kernel_lang
from firmware import matrix
from firmware.kernel_check import (DYNAMIC_SHAPE, buffer_dtype, buffer_ndim, calls_mma,
                                   const_int, is_mma, reject)
from firmware.lower.abi import ABORT_PREEMPT, FAULT_ABORT, FAULT_BOUNDS, FAULT_INDEX, \
    FAULT_NDIM, FAULT_SHAPE
from firmware.hazards import SHADOW_COLS
from firmware.lower.analysis.liveness import recomputed
from firmware.lower.expr import (DEFINED_BINOPS, ExprWriter, block_expr, hazard_args, page_map,
                                 shadow_of, subscript)
from firmware.lower.passes.vectorise import JAM
from firmware.lower.passes.variants import range_conds
from firmware.lower.program import (BlockBarrier, BlockFor, BlockIf, BlockJump, BlockNode,
                                    BlockWhile, Phase, Program, RunCollective, RunPhase,
                                    Segment, VLoop)
from firmware.lower import syntax
from firmware.lower.syntax import indices, user_name

_AUG_SYMBOL: dict[type, str] = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
    ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
    ast.LShift: "<<", ast.RShift: ">>"}


@dataclass(frozen=True)
class Mode:
    """How thread-level code is written (see the module doc)."""

    range_checked: bool  # the block's range checks passed
    stop: str  # what stops the launch (a fault or the abort word)
    done: str  # what ends the thread's phase (its ``return``)


#: ``_ph<i>``: a phase function, every access checked.
CHECKED = Mode(False, "return 1", "return 0")
#: ``_phf<i>`` and ``_phv<i>``: functions run when the block's range checks passed.
RANGE_CHECKED = Mode(True, "return 1", "return 0")
#: A phase written into ``_grid``'s thread loop, checked or range-checked.
INLINE_CHECKED = Mode(False, "return _blk", "continue")
INLINE_RANGE_CHECKED = Mode(True, "return _blk", "continue")


class Renderer:
    """Writes the module text of one lowered program."""

    def __init__(self, prog: Program) -> None:
        assert prog.affine is not None
        self.prog = prog
        self.k = prog.kernel
        self.checked = prog.checked
        self.affine = prog.affine
        self.origins = prog.origins
        self.tmp = 0
        self.sanitize = prog.options.sanitize
        self.line = 0  # the kernel's line of the statement being written (sanitize)

    # -- helpers --------------------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        """A new temporary: never a name assigned twice (numba's SSA pass costs work in
        every block of a function per variable assigned twice)."""
        self.tmp += 1
        return f"_{prefix}{self.tmp}"

    def expr(self, node: ast.AST, uniform: tuple[str, ...]) -> str:
        """A block-level (uniform) expression (see expr.block_expr)."""
        return block_expr(self.prog, node, uniform)[0]

    def hexpr(self, node: ast.AST, ind: str, out: list[str], mode: Mode) -> tuple[str, bool]:
        """A thread-level expression: hoisted checks go to ``out``; returns the text and
        whether it loads under short-circuit evaluation (then ``fault`` needs a check)."""
        w = ExprWriter(self.prog, out=out, ind=ind,
                       hoist=lambda name, idx, o, i: self.hoist_index(name, idx, o, i, mode.stop),
                       unchecked=self.unchecked if mode.range_checked else None)
        text = ast.unparse(w.visit(self.origins.copy(node)))
        return text, w.cond_loads

    def unchecked(self, node: ast.AST) -> bool:
        """Whether an access (or a copy of one) had its range checked for the block."""
        return self.affine.range_checked(self.origins.of(node))

    def pos_of(self, name: str) -> int:
        if name in self.k.buffers:
            return self.k.buffers[name]
        return len(self.k.params) + list(self.k.shared).index(name)

    # -- managed memory: which 64 KiB pages the launch touched -----------------------------
    def mark(self, name: str, ivars: list[str], ind: str, array: str = "") -> list[str]:
        """Mark the page of one checked (in-range) access of a managed buffer (``array``:
        the buffer's name where it is not ``u_<name>``)."""
        if name not in self.prog.managed:
            return []
        isz = np.dtype(buffer_dtype(self.k, name)).itemsize
        return [f"{ind}_mark({', '.join(page_map(self.prog, name))}, {isz}, "
                f"{array or user_name(name)}.shape, ({', '.join(ivars)},))"]

    def box_marks(self, stmts: list[ast.stmt], ind: str) -> list[str]:
        """Mark, once per block, the pages of the block's index box of every affine access
        of a managed buffer in the phase (its range check passed): exact for an affine
        access every thread makes; a superset when a guard skips some threads."""
        out: dict[str, None] = {}
        for s in stmts:
            for n in ast.walk(s):
                box = self.affine.boxes.get(n)
                if box is None or box.name not in self.prog.managed:
                    continue
                isz = np.dtype(buffer_dtype(self.k, box.name)).itemsize
                lo = ", ".join(f"np.int64({f})" for f in box.firsts)
                out[f"{ind}_mark_box({', '.join(page_map(self.prog, box.name))}, {isz}, "
                    f"{user_name(box.name)}.shape, ({lo},), ({', '.join(box.sizes)},))"] = None
        return list(out)

    def whole_marks(self) -> list[str]:
        """Managed buffers whose accesses are not marked one by one -- every access when
        the code is unchecked, the matrix unit's operands -- are marked whole (a superset
        of the pages touched) when the launch's code starts."""
        mma_operands = {a.id for n in ast.walk(self.k.fn) if isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Name) and n.func.id == "mma"
                        for a in n.args[:3] if isinstance(a, ast.Name)}
        return [f"    _pm_{p}[:] = 1" for p in self.prog.managed
                if not self.checked or p in mma_operands]

    # -- thread-level code -------------------------------------------------------------------
    def hoist_index(self, name: str, idx: list[str], out: list[str], ind: str,
                    stop: str, how: int = hazard.READ) -> list[str]:
        """Evaluate an access's indices into int64 temporaries and check them (unsigned
        compare: a negative index is a miss too); a miss records the fault and stops the
        thread. ``how``: the access's mode, which a checked variant records for a shared
        array (:meth:`track`)."""
        u = user_name(name)
        ivars = []
        for i in idx:
            v = self.fresh("k")
            out.append(f"{ind}{v} = _rt_index({i})")
            ivars.append(v)
        conds = " or ".join(f"_rt_oob({v}, {u}.shape[{d}])" for d, v in enumerate(ivars))
        out += [f"{ind}if {conds}:",
                f"{ind}    {_miss_call(self.pos_of(name), ivars, u)}",
                f"{ind}    {stop}"]
        # see intrinsics._rt_opaque; new names, as every temporary here
        hidden = [f"{v}o" for v in ivars]
        out += [f"{ind}{h} = _rt_opaque({v})" for h, v in zip(hidden, ivars)]
        out += self.mark(name, hidden, ind)
        out += self.track(name, hidden, ind, how)
        return hidden

    # -- the checked variant (ACCEL_SANITIZE): shared-memory accesses per barrier phase -----
    def track(self, name: str, ivars: list[str], ind: str, how: int) -> list[str]:
        """Record one in-range access of a shared array (firmware/hazards.py)."""
        if not (self.sanitize and name in self.k.shared):
            return []
        u = user_name(name)
        elem = ivars[0]
        for d, v in enumerate(ivars[1:], 1):
            elem = f"({elem}) * {u}.shape[{d}] + {v}"
        e = self.fresh("e")
        return [f"{ind}{e} = {elem}",
                f"{ind}_hz_acc({', '.join(hazard_args(self.prog, name, e, str(self.line), how))})"]

    def hazard_params(self) -> list[str]:
        """The checked variant's extra phase parameters: the barrier phase, the launch's
        hazard record and the shared arrays' shadows."""
        if not self.sanitize:
            return []
        return ["_hzep", "_hz", *dict.fromkeys(shadow_of(self.prog, s) for s in self.k.shared)]

    def shadows(self) -> list[str]:
        """``_grid``'s allocation of the shadows, once per call (the phase number never
        repeats within one, so they need no clearing)."""
        out = {}
        for name, (shape, _) in self.k.shared.items():
            size = "max(_dyn, 1)" if shape == DYNAMIC_SHAPE else str(max(1, int(np.prod(shape))))
            out[f"    {shadow_of(self.prog, name)} = np.zeros(({size}, {SHADOW_COLS}), "
                "np.int64)"] = None
        return ["    _hzep = 0", *out]

    def fault_check(self, ind: str, mode: Mode) -> list[str]:
        return [f"{ind}if fault[0] != 0:", f"{ind}    {mode.stop}"]

    def abort_check(self, ind: str, stop: str) -> list[str]:
        return [f"{ind}if _rt_abort_word(abort) > {ABORT_PREEMPT}:",
                f"{ind}    fault[0] = {FAULT_ABORT}", f"{ind}    {stop}"]

    def access(self, name: str, idx_nodes: list[ast.expr], ind: str, out: list[str],
               mode: Mode, node: ast.AST, how: int) -> tuple[list[str], bool]:
        """The index texts of a store/atomic target (checked when bounds-checking,
        unless ``node`` is an access whose range the block checked already)."""
        texts, loads = [], False
        for i in idx_nodes:
            t, c = self.hexpr(i, ind, out, mode)
            texts.append(t)
            loads = loads or c
        if not self.checked:
            return texts, loads
        if mode.range_checked and self.unchecked(node):
            if loads:
                out += self.fault_check(ind, mode)
            return texts, False
        if loads:
            out += self.fault_check(ind, mode)
            loads = False
        return self.hoist_index(name, texts, out, ind, mode.stop, how), loads

    def target(self, t: ast.expr, ind: str, out: list[str], mode: Mode,
               how: int = hazard.WRITE) -> str:
        if isinstance(t, ast.Subscript):
            name = t.value.id  # type: ignore[attr-defined]
            idx, _ = self.access(name, indices(t), ind, out, mode, t, how)
            return ast.unparse(subscript(name, [ast.parse(i, mode="eval").body for i in idx],
                                         ast.Store()))
        return ast.unparse(ExprWriter(self.prog).visit(self.origins.copy(t)))

    def conversion(self, t: ast.expr) -> str:
        """``"_rt_int"`` when ``t`` is an element of an integer buffer (a float stored there
        would go through numba's poison-prone fptosi), else ``""``."""
        if isinstance(t, ast.Subscript):
            t = t.value
        if not (isinstance(t, ast.Name) and (t.id in self.k.buffers or t.id in self.k.shared)):
            return ""
        dtype = buffer_dtype(self.k, t.id)
        return "" if dtype == "bool" or dtype.startswith("float") else "_rt_int"

    def stmt(self, s: ast.stmt, ind: str, writeback: list[str], mode: Mode) -> list[str]:
        out: list[str] = []
        self.line = s.lineno
        if isinstance(s, ast.Assign):
            value, loads = self.hexpr(s.value, ind, out, mode)
            if loads:
                out += self.fault_check(ind, mode)
            if len(s.targets) == 1:
                tgt = self.target(s.targets[0], ind, out, mode)
                return out + [f"{ind}{tgt} = {self.conversion(s.targets[0])}({value})"]
            v = self.fresh("v")
            out.append(f"{ind}{v} = {value}")
            for t in s.targets:
                tgt = self.target(t, ind, out, mode)
                out.append(f"{ind}{tgt} = {self.conversion(t)}({v})")
            return out
        if isinstance(s, ast.AugAssign):
            op = _AUG_SYMBOL[type(s.op)]
            value, loads = self.hexpr(s.value, ind, out, mode)
            if loads:
                out += self.fault_check(ind, mode)
            tgt = self.target(s.target, ind, out, mode, hazard.READ_WRITE)
            helper = DEFINED_BINOPS.get(type(s.op))
            conv = self.conversion(s.target)
            if helper is None and not conv:
                return out + [f"{ind}{tgt} {op}= {value}"]
            new = f"{helper}({tgt}, {value})" if helper else f"{tgt} {op} ({value})"
            return out + [f"{ind}{tgt} = {conv}({new})"]
        if is_mma(s):  # its own phase, run by thread 0 (see collective())
            return self.mma(s.value, ind, mode)  # type: ignore[arg-type]
        if isinstance(s, ast.Expr):  # atomic_add (barrier() is structural)
            call = s.value
            assert isinstance(call, ast.Call) and call.func.id == "atomic_add"  # type: ignore
            name = call.args[0].id  # type: ignore[attr-defined]
            idx_node = call.args[1]
            idx = list(idx_node.elts) if isinstance(idx_node, ast.Tuple) else [idx_node]
            if len(idx) != buffer_ndim(self.k, name):
                raise reject(s, f"atomic_add index of {name!r} needs "
                                f"{buffer_ndim(self.k, name)} components")
            value, loads = self.hexpr(call.args[2], ind, out, mode)
            if loads:
                out += self.fault_check(ind, mode)
            ivars, _ = self.access(name, idx, ind, out, mode, call, hazard.ATOMIC)
            v = self.fresh("v")
            out.append(f"{ind}{v} = {self.conversion(call.args[0])}({value})")
            out.append(f"{ind}_rt_atomic_add({user_name(name)}, ({', '.join(ivars)},), {v})")
            return out
        if isinstance(s, ast.If) and mode.range_checked and self.checked \
                and self.origins.of(s) in self.prog.always:
            # true for a block whose range checks passed; without bounds checks no block
            # passed any, so the guard stays
            return self.block(s.body, ind, writeback, mode)
        if isinstance(s, ast.If) and mode.range_checked and self.checked \
                and self.origins.of(s) in self.prog.selects:
            return self.select(s, ind, mode)
        if isinstance(s, ast.If):
            test, loads = self.hexpr(s.test, ind, out, mode)
            if loads:
                c = self.fresh("c")
                out += [f"{ind}{c} = {test}"] + self.fault_check(ind, mode)
                test = c
            out.append(f"{ind}if {test}:")
            out += self.block(s.body, ind + "    ", writeback, mode)
            if s.orelse:
                out.append(f"{ind}else:")
                out += self.block(s.orelse, ind + "    ", writeback, mode)
            return out
        if isinstance(s, ast.For):
            names = []
            any_loads = False
            for a in s.iter.args:  # type: ignore[attr-defined]
                text, loads = self.hexpr(a, ind, out, mode)
                any_loads = any_loads or loads
                r = self.fresh("r")
                out.append(f"{ind}{r} = {text}")
                names.append(r)
            if any_loads:
                out += self.fault_check(ind, mode)
            var = user_name(s.target.id)  # type: ignore[attr-defined]
            out.append(f"{ind}for {var} in range({', '.join(names)}):")
            out += self.abort_check(ind + "    ", mode.stop)
            return out + self.block(s.body, ind + "    ", writeback, mode)
        if isinstance(s, ast.While):
            inner = ind + "    "
            out = [f"{ind}while True:"] + self.abort_check(inner, mode.stop)
            test, loads = self.hexpr(s.test, inner, out, mode)
            if loads:
                out += self.fault_check(inner, mode)
            out += [f"{inner}if not ({test}):", f"{inner}    break"]
            return out + self.block(s.body, inner, writeback, mode)
        if isinstance(s, ast.Return):
            out = [f"{ind}_done[_t] = 1"] if self.prog.returns else []
            return out + [f"{ind}{w}" for w in writeback] + [f"{ind}{mode.done}"]
        if isinstance(s, (ast.Break, ast.Continue, ast.Pass)):
            return [f"{ind}{type(s).__name__.lower()}"]
        raise reject(s, f"{type(s).__name__} cannot be lowered")

    def select(self, s: ast.If, ind: str, mode: Mode) -> list[str]:
        """A diamond as a select (passes/if_convert.py): both values, then one
        assignment."""
        out: list[str] = []
        a, b = s.body[0], s.orelse[0]
        assert isinstance(a, ast.Assign) and isinstance(b, ast.Assign)
        values = []
        for v in (a.value, b.value):
            text, _ = self.hexpr(v, ind, out, mode)  # block-checked loads: nothing to check
            name = self.fresh("s")
            out.append(f"{ind}{name} = {text}")
            values.append(name)
        test, loads = self.hexpr(s.test, ind, out, mode)
        if loads:
            c = self.fresh("c")
            out += [f"{ind}{c} = {test}"] + self.fault_check(ind, mode)
            test = c
        tgt = self.target(a.targets[0], ind, out, mode)
        conv = self.conversion(a.targets[0])
        return out + [f"{ind}{tgt} = {conv}({values[0]} if {test} else {values[1]})"]

    def mma(self, call: ast.Call, ind: str, mode: Mode) -> list[str]:
        """The matrix unit's call: operands, then the scalar arguments evaluated (with
        thread 0's locals; the integer ones as int64 through ``_rt_index``, which
        firmware/matrix.py's range checks rely on; the layout flags ``ta``/``tb`` 0 when
        not written), then the BLAS pointer array and the dtype's slot in it."""
        out: list[str] = []
        names = [a.id for a in call.args[:3]]  # type: ignore[attr-defined]
        values = []
        for i, a in enumerate(call.args[3:]):
            text, loads = self.hexpr(a, ind, out, mode)
            if loads:
                out += self.fault_check(ind, mode)
            values.append(text if i == 6 else f"_rt_index({text})")  # beta stays a number
        values += ["np.int64(0)"] * (kernel_lang.MMA_MAX_NARGS - len(call.args))
        slot = matrix.SLOT[buffer_dtype(self.k, names[0])]
        args = ([user_name(n) for n in names] + values
                + ["_blas", str(slot), "abort", "fault"] + [str(self.pos_of(n)) for n in names])
        return out + [f"{ind}if _mma({', '.join(args)}) != 0:", f"{ind}    {mode.stop}"]

    def block(self, stmts: list[ast.stmt], ind: str, writeback: list[str],
              mode: Mode) -> list[str]:
        out: list[str] = []
        for s in stmts:
            out += self.stmt(s, ind, writeback, mode)
        return out or [f"{ind}pass"]

    def recomputed(self, phase: Phase, ind: str,
                   mode: Mode) -> tuple[frozenset[str], tuple[str, ...]]:
        """The affine locals ``phase`` recomputes (analysis/liveness.py), as phase_body's
        ``keep`` and ``pre``."""
        pre: list[str] = []
        names = recomputed(self.prog, phase)
        for n in names:
            text, _ = self.hexpr(self.affine.def_values[n], ind, pre, mode)
            pre.append(f"{ind}{user_name(n)} = ({text})")
        return frozenset(names), tuple(pre)

    def phase_body(self, stmts: list[ast.stmt], ind: str, mode: Mode,
                   keep: frozenset[str] = frozenset(), pre: tuple[str, ...] = ()) -> list[str]:
        """One thread's code of a phase: the global ids it uses, ``pre``, its per-thread
        locals (but ``keep``) loaded from their arrays, the statements, and what it
        assigned written back (also before a ``return``)."""
        pt = set(self.prog.per_thread)
        used = (syntax.names(stmts) & pt) - keep
        assigned = (syntax.assigned(stmts) & pt) - keep
        writeback = [f"_pt_{n}[_t] = {user_name(n)}" for n in sorted(assigned)]
        code = [*pre, *[f"{ind}{user_name(n)} = _pt_{n}[_t]" for n in sorted(used)]]
        code += self.block(stmts, ind, writeback, mode) + [f"{ind}{w}" for w in writeback]
        text = "\n".join(code)
        return [f"{ind}_gid{d} = _g{d} * _ls{d} + _l{d}" for d in range(3)
                if f"_gid{d}" in text] + code

    # -- block-level structure ---------------------------------------------------------------
    def structure(self, nodes: list[BlockNode], ind: str) -> list[str]:
        """Block-level code: thread loops over phases, with block-level (uniform) control
        flow around the phases that contain barriers."""
        out: list[str] = []
        for n in nodes:
            if isinstance(n, RunPhase):
                out += self.thread_loop(self.prog.phases[n.phase], ind)
            elif isinstance(n, RunCollective):
                out += self.collective(self.prog.phases[n.phase], ind)
            elif isinstance(n, BlockJump):
                out.append(f"{ind}{n.keyword}")
            elif isinstance(n, BlockBarrier):
                if self.sanitize:
                    out.append(f"{ind}_hzep += 1")
            elif isinstance(n, BlockIf):
                out.append(f"{ind}if {self.expr(n.test, n.uniform)}:")
                out += self.structure(n.body, ind + "    ") or [f"{ind}    pass"]
                if n.orelse is not None:
                    out.append(f"{ind}else:")
                    out += self.structure(n.orelse, ind + "    ") or [f"{ind}    pass"]
            elif isinstance(n, BlockFor):
                rng = ", ".join(self.expr(a, n.uniform) for a in n.loop.iter.args)  # type: ignore
                var = user_name(n.loop.target.id)  # type: ignore[attr-defined]
                out.append(f"{ind}for {var} in range({rng}):")
                out += self.abort_check(ind + "    ", "return _blk")
                out += self.structure(n.body, ind + "    ")
            elif isinstance(n, BlockWhile):
                out.append(f"{ind}while {self.expr(n.test, n.uniform)}:")
                out += self.abort_check(ind + "    ", "return _blk")
                out += self.structure(n.body, ind + "    ")
        return out

    def thread_loop(self, phase: Phase, ind: str) -> list[str]:
        """A phase: vectorised when it can be (``_phv``, under the block's range checks,
        the checked per-thread loop otherwise), else a loop over the threads running the
        per-thread phase (``_phf`` under the range checks of its affine accesses, when it
        has any)."""
        idx = phase.index
        conds = range_conds(self.prog, idx)
        if phase.vector is not None:
            call = [f"{ind}if _phv{idx}({', '.join(self.vector_params())}) != 0:",
                    f"{ind}    return _blk"]
            if not conds:
                return call
            return ([f"{ind}if {' and '.join(conds)}:"]
                    + self.box_marks(phase.stmts, ind + "    ")
                    + [f"    {c}" for c in call]
                    + [f"{ind}else:"] + self.per_thread_loop(phase, False, ind + "    "))
        if not conds:
            return self.per_thread_loop(phase, False, ind)
        return ([f"{ind}if {' and '.join(conds)}:"]
                + self.box_marks(phase.stmts, ind + "    ")
                + self.per_thread_loop(phase, True, ind + "    ")
                + [f"{ind}else:"]
                + self.per_thread_loop(phase, False, ind + "    "))

    def collective(self, phase: Phase, ind: str) -> list[str]:
        """A block-collective statement (mma) as a phase of its own that runs once per
        block, as thread 0: its arguments are uniform, so thread 0's locals are the
        block's. Skipped when the block has returned (only a uniform return can precede
        it: the barrier rule)."""
        idx = phase.index
        skip = [f"{ind}if not _done[0]:"] if self.prog.returns and idx > 0 else []
        inner = ind + "    " if skip else ind
        return skip + [f"{inner}_l0 = 0", f"{inner}_l1 = 0", f"{inner}_l2 = 0", f"{inner}_t = 0",
                       f"{inner}if _ph{idx}({self.phase_args()}) != 0:",
                       f"{inner}    return _blk"]

    def per_thread_loop(self, phase: Phase, range_checked: bool, ind: str) -> list[str]:
        """The loop over the block's threads running ``phase`` (its checked ``_ph`` or
        range-checked ``_phf`` variant): the phase's code written into it when it is
        inlined (a fault or abort returns the block from ``_grid``, a thread's ``return``
        is ``continue``), else a call of the phase function."""
        inner = ind + " " * 12
        if phase.inline:
            mode = INLINE_RANGE_CHECKED if range_checked else INLINE_CHECKED
            body = self.phase_body(phase.stmts, inner, mode, *self.recomputed(phase, inner, mode))
            return self.threads(ind, body, phase.index)
        fn = f"{'_phf' if range_checked else '_ph'}{phase.index}"
        return self.threads(ind, [f"{inner}if {fn}({self.phase_args()}) != 0:",
                                  f"{inner}    return _blk"], phase.index)

    def threads(self, ind: str, body: list[str], idx: int) -> list[str]:
        """Loops over the block's threads around ``body`` (indented ``ind`` + 12), which
        phase ``idx``'s threads that have returned skip."""
        inner = ind + " " * 12
        skip = [f"{inner}if _done[_t]:", f"{inner}    continue"] \
            if self.prog.returns and idx > 0 else []
        return [f"{ind}for _l2 in range(_ls2):",
                f"{ind}    for _l1 in range(_ls1):",
                f"{ind}        for _l0 in range(_ls0):",
                *([f"{inner}_t = (_l2 * _ls1 + _l1) * _ls0 + _l0"]
                  if skip or _uses(body, "_t") else []),
                *skip, *body]

    def phase_args(self) -> str:
        return ", ".join(self.phase_params())

    def phase_params(self) -> list[str]:
        return (["_l0", "_l1", "_l2", "_g0", "_g1", "_g2", "_ls0", "_ls1", "_ls2",
                 "_ng0", "_ng1", "_ng2", "_t", *(["_done"] if self.prog.returns else []),
                 "abort", "fault", "_blas", *self.hazard_params()]
                + [user_name(v) for v in self.prog.uniform_vars]
                + [user_name(s) for s in self.k.shared]
                + [f"_pt_{v}" for v in self.prog.per_thread]
                + [user_name(p) for p in self.k.params]
                + [a for p in self.prog.managed for a in page_map(self.prog, p)])

    # -- vectorised phases -------------------------------------------------------------------
    def vector_params(self) -> list[str]:
        """A vectorised phase's parameters: a phase's, less the thread's own indices."""
        return [p for p in self.phase_params() if p not in ("_l0", "_l1", "_l2", "_t")]

    def vector_function(self, phase: Phase) -> list[str]:
        """``_phv<i>``: the phase for a whole block, interchanged loops outside, thread
        loops (innermost over ``local_id(0)``) inside; only run when the block's range
        checks passed (or without bounds checks), so its accesses are unchecked."""
        assert phase.vector is not None
        lines = ["", "@njit(**_NJI)", f"def _phv{phase.index}({', '.join(self.vector_params())}):"]
        lines += self.vector_items(phase.vector, "    ", phase.index, RANGE_CHECKED)
        return lines + ["    return 0", ""]

    def vector_items(self, items: list[Segment | VLoop], ind: str, idx: int,
                     mode: Mode) -> list[str]:
        out: list[str] = []
        for it in items:
            if isinstance(it, Segment):
                out += self.segment(it, ind, idx, mode)
                continue
            s = it.loop
            names = []
            for a in s.iter.args:  # type: ignore[attr-defined]
                text, _ = self.hexpr(a, ind, out, mode)  # uniform: no loads
                r = self.fresh("r")
                out.append(f"{ind}{r} = {text}")
                names.append(r)
            var = user_name(s.target.id)  # type: ignore[attr-defined]
            if it.jam is None:
                out.append(f"{ind}for {var} in range({', '.join(names)}):")
                out += self.abort_check(ind + "    ", mode.stop)
                out += self.vector_items(it.items, ind + "    ", idx, mode)
                continue
            # unroll-and-jam: JAM iterations per pass of the thread loops, the rest after
            lo, hi = (names[0], names[1]) if len(names) > 1 else ("0", names[0])
            step = const_int(s.iter.args[2]) if len(names) == 3 else 1  # type: ignore
            split = self.fresh("r")
            out.append(f"{ind}{split} = {lo} + len(range({', '.join(names)})) "
                       f"// {JAM} * {JAM * step}")  # type: ignore[operator]
            rest = it.items[0]
            assert isinstance(rest, Segment)
            for rng, seg in ((f"{lo}, {split}, {JAM * step}", it.jam),  # type: ignore[operator]
                             (f"{split}, {hi}, {step}", rest)):
                out.append(f"{ind}for {var} in range({rng}):")
                out += self.abort_check(ind + "    ", mode.stop)
                out += self.segment(seg, ind + "    ", idx, mode)
        return out

    def segment(self, seg: Segment, ind: str, idx: int, mode: Mode) -> list[str]:
        """One thread loop of a vectorised phase: recomputed affine locals, per-thread
        locals loaded from and written back to their arrays, the statements."""
        inner = ind + "            "
        pre: list[str] = []
        for n in seg.remat:
            text, _ = self.hexpr(self.affine.def_values[n], inner, pre, mode)
            pre.append(f"{inner}{user_name(n)} = ({text})")
        keep = frozenset(seg.loop_vars) | frozenset(seg.remat)
        return self.threads(ind, self.phase_body(seg.stmts, inner, mode, keep, tuple(pre)), idx)

    # -- the module --------------------------------------------------------------------------
    def module(self) -> str:
        prog, k = self.prog, self.k
        uses_mma = calls_mma(list(k.fn.body))
        block_code = self.structure(prog.skeleton, "        ")
        nj = (f"dict(nogil=True, cache=True, fastmath={prog.options.fastmath}, "
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
            *(["from firmware.hazards import _hz_acc"] if self.sanitize else []),
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
        if prog.managed:
            lines += _MARK_HELPERS.splitlines()
        loaded = {n.value.id for n in ast.walk(k.fn)  # type: ignore[attr-defined]
                  if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)}
        if self.checked:
            for name in sorted(loaded):
                lines += self.load_helper(name)
        for phase in prog.phases:
            if not phase.inline:
                lines += self.phase_function(phase, "_ph", CHECKED)
            if phase.vector is not None:
                lines += self.vector_function(phase)
            if phase.fast and not phase.inline:
                lines += self.phase_function(phase, "_phf", RANGE_CHECKED)
        # the grid function
        sig = ["block_lo", "block_hi", "_ng0", "_ng1", "_ng2", "_ls0", "_ls1", "_ls2",
               "abort", "fault", "_blas", "_dyn"] + [user_name(p) for p in k.params] \
            + [a for p in prog.managed for a in page_map(prog, p)] \
            + (["_hz"] if self.sanitize else [])
        # _grid is called from Python only (its CPython wrapper): no C wrapper either
        lines += ["", "@njit(**_NJ, no_cfunc_wrapper=True)", f"def _grid({', '.join(sig)}):",
                  *(["    _nt = _ls0 * _ls1 * _ls2"] if prog.returns or prog.per_thread else []),
                  # which threads returned: only a kernel with a return needs it (an
                  # allocation's numba implementation costs ~0.4 s of a first compile)
                  *(["    _done = np.zeros(max(_nt, 1), np.uint8)"] if prog.returns else []),
                  *self.whole_marks(),
                  *(self.shadows() if self.sanitize else [])]
        for name, kind in prog.per_thread.items():
            dt = "np.float64" if kind == "float" else "np.int64"
            lines.append(f"    _pt_{name} = np.zeros(max(_nt, 1), {dt})")
        for v in prog.uniform_vars:
            lines.append(f"    {user_name(v)} = 0")
        lines += ["    for _blk in range(block_lo, block_hi):",
                  "        if _rt_abort_word(abort) != 0:",
                  "            return _blk",
                  "        _g0 = _blk % _ng0",
                  # block ids the code does not use are not computed: numba types and
                  # lowers every statement before LLVM drops the dead ones
                  *(["        _g1 = (_blk // _ng0) % _ng1"] if _uses(block_code, "_g1") else []),
                  *(["        _g2 = _blk // (_ng0 * _ng1)"] if _uses(block_code, "_g2") else []),
                  *(["        _hzep += 1"] if self.sanitize else [])]
        if prog.returns and len(prog.phases) > 1:
            lines.append("        _done[:] = 0")
        if any(shape == DYNAMIC_SHAPE for shape, _ in k.shared.values()):
            lines.append("        _dsh = np.zeros(_dyn, np.uint8)")  # the launch's bytes
        for name, (shape, dtype) in k.shared.items():
            np_dt = "np.bool_" if dtype == "bool" else f"np.{dtype}"
            if shape == DYNAMIC_SHAPE:  # whole elements of the launch's dynamic bytes
                size = np.dtype(dtype).itemsize
                lines.append(f"        {user_name(name)} = "
                             f"_dsh[:_dyn // {size} * {size}].view({np_dt})")
            else:
                # a 1-D array by its length: np.zeros of an int is the per-thread arrays'
                # implementation, already compiled (each signature costs ~0.3 s once)
                dims = shape[0] if len(shape) == 1 else shape
                lines.append(f"        {user_name(name)} = np.zeros({dims!r}, {np_dt})")
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
        pm = page_map(self.prog, name)
        hz = ["_hzln", "_t", "_hzep", "_hz", "_g0", "_g1", "_g2", "_ng0", "_ng1",
              shadow_of(self.prog, name)] if self.sanitize and name in self.k.shared else []
        track = []
        if hz:
            elem = "j0"
            for d in range(1, ndim):
                elem = f"({elem}) * a.shape[{d}] + j{d}"
            track = [f"    _e = {elem}",
                     f"    _hz_acc({', '.join(hazard_args(self.prog, name, '_e', '_hzln'))})"]
        return ["", "@njit(**_NJI)",
                f"def _ld_{name}(a, {', '.join(ivars)}, {', '.join(['fault', *pm, *hz])}):",
                *[f"    j{d} = _rt_index(i{d})" for d in range(ndim)],
                f"    if {conds}:",
                f"        {_miss_call(self.pos_of(name), js, 'a')}",
                f"        return {zero}",
                *self.mark(name, [", ".join(js)], "    ", "a"),
                *track,
                f"    return a[{sub}]", ""]

    def phase_function(self, phase: Phase, prefix: str, mode: Mode) -> list[str]:
        params = ", ".join(self.phase_params())
        return ["", "@njit(**_NJI)", f"def {prefix}{phase.index}({params}):",
                *self.phase_body(phase.stmts, "    ", mode, *self.recomputed(phase, "    ", mode)),
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


def _uses(code: list[str], name: str) -> bool:
    """Whether generated ``code`` mentions the variable ``name``."""
    return re.search(rf"\b{name}\b", "\n".join(code)) is not None


def _miss_helper(ndim: int) -> list[str]:
    """``_miss<ndim>(fault, pos, j0.., s0..)``: record a bounds miss (the first one only)
    of buffer ``pos`` at index ``j`` of shape ``s`` (layout: abi.FAULT_NDIM and below). One
    per number of dimensions, of scalars: numba compiles a helper taking tuples, or a
    literal position, once per distinct call (~0.2 s each, measured), this once per
    module."""
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
