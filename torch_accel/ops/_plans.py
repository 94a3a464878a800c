"""Launch plans: an eager operator's host work done once per kind of call.

A small operator's device work is a few microseconds, while working out torch's rules for
it (promotion, broadcasting, operands made contiguous, runtime views, the launch's
argument checks) cost ~150 us of host time per call (docs/torch.md, "Where an eager op's
time goes"). A training loop repeats the same few calls: the same operator on tensors of
the same dtypes, shapes, strides and device. So an operator keys each call on exactly
those, and the first call of a key makes a :class:`Plan` (or finds that none applies, and
says so once): the result's shape and dtype and the launch checked once
(``runtime.LaunchPlan``), which a later call of that key runs with only the buffers'
addresses new. Anything not in the key is not in the plan, so a call whose dtype, shape,
stride or device differs is another key.

The table is a part of the runtime's ``Device`` (as the kernels' modules are): a device
reset or a fault recovery drops it with the primary context, and a forked child cannot
reach it (torch's fork error, as for any use of the device there), so no plan outlives
the module its launch names.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

import torch

import runtime
from torch_accel import _C, _hooks
from torch_accel.ops._tensors import block_of

#: plans one device keeps; past this the table starts again (a program cycles through a
#: few hundred kinds of calls at most; a key that keeps changing must not grow it)
MAX_PLANS = 1024
#: where a plan's buffer comes from: the call's new result (else an operand's index)
RESULT = -1


class Plan(NamedTuple):
    """A kind of call, planned: its launch and where each of its buffers comes from."""

    launch: runtime.LaunchPlan
    #: a new result's shape and dtype (a call with an ``out`` given allocates nothing)
    shape: torch.Size
    dtype: torch.dtype
    #: per buffer parameter of the kernel: RESULT, or the index of the operand it reads
    sources: tuple[int, ...]
    #: a new result is ``torch.empty_like(operands[0])``: that operand has the result's
    #: shape and dtype, laid out with the standard contiguous strides (``like``), which
    #: empty_like keeps. torch parses ``torch.empty(shape, dtype=, device=)``'s arguments
    #: ~1 us longer, a twentieth of a small operator's host time.
    like: bool = False


def like(t: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> bool:
    """Whether ``torch.empty_like(t)`` is a new contiguous result of ``shape`` and
    ``dtype`` (a plan's ``like``): ``t`` has them, with the standard contiguous strides
    (a contiguous tensor may have other strides on its dimensions of size 1)."""
    if t.shape != shape or t.dtype != dtype:
        return False
    stride, expected = t.stride(), 1
    for i in range(len(shape) - 1, -1, -1):
        if stride[i] != expected:
            return False
        expected *= shape[i]
    return True


def table(device: int) -> dict[Hashable, Plan | None]:
    """``device``'s plans by key (None: that kind of call has no plan). In a child forked
    after initialisation this raises torch's "Cannot re-initialize" as any use does."""
    _hooks.lazy_init()
    return runtime.devices.get(device).part(("torch_accel", "plans"), dict)


def find(device: int, key: Hashable, make: Callable[[], Plan | None]) -> Plan | None:
    """The plan of ``key`` on ``device``, made by ``make()`` on the key's first call."""
    plans = table(device)
    try:
        return plans[key]
    except KeyError:
        pass
    plan = make()
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


def run(plan: Plan, device: torch.device, operands: tuple[torch.Tensor, ...],
        out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch ``plan`` on ``operands`` (on ``device``'s current stream) into ``out``, or a
    new result; return the result."""
    if out is None:
        out = torch.empty_like(operands[0]) if plan.like else \
            torch.empty(plan.shape, dtype=plan.dtype, device=device)
    tensors = [out if src == RESULT else operands[src] for src in plan.sources]
    buffers = _C._buffers(tensors) or [block_of(t) for t in tensors]
    plan.launch(buffers, runtime.current_stream(device.index))
    return out
