"""Pass 2: affine range checks. For each phase, in order, the accesses whose every index
is affine in a thread index (``global_id(d)``/``local_id(d)`` plus/minus int constants,
never-assigned int scalar parameters, uniform products such as ``group_id(1) * 16``,
variables of uniform loops, directly or through a local assigned once) and the
block-level conditions under which all of them are in range. A block that passes runs a
range-checked variant without per-access checks (checked saxpy: ~6.6-7 ms instead of ~18:
a check that can stop the thread is an early exit LLVM will not vectorise); one that
fails runs the checked per-thread loop, which faults exactly as before.

Reads: Program.phases. Writes: Program.kinds, Program.affine (analysis/affine.py: the
range-checked accesses and their boxes, per-statement conditions, the affine locals)."""

from __future__ import annotations

from firmware.lower.analysis.affine import AffineAnalysis
from firmware.lower.analysis.kinds import Kinds
from firmware.lower.program import Program


def run(prog: Program) -> None:
    prog.kinds = Kinds(prog.kernel)
    prog.affine = AffineAnalysis(prog)
    for phase in prog.phases:
        if not phase.collective:
            prog.affine.run(phase)
