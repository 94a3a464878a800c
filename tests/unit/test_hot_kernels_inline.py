"""The torch backend's hot elementwise kernels stay small enough for the firmware to run a
launch of them inline on its scheduler (firmware/kernel_check.py ``bounded_work``): a
launch handed to an engine instead cost a 4 Ki ``a + b`` ~175 us of device time against
~25 us inline (docs/torch.md, "Where an eager op's time goes"). A new op added to one of
them that takes it past the bound fails here, not as a slowdown nobody sees."""

from __future__ import annotations

import pytest

from firmware import jit, kernel_check, launches
from runtime.kernels import compile_module
from torch_accel.kernels import elementwise, nn

pytestmark = pytest.mark.timeout(60)

#: kernel -> its module's source and the argument types of a float32 (or int64) launch
HOT = {
    "arith_f": (elementwise.SOURCE, ("float32[1d]",) * 3
                + ("float64", "int64", "float64", "int64", "int64", "int64")),
    "arith_i": (elementwise.SOURCE, ("int64[1d]",) * 3 + ("int64",) * 6),
    "axpy_f": (elementwise.SOURCE, ("float32[1d]",) * 3 + ("float64", "int64")),
    "unary_hot_f": (elementwise.SOURCE, ("float32[1d]",) * 2
                    + ("int64", "float64", "float64", "int64")),
    "activation_backward_hot": (nn.SOURCE, ("float32[1d]",) * 3 + ("int64", "float64", "int64")),
}


@pytest.mark.parametrize("name", sorted(HOT))
def test_hot_elementwise_kernels_are_bounded_work(name: str) -> None:
    source, types = HOT[name]
    ir = compile_module(source)["kernels"][name]
    work = kernel_check.bounded_work(jit.validate(ir, types))
    assert work is not None and work <= kernel_check.INLINE_MAX_NODES, (name, work)


def test_the_full_binary_kernel_is_not_bounded_work() -> None:
    """What the split is for: the full kernel exceeds the bound (else it is not needed)."""
    ir = compile_module(elementwise.SOURCE)["kernels"]["binary_f"]
    assert kernel_check.bounded_work(jit.validate(ir, HOT["arith_f"][1])) is None


def test_an_optimisers_update_of_half_a_million_parameters_is_inline_with_axpy_only() -> None:
    """``axpy_f`` exists for its size: contiguous ``a + alpha * b`` (an optimiser's update)
    of 512 Ki float32 bounds within the firmware's inline budget with it (threads times
    nodes), and not with ``arith_f`` (an engine's hand-off and per-block cost instead)."""
    threads = 512 * 1024
    work = {}
    for name in ("axpy_f", "arith_f"):
        source, types = HOT[name]
        ir = compile_module(source)["kernels"][name]
        work[name] = threads * kernel_check.bounded_work(jit.validate(ir, types))
    assert work["axpy_f"] <= launches.INLINE_WORK < work["arith_f"], work
