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

from torch_accel import _C
from torch_accel.ops.fallback import cpu_fallback

lib = torch.library.Library("aten", "IMPL", "PrivateUse1")
#: "name.overload" -> the device kernel registered for it (tests list what is native)
native: dict[str, Callable[..., Any]] = {}


class Unsupported(Exception):
    """This call has no device kernel: run it on the CPU."""


def overload(qualname: str) -> torch._ops.OpOverload:
    name, _, over = qualname.partition(".")
    return getattr(getattr(torch.ops.aten, name), over or "default")


def _kernel(fn: Callable[..., Any], qualname: str) -> Callable[..., Any]:
    """``fn`` as ``qualname``'s kernel: a call it raises :class:`Unsupported` for runs
    on the CPU. (The operator is the frame's local ``_op``: the runtime's sanitizer names
    a launch's aten operator from it.)"""
    @functools.wraps(fn)
    def kernel(*args: Any, _op: torch._ops.OpOverload = overload(qualname),
               **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Unsupported:
            return cpu_fallback(_op, *args, **kwargs)

    native[qualname] = fn
    return kernel


def implements(*qualnames: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function for each aten ``name.overload`` on accel."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for qualname in qualnames:
            lib.impl(qualname, _kernel(fn, qualname))
        return fn
    return register


def implements_in_shim(index: int, name: str, functional: Callable[..., Any],
                       in_place: Callable[..., Any], alpha: bool) -> None:
    """Register the shim's C++ kernels (csrc/shim.cpp, "hot arithmetic") for ``name``'s
    ``Tensor`` and ``Scalar`` overloads and their in-place ``name_`` forms, as its hot op
    ``index``: they launch a call's plan themselves and hand every other call to these
    Python functions (``functional`` for the two functional forms, ``in_place`` for the
    two in-place ones), with ``alpha=`` when the overloads take it."""
    forms = ((f"{name}.Tensor", functional), (f"{name}.Scalar", functional),
             (f"{name}_.Tensor", in_place), (f"{name}_.Scalar", in_place))
    _C._hot_binary(index, name, [_kernel(fn, qualname) for qualname, fn in forms], alpha)
