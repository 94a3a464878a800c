"""Matrix products in a compiled graph on accel: the matrix unit's operands made contiguous
by generated kernels, and ``addmm``'s bias as a generated epilogue.

Inductor calls products as extern kernels, the eager operators (torch_accel/ops/linalg.py).
Those make a transposed operand contiguous with ``strided_copy`` and broadcast ``addmm``'s
bias into the output with another, because the unit reads row-major tiles
(torch_accel/kernels/matmul.py). Both kernels loop, so each launch goes to a firmware engine
(~0.2-1 ms a launch on two CPUs, docs/torch.md "An MLP step, second pass"); an MLP's
training step made six of them. Here, lowered on accel:

* each operand of ``mm``/``addmm``/``bmm`` is required contiguous. A transposed view of a
  graph input becomes one generated copy kernel; of a value the graph computes, the copy
  reads that value's loops inline, so the producer writes the layout the unit reads (the
  backward's ``threshold_backward`` writes its gradient transposed for the weight's
  ``mm``). Generated pointwise kernels are loop-free, which the firmware runs inline on
  its scheduler (``firmware/kernel_check.py``, ``bounded_work``);
* ``a @ b`` is computed as ``(b.T @ a.T).T`` when that copies fewer elements: ``x @ W.t()``
  of a wide layer copies ``x`` rather than the weight (784-256, batch 64: 50 k elements
  instead of 200 k), and the transposed product is read in place by a pointwise consumer;
* ``addmm(bias, a, b)`` is ``mm(a, b)`` then ``beta * bias + alpha * product`` as loops,
  which fuse with what follows (``nn.Linear`` then ReLU: one kernel adds the bias and
  applies the ReLU) instead of a broadcast copy before the product.

Other devices keep Inductor's own lowerings.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch._inductor import ir
from torch._inductor.virtualized import V

DEVICE_TYPE = "accel"
aten = torch.ops.aten


def _on_accel(*nodes: Any) -> bool:
    """Whether the product's operands are IR nodes on an accel device."""
    for node in nodes:
        device = node.get_device() if isinstance(node, ir.IRNode) else None
        if device is None or device.type != DEVICE_TYPE:
            return False
    return True


def _contiguous(*nodes: Any) -> list[Any]:
    return [ir.ExternKernel.require_contiguous(n) for n in nodes]


def _copied(node: Any) -> sympy.Expr:
    """The elements ``require_contiguous(node)`` copies: none for loops not yet stored
    (the copy is their producer, writing the layout asked for) or a buffer whose layout is
    still free or already contiguous; else all of them."""
    layout = node.maybe_get_layout()
    if layout is None:
        stored = ir.is_storage_and_layout(node.unwrap_view()) \
            if isinstance(node, ir.TensorBox) and isinstance(node.data, ir.BaseView) else False
        return node.get_numel() if stored else sympy.S.Zero
    if isinstance(layout, ir.FlexibleLayout) or layout.is_contiguous():
        return sympy.S.Zero
    return node.get_numel()


def _transposed(node: Any) -> Any:
    from torch._inductor.lowering import lowerings

    return lowerings[aten.permute.default](node, [1, 0])


def install() -> None:
    """Replace the ``mm``, ``addmm`` and ``bmm`` lowerings by ones that handle accel first
    (once)."""
    from torch._inductor.lowering import lowerings

    if getattr(lowerings[aten.mm.default], "_accel_matmul", False):
        return
    mm_lowering = lowerings[aten.mm.default]
    bmm_lowering = lowerings[aten.bmm.default]
    addmm_lowering = lowerings[aten.addmm.default]
    add, mul = lowerings[aten.add.Tensor], lowerings[aten.mul.Tensor]

    def mm(mat1: Any, mat2: Any, *args: Any, **kwargs: Any) -> Any:
        if not _on_accel(mat1, mat2):
            return mm_lowering(mat1, mat2, *args, **kwargs)
        if not (args or kwargs):
            # a @ b = (b.T @ a.T).T: worth it when that copies fewer elements, counting
            # the transposed product as copied once more (a pointwise consumer reads it
            # in place, anything else needs it contiguous)
            swapped = [_transposed(mat2), _transposed(mat1)]
            product = mat1.get_size()[0] * mat2.get_size()[1]
            if V.graph.sizevars.statically_known_lt(
                    _copied(swapped[0]) + _copied(swapped[1]) + product,
                    _copied(mat1) + _copied(mat2)):
                return _transposed(mm_lowering(*_contiguous(*swapped)))
        return mm_lowering(*_contiguous(mat1, mat2), *args, **kwargs)

    def bmm(mat1: Any, mat2: Any, *args: Any, **kwargs: Any) -> Any:
        if _on_accel(mat1, mat2):
            mat1, mat2 = _contiguous(mat1, mat2)
        return bmm_lowering(mat1, mat2, *args, **kwargs)

    def addmm(inp: Any, mat1: Any, mat2: Any, *, alpha: Any = 1, beta: Any = 1,
              layout: Any = None) -> Any:
        if layout is not None or not _on_accel(inp, mat1, mat2):
            return addmm_lowering(inp, mat1, mat2, alpha=alpha, beta=beta, layout=layout)
        product = mm(mat1, mat2)
        if alpha != 1:
            product = mul(product, alpha)
        if beta == 0:  # torch ignores the bias then, NaN included
            return product
        return add(product, inp if beta == 1 else mul(inp, beta))

    for op, fn in ((aten.mm.default, mm), (aten.bmm.default, bmm),
                   (aten.addmm.default, addmm)):
        fn._accel_matmul = True  # type: ignore[attr-defined]
        lowerings[op] = fn
