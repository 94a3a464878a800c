"""Lowering: one validated kernel + argument types + :class:`Options` -> the text of a
Python module that numba compiles (firmware/jit.py writes, imports and caches it).

A pass pipeline (pipeline.PASSES: split_phases, affine, if_convert, vectorise, variants,
per_thread) over a :class:`~firmware.lower.program.Program`, with analyses as objects
(analysis/), and a renderer (render.py, which also says why the generated code looks the
way it does). docs/compiler.md is the map."""

from __future__ import annotations

from typing import Any

from firmware.kernel_check import Kernel, KernelCompileError, validate
from firmware.lower.abi import (ABORT_KILL, ABORT_PREEMPT, ABORT_WATCHDOG, FAULT_ABORT,
                                FAULT_BOUNDS, FAULT_INDEX, FAULT_NDIM, FAULT_SHAPE,
                                FAULT_WORDS, MAX_BLOCK_THREADS, MAX_DIM, Options)
from firmware.lower.pipeline import lower_program


def lower_kernel(k: Kernel, options: Options) -> str:
    """The text of the generated module for an already validated kernel. Raises only
    :class:`KernelCompileError`: the lowering recurses over the syntax tree, whose depth
    validate() bounds; should Python's limits still be reached, that is the kernel's
    error, not the firmware's."""
    try:
        return lower_program(k, options)
    except (RecursionError, MemoryError) as exc:
        raise KernelCompileError(f"kernel {k.fn.name!r} is too large to lower "
                                 f"({type(exc).__name__})") from None


def lower(ir: dict[str, Any], arg_types: tuple[str, ...], options: Options) -> str:
    """Validate and lower one kernel: the text of the generated module."""
    return lower_kernel(validate(ir, tuple(arg_types)), options)


__all__ = ["ABORT_KILL", "ABORT_PREEMPT", "ABORT_WATCHDOG", "FAULT_ABORT", "FAULT_BOUNDS",
           "FAULT_INDEX", "FAULT_NDIM", "FAULT_SHAPE", "FAULT_WORDS", "MAX_BLOCK_THREADS",
           "MAX_DIM", "Options", "lower", "lower_kernel"]
