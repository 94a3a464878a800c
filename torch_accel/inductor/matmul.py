"""Matrix products in a compiled graph on accel: the matrix unit's kernel called from the
wrapper through a launch plan (``launcher.product``), its operands in the layouts the unit
reads in place, copied by a generated kernel otherwise, and ``addmm``'s bias inside the
product where the kernel takes it.

Inductor calls products as extern kernels, by default the eager operators
(torch_accel/ops/linalg.py) through torch's dispatch, ~100 us of host time a product here;
``launcher.product`` launches the same kernel through a plan checked once (~10 us) and
falls back to the eager operator for what the plan does not take. The unit reads a
row-major operand and one stored transposed (``w.t()``, every backward's operands) in
place: mma's ``ta``/``tb`` (docs/kernels.md "The matrix unit"). The eager operators copy
any other layout with ``strided_copy``, a looping kernel and so a firmware engine launch
(~0.2-1 ms on two CPUs, docs/torch.md "Where a compiled MLP training step's time goes").
Here, lowered on accel:

* an operand of ``mm``/``addmm``/``bmm`` whose stored layout is row- or column-major in
  its last two dimensions (a graph input, a transposed view of one, a slice of one at an
  offset) is passed as it lies; a value the graph computes is written row-major by its
  producer and read as it lies, transposed or not; anything else (an expanded operand,
  strided columns, a column slice) is made contiguous by a generated copy, which has no
  loop and so runs inline on the firmware's scheduler (``firmware/kernel_check.py``,
  ``bounded_work``) rather than as an engine's ``strided_copy``;
* ``addmm`` with a bias of one row (``nn.Linear``'s) or ``beta=0`` is one launch, whose
  kernel fills the output with the bias before the product. Another bias (a full matrix,
  a column) would be a broadcast ``strided_copy`` in the eager ``addmm``, so it is ``mm``
  followed by ``beta * bias + alpha * product`` as loops, which fuse with what follows.

``bmm`` keeps Inductor's lowering (the eager ``bmm``) with operands as above; other devices
keep Inductor's own lowerings.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def _dense(size: Sequence[sympy.Expr], stride: Sequence[sympy.Expr]) -> bool:
    """Whether ``size``/``stride`` are row-major with no gaps, as ``Tensor.is_contiguous``
    judges it (a dimension of size 1 may have any stride): what the eager product reads as
    ``view_of(t)`` from the first element."""
    known = V.graph.sizevars.statically_known_equals
    expected: sympy.Expr = sympy.S.One
    for n, s in reversed(list(zip(size, stride))):
        if not known(n, 1) and not known(s, expected):
            return False
        expected = expected * n
    return True


def _read_in_place(size: Sequence[sympy.Expr], stride: Sequence[sympy.Expr]) -> bool:
    """Whether the unit reads an operand of this layout without a copy: row-major, or
    row-major once its last two dimensions are swapped (then mma's ``ta``/``tb``)."""
    swapped = [*size[:-2], size[-1], size[-2]], [*stride[:-2], stride[-1], stride[-2]]
    return _dense(size, stride) or _dense(*swapped)


def _operand(node: Any) -> Any:
    """``node`` as the unit's operand: realized, and as it is stored when the unit reads
    that layout in place (a computed value not yet stored is frozen row-major, so its
    producer writes it as read); else a contiguous copy (a generated kernel)."""
    node = ir.ExternKernel.realize_input(node)
    layout = node.maybe_get_layout()
    if layout is not None and not isinstance(layout, ir.FlexibleLayout) \
            and _read_in_place(layout.size, layout.stride):
        return node
    return ir.ExternKernel.require_contiguous(node)


def _product(mat1: Any, mat2: Any, bias: Any = None, alpha: Any = 1, beta: Any = 1) -> Any:
    """``beta * bias + alpha * mat1 @ mat2`` (``mat1 @ mat2`` without a bias) as a call of
    ``launcher.product`` (the wrapper imports it as ``accel_product``): the eager
    products' kernel through a launch plan, not torch's dispatch."""
    mat1, mat2 = _operand(mat1), _operand(mat2)
    inputs = [mat1, mat2]
    if bias is not None:
        inputs.append(ir.ExternKernel.realize_input(bias))
    layout = ir.FixedLayout(mat1.get_device(), mat1.get_dtype(),
                            [mat1.get_size()[0], mat2.get_size()[1]])
    kwargs = {} if bias is None else {"alpha": alpha, "beta": beta}
    return ir.TensorBox.create(ir.ExternKernelOut(layout, inputs, kwargs=kwargs,
                                                  python_kernel_name="accel_product"))


def _row_bias(inp: Any, n: sympy.Expr) -> bool:
    """Whether ``addmm``'s bias is one row of the output's width (``[n]`` or ``[1, n]``),
    which the eager kernel broadcasts itself."""
    size = inp.get_size()
    known = V.graph.sizevars.statically_known_equals
    return len(size) in (1, 2) and known(size[-1], n) \
        and (len(size) == 1 or known(size[0], 1))


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
        if args or kwargs or not _on_accel(mat1, mat2):
            return mm_lowering(mat1, mat2, *args, **kwargs)
        return _product(mat1, mat2)

    def bmm(mat1: Any, mat2: Any, *args: Any, **kwargs: Any) -> Any:
        if _on_accel(mat1, mat2):
            mat1, mat2 = _operand(mat1), _operand(mat2)
        return bmm_lowering(mat1, mat2, *args, **kwargs)

    def addmm(inp: Any, mat1: Any, mat2: Any, *, alpha: Any = 1, beta: Any = 1,
              layout: Any = None) -> Any:
        if layout is not None or not _on_accel(inp, mat1, mat2):
            return addmm_lowering(inp, mat1, mat2, alpha=alpha, beta=beta, layout=layout)
        if beta == 0 or _row_bias(inp, mat2.get_size()[1]):
            # the kernel fills the rows with the bias (beta 0 ignores it, NaN included,
            # as torch does)
            bias = ir.ExternKernel.require_contiguous(inp) if beta != 0 else inp
            return _product(mat1, mat2, bias, alpha, beta)
        product = mm(mat1, mat2)
        if alpha != 1:
            product = mul(product, alpha)
        return add(product, inp if beta == 1 else mul(inp, beta))

    for op, fn in ((aten.mm.default, mm), (aten.bmm.default, bmm),
                   (aten.addmm.default, addmm)):
        fn._accel_matmul = True  # type: ignore[attr-defined]
        lowerings[op] = fn
