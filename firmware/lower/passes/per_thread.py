"""Pass 6: per-thread arrays for the locals that live across phases.

Locals that must survive from one phase to another (or from one iteration of a
block-level loop to the next), that block-level code reads, or that a vectorised phase
keeps across its thread loops become per-thread arrays, allocated once per launch: float64
unless every value ever assigned to the local is an integer/bool (then int64), a
conservative static guess, since the phase functions are typed by numba only after the
arrays are declared.

Reads: Program.phases, .skeleton, .uniform_vars, .vector_locals, .kinds. Writes:
Program.per_thread (name -> 'int' | 'float', in the order of the arrays)."""

from __future__ import annotations

from firmware.lower.analysis.liveness import live_across_phases
from firmware.lower.program import Program


def run(prog: Program) -> None:
    assert prog.kinds is not None
    prog.per_thread = {n: prog.kinds.local(n) for n in sorted(live_across_phases(prog))}
