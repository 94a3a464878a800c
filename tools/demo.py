"""The `make run` demo: discover, identify and exercise every device through the runtime.

Runs against ``$ACCEL_EMU_ROOT``. Each step is one of the seed's bring-up steps:
enumerate and identify the devices; allocate, copy and check memory; submit no-ops on a
user-mode queue and observe their completion; join two streams with an event; launch a
small kernel and check its result.
"""

from __future__ import annotations

import time

import numpy as np

import runtime
from runtime import kernel_lib


def main() -> int:
    print(f"runtime: {runtime.device_count()} device(s) visible (discovery read sysfs only)")
    runtime.init()
    for i in range(runtime.device_count()):
        p = runtime.get_device_properties(i)
        print(f"\naccel:{i}  {p.name}  [{p.state}]")
        print(f"  uuid {p.uuid}  serial {p.serial}  bus {p.pci_bus_id}  numa {p.numa_node}")
        print(f"  package {p.package_id} partition {p.partition_id} fabric {p.fabric_endpoint}")
        print(f"  driver {p.driver_version}  firmware {p.firmware_version}  "
              f"ISA {p.isa_version} stepping {p.isa_stepping}")
        print(f"  memory {p.total_memory >> 20} MiB  engines {p.compute_engines} compute / "
              f"{p.copy_engines} copy  caps {', '.join(p.capabilities)}")
        with runtime.device(i):
            ctx = runtime.primary_context()
            start = time.perf_counter()
            fences = [ctx.submit_noop() for _ in range(100)]
            fences[-1].wait(timeout=10)
            elapsed = time.perf_counter() - start
            assert all(f.query() for f in fences)
            print(f"  100 no-ops through the driver in {elapsed * 1e3:.1f} ms "
                  f"(last fence {fences[-1].seqno})")
            x = np.random.default_rng(i).random(1 << 20, dtype=np.float32)
            d = runtime.to_device(x)
            ok = np.array_equal(d.copy_to_host(), x)
            free, total = runtime.mem_get_info()
            print(f"  4 MiB round trip host->device->host {'matches' if ok else 'DIFFERS'}; "
                  f"{free >> 20} of {total >> 20} MiB free")
            s1, s2 = runtime.Stream(), runtime.Stream(priority=-1)
            start, end = runtime.Event(enable_timing=True), runtime.Event(enable_timing=True)
            start.record(s1)
            for _ in range(1000):
                s1.submit_nop()
            end.record(s1)
            s2.wait_event(end)
            d.memset(0, stream=s2)
            s2.synchronize()
            print(f"  1000 no-ops on a user-mode queue: {start.elapsed_time(end):.2f} ms of device "
                  f"time; a high-priority stream waited for them by event, then cleared the "
                  f"array ({int(np.count_nonzero(d.copy_to_host(stream=s2)))} non-zero left)")
            lib = runtime.compile(kernel_lib.SOURCE)
            y = runtime.to_device(np.ones(x.size, np.float32))
            out = runtime.empty(x.size, np.float32)
            start = time.perf_counter()
            lib.saxpy[(x.size + 255) // 256, 256](np.float32(3), runtime.to_device(x), y, out)
            got = out.copy_to_host()
            ok = np.allclose(got, 3 * x + 1)
            print(f"  saxpy kernel over 1 Mi elements (JIT-compiled in the firmware, cached): "
                  f"{'matches numpy' if ok else 'DIFFERS from numpy'} "
                  f"({(time.perf_counter() - start) * 1e3:.0f} ms including compile or cache load)")
            if "matrix" in runtime.get_device_properties(0).capabilities:
                a = np.random.default_rng(0).random((512, 256), dtype=np.float32)
                b = np.random.default_rng(1).random((256, 384), dtype=np.float32)
                c = runtime.empty((512, 384), np.float32)
                lib.matmul[(3, 4), 32](runtime.to_device(a), runtime.to_device(b), c)
                ok = np.allclose(c.copy_to_host(), a @ b, rtol=1e-4)
                print(f"  matmul 512x256 @ 256x384 on the matrix unit (mma, one 128x128 tile "
                      f"per block): {'matches numpy' if ok else 'DIFFERS from numpy'}")
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
