"""The `make run` demo: discover, identify and exercise every device through the runtime.

Runs against ``$ACCEL_EMU_ROOT``. Each step is one of the seed's bring-up steps:
enumerate and identify the devices, then submit a no-op and observe its completion.
"""

from __future__ import annotations

import time

import runtime


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
            print(f"  100 no-ops submitted and completed in {elapsed * 1e3:.1f} ms "
                  f"(last fence {fences[-1].seqno})")
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
