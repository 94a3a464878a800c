"""Two ranks under torchrun, each on its own device, summed by a torch.distributed group
(run: python examples/torchrun_allreduce.py [visible|set_device] against a serving
accel-emud with 2 devices, ACCEL_EMU_ROOT set; it launches itself as
``python -m torch.distributed.run --standalone --nproc-per-node=2`` would be typed).

Each rank binds to the device of its ``LOCAL_RANK`` -- ``visible``: ``ACCEL_VISIBLE_DEVICES``
set before the runtime is imported, so the rank sees one device, its index 0; ``set_device``
(the default): every device visible, ``runtime.set_device(local_rank)`` -- computes on it,
and all-reduces what it copied back to the host over gloo (the host-side backend: the
emulated devices have no collective library). Each rank prints its device's UUID and fabric
endpoint, the identity a topology-aware launcher groups ranks by (docs/distributed.md).
"""

import os
import sys

BIND = sys.argv[1] if len(sys.argv) > 1 else "set_device"
if "LOCAL_RANK" in os.environ and BIND == "visible":
    # like CUDA_VISIBLE_DEVICES: before the runtime is imported, so nothing has read it yet
    os.environ["ACCEL_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]

import subprocess  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import runtime  # noqa: E402
from runtime import kernel_lib  # noqa: E402

RANKS = 2
N = 4096


def launch() -> None:
    """The launcher side: torchrun starts RANKS ranks of this same file on this host."""
    if runtime.device_count() < RANKS:  # discovery only: the launcher holds no device
        sys.exit(f"needs {RANKS} devices, {runtime.device_count()} visible")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={RANKS}", __file__, BIND], check=True)


def rank_main() -> None:
    """One rank: (rank + 1) * arange(N) + 1 by saxpy on its own device, then the sum of every
    rank's result over gloo, checked against what numpy says it must be."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if BIND == "set_device":
        runtime.set_device(local_rank)
    props = runtime.get_device_properties()
    mod = runtime.compile(kernel_lib.SOURCE)
    x = np.arange(N, dtype=np.float32)
    out = runtime.empty(N, np.float32)
    mod.saxpy[(N + 255) // 256, 256](np.float32(local_rank + 1), runtime.to_device(x),
                                      runtime.to_device(np.ones(N, np.float32)), out)
    total = torch.from_numpy(out.copy_to_host())

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dist.all_reduce(total)
    assert np.allclose(total.numpy(), x * world * (world + 1) / 2 + world), total[:4]
    devices: list[object] = [None] * world
    dist.all_gather_object(devices, props.uuid)
    assert len(set(devices)) == world, f"ranks share a device: {devices}"
    line = (f"rank {dist.get_rank()} local_rank {local_rank} bind {BIND} "
            f"device {props.physical_index} uuid {props.uuid} fabric {props.fabric_endpoint}\n")
    os.write(sys.stdout.fileno(), line.encode())  # one write(2): the ranks' lines never mix
    dist.destroy_process_group()
    runtime.synchronize()


if __name__ == "__main__":
    rank_main() if "LOCAL_RANK" in os.environ else launch()
