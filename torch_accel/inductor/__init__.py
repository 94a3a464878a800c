"""torch.compile's default backend (Inductor) on accel: kernels in the device's language.

Registered when Inductor's code generators load (torch_accel/_dynamo_hook.py), never by
``import torch``: Inductor takes seconds to import. ``codegen`` writes the kernels and
``launcher`` runs them; docs/torch.md ("torch.compile") says what lowers and what falls
back to the eager operators.
"""

from __future__ import annotations

DEVICE_TYPE = "accel"


def register() -> None:
    """Register accel's scheduling, wrapper and device ops with Inductor."""
    from torch._inductor.codegen.common import (
        register_backend_for_device,
        register_device_op_overrides,
    )

    from torch_accel.inductor import codegen

    register_backend_for_device(DEVICE_TYPE, codegen.AccelScheduling, codegen.AccelWrapper)
    register_device_op_overrides(DEVICE_TYPE, codegen.AccelDeviceOpOverrides())
