"""``set_`` with a tensor source and without arguments: metadata only, as on the CPU.

torch implements both per backend (``set_tensor_``, ``set_cpu_``), so on accel they went
to the CPU fallback, which handed ``self`` a copy of the source's values instead of the
source's storage: ``a.set_(b)`` did not alias ``b``. Here both become the storage form
the shim implements (``set_.source_Storage_storage_offset``)."""

from __future__ import annotations

import torch

from torch_accel.ops._register import implements


@implements("set_.source_Tensor")
def set_tensor_(self: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    if self.dtype != source.dtype:  # torch's own check and words, from its meta kernel
        torch.empty(0, dtype=self.dtype, device="meta").set_(
            torch.empty(0, dtype=source.dtype, device="meta"))
    return self.set_(source.untyped_storage(), source.storage_offset(), source.size(),
                     source.stride())


@implements("set_")
def set_empty_(self: torch.Tensor) -> torch.Tensor:
    """``self`` becomes a 0-element tensor over a new empty storage of its device."""
    fresh = torch.empty(0, dtype=self.dtype, device=self.device).untyped_storage()
    return self.set_(fresh, 0, (0,), (1,))
