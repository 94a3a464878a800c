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

import ctypes
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

import runtime
from torch_accel import _C, _hooks
from torch_accel.ops._tensors import block_of

#: plans one device keeps; past this the table starts again (a program cycles through a
#: few hundred kinds of calls at most; a key that keeps changing must not grow it)
MAX_PLANS = 1024
#: where a plan's buffer comes from: the call's new result (else an operand's index;
#: ``RESULT - k`` is the k-th of a plan's ``more`` results)
RESULT = -1
#: the table's name among the runtime ``Device``'s parts
_PART = ("torch_accel", "plans")
#: a key's first call: no plan made yet (None is "this kind of call has none")
_UNSEEN = object()
#: bumped whenever a device's table goes (a reset, a lost context): the shim's C++ kernels
#: of add, sub, mul and div keep copies of plans and read this word at its address, without
#: the interpreter's lock, to know their copies stale (csrc/shim.cpp, "hot arithmetic")
epoch = ctypes.c_uint64(0)


class _Table(dict):
    """One device's plans by key: a part of the runtime ``Device``, closed with its other
    parts when the device is reset or its context lost."""

    def close(self) -> None:
        self.clear()
        epoch.value += 1


class Plan:
    """A kind of call, planned: its launch and where each of its buffers comes from."""

    __slots__ = ("launch", "shape", "dtype", "like", "more", "sources", "pick")

    def __init__(self, launch: runtime.LaunchPlan, shape: torch.Size, dtype: torch.dtype,
                 sources: Sequence[int], like: bool = False,
                 more: Sequence[tuple[tuple[int, ...], torch.dtype]] = ()) -> None:
        """``sources``: per buffer parameter of the kernel, RESULT or the index of the
        operand it reads. ``shape`` and ``dtype``: a new result's (a call with an ``out``
        given allocates nothing). ``like``: a new result is
        ``torch.empty_like(operands[0])``: that operand has the result's shape and dtype,
        laid out with the standard contiguous strides (:func:`like`), which empty_like
        keeps; the shim makes it without the dispatcher (``_C._empty_like``), where
        ``torch.empty(shape, dtype=, device=)`` parses its arguments and dispatches.
        ``more``: (shape, dtype) of each further new result (``nll_loss_forward``'s total
        weight), contiguous; the call then returns the results as a tuple."""
        self.launch, self.shape, self.dtype, self.like = launch, shape, dtype, like
        self.more = tuple(more)
        self.sources = tuple(sources)
        #: the buffers from ``(*reversed(more results), result, *operands)``, in one C
        #: call (a comprehension is a frame of its own)
        places = [src + 1 + len(self.more) for src in sources]
        self.pick: Callable[[tuple[torch.Tensor, ...]], Sequence[torch.Tensor]] = \
            operator.itemgetter(*places) if len(places) > 1 else \
            (lambda tensors: (tensors[places[0]],))


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
    return runtime.devices.get(device).part(_PART, _Table)


def lookup(device: int, key: Hashable, make: Callable[..., Plan | None],
           make_args: tuple[Any, ...]) -> Plan | None:
    """The plan of ``key`` on accel device ``device``, made by ``make(*make_args)`` on the
    key's first call; None if that kind of call has none."""
    if _hooks._init_pid != _hooks._pid:
        _hooks.lazy_init()  # a child forked after initialisation: torch's fork error
    plans = runtime.devices.get(device).part(_PART, _Table)
    plan = plans.get(key, _UNSEEN)
    if plan is _UNSEEN:
        plan = make(*make_args)
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = plan
    return plan


def call(device: int, key: Hashable, make: Callable[..., Plan | None],
         make_args: tuple[Any, ...], operands: tuple[Any, ...],
         out: torch.Tensor | None = None) -> Any:
    """Run the plan of ``key`` on accel device ``device`` (made by ``make(*make_args)`` on
    the key's first call) on ``operands``, on the device's current stream, into ``out`` or
    a new result, which is on ``operands[0]``'s device; return the result (a tuple with
    the plan's ``more`` results), or None if that kind of call has no plan. This is every
    planned operator's host path but the shim's add, sub, mul and div (docs/torch.md,
    "Where an eager op's time goes")."""
    plan = lookup(device, key, make, make_args)
    if plan is None:
        return None
    if out is None:
        out = _C._empty_like(operands[0]) if plan.like else \
            torch.empty(plan.shape, dtype=plan.dtype, device=operands[0].device)
    if plan.more:
        more = [torch.empty(shape, dtype=dtype, device=out.device) for shape, dtype in plan.more]
        tensors = plan.pick((*reversed(more), out, *operands))
        plan.launch(_C._buffers(tensors) or [block_of(t) for t in tensors])
        return (out, *more)
    tensors = plan.pick((out, *operands))
    plan.launch(_C._buffers(tensors) or [block_of(t) for t in tensors])
    return out


def planned(make: Callable[..., Plan | None], key: tuple[Any, ...],
            tensors: tuple[torch.Tensor, ...], make_args: tuple[Any, ...]) -> Any:
    """:func:`call` on ``tensors``, the kernel's operands, keyed on ``(make, *key)`` and
    their signature (``_C._signature``: devices, dtypes, sizes, strides); ``key`` is the
    call's other arguments. None when the call has no plan, or a tensor is a subclass or
    off the device."""
    sig = _C._signature(*tensors)
    device = tensors[0].get_device()
    if sig is None or device < 0:
        return None
    return call(device, (make, *key, sig), make, make_args, tensors)
