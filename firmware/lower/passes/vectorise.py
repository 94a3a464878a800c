"""Pass 4: vectorise phases by loop interchange, and unroll-and-jam.

A phase with a ``range`` loop whose bounds are uniform across the block gets a third
variant, ``_phv``, one call per block: that loop runs outside the thread loops
(innermost over ``local_id(0)``), so LLVM vectorises across threads (docs/kernels.md,
"Vectorised phases"). ``_phv`` runs only when every access of the phase passed the
block's range checks, so it cannot fault; a block that fails runs the checked per-thread
loop, whose fault record is the old one. Locals living across its thread loops are
per-thread arrays of their exact numba type or affine locals recomputed per thread;
stored buffers are accessed in one thread loop outside the interchanged loops, so every
buffer sees its accesses in the old order. An interchanged loop with a constant step and
a small one-loop body runs :data:`JAM` iterations per pass of the thread loops
(unroll-and-jam, each thread's order kept).

A checked variant (``Options.sanitize``) is not vectorised: it tracks each thread's
shared-memory accesses in the per-thread phases (firmware/hazards.py).

Reads: Program.phases, .affine, .kinds. Writes: Phase.vector (segments and interchanged
loops, with their jammed copies and recomputed locals), Program.vector_locals."""

from __future__ import annotations

import ast

from firmware.kernel_check import DYNAMIC_SHAPE, const_int, contains, structural
from firmware.lower.analysis.affine import Affine
from firmware.lower.analysis.liveness import remat
from firmware.lower.analysis.uniformity import Uniformity
from firmware.lower.program import Phase, Program, Segment, VLoop, segments
from firmware.lower.syntax import (Origins, Shift, access_name, assigned, is_access, names,
                                   node_count)

#: Iterations of an interchanged loop run per pass of the thread loops (unroll-and-jam),
#: and the largest loop body (syntax-tree nodes) so unrolled.
JAM = 4
JAM_NODES = 80


def run(prog: Program) -> None:
    assert prog.affine is not None
    if prog.options.sanitize:
        return  # the checked variant tracks each thread's accesses in the per-thread phases
    for phase in prog.phases:
        if phase.collective:
            continue
        phase.vector = _plan(prog, phase, prog.affine.carried_before[phase.index])
        if phase.vector is not None:
            _jam_all(phase.vector, prog.origins)


def _interchangeable(prog: Program, uni: Uniformity, s: ast.stmt) -> bool:
    """Whether a phase's loop can run outside the thread loop: a ``range`` loop with
    uniform bounds (loop_range), no break/continue of its own, and a variable read only
    in its body (so no thread needs its value after the loop)."""
    if not isinstance(s, ast.For) or uni.loop_range(s, {}) is None:
        return False
    if any(structural(c, True) for c in s.body):
        return False
    var = s.target.id  # type: ignore[attr-defined]
    inside = sum(1 for c in s.body for n in ast.walk(c)
                 if isinstance(n, ast.Name) and n.id == var and isinstance(n.ctx, ast.Load))
    return inside == prog.loads.get(var, 0)


def _split(prog: Program, uni: Uniformity, stmts: list[ast.stmt],
           loop_vars: tuple[str, ...]) -> list[Segment | VLoop]:
    """A phase's statements as segments (thread loops) and interchanged loops around
    further segments."""
    items: list[Segment | VLoop] = []
    seg: list[ast.stmt] = []
    for s in stmts:
        if not _interchangeable(prog, uni, s):
            seg.append(s)
            continue
        if seg:
            items.append(Segment(seg, loop_vars))
            seg = []
        var = s.target.id  # type: ignore[attr-defined]
        body = _split(prog, uni, s.body, loop_vars + (var,))  # type: ignore[attr-defined]
        items.append(VLoop(s, body))  # type: ignore[arg-type]
    if seg:
        items.append(Segment(seg, loop_vars))
    return items


def _plan(prog: Program, phase: Phase, before: dict[str, Affine]) -> list[Segment | VLoop] | None:
    """The vectorised form of a phase, or None when it keeps the per-thread form: it
    must have an interchangeable loop, no ``return``/atomics, every access range checked
    per block, every block-shared or global buffer it stores into accessed in one segment
    outside the interchanged loops, and every local that lives across segments
    recomputable (an affine local assigned once) or a per-thread array of its exact numba
    type."""
    assert prog.affine is not None and prog.kinds is not None
    k, stmts = prog.kernel, phase.stmts
    if contains(stmts, lambda n: isinstance(n, ast.Return) or (
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in ("atomic_add", "mma"))):
        return None
    if prog.checked and any(not prog.affine.range_checked(n) for s in stmts
                            for n in ast.walk(s) if is_access(n, k)):
        return None
    items = _split(prog, Uniformity(prog, phase.uniform), stmts, ())
    if not any(isinstance(i, VLoop) for i in items):
        return None
    segs = segments(items)
    if not _stores_confined(prog, segs):
        return None
    values = prog.affine.def_values
    order = list(before) + [s.targets[0].id for s in stmts  # type: ignore[attr-defined]
                            if isinstance(s, ast.Assign) and len(s.targets) == 1
                            and isinstance(s.targets[0], ast.Name)
                            and values.get(s.targets[0].id) is s.value]
    avail = set(before)
    users: dict[str, list[Segment]] = {}
    for seg in segs:
        used = (names(seg.stmts) & k.locals) - set(k.shared) - set(seg.loop_vars)
        seg.remat = remat(prog, used - assigned(seg.stmts), avail, order)
        for n in used - set(seg.remat):
            users.setdefault(n, []).append(seg)
        if not seg.loop_vars:
            avail |= {n for s in seg.stmts if isinstance(s, ast.Assign)
                      for n in assigned([s]) if n in order}
    stored = assigned(stmts)
    wide = set()
    for n, where in users.items():
        if n in stored and (len(where) > 1 or where[0].loop_vars):
            if not (phase.in_loop or prog.kinds.exact_float(n)):
                # nothing is marked: which locals were seen first depends on the set's
                # order, and generated source (a cache key) must not depend on the hash seed
                return None
            wide.add(n)
    prog.vector_locals |= wide
    return items


def _stores_confined(prog: Program, segs: list[Segment]) -> bool:
    """Whether every buffer the phase stores into is accessed in one segment that is
    outside the interchanged loops (then its accesses happen in the old order). The
    ``dynamic_shared`` arrays are one buffer: they alias."""
    k = prog.kernel
    where: dict[str, set[int]] = {}
    stored: set[str] = set()
    for i, seg in enumerate(segs):
        for s in seg.stmts:
            for n in ast.walk(s):
                if is_access(n, k):
                    name = access_name(n)
                    if k.shared.get(name, (None,))[0] == DYNAMIC_SHAPE:
                        name = "dynamic_shared()"
                    where.setdefault(name, set()).add(i)
                    if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store):
                        stored.add(name)
    return all(len(where[b]) == 1 and not segs[next(iter(where[b]))].loop_vars
               for b in stored)


def _jam_all(items: list[Segment | VLoop], origins: Origins) -> None:
    for it in items:
        if isinstance(it, VLoop):
            it.jam = _jammed(it, origins)
            _jam_all(it.items, origins)


def _jammed(it: VLoop, origins: Origins) -> Segment | None:
    """The segment running ``JAM`` iterations of an interchanged loop whose body is one
    small thread loop and whose step is a constant: the body once per iteration, the loop
    variable ``v`` read as ``v + m * step``. Each thread still runs its iterations in
    order (the same arithmetic, bit for bit); what changes is that its per-thread locals
    (``gemm``'s accumulator) are loaded and stored once per ``JAM`` iterations instead of
    every one (docs/kernels.md, "Vectorised phases")."""
    s = it.loop
    if len(it.items) != 1 or not isinstance(it.items[0], Segment):
        return None
    if len(s.iter.args) == 3 and not const_int(s.iter.args[2]):  # type: ignore[attr-defined]
        return None  # a step that is not a constant (or is 0: range raises)
    seg = it.items[0]
    if node_count(seg.stmts) > JAM_NODES:
        return None
    step = const_int(s.iter.args[2]) if len(s.iter.args) == 3 else 1  # type: ignore[attr-defined]
    var = s.target.id  # type: ignore[attr-defined]
    stmts: list[ast.stmt] = []
    for m in range(JAM):
        for st in seg.stmts:
            dup = origins.copy(st)
            stmts.append(Shift(var, m * step).visit(dup) if m else dup)  # type: ignore[arg-type]
    return Segment(stmts, seg.loop_vars, seg.remat)
