"""One emulated physical device: lifecycle, contexts, submission and recovery.

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

Every table a tenant fills is bounded (:mod:`kmod_emul.limits`): contexts, queues, pinned
memory, host allocations and modules, device-wide (ENOSPC) and per tenant (EDQUOT).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from abi import faults, fwimage, mailbox, uapi, userq
from abi._struct import Struct
from kmod_emul import bringup, limits, userfd
from kmod_emul.context import (
    Context,
    DefaultQueue,
    OpenFile,
    Queue,
    new_ring_memfd,
    tgid_of,
)
from kmod_emul.activity import Activity
from kmod_emul.coredump import Coredump
from kmod_emul.errors import DriverError
from kmod_emul.faultlog import FaultLog
from kmod_emul.fw import FirmwareProcess
from kmod_emul.identity import Identity, pci_bus_id
from kmod_emul.isolation import Isolation, foreign_or_unknown
from kmod_emul.link import Link, fabric_endpoint
from kmod_emul.memory import DeviceMemory, VramFile
from kmod_emul.ras import Ras
from kmod_emul.thermal import Thermal

log = logging.getLogger(__name__)

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
        self.index = index
        self.identity = identity
        self.pci_bus_id = pci_bus_id(index)
        #: the physical device this one is (a partition's: its parent's index) and which of
        #: its partitions (0 for a whole device), kmod_emul/partition.py
        self.package_id = index
        self.partition_id = 0
        #: how many partitions share this device's engines (a partition's mode; 1 if whole)
        self.engine_share = 1
        #: a physical device's partition mode: split into this many while > 1, when its own
        #: node refuses new opens (its partitions serve instead)
        self.partition_mode = 1
        #: the partitions it is split into, in order (kmod_emul/partition.py keeps the
        #: list): its resets are package resets that reach them, and they share its
        #: thermal model (one package, one thermal budget)
        self.partitions: list[AccelDevice] = []
        self.memory_total = memory_total
        self.firmware_dir = firmware_dir
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.state = uapi.DeviceState.BOOTING
        #: why the device was removed (a partition a mode change took away), for good:
        #: "" while it is there (``unplug``)
        self.removed = ""
        #: (errno, message) of the last failure; None while healthy.
        self.failure: tuple[int, str] | None = None
        self.fw: FirmwareProcess | None = None
        #: the last bring-up that succeeded, for its teardown (its undos, in reverse)
        self._up: bringup.Bringup[Boot] | None = None
        self.fw_image: fwimage.FirmwareImage | None = None
        self.files: set[OpenFile] = set()
        self.contexts: dict[int, Context] = {}
        self._ids = itertools.count(1)
        self.mem_config = mem
        self.memory = DeviceMemory(self, mem.vram[index], mem.process_limit)
        #: every device of the daemon (peers), set by the daemon once all exist
        self.all_devices: list[AccelDevice] = [self]
        self.reset_count = 0
        #: why the last reset happened, and when (wall-clock seconds); "" / 0 before any
        self.reset_reason = ""
        self.last_reset = 0.0
        #: (errno, message, wall-clock time) of the last failure: kept across the reset that
        #: recovers it, so that what went wrong stays visible (``failure`` is the current one)
        self.last_failure: tuple[int, str, float] | None = None
        #: what the driver does when a running firmware dies or stops heart-beating:
        #: "auto" resets the device at once (amdgpu's gpu_recovery), "manual" leaves it
        #: failed until someone resets it (--recovery, debugfs ``recovery``)
        self.recovery = "auto"
        # debugfs knobs
        self.fw_boot_fail = False
        #: a bring-up step to fail on purpose ("" for none): debugfs fail_step, --fail-step
        self.fail_step = ""
        self.reset_hold = False
        self.sched_hold = False
        self._hold_changed = trio.Event()
        self._reset_requested = trio.Event()
        #: module images are checked one at a time (each holds the interpreter lock a while)
        self.module_checks = trio.CapacityLimiter(1)
        self._static_info: bytes | None = None
        self.limits = self._limits()
        #: its port on the fabric (kmod_emul/link.py: the package/link reset scope)
        self.link = Link(self)
        self.thermal = Thermal(self)
        #: engine utilization and power (kmod_emul/activity.py), sampled while it serves
        self.activity = Activity(self)
        #: attempts to use what another tenant holds (kmod_emul/isolation.py)
        self.isolation = Isolation(self.name)
        #: after a shutdown the device did itself: what must hold before the driver's
        #: recovery resets it (None: nothing to wait for)
        self._recover_when: Callable[[], bool] | None = None
        #: every fault record of this device (sysfs ``fault_log``, the event node; persisted)
        self.faults = FaultLog(index, identity.uuid,
                               Path(mem.state_dir) if mem.state_dir else None)
        #: error counters and bad pages (sysfs ``ras/``, ``bad_pages``; debugfs ``ras_ctrl``)
        self.ras = Ras(self, Path(mem.state_dir) if mem.state_dir else None)
        #: the dump of a device-scope fault (sysfs ``devcoredump/``), taken as it is recorded
        self.coredump = Coredump(self)
        self.faults.listeners.append(self.coredump.on_record)

    def new_id(self) -> int:
        """Handles of every kind (contexts, queues, allocations) are unique on the device
        and never reused, so a stale or foreign handle can never alias a live object."""
        return next(self._ids)

    @property
    def memory_used(self) -> int:
        """Bytes held (allocations, resident managed memory); retired pages are neither
        used nor free (``memory.vram.reserved``), so the books of an idle device read 0."""
        return self.memory_total - self.memory.vram.reserved - self.memory.free_bytes()

    def fw_stats(self) -> dict[str, int]:
        return self.fw.mbx.stats() if self.fw is not None else {}

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

    def peer_contexts_of(self, pid: int) -> list[tuple[AccelDevice, Context]]:
        """Live contexts of ``pid`` on other devices that enabled access to this one."""
        return [(d, c) for d in self.all_devices if d is not self for c in d.contexts.values()
                if c.file.pid == pid and self.index in c.peers and c.lost is None]

    def describe(self) -> uapi.accel_device_info:
        """DEVICE_QUERY's answer; sysfs renders the same. The static part is built once per
        boot, since the query is a hot path (bench: device-query round trip)."""
        info = uapi.accel_device_info.from_buffer_copy(self.static_description())
        info.state = self.state
        info.memory_used = self.memory_used
        return info

    def static_description(self) -> bytes:
        """The description's fields that change only on boot, as the struct's bytes."""
        if self._static_info is None:
            self._static_info = bytes(self._describe_static())
        return self._static_info

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

    @property
    def name(self) -> str:
        return f"accel{self.index}"

    @property
    def config(self) -> dict[str, Any]:
        """The booted image's device configuration; before a boot nothing is known yet
        (the driver learns engines, limits and capabilities from the image it loads)."""
        if self.fw_image is None:
            return dict(fwimage.UNBOOTED_CONFIG)
        return fwimage.partition_config(self.fw_image.config, self.engine_share)

    def exclusive_owner(self) -> Context | None:
        return next((c for c in self.contexts.values() if c.exclusive and c.lost is None), None)

    def client_pids(self) -> set[int]:
        return {f.pid for f in self.files}

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

    def open(self, tid: int, uid: int, gid: int) -> OpenFile:
        self.check_present()
        if self.partition_mode > 1:
            raise DriverError(errno.EBUSY, f"{self.name} is split into {self.partition_mode} "
                                           "partitions; open one of them (accel-smi partition)")
        self.check_usable()
        pid = tgid_of(tid)
        owner = self.exclusive_owner()
        if owner is not None and owner.file.pid != pid:
            raise DriverError(
                errno.EBUSY,
                f"{self.name} is held exclusively by pid {owner.file.pid} (uid {owner.file.uid})",
            )
        f = OpenFile(self, pid, uid, gid)
        self.files.add(f)
        return f

    def release(self, f: OpenFile) -> None:
        if f.ctx is not None:
            self.destroy_context(f.ctx)
        f.replies.clear()
        self.files.discard(f)

    # --- usage, for the limits ---------------------------------------------------------------
    def live_contexts(self) -> list[Context]:
        return [c for c in self.contexts.values() if c.lost is None]

    def queue_count(self, pid: int | None = None) -> int:
        """Queues (rings and imported names) of live contexts, of ``pid`` or of everyone."""
        return sum(len(c.queues) for c in self.live_contexts() if pid in (None, c.file.pid))

    # --- contexts ------------------------------------------------------------------------
    def create_context(self, f: OpenFile, exclusive: bool, doorbell_fd: int, event_fd: int,
                       db_page_fd: int) -> Context:
        """CTX_CREATE: the process brings its doorbell pipe, event pipe and doorbell page
        (imported here); the driver adds the default queue, a ring of its own."""
        self.check_usable()
        if exclusive:
            others = sorted(p for p in self.client_pids() if p != f.pid)
            if others:
                raise DriverError(errno.EBUSY, f"{self.name} is open in other processes {others}")
        owner = self.exclusive_owner()
        if owner is not None and owner.file.pid != f.pid:
            raise DriverError(errno.EBUSY, f"{self.name} is held exclusively by pid {owner.file.pid}")
        live = self.live_contexts()
        lim = self.limits
        limits.check(len(live), 1, lim.max_contexts, f"{self.name} contexts", device_wide=True)
        limits.check(sum(c.file.pid == f.pid for c in live), 1, lim.max_contexts_per_process,
                     f"contexts of process {f.pid} on {self.name}", device_wide=False)
        mine: list[int] = []
        try:
            mine.append(userfd.import_pipe(f.pid, doorbell_fd, False, "doorbell pipe"))
            mine.append(userfd.import_pipe(f.pid, event_fd, True, "event pipe"))
            mine.append(userfd.import_memfd(f.pid, db_page_fd, userq.ACCEL_DB_PAGE_SIZE,
                                            uapi.ACCEL_SEALS_PINNED, "doorbell page"))
            db = userq.SharedWords(mine[2], userq.ACCEL_DB_PAGE_SIZE)
            ring_fd = new_ring_memfd(f"{self.name}-default-queue")
            mine.append(ring_fd)
            ring = DefaultQueue(ring_fd)
            event_keep = os.dup(mine[1])
        except BaseException:
            for fd in mine:
                os.close(fd)
            raise
        ctx = Context(self.new_id(), f, exclusive, db, event_keep, ring)
        self.fw_send(ctx.id, mailbox.fw_ctx_create(), fds=mine[:3])
        self.fw_send(ctx.id, mailbox.fw_queue_create(
            queue_id=0, priority=uapi.ACCEL_QUEUE_PRIORITY_LOW,
            doorbell_slot=userq.ACCEL_DB_DEFAULT_SLOT, depth=self.limits.max_queue_depth),
            fds=[ring_fd])
        self.contexts[ctx.id] = ctx
        f.ctx = ctx
        return ctx

    def destroy_context(self, ctx: Context) -> None:
        """Tear down in reverse order of creation: queues and mappings go with the firmware
        context, whose teardown the firmware confirms before the memory is reused. The
        driver's own descriptors and mappings of the context go at once."""
        firmware_has_it = ctx.lost is None and self.fw is not None
        self.contexts.pop(ctx.id, None)
        ctx.file.ctx = None
        self.memory.release_context(ctx, firmware_has_it)
        for mod in ctx.modules.values():
            mod.release()
        ctx.modules.clear()
        if firmware_has_it:
            self.fw_send(ctx.id, mailbox.fw_ctx_destroy())
        ctx.lose("context destroyed")
        ctx.close()

    def enable_peer(self, ctx: Context, peer_index: int) -> None:
        """Let ``ctx``'s work reach device ``peer_index``'s memory held by the same process:
        map that process's device-local allocations there into ``ctx`` (and later ones as
        they are made, see ``DeviceMemory.alloc``)."""
        peer = self.peer(peer_index)
        holders = [c for c in peer.live_contexts() if c.file.pid == ctx.file.pid]
        if not holders:
            raise self.isolation.refuse("peer", ctx.file.pid, ctx.file.uid,
                                        f"process {ctx.file.pid} holds no context on {peer.name}")
        if peer_index in ctx.peers:
            return
        ctx.peers.add(peer_index)
        for holder in holders:
            for alloc in holder.allocations.values():
                if alloc.backing.kind == uapi.MemKind.DEVICE and alloc.backing.owner is peer:
                    peer.memory.map_into(alloc, self, ctx)

    def peer(self, index: int) -> AccelDevice:
        peer = next((d for d in self.all_devices if d.index == index), None)
        if peer is None or peer is self:
            raise DriverError(errno.EINVAL, f"no peer device {index} for {self.name}")
        return peer

    # --- queues ---------------------------------------------------------------------------
    def _check_queue_limits(self, ctx: Context) -> None:
        lim = self.limits
        limits.check(self.queue_count(), 1, lim.max_queues, f"{self.name} queues",
                     device_wide=True)
        limits.check(self.queue_count(ctx.file.pid), 1, lim.max_queues_per_process,
                     f"queues of process {ctx.file.pid} on {self.name}", device_wide=False)
        limits.check(len(ctx.queues), 1, lim.max_queues_per_context,
                     f"queues of context {ctx.id}", device_wide=False)

    def create_queue(self, ctx: Context, priority: int, ring_fd: int) -> Queue:
        """QUEUE_CREATE: import the process's ring; give it a doorbell slot (EDQUOT when
        the context's page has none left: its share of queues is bounded by the page, and
        ``max_queues_per_context`` can never be set past it)."""
        self._check_queue_limits(ctx)
        used = ctx.ring_slots_used()
        slot = next((i for i in range(1, userq.ACCEL_DB_SLOT_COUNT) if i not in used), None)
        if slot is None:
            raise DriverError(errno.EDQUOT, f"context {ctx.id}: every one of its "
                                            f"{userq.ACCEL_DB_SLOT_COUNT - 1} doorbell slots "
                                            "is taken")
        fd = userfd.import_memfd(ctx.file.pid, ring_fd, userq.RING_FILE_SIZE,
                                 uapi.ACCEL_SEALS_PINNED, "ring")
        q = Queue(self.new_id(), priority, slot, fd)
        ctx.queues[q.id] = q
        self.fw_send(ctx.id, mailbox.fw_queue_create(queue_id=q.id, priority=priority,
                                                     doorbell_slot=slot,
                                                     depth=self.limits.max_queue_depth),
                     fds=[os.dup(fd)])
        return q

    def destroy_queue(self, ctx: Context, q: Queue) -> None:
        """The queue's work already queued still runs (its process waits for it in its own
        ring); the firmware forgets the queue once it drained. An imported name just goes."""
        del ctx.queues[q.id]
        q.close()
        self.fw_send(ctx.id, mailbox.fw_queue_destroy(queue_id=q.id))

    def import_queue(self, ctx: Context, peer_index: int, peer_qid: int) -> Queue:
        """Make a queue of this process on another device waitable by ``ctx``'s queues."""
        peer = self.peer(peer_index)
        source = next((q for c in peer.live_contexts() if c.file.pid == ctx.file.pid
                       for q in c.queues.values() if q.id == peer_qid and not q.imported), None)
        if source is None:
            raise foreign_or_unknown(ctx.file, "queue", peer_qid, peer.contexts.values(),
                                     f"queue {peer_qid} on {peer.name} is not this process's")
        self._check_queue_limits(ctx)
        local = Queue(self.new_id(), 0, -1, -1, imported=True)
        ctx.queues[local.id] = local
        self.fw_send(ctx.id, mailbox.fw_queue_import(queue_id=local.id, peer_index=peer_index,
                                                     peer_queue_id=peer_qid),
                     fds=[os.dup(source.fd)])
        return local

    def submit_noop(self, ctx: Context) -> int:
        """The driver as producer on the context's default queue: the packet, its doorbell
        slot, the page's sequence word, then the firmware's doorbell."""
        seqno = ctx.default_queue.push(userq.Nop().encode(),
                                       self.limits.max_queue_depth)
        ctx.db.set(userq.DB_SLOTS + 8 * userq.ACCEL_DB_DEFAULT_SLOT, seqno)
        ctx.db.set(userq.DB_SEQ, ctx.db.get(userq.DB_SEQ) + 1)
        if self.fw is not None:
            self.fw.ring_doorbell()
        return seqno

    def lose_context(self, ctx: Context, reason: str) -> None:
        """Lose one context (a fault of context scope) and no other: the firmware stops its
        queues and tears it down as for a destroy (the memory mapped in it is held until
        that is confirmed); the driver keeps it, answering ENODEV, until its process closes
        it, as a context a reset lost."""
        if ctx.lost is not None:
            return
        if self.fw is not None:
            self.memory.hold_for_teardown(ctx)
            self.fw_send(ctx.id, mailbox.fw_ctx_destroy())
        ctx.lose(reason)

    def lose_contexts(self, reason: str) -> list[int]:
        """Lose every live context; their ids (what a device-scope record names). The
        firmware, which runs on until the reset stops it, is told first (CTX_LOST), so
        nothing its processes ring once they are told starts."""
        lost = [c for c in self.contexts.values() if c.lost is None]
        for ctx in lost:
            self.fw_send(ctx.id, mailbox.fw_ctx_lost())
            ctx.lose(reason)
        return [c.id for c in lost]

    def unplug(self, reason: str) -> None:
        """Remove the device for good (a partition that a mode change, or the rollback of
        one, takes away), as Linux's ``drm_dev_unplug``: from here every open and every
        command answers ENODEV, whoever holds it and whenever they opened it; the contexts
        it has, however recent, are lost (their processes' waiters see it at once) and
        recorded (DEVICE_REMOVED). The open files stay until their processes close them,
        and the VRAM with them: it closes once the last allocation in it is given back
        (``DeviceMemory.retire``). The caller halts the firmware."""
        self.removed = reason
        lost = self.lose_contexts(f"{self.name} was removed ({reason})")
        if lost:
            self.report(faults.BY_NAME["DEVICE_REMOVED"].code, contexts=lost, message=reason)
        self.memory.retire()

    def report(self, code: int, ctx: Context | None = None, **fields: Any) -> dict[str, Any]:
        """Record a fault of catalogue ``code`` (of ``ctx``'s process, when it has one)."""
        if ctx is not None:
            fields.update(context=ctx.id, pid=ctx.file.pid, uid=ctx.file.uid)
        return self.faults.report(code, **fields)

    # --- reset and fault injection -----------------------------------------------------
    def request_reset(self, reason: str = "reset requested") -> None:
        """Begin a device reset; returns at once (state reads in_reset until it is done).
        A split device's reset is a package reset: each of its partitions resets too, as
        by a reset of its own (its contexts lost, its ``reset_count`` counted)."""
        log.info("%s: %s", self.name, reason)
        self.state = uapi.DeviceState.IN_RESET
        self.failure = None  # a reset starts afresh; the next boot says how it went
        self.reset_reason, self.last_reset = reason, time.time()
        lost = self.lose_contexts(f"{self.name} was reset ({reason})")
        self.report(faults.BY_NAME["DEVICE_RESET"].code, contexts=lost, message=reason)
        self._reset_requested.set()
        for part in self.partitions:  # real parts tie the package's resets to its partitions
            part.request_reset(f"package reset of {self.name}: {reason}")

    def set_reset_hold(self, hold: bool) -> None:
        self.reset_hold = hold
        self._hold_changed.set()
        self._hold_changed = trio.Event()

    def hang_firmware(self) -> None:
        if self.fw is None:
            raise DriverError(errno.ENODEV, f"{self.name} has no running firmware")
        self.fw.send(0, mailbox.fw_hang())

    def _fail(self, err: int, message: str) -> list[int]:
        """Fail the device: every context is lost; their ids."""
        log.warning("%s failed: %s", self.name, message)
        self.state = uapi.DeviceState.FAILED
        self.failure = (err, message)
        self.last_failure = (err, message, time.time())
        return self.lose_contexts(f"{self.name} failed: {message}")

    def _fail_running(self, err: int, message: str, code: int) -> None:
        """The running firmware died or hung (catalogue ``code``): fail (every context is
        told, the fault recorded), then, with ``recovery`` auto, reset at once -- the
        firmware restarts as in a reset, the contexts stay lost. (A failed boot is not
        retried: it would fail again.)"""
        self.report(code, contexts=self._fail(err, message), message=message,
                    errno=errno.errorcode.get(err, str(err)))
        if self.recovery == "auto":
            self.request_reset(f"recovery from: {message}")

    def shut_down(self, err: int, message: str, code: int,
                  recover_when: Callable[[], bool] | None) -> None:
        """The device stopped itself (a thermal shutdown): fail it (every context is
        told, the fault recorded), stop its firmware, and with ``recovery`` auto reset it
        once ``recover_when()`` holds (None: something else resets it -- a partition's
        package does)."""
        self.report(code, contexts=self._fail(err, message), message=message,
                    errno=errno.errorcode.get(err, str(err)))
        self._recover_when = recover_when if self.recovery == "auto" else None
        if self.fw is not None:
            self.fw.kill()  # powered off: _watch_exit ends serving

    async def _recover_once(self) -> None:
        """Reset a device that shut itself down once it may serve again (cooled)."""
        ready, self._recover_when = self._recover_when, None
        while ready is not None and not self._reset_requested.is_set():
            if ready():
                assert self.failure is not None
                self.request_reset(f"recovery from: {self.failure[1]}")
                return
            await trio.sleep(0.1)

    # --- supervisor ----------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Boot, serve, recover on reset; forever. ``started`` after the first boot attempt."""
        resetting = False
        try:
            while True:
                await self._boot()
                if resetting:  # counted once the reset's boot has settled state and failure
                    self.reset_count += 1
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
                if self.state == uapi.DeviceState.OPERATIONAL:
                    await self._serve()
                await self._stop_firmware()
                await self._recover_once()
                await self._reset_requested.wait()
                self._reset_requested = trio.Event()
                while self.reset_hold:
                    await self._hold_changed.wait()
                await self.link.drain()  # a package reset waits for its peers first
                resetting = True
        finally:
            await self._stop_firmware()

    async def _boot(self) -> None:
        """Run the bring-up table (``BRINGUP``); a failed step leaves the device failed
        with that step's error, and nothing it or the steps before it made."""
        self.state = uapi.DeviceState.BOOTING
        self.failure = None
        self.sched_hold = False  # a fresh firmware schedules
        self.ras.retire_pending()  # nothing from before the reset runs any more
        flags = mailbox.BootFlag.FAIL_BOOT if self.fw_boot_fail else 0
        fw = FirmwareProcess(self.firmware_dir, flags, self.name, self.memory_total,
                             self.mem_config, self.engine_share)
        try:
            self._up = await bringup.bring_up(BRINGUP, Boot(self, fw), self.name,
                                              fail_at=self.fail_step)
        except DriverError as exc:
            self._fail(exc.errno, exc.message)
            return
        except OSError as exc:  # out of descriptors, memory, processes: this device only
            self._fail(exc.errno or errno.EIO,
                       f"bring-up step {bringup.failed_step(exc)} failed: {exc.strerror or exc}")
            return
        if self._reset_requested.is_set():
            return  # a reset arrived while booting; serve() is skipped by the state check
        self.state = uapi.DeviceState.OPERATIONAL
        self.link.restored()
        assert fw.image is not None
        log.info("%s: firmware %s up (pid %d)", self.name, fw.image.version, fw.pid)

    async def _stop_firmware(self) -> None:
        """Tear the last bring-up down: the same undos a failed one runs."""
        up, self._up = self._up, None
        if up is not None:
            await up.teardown()

    # --- bring-up steps of the driver's own (the firmware's are FirmwareProcess's) -------
    def _configure(self, img: fwimage.FirmwareImage) -> None:
        """Learn the device from the image that runs: engines, limits, capabilities and
        versions (the description and sysfs render them)."""
        self.fw_image, self._static_info = img, None
        self.limits = self._limits()

    def _unconfigure(self) -> None:
        """Back to knowing nothing: versions report what runs, not what ran before."""
        self.fw_image = None
        self._static_info = None
        self.limits = self._limits()

    def _limits(self) -> limits.Limits:
        """What the configuration allows, cut to the daemon's descriptors, with the
        operator's values (``--limit``) once an image says what the tables are (the daemon
        checked them against the image at start: ``daemon.check_limits``)."""
        overrides = dict(self.mem_config.limits) if self.fw_image is not None else {}
        try:
            return limits.Limits.for_device(self.config, self.mem_config.devices,
                                            self.mem_config.fd_limit, overrides)
        except limits.LimitError as exc:  # an image installed since allows less
            raise DriverError(errno.EINVAL, f"accel-emud --limit: {exc}") from None

    def _attach(self, fw: FirmwareProcess) -> None:
        """Route the driver's messages to this firmware; first, the memory budget."""
        self.fw = fw
        try:
            self.send_budget()
        except BaseException:
            self._detach()  # a step that fails releases its own half
            raise

    def _detach(self) -> None:
        """No more messages; what was never sent is dropped (its descriptors closed), and
        the confirmations the firmware owed (unmaps, context teardowns) will never come."""
        fw, self.fw = self.fw, None
        if fw is not None:
            fw.drop_backlog()
        self.memory.firmware_gone()

    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            for watcher in (self._irq_loop, self._watch_exit, self._watch_heartbeat,
                            self._watch_reset, self.activity.run):
                nursery.start_soon(watcher, nursery.cancel_scope)

    async def _watch_reset(self, scope: trio.CancelScope) -> None:
        await self._reset_requested.wait()
        scope.cancel()

    async def _irq_loop(self, scope: trio.CancelScope) -> None:
        fw = self.fw
        assert fw is not None
        while True:
            await fw.wait_irq()
            fw.flush()
            while (item := fw.mbx.cpl.pop()) is not None:
                try:
                    self._completion(*item)
                except Exception:  # a driver bug must not take the device down
                    log.exception("%s: driver bug handling completion %s", self.name, item[:3])

    def _completion(self, op: int, status: int, ctx_id: int, payload: bytes) -> None:
        """Dispatch one firmware completion through ``COMPLETION_HANDLERS``."""
        try:
            msg = mailbox.decode(mailbox.COMPLETIONS, op, payload)
        except mailbox.MessageError as exc:  # a firmware that speaks another mailbox
            log.error("%s: firmware sent %s", self.name, exc)
            return
        COMPLETION_HANDLERS[mailbox.Op(op)](self, ctx_id, status, msg)

    def _on_map_done(self, ctx_id: int, status: int, msg: mailbox.fw_map_done) -> None:
        # the firmware could not map it: packets that touch it fault with EFAULT
        log.warning("%s: firmware could not map %#x of context %d (%s)", self.name, msg.va,
                    ctx_id, errno.errorcode.get(status, status))

    def _on_queue_done(self, ctx_id: int, status: int, msg: mailbox.fw_queue_done) -> None:
        log.warning("%s: firmware could not map the ring of queue %d of context %d (%s)",
                    self.name, msg.queue_id, ctx_id, errno.errorcode.get(status, status))
        self._fault_queue(ctx_id, msg.queue_id, status)
        ctx = self.contexts.get(ctx_id)
        if ctx is not None:
            self.report(faults.BY_NAME["QUEUE_UNMAPPABLE"].code, ctx, queue=msg.queue_id,
                        engine="firmware", errno=errno.errorcode.get(status, str(status)))

    def _on_link_done(self, ctx_id: int, status: int, msg: mailbox.fw_link) -> None:
        self.link.on_answer(msg)

    def _on_fault(self, ctx_id: int, status: int, msg: mailbox.fw_fault) -> None:
        """A packet faulted (``status`` its errno): record it for its process. The process
        learns it from its own ring; this is the record everyone else reads."""
        ctx = self.contexts.get(ctx_id)
        op = userq.op_name(msg.opcode)
        self.report(faults.queue_fault_kind(status).code, ctx, engine=faults.engine_of(op),
                    queue=msg.queue_id, seqno=msg.seqno, address=msg.address, opcode=op,
                    errno=errno.errorcode.get(status, str(status)),
                    **({} if ctx is not None else {"context": ctx_id}))

    def _on_unmap_done(self, ctx_id: int, status: int, msg: mailbox.fw_unmap_done) -> None:
        self.memory.unmapped(ctx_id, msg.va)

    def _on_ctx_destroy_done(self, ctx_id: int, status: int,
                             msg: mailbox.fw_ctx_destroy_done) -> None:
        self.memory.context_destroyed(ctx_id)

    def _fault_queue(self, ctx_id: int, qid: int, code: int) -> None:
        """A queue the firmware could not map never runs: say so in its ring (the process
        then raises at its next submission or wait) and wake the process."""
        ctx = self.contexts.get(ctx_id)
        q = ctx.queues.get(qid) if ctx is not None else None
        if ctx is None or q is None:
            return
        if q.fd >= 0:
            ring = userq.RingView(q.fd)
            try:
                if not ring.read_fault()[0]:
                    ring.write_fault(max(1, ring.completed + 1), code, 0, 0)
            finally:
                ring.close()
        ctx.signal()

    async def _watch_exit(self, scope: trio.CancelScope) -> None:
        assert self.fw is not None
        status = await self.fw.proc.wait()
        if self.state == uapi.DeviceState.OPERATIONAL:
            self._fail_running(errno.ENODEV,
                               f"firmware process exited unexpectedly (status {status})",
                               faults.BY_NAME["FIRMWARE_DIED"].code)
        scope.cancel()

    async def _watch_heartbeat(self, scope: trio.CancelScope) -> None:
        assert self.fw is not None
        mbx = self.fw.mbx
        last = mbx.heartbeat[0]
        last_change = trio.current_time()
        while True:
            await trio.sleep(min(0.1, self.heartbeat_timeout_s / 4))
            beat = mbx.heartbeat[0]
            now = trio.current_time()
            if beat != last:
                last, last_change = beat, now
            elif now - last_change > self.heartbeat_timeout_s:
                self._fail_running(
                    errno.ENODEV,
                    f"firmware stopped heart-beating (none for {now - last_change:.1f} s)"
                    + ("" if self.recovery == "auto" else "; reset the device"),
                    faults.BY_NAME["FIRMWARE_HANG"].code,
                )
                scope.cancel()
                return


@dataclass(eq=False)
class Boot:
    """One bring-up of a device: the device, and the firmware its steps assemble."""

    dev: AccelDevice
    fw: FirmwareProcess


#: A device's bring-up, in order: (name, do, undo). A failure at a step undoes the steps
#: before it, last first; a stop or reset undoes them all (kmod_emul/bringup.py). The
#: debugfs knob ``fail_step`` (``accel-emud --fail-step accelN:STEP`` at start) fails
#: the named one; docs/driver.md lists what each makes and releases.
BRINGUP: tuple[bringup.Step[Boot], ...] = (
    bringup.Step("image", lambda b: b.fw.load_image()),
    bringup.Step("mailbox", lambda b: b.fw.map_mailbox(), lambda b: b.fw.unmap_mailbox()),
    bringup.Step("interrupts", lambda b: b.fw.open_interrupts(),
                 lambda b: b.fw.close_interrupts()),
    bringup.Step("fd_channel", lambda b: b.fw.open_fd_channel(),
                 lambda b: b.fw.close_fd_channel()),
    bringup.Step("process", lambda b: b.fw.start_process(), lambda b: b.fw.halt_process()),
    bringup.Step("handshake", lambda b: b.fw.handshake()),
    bringup.Step("config", lambda b: b.dev._configure(b.fw.image),
                 lambda b: b.dev._unconfigure()),
    bringup.Step("attach", lambda b: b.dev._attach(b.fw), lambda b: b.dev._detach()),
)
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in BRINGUP)


#: What the driver does with each completion the firmware sends: one entry per op of
#: ``mailbox.COMPLETIONS`` (checked when the driver loads).
COMPLETION_HANDLERS: dict[mailbox.Op, Callable[[AccelDevice, int, int, Any], None]] = {
    mailbox.Op.MAP: AccelDevice._on_map_done,
    mailbox.Op.QUEUE_CREATE: AccelDevice._on_queue_done,
    mailbox.Op.QUEUE_IMPORT: AccelDevice._on_queue_done,
    mailbox.Op.UNMAP: AccelDevice._on_unmap_done,
    mailbox.Op.CTX_DESTROY: AccelDevice._on_ctx_destroy_done,
    mailbox.Op.FAULT: AccelDevice._on_fault,
    mailbox.Op.LINK: AccelDevice._on_link_done,
}
assert set(COMPLETION_HANDLERS) == set(mailbox.COMPLETIONS), "a completion without a handler"
