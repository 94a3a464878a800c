"""Every operator without a device kernel runs on the CPU: counted, and warned about on
request (``TORCH_ACCEL_FALLBACK_WARN=1``, or ``torch_accel.ops.fallback.WARN = True``).

The fallback moves the accel tensors among the arguments to the host, runs the CPU
kernel, and puts back what the operator wrote: every argument the schema marks as written
(``Tensor(a!)``, ``Tensor(a!)?``, ``Tensor(a!)[]``: in-place, ``out=`` and running-stat
arguments) gets the new values copied into it, so aliasing holds; fresh results move to
the device of the first accel argument. It is correct and slow: ``fallback_counts`` shows
which operators a program should not leave to it.

Two kinds of operator must not take that road (:func:`rule` tells them apart):

* a view (a result aliasing an argument without writing it, ``Tensor(a) self ->
  Tensor(a)``) made on the host would be a copy, so writes through it would be lost. Its
  geometry (sizes, strides, offset, dtype) is computed by torch's Meta kernel instead, and
  the result is that geometry over the argument's own device storage;
* a factory (``device="accel"`` and no accel tensor) would dispatch back here forever if
  run as given: it runs with ``device="cpu"`` and its result moves to the device asked for.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_leaves, tree_map

from torch_accel.ops._operands import common_device

WARN = os.environ.get("TORCH_ACCEL_FALLBACK_WARN", "") not in ("", "0")
#: operator name -> calls that ran on the CPU, this process
fallback_counts: Counter[str] = Counter()

#: arguments the CPU kernel writes although the schema does not mark them: torch's own
#: decompositions route native_batch_norm to _native_batch_norm_legit for this reason
UNDECLARED_WRITES: dict[str, tuple[str, ...]] = {
    "aten::native_batch_norm": ("running_mean", "running_var"),
    "aten::native_batch_norm.out": ("running_mean", "running_var"),
}

Rule = Literal["view", "writes", "compute"]

lib = torch.library.Library("_", "IMPL")


def _is_accel(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "accel"


def _overload_name(schema: torch._C.FunctionSchema) -> str:
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def written_arguments(schema: torch._C.FunctionSchema) -> list[str]:
    """The arguments whose values the operator changes, whatever their type (a tensor, an
    optional tensor, a list of tensors)."""
    undeclared = UNDECLARED_WRITES.get(_overload_name(schema), ())
    return [a.name for a in schema.arguments
            if (a.alias_info is not None and a.alias_info.is_write) or a.name in undeclared]


def rule(schema: torch._C.FunctionSchema) -> Rule:
    """How the fallback runs an operator: ``view`` (a result aliases an argument it does
    not write), ``writes`` (copies back its written arguments), ``compute`` (fresh results
    only)."""
    if written_arguments(schema):
        return "writes"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    return "compute"


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """``t``'s geometry over a Meta storage of the same size: what a view's Meta kernel
    needs to compute the view's strides and offset."""
    elements = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(elements, dtype=t.dtype, device="meta").as_strided(
        t.size(), t.stride(), t.storage_offset())


def _by_name(schema: torch._C.FunctionSchema, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**dict(zip((a.name for a in schema.arguments), args)), **kwargs}


def _view(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # the argument the schema says the results alias (``Tensor(a) self``)
    aliased = next(a.name for a in op._schema.arguments if a.alias_info is not None)
    base = _by_name(op._schema, args, kwargs)[aliased]
    meta_args, meta_kwargs = tree_map(lambda x: _meta_like(x) if _is_accel(x) else x, (args, kwargs))

    def over_base(r: object) -> object:
        if not isinstance(r, torch.Tensor):
            return r
        view = torch.empty(0, dtype=r.dtype, device=base.device)
        return view.set_(base.untyped_storage(), r.storage_offset(), r.size(), r.stride())

    return tree_map(over_base, op(*meta_args, **meta_kwargs))


def _advanced_indices(arg: torch._C.Argument) -> bool:
    # ``Tensor?[] indices`` of index, index_put_, ...: torch.cuda takes CPU indices there
    return str(arg.type) == "List[Optional[Tensor]]"


def check_same_device(schema: torch._C.FunctionSchema, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
    """Refuse tensors on two devices as the native operators do (ops/_operands.py), in
    torch's words, before anything moves: on the host they would all be CPU tensors and
    the CPU kernel would run (``torch.cat([on_accel0, on_accel1])`` returned a tensor). A
    0-d CPU tensor is a number, as in torch."""
    by_name = _by_name(schema, args, kwargs)
    common_device(t for arg in schema.arguments if not _advanced_indices(arg)
                  for t in tree_leaves(by_name.get(arg.name)))


def cpu_fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    name = str(op.name()) if callable(getattr(op, "name", None)) else str(op)
    fallback_counts[name] += 1
    if WARN:
        warnings.warn(f"accel: {name} has no device kernel and ran on the CPU", stacklevel=2)
    schema = op._schema
    if rule(schema) == "view":
        return _view(op, args, kwargs)
    check_same_device(schema, args, kwargs)
    devices = [t.device for t in tree_leaves((args, kwargs)) if _is_accel(t)]
    asked = [d for d in tree_leaves((args, kwargs))
             if isinstance(d, torch.device) and d.type == "accel"]
    device = (devices or asked or [torch.device("accel")])[0]
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def to_cpu(x: object) -> object:
        if isinstance(x, torch.device) and x.type == "accel":
            return torch.device("cpu")  # a factory: made on the host, moved below
        if not _is_accel(x):
            return x
        if id(x) not in moved:
            moved[id(x)] = (x, x.cpu())
        return moved[id(x)][1]

    cpu_args, cpu_kwargs = tree_map(to_cpu, (args, kwargs))
    out = op(*cpu_args, **cpu_kwargs)
    written: dict[int, torch.Tensor] = {}  # cpu tensor id -> the accel tensor it stands for
    flat = _by_name(schema, args, kwargs)
    for arg_name in written_arguments(schema):
        for t in tree_leaves(flat.get(arg_name)):
            if _is_accel(t):
                orig, cpu = moved[id(t)]
                if orig.shape != cpu.shape:  # an out= argument the operator resized
                    orig.resize_(cpu.shape)
                orig.copy_(cpu)
                written[id(cpu)] = orig

    def back(x: object) -> object:
        if isinstance(x, torch.Tensor):
            w = written.get(id(x))
            return w if w is not None else x.to(device)
        return x

    return tree_map(back, out)


lib.fallback(cpu_fallback, "PrivateUse1")
