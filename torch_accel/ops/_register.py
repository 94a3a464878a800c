"""How an operator module registers its device kernels: ``@implements("add.Tensor", ...)``.

A kernel that meets a case it has no device code for (a dtype the kernels lack, a
``weight=`` argument, ...) raises :class:`Unsupported`; the operator then runs through the
counted CPU fallback instead (fallback.py), so every call is answered and the counts show
what ran where.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from torch_accel.ops.fallback import cpu_fallback

lib = torch.library.Library("aten", "IMPL", "PrivateUse1")
#: "name.overload" -> the device kernel registered for it (tests list what is native)
native: dict[str, Callable[..., Any]] = {}


class Unsupported(Exception):
    """This call has no device kernel: run it on the CPU."""


def overload(qualname: str) -> torch._ops.OpOverload:
    name, _, over = qualname.partition(".")
    return getattr(getattr(torch.ops.aten, name), over or "default")


def implements(*qualnames: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function for each aten ``name.overload`` on accel."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for qualname in qualnames:
            op = overload(qualname)

            @functools.wraps(fn)
            def kernel(*args: Any, _op: torch._ops.OpOverload = op, **kwargs: Any) -> Any:
                try:
                    return fn(*args, **kwargs)
                except Unsupported:
                    return cpu_fallback(_op, *args, **kwargs)

            lib.impl(qualname, kernel)
            native[qualname] = fn
        return fn
    return register
