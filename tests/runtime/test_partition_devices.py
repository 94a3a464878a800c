"""Compute partitions through the runtime (docs/partitions.md): the runtime sees a split
device's partitions as devices of their own (and not the split device), computes on each
within its slice of memory, may not reach one partition's memory from another, and a
reset of one partition leaves another partition's tenant working with its data intact."""

from __future__ import annotations

import pytest
from scenario import IDLE

from testkit.bystander import Bystander

ON_EACH_PARTITION = """
import numpy as np, runtime
from runtime import discovery
from runtime.kernel_lib import SOURCE

print("devices", runtime.device_count(), " ".join(discovery.visible_devices()))
for dev in range(runtime.device_count()):
    lib = runtime.compile(SOURCE, dev)
    x = runtime.to_device(np.arange(4096, dtype=np.float32), device=dev)
    out = runtime.to_device(np.zeros(4096, np.float32), device=dev)
    lib.saxpy[4096 // 64, 64](np.float32(2.0), x, x, out, stream=runtime.current_stream(dev))
    free, total = runtime.mem_get_info(dev)
    print(dev, "saxpy", float(out.copy_to_host().sum()), "total", total)
try:
    runtime.enable_peer_access(1, 0)
    print("peer access granted")
except runtime.AccelError as exc:
    print("peer access refused", type(exc).__name__)
"""

RESET_OTHER = """
import numpy as np, runtime
from runtime import discovery
from runtime.kernel_lib import SOURCE

lib = runtime.compile(SOURCE, 0)
x = runtime.to_device(np.arange(4096, dtype=np.float32))
runtime.synchronize(0)
before = discovery.read_attr("accel1", "reset_count")
(discovery.root() / "sys/class/accel/accel1/reset").write_text("1")
try:
    lib.fill[1, 256](x, np.float32(1))
    runtime.synchronize(0)
    print("work after the reset ran")
except runtime.DeviceLostError:
    print("lost")
"""


@pytest.mark.timeout(120)
def test_partitions_are_devices_and_reset_alone(make_daemon):
    d = make_daemon(devices=1)
    (d.root / "sys/class/accel/accel0/partition_mode").write_text("2")
    out = d.run_py(ON_EACH_PARTITION)
    assert out.returncode == 0, out.stderr
    half = (256 << 20) // 2
    assert out.stdout.splitlines() == [
        "devices 2 accel1 accel2",
        f"0 saxpy 25159680.0 total {half}", f"1 saxpy 25159680.0 total {half}",
        "peer access refused InvalidValueError"]

    with Bystander(d, 2, alone=True) as other_partition:
        out = d.run_py(RESET_OTHER, ACCEL_VISIBLE_DEVICES="1")
        other_partition.check()  # its data intact, its work running
        assert d.attr(2, "reset_count") == "0"
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["lost"]
    d.wait_attrs(1, {"state": "operational", "reset_count": "1"})
    for dev in (1, 2):
        d.wait_attrs(dev, IDLE)
    (d.root / "sys/class/accel/accel0/partition_mode").write_text("1")
    out = d.run_py("import runtime; print(runtime.device_count())")
    assert out.stdout.split() == ["1"], out.stderr
