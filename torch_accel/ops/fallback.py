"""Every operator without a device kernel runs on the CPU: counted, and warned about on
request (``TORCH_ACCEL_FALLBACK_WARN=1``, or ``torch_accel.ops.fallback.WARN = True``).

The fallback moves the accel tensors among the arguments to the host, runs the CPU
kernel, and puts back what the operator wrote: arguments the schema marks as written
(in-place and ``out=`` operators) get the new values copied into them, so aliasing holds;
fresh results move to the device of the first accel argument. It is correct and slow:
``fallback_counts`` shows which operators a program should not leave to it.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from typing import Any

import torch
from torch.utils._pytree import tree_map

WARN = os.environ.get("TORCH_ACCEL_FALLBACK_WARN", "") not in ("", "0")
#: operator name -> calls that ran on the CPU, this process
fallback_counts: Counter[str] = Counter()

lib = torch.library.Library("_", "IMPL")

#: arguments an operator writes although its schema does not mark them ``(a!)``: the
#: CPU's ``native_batch_norm`` updates the running statistics in place (torch keeps that
#: schema unannotated for its own backends), so without this a BatchNorm's
#: ``running_mean``/``running_var`` on accel never moved
UNMARKED_WRITES: dict[str, tuple[str, ...]] = {
    "aten::native_batch_norm": ("running_mean", "running_var"),
}


def _is_accel(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "accel"


def cpu_fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    name = str(op.name()) if callable(getattr(op, "name", None)) else str(op)
    fallback_counts[name] += 1
    if WARN:
        warnings.warn(f"accel: {name} has no device kernel and ran on the CPU", stacklevel=2)
    devices = [t.device for t in torch.utils._pytree.tree_leaves((args, kwargs)) if _is_accel(t)]
    device = devices[0] if devices else torch.device("accel")
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def to_cpu(x: object) -> object:
        if not _is_accel(x):
            return x
        if id(x) not in moved:
            moved[id(x)] = (x, x.cpu())
        return moved[id(x)][1]

    cpu_args, cpu_kwargs = tree_map(to_cpu, (args, kwargs))
    out = op(*cpu_args, **cpu_kwargs)
    written: dict[int, torch.Tensor] = {}  # cpu tensor id -> the accel tensor it stands for
    schema = op._schema
    flat = {**dict(zip((a.name for a in schema.arguments), args)), **kwargs}
    unmarked = UNMARKED_WRITES.get(name, ())
    for arg in schema.arguments:
        value = flat.get(arg.name)
        if (arg.alias_info is not None and arg.alias_info.is_write) or arg.name in unmarked:
            for t in (value if isinstance(value, (list, tuple)) else [value]):
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
