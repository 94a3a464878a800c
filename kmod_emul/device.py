"""One emulated physical device: where it is, its lifecycle, its tables, its subsystems.

Lifecycle (sysfs ``state``)::

    booting --ok--> operational --firmware exit / heartbeat lost--> failed
       |                 |                                            |
       +--boot error--> failed                                        |
    in_reset <--reset requested (from any state)----------------------+
       +--firmware stopped, hold released--> booting

Every open file, context and firmware process belongs to exactly one device. A reset or a
failure loses every context (their next command answers ENODEV, and their waiters see the
"lost" word of their doorbell page) but keeps the open files, so the processes holding them
see the loss instead of a vanished fd. Initialisation failures keep their own errno
(ENOPKG, ENOEXEC, EIO) so that nothing collapses into "no accelerator".

``AccelDevice`` holds the state every part reads (placement, lifecycle, the tables of
files and contexts, the debugfs knobs) and composes the subsystems that act on it, as
ivpu spreads a device over drv, job, ipc, pm and mmu_context:

* :mod:`kmod_emul.tenants` (``dev.tenants``): open files, contexts, queues, peers;
* :mod:`kmod_emul.boot`: the bring-up table and the firmware's attach;
* :mod:`kmod_emul.reset` (``dev.resets``): failures, resets, recovery, unplug;
* :mod:`kmod_emul.irq`: the interrupt loop and the completion handlers;
* :mod:`kmod_emul.watch`: the firmware's exit and heartbeat watchers;
* memory, link, thermal, activity, isolation, fault log, RAS and coredump, each its own.

Every table a tenant fills is bounded (:mod:`kmod_emul.limits`): contexts, queues, pinned
memory, host allocations and modules, device-wide (ENOSPC) and per tenant (EDQUOT).
"""

from __future__ import annotations

import errno
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from abi import faults, fwimage, mailbox, uapi
from abi._struct import Struct
from kmod_emul import boot, bringup, irq, watch
from kmod_emul.activity import Activity
from kmod_emul.context import Context, OpenFile
from kmod_emul.coredump import Coredump
from kmod_emul.errors import DriverError
from kmod_emul.faultlog import FaultLog
from kmod_emul.fw import FirmwareProcess
from kmod_emul.identity import Identity, pci_bus_id
from kmod_emul.isolation import Isolation
from kmod_emul.link import Link, fabric_endpoint
from kmod_emul.memory import DeviceMemory, VramFile
from kmod_emul.ras import Ras
from kmod_emul.reset import Resets
from kmod_emul.tenants import Tenants
from kmod_emul.thermal import Thermal

DEVICE_NAME = "Accel-Emu A1"
DRIVER_VERSION = "1.0.0"


@dataclass(frozen=True)
class MemoryConfig:
    """Where the device's bytes live and what a process may hold (from the daemon)."""

    #: every device's VRAM, by device index (its firmware maps them all: peers)
    vram: dict[int, VramFile]
    process_limit: int = 0
    jit_cache: str = ""  # the firmware's persistent kernel cache
    devices: int = 1  # how many devices the daemon serves (they share its descriptors)
    fd_limit: int = 1024  # the daemon's descriptor limit (its children inherit it)
    state_dir: str = ""  # where per-UUID state persists (fault log, bad pages); "" keeps none
    limits: tuple[tuple[str, int], ...] = ()  # the operator's limits (--limit), by name


class AccelDevice:
    def __init__(self, index: int, identity: Identity, memory_total: int, firmware_dir: Path,
                 heartbeat_timeout_s: float, mem: MemoryConfig) -> None:
        # --- placement: which device, where (kmod_emul/partition.py sets a partition's)
        self.index = index
        self.identity = identity
        self.pci_bus_id = pci_bus_id(index)
        #: the physical device this one is (a partition's: its parent's index) and which of
        #: its partitions (0 for a whole device)
        self.package_id = index
        self.partition_id = 0
        #: how many partitions share this device's engines (a partition's mode; 1 if whole)
        self.engine_share = 1
        #: a physical device's partition mode: split into this many while > 1, when its own
        #: node refuses new opens (its partitions serve instead)
        self.partition_mode = 1
        #: the partitions it is split into, in order: its resets are package resets that
        #: reach them, and they share its thermal model (one package, one thermal budget)
        self.partitions: list[AccelDevice] = []
        #: every device of the daemon (peers), set by the daemon once all exist
        self.all_devices: list[AccelDevice] = [self]
        self.memory_total = memory_total
        self.firmware_dir = firmware_dir
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.mem_config = mem
        state_dir = Path(mem.state_dir) if mem.state_dir else None

        # --- lifecycle (kmod_emul/boot.py and kmod_emul/reset.py move it)
        self.state = uapi.DeviceState.BOOTING
        #: why the device was removed (a partition a mode change took away), for good
        self.removed = ""
        #: (errno, message) of the current failure; None while healthy
        self.failure: tuple[int, str] | None = None
        #: the last failure and its wall-clock time, kept across the reset that recovers it
        self.last_failure: tuple[int, str, float] | None = None
        self.reset_count = 0
        #: engine faults the firmware reported on tenants' queues (sysfs ``faults``): the
        #: driver counts them as their reports come (kmod_emul/irq.py), so the count goes
        #: on across resets (a counter never goes down, and the fault log keeps those
        #: lives' records) and leaves out a diagnostic's (ACCEL_CTX_DIAGNOSTIC)
        self.tenant_faults = 0
        #: why the last reset happened, and when (wall-clock seconds); "" / 0 before any
        self.reset_reason = ""
        self.last_reset = 0.0
        self.fw: FirmwareProcess | None = None
        self.fw_image: fwimage.FirmwareImage | None = None
        #: the last bring-up that succeeded, for its teardown (its undos, in reverse)
        self.up: bringup.Bringup[boot.Boot] | None = None
        #: DEVICE_QUERY's fields that change only on boot, as bytes (built on first query)
        self.static_info: bytes | None = None
        #: the last DEVICE_QUERY answer, with the (static part, state, memory used) of it
        self._described: tuple[tuple[bytes, int, int], bytes] = ((b"", 0, 0), b"")

        # --- knobs: what the driver does when a running firmware dies or hangs ("auto"
        # resets at once as amdgpu's gpu_recovery, "manual" leaves it failed: --recovery),
        # and debugfs fault injection (a bring-up step to fail, a boot to fail, a hold)
        self.recovery = "auto"
        self.fw_boot_fail = False
        self.fail_step = ""
        self.sched_hold = False
        #: debugfs ``map_fail``: how many of the next device-local MAPs to fail
        self.map_fail = 0
        #: module images are checked one at a time (each holds the interpreter lock a while)
        self.module_checks = trio.CapacityLimiter(1)

        # --- tables, and the subsystems that fill them
        self.files: set[OpenFile] = set()
        self.contexts: dict[int, Context] = {}
        self._ids = itertools.count(1)
        self.limits = boot.limits_of(self)
        self.tenants = Tenants(self)
        self.resets = Resets(self)
        self.memory = DeviceMemory(self, mem.vram[index], mem.process_limit)
        self.link = Link(self)  # its port on the fabric: the package/link reset scope
        self.thermal = Thermal(self)
        self.activity = Activity(self)  # engine utilization and power, sampled while serving
        self.isolation = Isolation(self.name)  # attempts to use what another tenant holds
        #: every fault record (sysfs ``fault_log``, the event node; persisted)
        self.faults = FaultLog(index, identity.uuid, state_dir)
        self.ras = Ras(self, state_dir)  # error counters and bad pages
        self.coredump = Coredump(self)  # the dump of a device-scope fault, taken as recorded
        self.faults.listeners.append(self.coredump.on_record)

    @property
    def name(self) -> str:
        return f"accel{self.index}"

    def new_id(self) -> int:
        """Handles of every kind (contexts, queues, allocations) are unique on the device
        and never reused, so a stale or foreign handle can never alias a live object."""
        return next(self._ids)

    @property
    def memory_used(self) -> int:
        """Bytes held (allocations, resident managed memory); retired pages are neither
        used nor free (``memory.vram.reserved``), so the books of an idle device read 0."""
        return self.memory_total - self.memory.vram.reserved - self.memory.free_bytes()

    @property
    def config(self) -> dict[str, Any]:
        """The booted image's device configuration; before a boot nothing is known yet
        (the driver learns engines, limits and capabilities from the image it loads)."""
        if self.fw_image is None:
            return dict(fwimage.UNBOOTED_CONFIG)
        return fwimage.partition_config(self.fw_image.config, self.engine_share)

    # --- the firmware's mailbox ------------------------------------------------------------
    def fw_stats(self) -> dict[str, int]:
        return self.fw.mbx.stats() if self.fw is not None else {}

    def fw_stat(self, name: str) -> int:
        """One of the firmware's counters (``mailbox.STAT_NAMES``); 0 while none runs."""
        return self.fw.mbx.stat(name) if self.fw is not None else 0

    def fw_send(self, ctx_id: int, payload: Struct, fds: list[int] | None = None) -> None:
        """Send a control message to the running firmware, handing it ``fds`` (owned by
        the call: closed once sent). Dropped, descriptors closed, when no firmware runs:
        a reset or failure has already voided the state it was about."""
        if self.fw is not None:
            self.fw.send(ctx_id, payload, fds)
        else:
            for fd in fds or ():
                os.close(fd)

    async def fw_took_all(self, timeout: float = 1.0) -> None:
        """Return once the running firmware has taken every control message sent so far,
        or after ``timeout`` (a hung firmware takes none): for a knob whose writer acts
        on its effect next, as a test queues work after ``sched_hold``."""
        with trio.move_on_after(timeout):
            while self.fw is not None and self.fw.untaken():
                await trio.sleep(0.0005)

    def send_budget(self) -> None:
        """What managed memory may not make resident: the allocations and retired pages."""
        vram = self.memory.vram
        self.fw_send(0, mailbox.fw_set_budget(device_bytes=vram.used + vram.reserved))

    # --- what it is ------------------------------------------------------------------------
    def describe(self) -> bytes:
        """DEVICE_QUERY's answer, the reply's bytes; sysfs renders the same. The query is a
        hot path (bench: device-query round trip): the static part is built once per boot,
        and the answer is built again only when it, the state or the memory in use moved."""
        now = (self.static_description(), self.state, self.memory_used)
        if now != self._described[0]:
            self._described = (now, uapi.device_info_now(*now))
        return self._described[1]

    def static_description(self) -> bytes:
        """The description's fields that change only on boot, as the struct's bytes."""
        if self.static_info is None:
            self.static_info = bytes(self._describe_static())
        return self.static_info

    def _describe_static(self) -> uapi.accel_device_info:
        cfg = self.config
        lim = self.limits
        manifest = self.fw_image.manifest if self.fw_image else {}
        return uapi.accel_device_info(
            index=self.index, numa_node=0, package_id=self.package_id,
            partition_id=self.partition_id,
            compute_engines=cfg["compute_engines"], copy_engines=cfg["copy_engines"],
            max_threads_per_block=cfg["max_threads_per_block"],
            max_shared_mem_per_block=cfg["max_shared_mem_per_block"],
            max_contexts=lim.max_contexts,
            capabilities=uapi.names_to_caps(cfg["capabilities"]),
            memory_total=self.memory_total, name=DEVICE_NAME.encode(),
            uuid=self.identity.uuid.encode(), serial=self.identity.serial.encode(),
            pci_bus_id=self.pci_bus_id.encode(),
            fabric_endpoint=fabric_endpoint(self.index).encode(),
            driver_version=DRIVER_VERSION.encode(),
            firmware_version=str(manifest.get("version", "")).encode(),
            isa_version=str(manifest.get("isa_version", "")).encode(),
            isa_stepping=str(manifest.get("isa_stepping", "")).encode(),
            max_contexts_per_process=lim.max_contexts_per_process,
            max_queues_per_context=lim.max_queues_per_context, max_queues=lim.max_queues,
            max_modules_per_context=lim.max_modules_per_context,
            max_pinned_bytes_per_process=lim.max_pinned_bytes_per_process,
            max_pinned_bytes=lim.max_pinned_bytes,
            max_host_allocations_per_process=lim.max_host_allocations_per_process,
            max_module_bytes_per_context=lim.max_module_bytes_per_context,
            max_queues_per_process=lim.max_queues_per_process,
            max_queue_depth=lim.max_queue_depth,
        )

    # --- access control ----------------------------------------------------------------
    def check_present(self) -> None:
        """ENODEV once the device was removed, for every open and command (Linux's
        ``drm_dev_enter`` after ``drm_dev_unplug``)."""
        if self.removed:
            raise DriverError(errno.ENODEV, f"{self.name} was removed ({self.removed})")

    def check_usable(self) -> None:
        """Raise the errno that says why the device cannot take new work right now."""
        self.check_present()
        if self.state == uapi.DeviceState.OPERATIONAL:
            return
        if self.state == uapi.DeviceState.FAILED:
            assert self.failure is not None
            raise DriverError(*self.failure)
        raise DriverError(
            errno.EAGAIN,
            f"{self.name} is {self.state.label}; wait until its state is operational "
            "(accel-smi shows it) and retry",
        )

    def report(self, code: int, ctx: Context | None = None, **fields: Any) -> dict[str, Any]:
        """Record a fault of catalogue ``code`` (of ``ctx``'s process, when it has one; a
        diagnostic context's records say so in ``origin``)."""
        if ctx is not None:
            fields.update(context=ctx.id, pid=ctx.file.pid, uid=ctx.file.uid)
            if ctx.diagnostic:
                fields.setdefault("origin", faults.ORIGIN_DIAG)
        return self.faults.report(code, **fields)

    # --- supervisor ----------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Boot, serve, recover on reset; forever. ``started`` after the first boot attempt."""
        resetting = False
        try:
            while True:
                await boot.boot(self)
                if resetting:  # counted once the reset's boot has settled state and failure
                    self.reset_count += 1
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
                if self.state == uapi.DeviceState.OPERATIONAL:
                    await self.serve()
                await boot.stop(self)
                await self.resets.recover_once()
                await self.resets.next_reset()
                await self.link.drain()  # a package reset waits for its peers first
                resetting = True
        finally:
            await boot.stop(self)

    async def serve(self) -> None:
        """Run the interrupt loop and the watchers until one of them ends serving."""
        async with trio.open_nursery() as nursery:
            for task in (irq.irq_loop, watch.watch_exit, watch.watch_heartbeat,
                         watch.watch_reset):
                nursery.start_soon(task, self, nursery.cancel_scope)
            nursery.start_soon(self.activity.run, nursery.cancel_scope)
