"""What generated code and firmware/jit.py agree on: the code-generation options, the
abort word, the fault array's layout and the launch bounds the generated arithmetic relies
on. A change here changes generated code or its reading: bump jit.FIRMWARE_JIT_ABI.

The abort word
--------------
``abort`` is an int64 array of one element, written by other threads:

* ``0`` -- run;
* :data:`ABORT_PREEMPT` (1) -- stop at the next block boundary: the running block finishes
  and ``CompiledKernel.run`` returns the first block not run, so the launch can resume;
* any other nonzero value (:data:`ABORT_WATCHDOG` = 2, :data:`ABORT_KILL` = 3) -- stop as
  soon as possible, also inside a running block's loops. Stopped between blocks, ``run``
  returns the resume block like a preemption; stopped inside a block (not resumable), it
  raises ``KernelFault`` with kind ``"watchdog"`` (value 2) or ``"abort"``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from firmware.kernel_check import MAX_NDIM

#: Values of the abort word (see the module doc).
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


@dataclass(frozen=True)
class Options:
    """Code-generation options; each is part of the cache key (numba's own cache index
    does not key on them)."""

    boundscheck: bool = True
    fastmath: bool = False
    #: the checked variant of ``ACCEL_SANITIZE`` launches (firmware/hazards.py): every
    #: shared-memory access tracked per barrier phase; implies the per-thread checked
    #: phases only (no vectorised, range-checked or inlined variants)
    sanitize: bool = False


def options_key(options: Options) -> dict[str, Any]:
    """The options as the cache key names them: ``sanitize`` only when set, so the keys
    of unchecked kernels (and the vendor library's) are those from before it existed."""
    fields = asdict(options)
    if not options.sanitize:
        del fields["sanitize"]
    return fields
