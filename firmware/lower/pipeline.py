"""The lowering pipeline: a validated kernel -> its program, through the passes in
order, -> the module text (render.py). docs/compiler.md describes each pass: what it
reads, what it writes, and how to add one."""

from __future__ import annotations

from typing import Callable

from firmware.kernel_check import Kernel
from firmware.lower.abi import Options
from firmware.lower.passes import affine, if_convert, per_thread, split_phases, variants, \
    vectorise
from firmware.lower.program import Program
from firmware.lower.render import Renderer

#: The passes in the order they run; each reads what the earlier ones wrote to the
#: Program (docs/compiler.md).
PASSES: tuple[Callable[[Program], None], ...] = (
    split_phases.run,
    affine.run,
    if_convert.run,
    vectorise.run,
    variants.run,
    per_thread.run,
)


def lower_program(k: Kernel, options: Options) -> str:
    """Run every pass over one validated kernel, then render it."""
    prog = Program.of(k, options)
    for run in PASSES:
        run(prog)
    return Renderer(prog).module()
