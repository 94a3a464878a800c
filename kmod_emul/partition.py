"""Compute partitions: a physical device split into 1, 2 or 4 devices (docs/partitions.md).

As NVIDIA MIG or AMD compute partitions do, a device whose mode is K > 1 serves as K
partition devices, each with a dedicated slice of memory (``memory_total // K``, a VRAM
memfd of its own), ``1/K`` of the compute and copy engines (``abi.fwimage.partition_config``,
which its firmware schedules on too) and a firmware process of its own, so a fault or a
reset of one leaves the others running. Partition ``k`` of physical device ``N`` is
``accel{D + 4N + k}`` (``D`` physical devices): the same name in every mode and across
restarts, and one that discovery's ``accel\\d+`` lists. Its UUID is minted once per
(slot, mode, k) by the identity store, so it is stable across restarts; a mode's partitions
are new instances, as MIG instances are. While partitioned, the physical device's own node
refuses new opens (EBUSY) and discovery skips it.

A mode changes only while the device and its partitions are idle (no open file, no
context): EBUSY otherwise. The mode of each device persists per UUID in
``STATE_DIR/partitions.json``, so a restarted daemon serves the same partitions.

The partitions of a device are one package: a reset of the device resets them all
(``AccelDevice.request_reset``).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
from pathlib import Path
from typing import Protocol

import trio

from kmod_emul.attr import Attr
from kmod_emul.device import AccelDevice
from kmod_emul.errors import DriverError
from kmod_emul.identity import IdentityStore, pci_bus_id

log = logging.getLogger(__name__)

#: The modes a device may be split into (sysfs ``available_partition_modes``).
MODES: tuple[int, ...] = (1, 2, 4)
MAX_PARTITIONS = max(MODES)


def partition_index(physical: int, parent: int, k: int) -> int:
    """The device index of partition ``k`` of device ``parent`` among ``physical``
    devices: a block of ``MAX_PARTITIONS`` indices per device, after the physical ones."""
    return physical + MAX_PARTITIONS * parent + k


def parse_mode(text: str) -> int:
    """A ``partition_mode`` value: one of ``MODES``."""
    value = text.strip()
    if not value.isdigit() or int(value) not in MODES:
        raise DriverError(errno.EINVAL, f"partition_mode is one of "
                                        f"{' '.join(map(str, MODES))}, not {value!r}")
    return int(value)


class DeviceNodes(Protocol):
    """Where a partition's nodes appear and go (the filesystem, kmod_emul/fs.py)."""

    def add_device(self, dev: AccelDevice) -> None: ...

    def remove_device(self, dev: AccelDevice) -> None: ...


@dataclasses.dataclass(eq=False)
class _Running:
    """A partition's supervisor task: cancelled to stop it; ``done`` once it stopped."""

    scope: trio.CancelScope
    done: trio.Event


class Partitions:
    """The daemon's partitions: which exist, their supervisors, and mode changes."""

    def __init__(self, devices: list[AccelDevice], state_dir: Path) -> None:
        self.physical = devices
        self.state_dir = state_dir
        self.path = state_dir / "partitions.json"
        self.nodes: DeviceNodes | None = None
        self._nursery: trio.Nursery | None = None
        self._running: dict[int, _Running] = {}
        self._changing: set[int] = set()

    def enabled(self) -> list[AccelDevice]:
        return [c for d in self.physical for c in d.partitions]

    # --- persistence ---------------------------------------------------------------------
    def _load(self) -> dict[str, int]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise RuntimeError(f"partition store {self.path} is unreadable: {exc}") from None
        return {k: v for k, v in data.items() if v in MODES} if isinstance(data, dict) else {}

    def _save(self) -> None:
        data = self._load()
        data.update({d.identity.uuid: d.partition_mode for d in self.physical})
        tmp = self.path.with_suffix(f".tmp.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, self.path)

    def restore(self) -> None:
        """Split the devices as the last daemon left them (before the tree is built)."""
        saved = self._load()
        for dev in self.physical:
            mode = saved.get(dev.identity.uuid, 1)
            if mode > 1:
                dev.partition_mode = mode
                dev.partitions = self._make(dev, mode)

    # --- supervisors ----------------------------------------------------------------------
    async def start(self, nursery: trio.Nursery) -> None:
        """Boot the restored partitions under the daemon's ``nursery``, where later
        mode changes start theirs too."""
        self._nursery = nursery
        await self._boot(self.enabled())

    async def _boot(self, devices: list[AccelDevice]) -> None:
        """Start each partition's supervisor, side by side; return once each has booted."""
        assert self._nursery is not None
        async with trio.open_nursery() as booting:
            for dev in devices:
                booting.start_soon(self._nursery.start, self._supervise, dev)

    async def _supervise(self, dev: AccelDevice, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        running = _Running(trio.CancelScope(), trio.Event())
        self._running[dev.index] = running
        try:
            with running.scope:
                await dev.run(task_status=task_status)
        finally:
            del self._running[dev.index]
            running.done.set()

    async def _stop(self, dev: AccelDevice) -> None:
        """Halt a partition's firmware (its supervisor's teardown) and free its VRAM."""
        running = self._running.get(dev.index)
        if running is not None:
            running.scope.cancel()
            await running.done.wait()
        for fd in dev.mem_config.vram_fds.values():
            os.close(fd)

    # --- mode changes ---------------------------------------------------------------------
    def _make(self, parent: AccelDevice, mode: int) -> list[AccelDevice]:
        """The ``mode`` partitions of ``parent``, not yet booted."""
        size = parent.memory_total // mode
        slots = {k: f"{parent.pci_bus_id}/partition{mode}.{k}" for k in range(mode)}
        identities = IdentityStore(self.state_dir).identities(list(slots.values()))
        made = []
        for k, slot in slots.items():
            index = partition_index(len(self.physical), parent.index, k)
            fd = os.memfd_create(f"accel{index}-vram", os.MFD_CLOEXEC)  # sparse, as a device's
            os.ftruncate(fd, size)
            # its firmware reaches its own VRAM alone; its descriptors count against the
            # daemon's like one more device's
            mem = dataclasses.replace(parent.mem_config, vram_fds={index: fd},
                                      devices=parent.mem_config.devices - 1 + mode)
            dev = AccelDevice(index, identities[slot], size, parent.firmware_dir,
                              parent.heartbeat_timeout_s, mem)
            dev.pci_bus_id = pci_bus_id(parent.index, k + 1)
            dev.package_id, dev.partition_id, dev.engine_share = parent.index, k, mode
            dev.recovery = parent.recovery
            made.append(dev)
        return made

    async def set_mode(self, parent: AccelDevice, mode: int) -> None:
        """Split ``parent`` into ``mode`` partitions (1: whole again), once it and its
        partitions are idle; returns once the new partitions have booted."""
        if parent.index in self._changing:
            raise DriverError(errno.EBUSY, f"{parent.name}: a partition mode change is "
                                           "under way")
        if mode == parent.partition_mode:
            return
        old = parent.partitions
        busy = [d.name for d in (parent, *old) if d.files or d.contexts]
        if busy:
            raise DriverError(errno.EBUSY, f"{', '.join(busy)} in use: the partition mode "
                                           "changes only while no process holds them")
        assert self.nodes is not None
        self._changing.add(parent.index)
        try:
            for dev in old:  # first out of reach, so that nothing opens them meanwhile
                self.nodes.remove_device(dev)
            parent.partitions = []
            parent.partition_mode = mode
            for dev in old:
                await self._stop(dev)
            new = self._make(parent, mode) if mode > 1 else []
            parent.partitions = new
            for dev in new:
                self.nodes.add_device(dev)
            self._save()
            log.info("%s: partition mode %d%s", parent.name, mode,
                     f" ({', '.join(d.name for d in new)})" if new else "")
            await self._boot(new)
        finally:
            self._changing.discard(parent.index)


def partition_attrs(parts: Partitions, dev: AccelDevice) -> dict[str, Attr]:
    """A physical device's ``partition_mode`` (root writes 1, 2 or 4),
    ``available_partition_modes`` and ``partitions`` (the names of its partitions)."""
    return {
        "partition_mode": Attr(read=lambda: str(dev.partition_mode),
                               write=lambda text: parts.set_mode(dev, parse_mode(text))),
        "available_partition_modes": Attr(read=lambda: " ".join(map(str, MODES))),
        "partitions": Attr(read=lambda: " ".join(c.name for c in dev.partitions)),
    }
