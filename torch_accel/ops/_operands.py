"""Operands and results of the elementwise families: torch's promotion and broadcasting
rules turned into flat device buffers the kernels walk with stride 1 (or 0 for a value
broadcast everywhere), and results written back into any ``out=`` tensor.

An operand of the result's shape, dtype and layout is used as it is; a one-element
operand is read with stride 0; anything else (broadcast, strided, another dtype) is first
made contiguous in the compute dtype by the strided-copy kernel, as TensorIterator would
make it contiguous in a temporary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from torch_accel.ops._tensors import NUMPY, view_of
from torch_accel.ops.copy import contiguous_on_device, strided_into

Number = int | float | bool


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float, bool))


def as_number(x: Any) -> Any:
    """A 0-d CPU tensor mixed with device tensors is a number (torch allows exactly that)."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() == 0:
        return x.item()
    return x


def common_device(xs: Iterable[Any]) -> torch.device | None:
    """The one device of the tensors among ``xs`` (None: no tensor; a 0-d CPU tensor is
    a number, as in torch). Tensors on two devices are refused in torch's own words
    (TensorIterator's), so code that handles the CPU's or CUDA's error handles this one."""
    device = None
    for x in xs:
        if not isinstance(x, torch.Tensor) or (x.device.type == "cpu" and x.dim() == 0):
            continue
        if device is None:
            device = x.device
        elif x.device != device:
            raise RuntimeError("Expected all tensors to be on the same device, but found at "
                               f"least two devices, {device} and {x.device}!")
    return device


def device_of(*xs: Any) -> torch.device:
    """The device an operator runs on: its tensors' one device, checked before any
    kernel is queued (the kernel launcher's refusal would be the runtime's ValueError)."""
    device = common_device(xs)
    if device is None or device.type != "accel":
        raise RuntimeError("accel: no accel tensor among the operands")
    return device


def supported(*dtypes: torch.dtype) -> bool:
    """Whether the kernels have a type for each dtype (float16, complex ... fall back)."""
    return all(d in NUMPY for d in dtypes)


def operand(x: torch.Tensor | Number, dtype: torch.dtype, shape: torch.Size,
            device: torch.device) -> tuple[Any, int]:
    """(buffer or number, stride) for one input of an elementwise kernel over ``shape``."""
    if is_number(x):
        return x, 0
    if x.numel() == 1 and x.shape != shape:
        one = x.reshape(1)
        return view_of(contiguous_on_device(one, dtype)), 0
    if x.shape == shape:
        return view_of(contiguous_on_device(x, dtype)), 1
    return view_of(contiguous_on_device(x.expand(shape), dtype)), 1


def number_buffer(x: Number, dtype: torch.dtype, device: torch.device) -> Any:
    """A number the kernel wants as a buffer (its first operand): one element, stride 0."""
    return view_of(torch.full((1,), x, dtype=dtype, device=device))


def result(shape: torch.Size, dtype: torch.dtype, device: torch.device,
           out: torch.Tensor | None, compute: Callable[[Any], None]) -> torch.Tensor:
    """Run ``compute(flat_output_buffer)`` and return ``out`` (resized as torch's ``out=``
    rules say) or a new tensor: into ``out`` directly when it is contiguous of ``dtype``,
    else through a contiguous temporary copied (and converted) into it."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    elif out.shape != shape:
        out.resize_(shape)
    if out.is_contiguous() and out.dtype == dtype:
        compute(view_of(out))
        return out
    tmp = torch.empty(shape, dtype=dtype, device=device)
    compute(view_of(tmp))
    strided_into(out, tmp)
    return out


def _type_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype in its messages ("Float", "Long")."""
    return {torch.float32: "Float", torch.float64: "Double", torch.int64: "Long",
            torch.int32: "Int", torch.bool: "Bool", torch.int16: "Short",
            torch.int8: "Char", torch.uint8: "Byte"}.get(dtype, str(dtype))


def check_cast(result: torch.dtype, out: torch.Tensor | None) -> None:
    """torch's refusal of an in-place or ``out=`` result its dtype cannot hold."""
    if out is not None and not torch.can_cast(result, out.dtype):
        raise RuntimeError(f"result type {_type_name(result)} can't be cast to the desired "
                           f"output type {_type_name(out.dtype)}")


def into(out: torch.Tensor | None, res: torch.Tensor) -> torch.Tensor:
    """A computed result given to an ``out=`` tensor (resized as torch's ``out=`` rule
    says, converted to its dtype), or the result itself without one."""
    if out is None:
        return res
    check_cast(res.dtype, out)
    if out.shape != res.shape:
        out.resize_(res.shape)
    return out.copy_(res)


def broadcast(*xs: Any) -> torch.Size:
    return torch.broadcast_shapes(*(x.shape for x in xs if isinstance(x, torch.Tensor)))
