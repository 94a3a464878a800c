"""The names ``nvidia-smi --help-query-gpu`` documents, for ``accel-smi --query-gpu``.

A script ported from nvidia-smi asks for fields such as ``fan.speed`` or
``ecc.errors.uncorrected.volatile.total``. nvidia-smi answers ``[Not Supported]`` for a
valid field the device lacks and refuses only a name it does not know; accel-smi does the
same, so one field it does not model does not fail the whole query.
"""

from __future__ import annotations

from itertools import product

#: answered for a valid nvidia-smi field accel-smi does not model, as nvidia-smi prints it
NOT_SUPPORTED = "[Not Supported]"

_ECC_PARTS = ("device_memory", "dram", "register_file", "l1_cache", "l2_cache",
              "texture_memory", "texture_shm", "cbu", "sram", "total")
_REASONS = ("supported", "active", "gpu_idle", "applications_clocks_setting",
            "sw_power_cap", "hw_slowdown", "hw_thermal_slowdown",
            "hw_power_brake_slowdown", "sw_thermal_slowdown", "sync_boost")
_CLOCKS = ("graphics", "gr", "sm", "memory", "mem", "video")

_PLAIN = """
timestamp driver_version count name gpu_name serial gpu_serial uuid gpu_uuid pci.bus_id
gpu_bus_id pci.domain pci.bus pci.device pci.device_id pci.sub_device_id
pcie.link.gen.current pcie.link.gen.gpucurrent pcie.link.gen.max pcie.link.gen.gpumax
pcie.link.gen.hostmax pcie.link.width.current pcie.link.width.max index display_mode
display_active persistence_mode addressing_mode accounting.mode accounting.buffer_size
driver_model.current driver_model.pending vbios_version inforom.img inforom.oem
inforom.ecc inforom.pwr gom.current gom.pending fan.speed pstate memory.total
memory.reserved memory.used memory.free compute_mode compute_cap utilization.gpu
utilization.memory utilization.encoder utilization.decoder utilization.jpeg
utilization.ofa encoder.stats.sessionCount encoder.stats.averageFps
encoder.stats.averageLatency ecc.mode.current ecc.mode.pending
retired_pages.single_bit_ecc.count retired_pages.sbe retired_pages.double_bit.count
retired_pages.dbe retired_pages.pending remapped_rows.correctable
remapped_rows.uncorrectable remapped_rows.pending remapped_rows.failure temperature.gpu
temperature.gpu.tlimit temperature.memory power.management power.draw power.draw.average
power.draw.instant power.limit enforced.power.limit power.default_limit power.min_limit
power.max_limit clocks.current.graphics clocks.gr clocks.current.sm clocks.sm
clocks.current.memory clocks.mem clocks.current.video clocks.video mig.mode.current
mig.mode.pending fabric.state fabric.status protected_memory.total protected_memory.used
protected_memory.free
"""

#: every field name nvidia-smi's ``--help-query-gpu`` lists
NVSMI_GPU_FIELDS: frozenset[str] = frozenset(
    _PLAIN.split()
    + [f"ecc.errors.{kind}.{span}.{part}" for kind, span, part in
       product(("corrected", "uncorrected"), ("volatile", "aggregate"), _ECC_PARTS)]
    + [f"{group}.{reason}" for group, reason in
       product(("clocks_throttle_reasons", "clocks_event_reasons"), _REASONS)]
    + [f"clocks.{kind}.{clock}" for kind, clock in
       product(("applications", "default_applications", "max"), _CLOCKS)])
