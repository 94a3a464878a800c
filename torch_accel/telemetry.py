"""torch.cuda's NVML-backed names (``utilization``, ``temperature``, ``list_gpu_processes``)
for the accel device: read from the driver's sysfs attributes of the device, as NVML reads
the kernel driver's, so they answer without initialising anything (fork-safe, like
``device_count``) and show every process's work, not only this one's."""

from __future__ import annotations

from runtime import discovery


def _attr(index: int, name: str) -> str:
    """Attribute ``name`` of visible device ``index`` (its physical device or partition)."""
    visible = discovery.visible_devices()
    if not 0 <= index < len(visible):
        raise ValueError(f"invalid accel device index {index}: {len(visible)} visible")
    return discovery.read_attr(visible[index], name)


def utilization(index: int) -> int:
    """Percent of the last second the device's compute engines were busy (the driver's
    ``utilization``, NVML's ``utilization.gpu``)."""
    return int(_attr(index, "utilization"))


def temperature(index: int) -> int:
    """The die temperature in degrees Celsius (the driver's ``temperature``)."""
    return int(_attr(index, "temperature"))


def list_processes(index: int) -> str:
    """torch.cuda.list_gpu_processes's text: a ``GPU:N`` line (here ``accel:N``), then one
    line per process holding device memory, or ``no processes are running``. The driver's
    ``processes`` attribute has a ``pid device_bytes`` header and one row per process this
    user may see."""
    lines = [f"accel:{index}"]
    for row in _attr(index, "processes").splitlines()[1:]:
        pid, _, used = row.partition(" ")
        if pid.isdigit() and used.strip().isdigit():
            lines.append(f"process {int(pid):>10d} uses {int(used) / (1 << 20):>12.3f} MB "
                         "accel memory")
    if len(lines) == 1:
        lines.append("no processes are running")
    return "\n".join(lines)
