"""The firmware's own check of a module's kernels, at its trust boundary: IR the runtime's
front end never saw, loaded through the raw uAPI on a real mount. The driver checks a
module's format, not its code (test_cmd_module.py); the firmware runs the language's front
end (abi/kernel_frontend.py) again when a kernel is launched, and refuses the launch."""

from __future__ import annotations

import errno
import json
import os

import pytest
from rawdev import RawDev

from abi import kernel_lang, uapi, userq
from runtime._shm import sealed_memfd
from testkit.waiting import wait_until


#: Kernels no runtime would emit, in IR the driver takes (its fields are well formed): the
#: firmware must refuse each at launch, through the language's own front end. The first
#: two passed the firmware's former checker of its own.
_HOSTILE_IR = {
    "early": "def early(out, v):\n    if local_id(0) > 0:\n        return\n    barrier()\n"
             "    out[0] = v\n",
    "power": "def power(out, v):\n    w = v\n    w **= 2.0\n    out[0] = w\n",
    "dunder": "def dunder(out, v):\n    __w = v\n    out[0] = __w\n",
}


@pytest.mark.timeout(300)
def test_the_firmware_checks_ir_the_runtime_never_saw(daemon) -> None:
    """On a real mount, through the raw uAPI: a module of hand-made IR (MODULE_LOAD of a
    sealed memfd; the runtime's front end never ran) loads, since the driver checks its
    format and not its code; launching its kernels is the firmware's check. The kernel
    the language accepts runs; each one it rejects faults its launch with EINVAL."""
    params = [{"name": "out", "kind": "buffer", "dtype": "float32", "ndim": 1},
              {"name": "v", "kind": "scalar", "dtype": "float32"}]
    sources = {"fill": "def fill(out, v):\n    out[global_id(0)] = v\n", **_HOSTILE_IR}
    module = {"format": kernel_lang.IR_FORMAT, "isa": kernel_lang.ISA,
              "isa_version": kernel_lang.ISA_VERSION,
              "kernels": {name: {"name": name, "params": params, "source": source,
                                 "shared_mem": 0, "uses_barrier": "barrier" in source}
                          for name, source in sources.items()}}
    raw = json.dumps(module).encode()
    with RawDev(daemon.node(0)) as dev:
        ctx = dev.ctx_create()
        fd = sealed_memfd("module", len(raw), raw)
        try:
            mid = dev.call(uapi.ACCEL_CMD_MODULE_LOAD, uapi.accel_module_load(
                ctx_id=ctx, size=len(raw), fd=fd)).module_id
        finally:
            os.close(fd)
        out = dev.mem_alloc(ctx, 4096)
        f32 = kernel_lang.DTYPE_CODES["float32"]
        block = (userq.ARG_RECORD.pack(userq.ARG_BUFFER, f32, out.va, 4096)
                 + userq.ARG_RECORD.pack(userq.ARG_SHAPE, 1, 1024, 0)
                 + userq.ARG_SCALAR_RECORDS[f32].pack(userq.ARG_SCALAR, f32, 1.0, 0))
        args_fd = sealed_memfd("args", 4096)
        try:
            args = dev.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
                ctx_id=ctx, size=4096, kind=uapi.MemKind.HOST_PINNED, fd=args_fd))
            os.pwrite(args_fd, block, 0)
        finally:
            os.close(args_fd)
        faults = {}
        for name in sources:
            handle = dev.call(uapi.ACCEL_CMD_KERNEL_GET, uapi.accel_kernel_get(
                ctx_id=ctx, module_id=mid, name=name.encode())).handle
            q = dev.queue_create(ctx)  # one each: a faulted queue runs nothing more
            ring = dev.rings[q][1]
            dev.submit(q, [userq.Launch(handle, userq.pack_dims((1, 1, 1)),
                                        userq.pack_dims((32, 1, 1)), 0, args.va,
                                        len(block)).encode()])
            # a compile, when the JIT cache misses
            wait_until(lambda: ring.completed, 240, f"{name}'s launch to complete")
            faults[name] = ring.read_fault()[1]
    assert faults == {"fill": 0, **{name: errno.EINVAL for name in _HOSTILE_IR}}
