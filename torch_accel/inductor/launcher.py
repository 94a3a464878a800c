"""What Inductor's generated wrapper calls: one generated kernel, compiled by the runtime
and launched on the current accel stream, as every eager operator's kernel is.

The wrapper (Python, written by Inductor) defines each kernel once, ``k = Generated(name,
source)``, and calls ``k(buf0, arg0_1, ..., ks0, numel)``: the kernel's buffers (torch
tensors on one accel device), its size variables (ints) and last the number of threads
(one per output element or row), or of blocks for a block reduction (``Generated(name,
source, block=n)``: a block of ``n`` threads per output row, codegen.py); the products are
``product(a, b, bias, out=...)`` calls. Nothing here knows Inductor: the source is already
our kernel language (torch_accel/inductor/codegen.py writes it), and the launch is the
runtime's (``runtime.compile``, ``Kernel.plan``), so a compiled model's kernels go through
the same module load, JIT, launch packet, fault and profiler paths as eager ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

import runtime
from torch_accel.kernels import _shared as shared
from torch_accel.ops import linalg
from torch_accel.ops._register import Unsupported
from torch_accel.ops._tensors import NUMPY, block_of

#: threads per block: one thread per element (pointwise) or per output row (reductions)
BLOCK = shared.BLOCK
#: launch plans one kernel keeps (kinds of call: buffer extents, sizes); past it, restart
MAX_PLANS = 64

#: the dtypes of kernel buffers: torch_accel's, and the 16-bit floats as their bits
#: (the generated code converts them: halfbits.py)
BUFFER_DTYPES = {**NUMPY, torch.float16: np.dtype(np.uint16), torch.bfloat16: np.dtype(np.uint16)}

#: generated kernels launched in this process, by kernel name (tests read it)
launches: dict[str, int] = {}


def get_raw_stream(device: int) -> int:
    """The current stream's id on ``device`` (what the wrapper names its stream by; the
    kernels themselves launch on the current stream when they run)."""
    return runtime.current_stream(device).stream_id


def _extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first one to its storage's end: Inductor indexes a buffer from
    its data pointer by its own layout, which may reach past ``t``'s own view (a reused
    buffer, a reinterpreted one); the firmware's bounds checks guard the rest."""
    return (t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()) \
        // t.element_size()


class Generated:
    """One kernel Inductor generated, compiled once per device (``runtime.compile``: the
    front end, then the firmware's JIT on first launch, whose cache keys on the source and
    every compatibility input, not on the name), launched through a checked plan per kind
    of call."""

    def __init__(self, name: str, source: str, block: int | None = None) -> None:
        self.name = name
        self.source = source
        #: threads per block of a block reduction (then ``numel`` counts blocks)
        self.block = block
        #: the module's name in the device's parts: the source's hash, so two graphs that
        #: generate one kernel share its module
        self._key = "inductor/" + hashlib.sha256(source.encode()).hexdigest()[:24]
        self._plans: dict[Hashable, runtime.LaunchPlan] = {}

    def _kernel(self, device: int) -> runtime.Kernel:
        return getattr(shared.module(self._key, self.source, device), self.name)

    def __call__(self, *args: Any) -> None:
        *params, numel = args
        numel = int(numel)
        # a Python number Dynamo made a graph input travels as a 0-d CPU tensor; the
        # kernel takes it as a scalar parameter (codegen.py's ``load``)
        params = [a.item() if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a
                  for a in params]
        tensors = [a for a in params if isinstance(a, torch.Tensor)]
        if numel <= 0 or not tensors:
            return
        device = tensors[0].device.index
        key = (device, numel, *((a.dtype, _extent(a)) if isinstance(a, torch.Tensor)
                                else a for a in params))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(device, numel, params)
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        plan([block_of(t) for t in tensors], runtime.current_stream(device))
        launches[self.name] = launches.get(self.name, 0) + 1

    def _plan(self, device: int, numel: int, params: list[Any]) -> runtime.LaunchPlan:
        """The launch checked once for these extents and sizes."""
        values: list[Any] = []
        for a in params:
            if isinstance(a, torch.Tensor):
                if a.dtype not in BUFFER_DTYPES:
                    raise TypeError(f"{self.name}: no device dtype for {a.dtype}")
                base, offset = block_of(a)
                values.append(base.view(BUFFER_DTYPES[a.dtype], (_extent(a),), offset))
            else:
                values.append(a if isinstance(a, float) else int(a))
        values.append(numel)
        if self.block is not None:
            return self._kernel(device).plan(numel, self.block, values)
        return self._kernel(device).plan(shared.grid(numel, BLOCK), BLOCK, values)


def product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
            out: torch.Tensor, alpha: float = 1, beta: float = 1) -> None:
    """``out = beta * bias + alpha * a @ b`` (``a @ b`` without a bias), the products of a
    compiled graph (torch_accel/inductor/matmul.py lowers ``mm`` and ``addmm`` to it): the
    eager operator's own code called directly, whose launch plan (ops/linalg.py) takes the
    training loop's products; through torch's dispatch a product cost ~100 us of host
    time, planned ~10 us (measured side by side, docs/torch.md "Where a compiled MLP
    training step's time goes"). What the device does not take runs through torch."""
    try:
        if bias is None:  # an alpha comes only with a bias (matmul.py)
            linalg.mm(a, b, out=out)
        else:
            linalg.addmm(bias, a, b, alpha=alpha, beta=beta, out=out)
    except Unsupported:
        if bias is None:
            torch.mm(a, b, out=out)
        else:
            torch.addmm(bias, a, b, alpha=alpha, beta=beta, out=out)
