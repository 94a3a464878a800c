"""Copies: host <-> device, device <-> device and peer, any strides and dtypes.

torch's ``copy_`` (and so ``.to``, ``.cpu``, ``.clone``) ends here, in ``_copy_from``.
Contiguous bytes of one dtype move as one copy-engine transfer, ordered on the current
stream; everything else goes through the device's strided-copy kernel (which also
converts dtypes) or, on the host side, through torch's own CPU copy. ``non_blocking``
with pinned memory is asynchronous, as torch.cuda's is; with pageable memory a copy to
the host returns once the data has arrived and one to the device once it is staged.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

import runtime
from torch_accel import _hooks
from torch_accel.kernels import layout
from torch_accel.ops._tensors import NUMPY, storage_of, stream, view_of

lib = torch.library.Library("aten", "IMPL", "PrivateUse1")


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as numpy, a pinned array when torch pinned them
    (so the copy engines reach them without staging). Not ``Tensor.numpy()``: that marks
    the storage as shared with numpy for good, and a user's tensor could never be resized
    again (``out=`` operators resize theirs). The caller holds ``t`` while the bytes are
    in use."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return np.empty(0, np.uint8)
    pinned = _hooks.pinned_at(t.data_ptr())
    if pinned is not None:
        return pinned[:nbytes]
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(t.data_ptr()))


#: same-size integer types, to move the bits of dtypes the kernels have no type for
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def strided_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` on one device, any strides, converting dtype: the device's
    strided-copy kernel (``src`` broadcast to ``dst``'s shape). A dtype the kernels lack
    (float16, bfloat16, complex) moves as same-size integers (complex128 as its real and
    imaginary float64s), converted on the host if it must be."""
    src = src.expand_as(dst)
    if src.dtype == dst.dtype and dst.element_size() == 16:  # complex128: two float64s
        src, dst = torch.view_as_real(src), torch.view_as_real(dst)
    if src.dtype not in NUMPY or dst.dtype not in NUMPY:
        if src.dtype != dst.dtype:
            src = src.cpu().to(dst.dtype).to(dst.device)
        if dst.element_size() not in _BITS:
            raise NotImplementedError(f"accel: strided copies of {dst.dtype}")
        src, dst = src.view(_BITS[src.element_size()]), dst.view(_BITS[dst.element_size()])
    layout.strided_copy(storage_of(dst), storage_of(src), tuple(dst.shape),
                        tuple(src.stride()), src.storage_offset(),
                        tuple(dst.stride()), dst.storage_offset(), stream=stream(dst.device.index))


def contiguous_on_device(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` itself when already contiguous (and of ``dtype``), else a contiguous copy."""
    dtype = dtype or t.dtype
    if t.is_contiguous() and t.dtype == dtype:
        return t
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    strided_into(out, t)
    return out


def _to_device(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
    host = src.to(dst.dtype).expand_as(dst).contiguous()
    target = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
    if host.numel():
        s = stream(dst.device.index)
        arr = _host_array(host)
        view_of(target).view(np.uint8, arr.nbytes).copy_from_host(
            arr, stream=s if non_blocking and isinstance(arr, runtime.HostArray) else None)
    if target is not dst:
        strided_into(dst, target)


def _to_host(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
    dense = contiguous_on_device(src.expand(dst.shape) if src.shape != dst.shape else src)
    direct = dst.is_contiguous() and dst.dtype == src.dtype
    host = dst if direct else torch.empty(dst.shape, dtype=src.dtype)
    if dense.numel():
        arr = _host_array(host)
        pinned = isinstance(arr, runtime.HostArray)
        view_of(dense).view(np.uint8, arr.nbytes).copy_to_host(
            out=arr, stream=stream(src.device.index) if non_blocking and pinned else None)
    if not direct:
        dst.copy_(host)


def _between_devices(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.device == dst.device:
        if (src.shape == dst.shape and src.dtype == dst.dtype and src.is_contiguous()
                and dst.is_contiguous()):
            if src.numel():
                view_of(dst).copy_(view_of(src), stream=stream(dst.device.index))
        else:
            strided_into(dst, src)
        return
    # peer: the source's work first, then one transfer of contiguous bytes of dst's dtype
    # on dst's stream; then src's stream waits for it, as torch.cuda's copy ends in a
    # barrier: the source's memory, freed, goes back to src's stream, which would
    # otherwise hand it out again (and let it be written) before the transfer read it
    dense = contiguous_on_device(src.expand(dst.shape), dst.dtype)
    src_stream = stream(src.device.index)
    src_stream.synchronize()
    target = dst if dst.is_contiguous() else torch.empty_like(dst, memory_format=torch.contiguous_format)
    if dense.numel():
        with runtime.device(dst.device.index):
            runtime.enable_peer_access(src.device.index)
            dst_stream = stream(dst.device.index)
            view_of(target).copy_(view_of(dense), stream=dst_stream)
        if dst_stream.capturing is None:  # a capture records no cross-stream wait
            src_stream.wait_stream(dst_stream)
    if target is not dst:
        strided_into(dst, target)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if src.device.type == "accel" and dst.device.type == "accel":
        _between_devices(src, dst)
    elif dst.device.type == "accel":
        _to_device(src, dst, non_blocking)
    else:
        _to_host(src, dst, non_blocking)
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    dst.resize_(src.shape)
    return _copy_from(src, dst)


def _local_scalar_dense(t: torch.Tensor):  # noqa: ANN202 - a Python number of t's kind
    """``t.item()`` of any one-element tensor (``[1, 1]`` as well as 0-d)."""
    return _copy_from(t.reshape(()), torch.empty((), dtype=t.dtype)).item()


lib.impl("_copy_from", _copy_from)
lib.impl("_copy_from_and_resize", _copy_from_and_resize)
lib.impl("_local_scalar_dense", _local_scalar_dense)
