"""Tensors as runtime arrays: what an operator hands its device kernels.

A storage is one runtime caching-allocator block (torch_accel/_hooks.py ``blocks``); a
tensor is a window on it. ``view_of`` gives a contiguous tensor's elements as a
``runtime.DeviceView`` (no copy); ``storage_of`` the whole storage in elements, with the
tensor's element offset, for kernels that walk strides themselves.
"""

from __future__ import annotations

import numpy as np
import torch

import runtime
from torch_accel import _C, _hooks

#: torch dtypes the device's kernel language has, as numpy dtypes
NUMPY = {
    torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
    torch.uint16: np.dtype(np.uint16), torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
}


_EMPTY: dict[int, runtime.DeviceArray] = {}


def base_of(t: torch.Tensor) -> runtime.DeviceArray:
    """The runtime block holding ``t``'s storage; a storage of no bytes has none (its
    pointer is null), and is a zero-length array that kernels see as "nothing to do". A
    storage torch made around another's memory (a DLPack import) is the window of the
    block holding it that it covers (torch_accel/dlpack.py)."""
    if t.untyped_storage().nbytes() == 0:
        dev = t.device.index
        if dev not in _EMPTY:
            _EMPTY[dev] = runtime.empty(0, np.uint8, device=dev)
        return _EMPTY[dev]
    try:
        return _hooks.blocks[_C._storage_block(t)]
    except RuntimeError:  # not a block of the allocator's: a view of the one holding it
        storage = t.untyped_storage()
        block, offset = _hooks.block_holding(t.device.index, storage.data_ptr())
        return block.view(np.uint8, storage.nbytes(), offset)


def block_of(t: torch.Tensor) -> tuple[runtime.DeviceArray, int]:
    """The allocation holding ``t``'s first element and that element's byte offset in it,
    as a launch plan takes its buffers (torch_accel/ops/_plans.py): the storage's own
    block on the hot path, else (a DLPack import) the block the storage is a window of,
    else (a storage of no bytes) the empty array."""
    offset = t.storage_offset() * t.element_size()
    try:
        return _hooks.blocks[_C._storage_block(t)], offset
    except RuntimeError:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return base_of(t), 0
        block, start = _hooks.block_holding(t.device.index, storage.data_ptr())
        return block, start + offset


def _np(t: torch.Tensor) -> np.dtype:
    # dtypes without a device kernel type (float16, complex ...) are viewed as bytes
    return NUMPY.get(t.dtype, np.dtype(np.uint8))


def view_of(t: torch.Tensor) -> runtime.DeviceView:
    """A contiguous tensor's elements, flat, as a runtime view (a 0-d tensor is one
    element long)."""
    assert t.is_contiguous(), "view_of needs a contiguous tensor"
    dtype = _np(t)
    count = t.numel() * t.element_size() // dtype.itemsize
    return base_of(t).view(dtype, count, t.storage_offset() * t.element_size() if count else 0)


def storage_of(t: torch.Tensor) -> runtime.DeviceView:
    """``t``'s whole storage as elements of its dtype (index it with the tensor's own
    offset and strides)."""
    base = base_of(t)
    dtype = _np(t)
    return base.view(dtype, t.untyped_storage().nbytes() // dtype.itemsize)


def stream(device: int) -> runtime.Stream:
    """The runtime stream torch sees as current on ``device``: the runtime's current
    stream itself (torch's stream switches set it), without a round trip through ids."""
    return runtime.current_stream(device)
