"""One partition's kernel launches while the other partition of the same device is saturated
(docs/partitions.md).

A private one-device daemon is split into 2 partitions. A tenant on the second partition
runs a giant grid on its compute engine, switched on and off through its stdin; the
bystander, another process on the first partition, times launch-to-completion of a small
kernel (``fill`` of 256 floats) in blocks that alternate with blocks of the same while the
other partition is quiet. Then the device is made whole again and the same is timed for
two tenants of it, who share its engines. Partitions have engines and a firmware of their
own; on this emulator both partitions' engines are host threads, so on a host with few
CPUs the flood still takes CPU time from the bystander's partition.
"""

from __future__ import annotations

from bench.core import Env, Row, timed_row
from bench.floods import GIANT_GRID, launch_round_trips


def partition_isolation(env: Env) -> list[Row]:
    """A kernel launch round trip with a giant grid on the other partition of the same
    device vs quiet, and the same for two tenants of the whole device."""
    d = env.new_accel(1)
    d.start()
    mode = d.root / "sys/class/accel/accel0/partition_mode"
    samples = 30 if env.quick else 100
    rounds = 2 if env.quick else 4
    rows = []
    # split in 2, the partitions are accel1 and accel2 (docs/partitions.md); then whole
    for split, flood_on, bystander_on, what in (
            ("2", "2", "1", "partition 0's kernel launch round trip, partition 1 running a "
                            "giant grid"),
            ("1", "0", "0", "a tenant's kernel launch round trip, another tenant of the "
                            "whole device running a giant grid")):
        mode.write_text(split)
        flooded, quiet = launch_round_trips(d.root, GIANT_GRID, flood_on, bystander_on,
                                            samples, rounds)
        rows.append(timed_row(
            what, flooded, "same, the other quiet", quiet, goal=None,
            note=f"worst flooded {flooded.percentile_us(100):,.0f} us vs quiet "
                 f"{quiet.percentile_us(100):,.0f} us; {rounds} rounds of {samples}"))
    return rows
