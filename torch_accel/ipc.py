"""Sharing accel tensors between processes through ``torch.multiprocessing``, as torch.cuda
shares CUDA tensors with cudaIpc handles.

torch 2.13's reductions (torch/multiprocessing/reductions.py) know CUDA and meta tensors;
any other device's storage goes to the CPU shared-memory path, which an accel storage
cannot take: the consumer of a queue hung. Here an accel tensor pickles as the runtime's
IPC handle of the block holding its storage (``DeviceArray.ipc_handle()``, docs/memory.md)
and its geometry; the consumer opens the handle (``runtime.open_ipc_handle``, which maps
the producer's device memory) and rebuilds the tensor over it, so both see the same bytes.

As with CUDA:
* the producer's queued writes are complete before the handle leaves (it synchronizes the
  device; torch.cuda sends an event instead);
* the producer must keep the tensor alive while consumers use it: its caching allocator
  may hand the block out again once it is freed there (the driver keeps the memory itself
  mapped while an importer holds it);
* a tensor received from another process cannot be shared again (RuntimeError), and an
  accel storage alone cannot be pickled: pickle a tensor.
"""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.multiprocessing import reductions

import runtime
from torch_accel import _C, _hooks
from torch_accel.ops._tensors import base_of

_torch_reduce_tensor = reductions.reduce_tensor
_torch_reduce_storage = reductions.reduce_storage


def rebuild_accel_tensor(cls: type, handle: runtime.IpcHandle, offset: int, nbytes: int,
                         size: torch.Size, stride: tuple[int, ...], storage_offset: int,
                         dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    """The consumer's side: map the producer's block and make the tensor over the window
    of it the producer's storage was. The storage's deleter drops the mapping."""
    _hooks.lazy_init()
    window = runtime.open_ipc_handle(handle).view(np.uint8, nbytes, offset)
    _hooks.blocks[(window.device, window.va)] = window
    storage = _C._block_tensor(window.device, window.va, nbytes).untyped_storage()
    t = torch.empty(0, dtype=dtype, device=torch.device("accel", window.device))
    t.set_(storage, storage_offset, size, stride)
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad)
    return t.requires_grad_(requires_grad)


def reduce_tensor(t: torch.Tensor) -> Any:
    """An accel tensor as its block's IPC handle; any other as torch reduces it."""
    if t.device.type != "accel":
        return _torch_reduce_tensor(t)
    storage = t.untyped_storage()
    whole = base_of(t)
    whole = getattr(whole, "base", whole)  # the allocation a window (view) is part of
    if isinstance(whole, runtime.memory.ImportedArray):
        raise RuntimeError("accel: this tensor was received from another process and cannot "
                           "be shared again; share it from the process that allocated it")
    offset = storage.data_ptr() - whole.va
    torch.accel.synchronize(t.device)
    return (rebuild_accel_tensor, (type(t), whole.ipc_handle(), offset, storage.nbytes(),
                                   t.size(), t.stride(), t.storage_offset(), t.dtype,
                                   t.requires_grad))


def reduce_storage(storage: Any) -> Any:
    if storage.device.type == "accel":
        raise RuntimeError("Cannot pickle accel storage; try pickling an accel tensor instead")
    return _torch_reduce_storage(storage)


def install() -> None:
    """Register for every tensor class torch registers its reduction for (later
    registrations win in ForkingPickler)."""
    for cls in (*torch._tensor_classes, torch.Tensor, torch.nn.Parameter):
        ForkingPickler.register(cls, reduce_tensor)
    ForkingPickler.register(torch.UntypedStorage, reduce_storage)
