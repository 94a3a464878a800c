"""Which of Inductor's lowerings the accel code generator can write, and eager operators for
the rest.

Inductor decides at *lowering* time whether an aten operator becomes loops (a ``Pointwise``
or ``Reduction`` of its IR) or a call of the eager operator; it writes the loops'
operations (``ops.acos``, ``ops.erf``, ...) only later, at *code generation*. The kernel
language has few math built-ins (``sqrt exp log sin cos tanh abs floor``): an operation
``AccelOverrides`` cannot write (``acos``, ``erf``, ``lgamma``, the Bessel functions, ...)
raised ``NotImplementedError`` at code generation and failed the whole compile. Inductor
has no per-device switch for this (its Triton and C++ back ends write every operation), so
``install`` wraps the lowerings: when one produces loops on an accel device that use an
operation the code generator cannot write (``used_ops`` of Inductor's op count), or a
reduction it has no loop for, the aten operator is called instead, as Inductor's own
fallbacks are (``fallback_handler``, not added to its global set: other devices keep their
lowering). Loops read the unrealized loops of their inputs inline, but those were checked
when they were lowered, so only this operator's own operations can fail the check.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._inductor import ir
from torch._inductor.codegen.common import OpOverrides
from torch._inductor.ops_handler import DefaultHandler, OpsHandler
from torch._inductor.virtualized import V

from torch_accel.inductor.codegen import AccelKernel, AccelOverrides

DEVICE_TYPE = "accel"


class _Recorder(DefaultHandler):
    """An ops handler that only records the names of the operations called."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def _default(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.names.add(name)
        return "v"


@functools.cache
def can_write(name: str) -> bool:
    """Whether ``AccelOverrides`` writes the operation ``name``: defined by accel (or by
    Inductor's shared overrides) and not the handler protocol's ``NotImplementedError``;
    an inherited decomposition (``erfc`` as ``1 - erf``) only if every operation it calls
    can be written."""
    owner = next((cls for cls in AccelOverrides.__mro__ if name in vars(cls)), None)
    if owner is None or owner in (OpsHandler, DefaultHandler, object):
        return False
    if owner is AccelOverrides or owner is OpOverrides:
        return True
    recorder = _Recorder()
    method = getattr(AccelOverrides, name)
    try:
        with V.set_ops_handler(recorder):
            method(*["x"] * (method.__code__.co_argcount))
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 - a decomposition the probe's strings cannot run
        return True
    return all(can_write(n) for n in recorder.names - {name})


def _writable(node: Any) -> bool:
    """Whether a lowering's result can be generated on accel: anything not loops on an
    accel device, or loops whose operations (and reduction) the code generator writes."""
    if not isinstance(node, ir.TensorBox):
        return True
    data = node.data.data if isinstance(node.data, ir.StorageBox) else node.data
    if not isinstance(data, ir.Loops):
        return True
    device = data.get_device()
    if device is None or device.type != DEVICE_TYPE:
        return True
    if isinstance(data, ir.Reduction) and data.reduction_type not in AccelKernel.REDUCTIONS:
        return False
    return all(can_write(n) for n in data.inner_fn_opcount().used_ops)


def _guarded(op: torch._ops.OpOverload, lowering: Any) -> Any:
    fallback = None

    @functools.wraps(lowering)
    def lower(*args: Any, **kwargs: Any) -> Any:
        nonlocal fallback
        result = lowering(*args, **kwargs)
        outputs = result if isinstance(result, (list, tuple)) else [result]
        if all(_writable(o) for o in outputs):
            return result
        if fallback is None:
            from torch._inductor.lowering import fallback_handler
            fallback = fallback_handler(op, add_to_fallback_set=False)
        return fallback(*args, **kwargs)

    lower._accel_guarded = True  # type: ignore[attr-defined]
    return lower


def install() -> None:
    """Wrap every aten and prims lowering Inductor has (once)."""
    from torch._inductor.lowering import lowerings

    for op, lowering in list(lowerings.items()):
        if isinstance(op, torch._ops.OpOverload) and not getattr(lowering, "_accel_guarded",
                                                                 False) \
                and not getattr(lowering, "_is_fallback_handler", False):
            lowerings[op] = _guarded(op, lowering)
