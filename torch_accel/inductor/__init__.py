"""torch.compile's default backend (Inductor) on accel: kernels in the device's language.

Registered when Inductor's code generators load (torch_accel/_dynamo_hook.py), never by
``import torch``: Inductor takes seconds to import. ``codegen`` writes the kernels,
``launcher`` runs them and ``matmul`` lowers the matrix products; docs/torch.md
("torch.compile") says what lowers and what falls back to the eager operators.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

DEVICE_TYPE = "accel"


@functools.cache
def codegen_version() -> str:
    """A hash of this package's sources: what Inductor's FX-graph cache must key on besides
    torch's own sources and config, or a changed code generator would be served the
    wrappers and kernels the old one wrote."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def register() -> None:
    """Register accel's scheduling, wrapper and device ops with Inductor."""
    from torch._inductor.codegen.common import (
        register_backend_for_device,
        register_device_op_overrides,
    )

    from torch._inductor.custom_graph_pass import CustomGraphModulePass

    from torch_accel.inductor import codegen, fallbacks, matmul

    class CodegenIdentity(CustomGraphModulePass):
        """A post-grad pass that changes nothing: Inductor puts a device's custom pass's
        ``uuid()`` in its cache key, which so names this code generator's version."""

        def __call__(self, gm: object) -> None:
            pass

        def uuid(self) -> str:
            return codegen_version()

    register_backend_for_device(DEVICE_TYPE, codegen.AccelScheduling, codegen.AccelWrapper,
                                device_custom_pass=CodegenIdentity())
    register_device_op_overrides(DEVICE_TYPE, codegen.AccelDeviceOpOverrides())
    matmul.install()
    fallbacks.install()
