"""One emulated physical device: lifecycle, contexts, submission and recovery.

Lifecycle (sysfs ``state``)::

    booting --ok--> operational --firmware exit / heartbeat lost--> failed
       |                 |                                            |
       +--boot error--> failed                                        |
    in_reset <--reset requested (from any state)----------------------+
       +--firmware stopped, hold released--> booting

Every open file, context and firmware process belongs to exactly one device. A reset or a
failure loses every context (their next command answers ENODEV) but keeps the open files,
so the processes holding them see the loss instead of a vanished fd. Initialisation
failures keep their own errno (ENOPKG, ENOEXEC, EIO) so that nothing collapses into
"no accelerator".
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from firmware import abi, image
from kmod_emul import uapi
from kmod_emul.context import Context, OpenFile, Queue, tgid_of
from kmod_emul.errors import DriverError
from kmod_emul.fw import FirmwareProcess, load_image
from kmod_emul.identity import Identity, pci_bus_id
from kmod_emul.memory import DeviceMemory, create_user_file

log = logging.getLogger(__name__)

DEVICE_NAME = "Accel-Emu A1"
DRIVER_VERSION = "1.0.0"


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def fabric_endpoint(index: int) -> str:
    return f"fabric0:port{index}"


@dataclass(frozen=True)
class MemoryConfig:
    """Where the device's bytes live and what a process may hold (from the daemon)."""

    vram_fds: dict[int, int]  # every device's VRAM memfd, by device index
    shm_dir: str
    process_limit: int = 0
    jit_cache: str = ""  # the firmware's persistent kernel cache


class AccelDevice:
    def __init__(self, index: int, identity: Identity, memory_total: int, firmware_dir: Path,
                 heartbeat_timeout_s: float, mem: MemoryConfig) -> None:
        self.index = index
        self.identity = identity
        self.pci_bus_id = pci_bus_id(index)
        self.memory_total = memory_total
        self.firmware_dir = firmware_dir
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.state = uapi.DeviceState.BOOTING
        #: (errno, message) of the last failure; None while healthy.
        self.failure: tuple[int, str] | None = None
        self.fw: FirmwareProcess | None = None
        self.fw_image: image.FirmwareImage | None = None
        self.files: set[OpenFile] = set()
        self.contexts: dict[int, Context] = {}
        self._ids = itertools.count(1)
        self.mem_config = mem
        self.memory = DeviceMemory(self, mem.vram_fds[index], mem.shm_dir, mem.process_limit)
        #: every device of the daemon (peers), set by the daemon once all exist
        self.all_devices: list[AccelDevice] = [self]
        self.reset_count = 0
        # debugfs knobs
        self.fw_boot_fail = False
        self.reset_hold = False
        self.sched_hold = False
        self._hold_changed = trio.Event()
        self._reset_requested = trio.Event()
        self._static_info: bytes | None = None
        #: destroyed contexts whose teardown the firmware has not confirmed yet
        self._dying: dict[int, Context] = {}

    def new_id(self) -> int:
        """Handles of every kind (contexts, queues, allocations) are unique on the device
        and never reused, so a stale or foreign handle can never alias a live object."""
        return next(self._ids)

    @property
    def memory_used(self) -> int:
        return self.memory_total - self.memory.free_bytes()

    def fw_stats(self) -> dict[str, int]:
        return self.fw.mbx.stats() if self.fw is not None else {}

    def fw_send(self, op: abi.Op, ctx_id: int, args: tuple[int, ...] = (),
                payload: bytes = b"") -> None:
        """Send a control message to the running firmware (dropped when none runs: a reset
        or failure has already voided the state it was about)."""
        if self.fw is not None:
            self.fw.send(op, ctx_id, args, payload)

    def send_budget(self) -> None:
        self.fw_send(abi.Op.SET_BUDGET, 0, (self.memory.vram.used,))

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
        manifest = self.fw_image.manifest if self.fw_image else {}
        return uapi.accel_device_info(
            index=self.index, numa_node=0, package_id=self.index, partition_id=0,
            compute_engines=cfg["compute_engines"], copy_engines=cfg["copy_engines"],
            max_threads_per_block=cfg["max_threads_per_block"],
            max_shared_mem_per_block=cfg["max_shared_mem_per_block"],
            max_contexts=cfg["max_contexts"],
            capabilities=uapi.names_to_caps(cfg["capabilities"]),
            memory_total=self.memory_total, name=DEVICE_NAME.encode(),
            uuid=self.identity.uuid.encode(), serial=self.identity.serial.encode(),
            pci_bus_id=self.pci_bus_id.encode(),
            fabric_endpoint=fabric_endpoint(self.index).encode(),
            driver_version=DRIVER_VERSION.encode(),
            firmware_version=str(manifest.get("version", "")).encode(),
            isa_version=str(manifest.get("isa_version", "")).encode(),
            isa_stepping=str(manifest.get("isa_stepping", "")).encode(),
        )

    @property
    def name(self) -> str:
        return f"accel{self.index}"

    @property
    def config(self) -> dict[str, Any]:
        """The booted image's device configuration (the shipped defaults before a boot)."""
        return self.fw_image.config if self.fw_image else dict(image.DEFAULT_PAYLOAD)

    def exclusive_owner(self) -> Context | None:
        return next((c for c in self.contexts.values() if c.exclusive and c.lost is None), None)

    def client_pids(self) -> set[int]:
        return {f.pid for f in self.files}

    # --- access control ----------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise the errno that says why the device cannot take new work right now."""
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

    # --- contexts ------------------------------------------------------------------------
    def create_context(self, f: OpenFile, exclusive: bool) -> Context:
        self.check_usable()
        if exclusive:
            others = sorted(p for p in self.client_pids() if p != f.pid)
            if others:
                raise DriverError(errno.EBUSY, f"{self.name} is open in other processes {others}")
        owner = self.exclusive_owner()
        if owner is not None and owner.file.pid != f.pid:
            raise DriverError(errno.EBUSY, f"{self.name} is held exclusively by pid {owner.file.pid}")
        ctx = Context(self.new_id(), f, exclusive)
        token = secrets.randbits(64)
        ctx.doorbell_path = os.path.join(self.mem_config.shm_dir, uapi.doorbell_name(ctx.id, token))
        os.mkfifo(ctx.doorbell_path, 0o600)
        os.chown(ctx.doorbell_path, f.uid, f.gid)
        ctx.files.append(ctx.doorbell_path)
        self.fw_send(abi.Op.CTX_CREATE, ctx.id, (token,))
        self.contexts[ctx.id] = ctx
        f.ctx = ctx
        ctx.default_queue = self.create_queue(ctx, uapi.ACCEL_QUEUE_PRIORITY_LOW)
        return ctx

    def destroy_context(self, ctx: Context) -> None:
        """Tear down in reverse order of creation: queues and mappings go with the firmware
        context, whose teardown the firmware confirms before memory and files are reused."""
        firmware_has_it = ctx.lost is None and self.fw is not None
        self.contexts.pop(ctx.id, None)
        ctx.file.ctx = None
        self.memory.release_context(ctx, firmware_has_it)
        if firmware_has_it:
            self._dying[ctx.id] = ctx
            self.fw_send(abi.Op.CTX_DESTROY, ctx.id)
        else:
            _unlink_all(ctx.files)
        ctx.lose("context destroyed")

    def enable_peer(self, ctx: Context, peer_index: int) -> None:
        """Let ``ctx``'s work reach device ``peer_index``'s memory held by the same process:
        map that process's device-local allocations there into ``ctx`` (and later ones as
        they are made, see ``DeviceMemory.alloc``)."""
        peer = next((d for d in self.all_devices if d.index == peer_index), None)
        if peer is None or peer is self:
            raise DriverError(errno.EINVAL, f"no peer device {peer_index} for {self.name}")
        holders = [c for c in peer.contexts.values() if c.file.pid == ctx.file.pid and c.lost is None]
        if not holders:
            raise DriverError(errno.EPERM, f"process {ctx.file.pid} holds no context on {peer.name}")
        if peer_index in ctx.peers:
            return
        ctx.peers.add(peer_index)
        for holder in holders:
            for alloc in holder.allocations.values():
                if alloc.backing.kind == uapi.MemKind.DEVICE and alloc.backing.owner is peer:
                    peer.memory.map_into(alloc, self, ctx)

    # --- queues ---------------------------------------------------------------------------
    def create_queue(self, ctx: Context, priority: int) -> Queue:
        qid, token = self.new_id(), secrets.randbits(64)
        path = os.path.join(self.mem_config.shm_dir, uapi.ring_name(qid, token))
        create_user_file(path, uapi.RING_FILE_SIZE, ctx.file.uid, ctx.file.gid)
        ctx.files.append(path)
        q = Queue(qid, ctx, priority, path)
        ctx.queues[q.id] = q
        self.fw_send(abi.Op.QUEUE_CREATE, ctx.id, (q.id, priority, token))
        return q

    def destroy_queue(self, q: Queue) -> None:
        """The queue's work already queued still runs; waits on its fence keep working.
        Retired queues that have drained are forgotten here, files and all (a wait on one
        is already satisfied in shared memory and never reaches the driver)."""
        ctx = q.ctx
        del ctx.queues[q.id]
        ctx.retired_queues[q.id] = q
        for old in [r for r in ctx.retired_queues.values() if r.completed >= r.submitted]:
            del ctx.retired_queues[old.id]
            ctx.files.remove(old.path)
            _unlink_all([old.path])
        self.fw_send(abi.Op.QUEUE_DESTROY, q.ctx.id, (q.id,))

    def import_queue(self, ctx: Context, peer_index: int, peer_qid: int) -> Queue:
        """Make a queue of this process on another device waitable by ``ctx``'s queues."""
        peer = next((d for d in self.all_devices if d.index == peer_index), None)
        if peer is None or peer is self:
            raise DriverError(errno.EINVAL, f"no peer device {peer_index} for {self.name}")
        source = next((q for c in peer.contexts.values() if c.file.pid == ctx.file.pid
                       and c.lost is None for q in c.queues.values() if q.id == peer_qid), None)
        if source is None:
            raise DriverError(errno.ENOENT, f"queue {peer_qid} on {peer.name} is not this process's")
        token = int(os.path.basename(source.path).rsplit("-", 1)[1], 16)
        local = Queue(self.new_id(), ctx, 0, source.path, fence_only=True)
        ctx.queues[local.id] = local
        self.fw_send(abi.Op.QUEUE_IMPORT, ctx.id, (local.id, peer_index, peer_qid, token))
        return local

    def submit_noop(self, ctx: Context) -> int:
        """The driver as producer on the context's default queue."""
        assert ctx.default_queue is not None
        seqno = ctx.default_queue.push(bytes(uapi.accel_packet(opcode=uapi.Op.NOP)))
        if self.fw is not None:
            self.fw.ring_doorbell()
        return seqno

    def _lose_contexts(self, reason: str) -> None:
        for ctx in self.contexts.values():
            ctx.lose(reason)

    # --- reset and fault injection -----------------------------------------------------
    def request_reset(self, reason: str = "reset requested") -> None:
        """Begin a device reset; returns at once (state reads in_reset until it is done)."""
        log.info("%s: %s", self.name, reason)
        self.state = uapi.DeviceState.IN_RESET
        self.failure = None  # a reset starts afresh; the next boot says how it went
        self._lose_contexts(f"{self.name} was reset ({reason})")
        self._reset_requested.set()

    def set_reset_hold(self, hold: bool) -> None:
        self.reset_hold = hold
        self._hold_changed.set()
        self._hold_changed = trio.Event()

    def hang_firmware(self) -> None:
        if self.fw is None:
            raise DriverError(errno.ENODEV, f"{self.name} has no running firmware")
        self.fw.send(abi.Op.HANG, 0, ())

    def _fail(self, err: int, message: str) -> None:
        log.warning("%s failed: %s", self.name, message)
        self.state = uapi.DeviceState.FAILED
        self.failure = (err, message)
        self._lose_contexts(f"{self.name} failed: {message}")

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
                await self._reset_requested.wait()
                self._reset_requested = trio.Event()
                while self.reset_hold:
                    await self._hold_changed.wait()
                resetting = True
        finally:
            await self._stop_firmware()

    async def _boot(self) -> None:
        self.state = uapi.DeviceState.BOOTING
        self.failure = None
        self.fw_image = None  # versions report what runs, not what ran before
        self._static_info = None
        self.sched_hold = False  # a fresh firmware schedules
        flags = abi.BootFlag.FAIL_BOOT if self.fw_boot_fail else 0
        try:
            img = load_image(self.firmware_dir)
            self.fw = await FirmwareProcess.boot(img, flags, self.name, self.memory_total,
                                                 self.mem_config)
        except DriverError as exc:
            self._fail(exc.errno, exc.message)
            return
        self.fw_image = img
        self._static_info = None
        if self._reset_requested.is_set():
            return  # a reset arrived while booting; serve() is skipped by the state check
        self.state = uapi.DeviceState.OPERATIONAL
        log.info("%s: firmware %s up (pid %d)", self.name, img.version, self.fw.pid)

    async def _stop_firmware(self) -> None:
        if self.fw is not None:
            fw, self.fw = self.fw, None
            self.memory.firmware_gone()
            for ctx in self._dying.values():
                _unlink_all(ctx.files)
            self._dying.clear()
            await fw.stop()

    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            for watcher in (self._irq_loop, self._watch_exit, self._watch_heartbeat,
                            self._watch_reset):
                nursery.start_soon(watcher, nursery.cancel_scope)

    async def _watch_reset(self, scope: trio.CancelScope) -> None:
        await self._reset_requested.wait()
        scope.cancel()

    async def _irq_loop(self, scope: trio.CancelScope) -> None:
        fw = self.fw
        assert fw is not None
        self.send_budget()
        while True:
            await fw.wait_irq()
            fw.flush()
            while (item := fw.mbx.cpl.pop()) is not None:
                try:
                    self._completion(*item[0])
                except Exception:  # a driver bug must not take the device down
                    log.exception("%s: driver bug handling completion %s", self.name, item[0])

    def _completion(self, op: int, status: int, ctx_id: int, *a: int) -> None:
        if op == abi.Op.FENCE:
            ctx = self.contexts.get(ctx_id)
            if ctx is not None and (q := ctx.queues.get(a[0]) or ctx.retired_queues.get(a[0])):
                q.wake()
        elif op == abi.Op.UNMAP:
            self.memory.unmapped(ctx_id, a[0])
        elif op == abi.Op.CTX_DESTROY:
            self.memory.context_destroyed(ctx_id)
            dead = self._dying.pop(ctx_id, None)
            if dead is not None:
                _unlink_all(dead.files)

    async def _watch_exit(self, scope: trio.CancelScope) -> None:
        assert self.fw is not None
        status = await self.fw.proc.wait()
        if self.state == uapi.DeviceState.OPERATIONAL:
            self._fail(errno.ENODEV, f"firmware process exited unexpectedly (status {status})")
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
                self._fail(
                    errno.ENODEV,
                    f"firmware stopped heart-beating (none for {now - last_change:.1f} s); "
                    f"reset the device",
                )
                scope.cancel()
                return
