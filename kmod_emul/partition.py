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
context): EBUSY otherwise. A change whose new partitions do not all boot is rolled back:
they are removed and the previous partitions (same UUIDs) boot again, and the writer gets
EIO (debugfs ``partition_fail_step`` makes one fail on purpose). A partition leaves as a
hot-unplugged device does: every open and command answers ENODEV from then on, its
contexts are lost (those opened while the change ran too), its firmware halts, and its
VRAM file closes once the last allocation in it is given back (docs/partitions.md,
"Removal"). The mode of each device persists per UUID in ``STATE_DIR/partitions.json``, so
a restarted daemon serves the same partitions.

The partitions of a device are one package: a reset of the device resets them all
(``Resets.request``), and they share its thermal model (kmod_emul/thermal.py).
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

from abi import uapi
from kmod_emul.attr import Attr, parse_number
from kmod_emul.device import AccelDevice
from kmod_emul.errors import DriverError
from kmod_emul.identity import IdentityStore, pci_bus_id
from kmod_emul.memory import VramFile
from kmod_emul.sysfs import parse_fail_step

log = logging.getLogger(__name__)

#: The modes a device may be split into (sysfs ``available_partition_modes``).
MODES: tuple[int, ...] = (1, 2, 4)
MAX_PARTITIONS = max(MODES)


def partition_index(physical: int, parent: int, k: int) -> int:
    """The device index of partition ``k`` of device ``parent`` among ``physical``
    devices: a block of ``MAX_PARTITIONS`` indices per device, after the physical ones."""
    return physical + MAX_PARTITIONS * parent + k


#: A partition made to fail its bring-up: (partition k of the new mode, step name).
InjectedFailure = tuple[int, str]
#: The pseudo-step of ``partition_fail_step`` before any bring-up step: partition K's
#: memory cannot be made (memfd_create failing, as when the daemon is out of descriptors
#: or memory), so the change fails before any of its partitions exists.
MAKE_STEP = "memory"


def parse_partition_fail_step(text: str) -> InjectedFailure | None:
    """A ``partition_fail_step`` value: ``K:STEP`` (partition K of the next mode change
    fails its bring-up at STEP), or ``none`` (or nothing) for none."""
    value = text.strip()
    if value in ("", "none"):
        return None
    k_text, sep, step = value.partition(":")
    if not sep or (step != MAKE_STEP and not parse_fail_step(step)):
        raise DriverError(errno.EINVAL, f"write K:STEP (K below {MAX_PARTITIONS}, STEP a "
                                        f"bring-up step or {MAKE_STEP}) or none, not "
                                        f"{value[:64]!r}")
    return parse_number(k_text, "partition", MAX_PARTITIONS, decimal=True), step


def parse_mode(text: str) -> int:
    """A ``partition_mode`` value: one of ``MODES``."""
    value = text.strip()
    mode = parse_number(value, "partition_mode", max(MODES) + 1, decimal=True)
    if mode not in MODES:
        raise DriverError(errno.EINVAL, f"partition_mode is one of "
                                        f"{' '.join(map(str, MODES))}, not {value[:64]!r}")
    return mode


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
        #: physical index -> the partition its mode changes make fail (debugfs
        #: ``partition_fail_step``); a rollback's partitions never do
        self.fail_next: dict[int, InjectedFailure] = {}

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

    def _unplug(self, dev: AccelDevice, why: str) -> None:
        """Take a partition away at once, before anything waits: its nodes go, and it
        answers ENODEV to every open and command from now on, its contexts lost
        (``Resets.unplug``). So no context can appear on it after this, and none made
        before (however recently: while the change booted it) is left working."""
        assert self.nodes is not None
        self.nodes.remove_device(dev)
        dev.resets.unplug(why)

    async def _halt(self, dev: AccelDevice) -> None:
        """Halt an unplugged partition's firmware (its supervisor's teardown). Its VRAM
        goes when its last allocation does (``DeviceMemory.retire``)."""
        running = self._running.get(dev.index)
        if running is not None:
            running.scope.cancel()
            await running.done.wait()

    # --- mode changes ---------------------------------------------------------------------
    def _make(self, parent: AccelDevice, mode: int,
              fail: InjectedFailure | None = None) -> list[AccelDevice]:
        """The ``mode`` partitions of ``parent``, not yet booted, on its thermal model;
        ``fail`` names one whose bring-up is to fail (its ``fail_step``)."""
        size = parent.memory_total // mode
        slots = {k: f"{parent.pci_bus_id}/partition{mode}.{k}" for k in range(mode)}
        identities = IdentityStore(self.state_dir).identities(list(slots.values()))
        made: list[AccelDevice] = []
        vram: list[VramFile] = []
        try:
            for k, slot in slots.items():
                index = partition_index(len(self.physical), parent.index, k)
                step = fail[1] if fail is not None and fail[0] == k else ""
                if step == MAKE_STEP:
                    raise OSError(errno.ENOMEM, f"partition {k}'s memory (injected: "
                                                "partition_fail_step)")
                vram.append(VramFile(f"accel{index}-vram", size))
                # its firmware reaches its own VRAM alone; its descriptors count against
                # the daemon's like one more device's
                mem = dataclasses.replace(parent.mem_config, vram={index: vram[-1]},
                                          devices=parent.mem_config.devices - 1 + mode)
                dev = AccelDevice(index, identities[slot], size, parent.firmware_dir,
                                  parent.heartbeat_timeout_s, mem)
                dev.pci_bus_id = pci_bus_id(parent.index, k + 1)
                dev.package_id, dev.partition_id, dev.engine_share = parent.index, k, mode
                dev.recovery = parent.recovery
                dev.thermal = parent.thermal  # one package, one thermal budget
                dev.fail_step = step
                made.append(dev)
        except BaseException:
            for file in vram:  # none of them booted or was reachable: nothing holds them
                file.close()
            raise
        return made

    async def set_mode(self, parent: AccelDevice, mode: int) -> None:
        """Split ``parent`` into ``mode`` partitions (1: whole again), once it and its
        partitions are idle; returns once the new partitions have booted. If one does not
        boot, the change is rolled back (``_roll_back``) and the write fails with EIO."""
        if parent.index in self._changing:
            raise DriverError(errno.EBUSY, f"{parent.name}: a partition mode change is "
                                           "under way")
        if mode == parent.partition_mode:
            return
        # The check and the unplug of what it checked (``_switch``) run with no wait
        # between them, so nothing opens these meanwhile; what opens the new partitions
        # while they boot is the change's to account for (``_roll_back``).
        busy = [d.name for d in (parent, *parent.partitions) if d.files or d.contexts]
        if busy:
            raise DriverError(errno.EBUSY, f"{', '.join(busy)} in use: the partition mode "
                                           "changes only while no process holds them")
        self._changing.add(parent.index)
        try:
            previous = parent.partition_mode
            try:
                await self._switch(parent, mode, self.fail_next.get(parent.index),
                                   f"partition mode of {parent.name} changed to {mode}")
            except OSError as e:
                await self._undo_unmade(parent, mode, previous, e)
            # a partition a reset reached while booting boots again: only a failed one
            # did not boot
            failed = [d for d in parent.partitions if d.state == uapi.DeviceState.FAILED]
            if failed:
                await self._roll_back(parent, mode, previous, failed)
            self._save()
            log.info("%s: partition mode %d%s", parent.name, mode,
                     f" ({', '.join(d.name for d in parent.partitions)})"
                     if parent.partitions else "")
        finally:
            self._changing.discard(parent.index)

    async def _switch(self, parent: AccelDevice, mode: int, fail: InjectedFailure | None,
                      why: str) -> None:
        """Replace ``parent``'s partitions by ``mode`` new ones and boot them (whether
        each booted is its ``state``'s to say); the old ones are removed because ``why``.
        If the new ones cannot be made (OSError), the device is whole (mode 1) when it
        raises: never a mode with no partition in it, which no one could open."""
        assert self.nodes is not None
        old = parent.partitions
        for dev in old:  # out of reach first: no wait between the caller's check and this
            self._unplug(dev, why)
        parent.partitions = []
        parent.partition_mode = mode
        for dev in old:
            await self._halt(dev)
        try:
            parent.partitions = self._make(parent, mode, fail) if mode > 1 else []
        except OSError:
            parent.partition_mode = 1
            raise
        for dev in parent.partitions:
            self.nodes.add_device(dev)
        await self._boot(parent.partitions)

    async def _undo_unmade(self, parent: AccelDevice, mode: int, previous: int,
                           error: OSError) -> None:
        """Undo a change to ``mode`` whose partitions could not be made (``error``): back to
        the ``previous`` mode's partitions as for a rollback, or whole if those cannot be
        made either; the store says what the device is; then the writer gets the errno."""
        log.error("%s: partition mode %d could not be made (%s), back to mode %d",
                  parent.name, mode, error, previous)
        try:
            await self._switch(parent, previous, None, f"partition mode {mode} of "
                                                       f"{parent.name} could not be made")
        except OSError as again:
            log.error("%s: partition mode %d could not be made either (%s): whole",
                      parent.name, previous, again)
        self._save()
        raise DriverError(error.errno or errno.ENOMEM,
                          f"{parent.name}: partition mode {mode} could not be made "
                          f"({error.strerror}); now mode {parent.partition_mode}") from error

    async def _roll_back(self, parent: AccelDevice, mode: int, previous: int,
                         failed: list[AccelDevice]) -> None:
        """Undo a change to ``mode`` that ``failed`` partitions did not boot in: back to
        the ``previous`` mode's partitions (the same UUIDs: the identity store keeps
        them), the store untouched; then EIO for the writer, the cause in the log. The
        partitions that did boot may have been opened meanwhile: they are removed as any
        partition is (``_unplug``), so whoever got a context there loses it (ENODEV, a
        DEVICE_REMOVED record) before their memory goes."""
        why = "; ".join(f"{d.name} (partition {d.partition_id}): "
                        f"{d.failure[1] if d.failure else d.state.label}" for d in failed)
        log.error("%s: partition mode %d failed, back to mode %d: %s", parent.name, mode,
                  previous, why)
        await self._switch(parent, previous, None,
                           f"partition mode {mode} of {parent.name} failed and was rolled back")
        raise DriverError(errno.EIO, f"{parent.name}: partition mode {mode} failed "
                                     f"({why}); back to mode {previous}")


def partition_attrs(parts: Partitions, dev: AccelDevice) -> dict[str, Attr]:
    """A physical device's ``partition_mode`` (root writes 1, 2 or 4),
    ``available_partition_modes`` and ``partitions`` (the names of its partitions)."""
    return {
        "partition_mode": Attr(read=lambda: str(dev.partition_mode),
                               write=lambda text: parts.set_mode(dev, parse_mode(text))),
        "available_partition_modes": Attr(read=lambda: " ".join(map(str, MODES))),
        "partitions": Attr(read=lambda: " ".join(c.name for c in dev.partitions)),
    }


def partition_debug_attrs(parts: Partitions, dev: AccelDevice) -> dict[str, Attr]:
    """A physical device's debugfs ``partition_fail_step`` (``K:STEP`` or ``none``):
    partition K of its later mode changes fails its bring-up at STEP, or cannot be made at
    all (STEP ``memory``), so that the rollback of a failed change can be exercised (a
    rollback's partitions never fail)."""

    def read() -> str:
        fail = parts.fail_next.get(dev.index)
        return f"{fail[0]}:{fail[1]}" if fail is not None else "none"

    def write(text: str) -> None:
        fail = parse_partition_fail_step(text)
        if fail is None:
            parts.fail_next.pop(dev.index, None)
        else:
            parts.fail_next[dev.index] = fail

    return {"partition_fail_step": Attr(read=read, write=write)}
