"""``import torch_accel``: PyTorch's out-of-tree ``accel`` backend on the emulated device.

Importing registers the device type ``accel`` (torch's PrivateUse1 key, renamed), the
``torch.accel`` module (torch_accel/accel.py), the C++ shim's guard, allocator and hooks
(torch_accel/csrc/shim.cpp), the operators (torch_accel/ops/) and the c10d backend ``accl``
(torch_accel/distributed.py). torch's backend
autoloading (the ``torch.backends`` entry point) imports it with ``import torch``.
Importing initialises no device: that waits for the first use, as torch.cuda does.
docs/torch.md is the guide.
"""

from __future__ import annotations


def _autoload() -> None:
    """torch's ``torch.backends`` entry point: importing this package did the work. It is
    defined before ``import torch``, which (autoloading) asks for it while this package is
    still being imported."""


import torch  # noqa: E402

from torch_accel import _build

_C = _build.load()

torch.utils.rename_privateuse1_backend("accel")

from torch_accel import _hooks, accel  # noqa: E402 - needs the backend named first

_C._register(_hooks)
torch._register_device_module("accel", accel)
torch.utils.generate_methods_for_privateuse1_backend(
    for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)

from torch_accel import ops  # noqa: E402,F401 - registers the operators
from torch_accel import _dynamo_hook, distributed, dlpack, ipc, profiler  # noqa: E402

profiler.install()
dlpack.install()
ipc.install()
_dynamo_hook.install()
distributed.install()
from torch_accel.ops.fallback import fallback_counts  # noqa: E402

__all__ = ["accel", "fallback_counts"]
