"""DLPack for accel tensors: ``torch.utils.dlpack.to_dlpack(x)``, ``torch.from_dlpack(x)``
share ``x``'s device memory, as they do for CUDA tensors.

torch's C++ converter already maps PrivateUse1 to DLPack's ``kDLExtDev`` both ways; two
things stood in the way:
* ``Tensor.__dlpack_device__`` (torch/_tensor.py) names ``kDLExtDev`` only for a device
  whose type reads ``"privateuse1"``, which a renamed backend's never does, so it raised
  "Unknown device type accel for Dlpack": accel's answer is given here, anything else is
  torch's.
* the imported tensor's storage is torch's wrapper around the producer's pointer (its
  deleter frees the DLPack capsule, which holds the producer's tensor), not a block of the
  caching allocator, and it may start inside one (a DLPack tensor's data is the exporting
  view's first element). Operators find the block holding that address
  (``_hooks.block_holding``) and see the storage as a window on it (ops/_tensors.py).
"""

from __future__ import annotations

import enum

import torch
from torch.utils.dlpack import DLDeviceType

_torch_dlpack_device = torch.Tensor.__dlpack_device__


def __dlpack_device__(self: torch.Tensor) -> tuple[enum.IntEnum, int]:
    """``(kDLExtDev, index)`` for an accel tensor, torch's answer for any other."""
    if self.device.type == "accel":
        return DLDeviceType.kDLExtDev, self.device.index or 0
    return _torch_dlpack_device(self)


def install() -> None:
    torch.Tensor.__dlpack_device__ = __dlpack_device__  # type: ignore[method-assign]
