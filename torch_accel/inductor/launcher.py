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
from torch_accel.kernels import matmul
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
#: threads per block of the matrix unit's ``mm`` kernel, as the eager product launches it
#: (torch_accel/kernels/matmul.py: one ``TILE`` x ``TILE`` tile of the output per block)
PRODUCT_THREADS = 128
#: the products' launch plans, per kind of call (dtype, shapes, strides, alpha, beta), or
#: None for a call the plan does not take (the eager operator runs it)
_products: dict[Hashable, runtime.LaunchPlan | None] = {}


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


def _stored(t: torch.Tensor) -> tuple[tuple[int, int], bool] | None:
    """A 2-D operand's ``[rows, columns]`` as stored and whether that is its transpose
    (mma's ``ta``/``tb``), or None unless it is dense one way or the other."""
    rows, cols = t.shape
    if t.is_contiguous():
        return (rows, cols), False
    if t.t().is_contiguous():
        return (cols, rows), True
    return None


def _product_plan(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor, alpha: float, beta: float
                  ) -> runtime.LaunchPlan | None:
    """The eager product's ``mm`` kernel launch checked once for this kind of call, or
    None where the eager operator has more to do (another dtype or device, an empty
    product, a layout or bias it copies first, an ``out`` it must not write directly)."""
    dtype = out.dtype
    if dtype not in (torch.float32, torch.float64) or a.dim() != 2 or b.dim() != 2 \
            or {a.dtype, b.dtype} != {dtype} or not a.device == b.device == out.device:
        return None
    (m, k), n = a.shape, b.shape[1]
    if not (m and n and k) or tuple(out.shape) != (m, n) or not out.is_contiguous():
        return None
    has_bias = bias is not None and beta != 0
    if has_bias and (bias.dtype != dtype or bias.numel() != n or not bias.is_contiguous()
                     or bias.device != out.device):
        return None
    va, vb = _stored(a), _stored(b)
    if va is None or vb is None:
        return None
    device, np_dtype = out.device.index, BUFFER_DTYPES[dtype]
    views = [block_of(t)[0].view(np_dtype, shape, block_of(t)[1])
             for t, shape in ((out, (m, n)), (a, va[0]), (b, vb[0]),
                              (bias if has_bias else out, (n,)))]
    kernel = shared.module("matmul", matmul.SOURCE, device).mm
    grid = (-(-n // matmul.TILE), -(-m // matmul.TILE))
    return kernel.plan(grid, PRODUCT_THREADS, [
        *views[:3], np.float64(beta if has_bias else 0.0), np.float64(alpha),
        np.int64(va[1]), np.int64(vb[1]), np.int64(k), views[3], np.int64(has_bias)])


def product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
            out: torch.Tensor, alpha: float = 1, beta: float = 1) -> None:
    """``out = beta * bias + alpha * a @ b`` (``a @ b`` without a bias), the products of a
    compiled graph (torch_accel/inductor/matmul.py lowers ``mm`` and ``addmm`` to it): the
    matrix unit's kernel, as the eager ``mm``/``addmm`` launch it, through a launch plan
    checked once per kind of call, as ``Generated`` launches its kernels. Through torch's
    dispatch to the eager operator a product cost ~100 us of host time, planned ~10 us
    (measured side by side, docs/torch.md "Where a compiled MLP training step's time
    goes"). What the plan does not take runs as the eager operator."""
    key = (out.device.index, out.dtype, a.dtype, b.dtype, tuple(a.shape), a.stride(),
           tuple(b.shape), b.stride(), tuple(out.shape), out.stride(),
           None if bias is None else (bias.dtype, tuple(bias.shape), bias.stride()),
           alpha, beta)
    if key not in _products:
        if len(_products) >= MAX_PLANS:
            _products.clear()
        _products[key] = _product_plan(a, b, bias, out, alpha, beta)
    plan = _products[key]
    has_bias = bias is not None and beta != 0
    operands = (a, b, bias) if has_bias else (a, b)
    written = out.untyped_storage().data_ptr()
    if plan is None or any(t.untyped_storage().data_ptr() == written for t in operands):
        if bias is None:  # an alpha comes only with a bias (matmul.py)
            torch.mm(a, b, out=out)
        else:
            torch.addmm(bias, a, b, alpha=alpha, beta=beta, out=out)
        return
    plan([block_of(t) for t in (out, a, b, bias if has_bias else out)],
         runtime.current_stream(out.device.index))
