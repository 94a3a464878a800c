"""The firmware's boot ROM and its control loop.

Boot: the driver has copied an image into the mailbox; the boot ROM verifies it (magic,
checksum, mailbox ABI range), publishes its versions, sets READY and raises an interrupt.

Run: one loop consumes the mailbox (contexts, mappings, queues) and runs the queue
scheduler (:mod:`firmware.scheduler`) over the user-mode rings. Every pass does bounded work
(docs/containment.md): at most ``MAILBOX_BATCH`` control messages, and the scheduler's own
bounds; its cost grows with the rings that have work, not with idle ones. After activity
it keeps polling for a while, yielding the CPU, so back-to-back work costs no wake-up;
then it marks every context's doorbell page "sleeping" and sleeps in poll(2) (no limit on
descriptor numbers) on the driver's doorbell pipe, the contexts' doorbell pipes and the
engines' wake-up pipe (the machine has two cores: an idle firmware must not burn one). A
producer that sees "sleeping" writes one byte to its context's doorbell pipe.

Memory is released only when the device is done with it: an UNMAP is answered once every
packet written before it has completed, and a context's teardown once its queues stopped.
Everything a context held (mappings, rings, pipes) is closed when it is torn down.
"""

from __future__ import annotations

import argparse
import errno
import functools
import mmap
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from abi import fwimage, mailbox, schedule, uapi, userq
from abi._struct import Struct
from firmware import host_cpu, memory
from firmware.adversary import Adversary
from firmware.rings import FwContext, Ring
from firmware.scheduler import Scheduler
from firmware.telemetry import Counters, log_unexpected

#: Keep polling this long after the last work before sleeping (back-to-back work then
#: costs no wake-up), yielding the CPU between polls that found nothing. Never after a
#: pass that had work: under EEVDF a yield forfeits the rest of the caller's slice, and a
#: loop saturated by one tenant's launches, yielding after every pass, ran about one pass
#: per tick (4 ms) whenever a busy thread shared its CPU, and so did another tenant's
#: packet (docs/containment.md, "Worst-case delay"). Idle, the yield stays: the thread it
#: hands the CPU to is then mostly the waiter it serves, itself yielding, and a quiet
#: round trip measured slower both napping in poll(2) and polling without yielding (same
#: place).
SPIN_AFTER_ACTIVITY_S = 500e-6
#: ...but while a compute engine runs, the loop naps for the rest of that while instead
#: of yielding: the engines are threads on the host's CPUs, at a lower priority, and a
#: spinning loop kept a launch's second engine from starting until the first was nearly
#: done. The nap is a sleep in poll(2) with the contexts marked sleeping, so a doorbell
#: ends it at once (a plain sleep made every tenant's packet wait out the nap while
#: another tenant's grid ran), and so does the engine's completion (its wake-up pipe).
#: Naps of a fixed 50 us cost a pass and a poll each, two or three per engine launch.
#: Control messages handled per pass of the loop.
MAILBOX_BATCH = 256
_POLL_IN = select.POLLIN | select.POLLHUP | select.POLLERR


class Firmware:
    def __init__(self, mbx: mailbox.Mailbox, doorbell_fd: int, irq_fd: int,
                 backings: memory.Backings, vram_size: int, fdchan: mailbox.FdChannel,
                 jit_cache_dir: str, engine_share: int = 1) -> None:
        self.mbx = mbx
        self.doorbell_fd = doorbell_fd
        self.irq_fd = irq_fd
        self.backings = backings
        self.vram_size = vram_size
        self.fdchan = fdchan
        self.jit_cache_dir = jit_cache_dir
        #: the partitions the device's engines are divided among (1: the whole device)
        self.engine_share = engine_share
        self.contexts: dict[int, FwContext] = {}
        #: entries of the mailbox's context table no context holds
        self._free_stats_slots = list(range(mailbox.CTX_STATS_SLOTS - 1, -1, -1))
        self.heartbeat_s = 0.05
        self.counters = Counters(mailbox.STAT_NAMES)
        self._cpl_lock = threading.Lock()
        self._backlog: list[tuple[mailbox.Op, int, Struct, int]] = []
        #: (ctx, va, {ring: wptr it must complete}) waiting for the device to finish
        self._deferred_unmaps: list[tuple[FwContext, int, dict[Ring, int]]] = []
        self._closing: list[Ring] = []
        self._teardowns: list[FwContext] = []
        self.sched: Scheduler | None = None
        self.hung = False
        self._poller = select.poll()
        self._poller.register(doorbell_fd, select.POLLIN)
        #: context doorbells whose writers are all gone (EOF): no longer polled
        self._dead_doorbells: set[int] = set()
        #: every message of mailbox.COMMANDS -> its handler; one missing fails the boot
        self.device_handlers: dict[mailbox.Op, Callable[[int, Any], None]] = {
            mailbox.Op.HANG: self._on_hang,
            mailbox.Op.HOLD: self._on_hold,
            mailbox.Op.SET_BUDGET: self._on_set_budget,
            mailbox.Op.CTX_CREATE: self._on_ctx_create,
            mailbox.Op.LINK: self._on_link,
        }
        #: ... the messages about an existing context (one for a context that is gone is
        #: dropped, its descriptors closed)
        self.context_handlers: dict[mailbox.Op, Callable[[FwContext, Any], None]] = {
            mailbox.Op.CTX_DESTROY: self._on_ctx_destroy,
            mailbox.Op.CTX_LOST: self._on_ctx_lost,
            mailbox.Op.FAULT_REPLAY: self._on_fault_replayed,
            mailbox.Op.MAP: self._on_map,
            mailbox.Op.UNMAP: self._on_unmap,
            mailbox.Op.QUEUE_CREATE: self._on_queue_create,
            mailbox.Op.QUEUE_IMPORT: self._on_queue_import,
            mailbox.Op.QUEUE_DESTROY: self._on_queue_destroy,
            mailbox.Op.MODULE_LOAD: self._on_module_load,
            mailbox.Op.MODULE_UNLOAD: self._on_module_unload,
        }

    # boot -------------------------------------------------------------------------
    def boot(self) -> bool:
        self.mbx.set_fw_state(mailbox.FwState.BOOTING)
        missing = set(mailbox.COMMANDS) - set(self.device_handlers) - set(self.context_handlers)
        if missing:  # this firmware cannot serve the mailbox it claims to speak
            names = ", ".join(sorted(op.name for op in missing))
            self.mbx.set_fw_state(mailbox.FwState.BOOT_FAILED, errno.EIO,
                                  f"boot ROM: no handler for mailbox message {names}")
            self.interrupt()
            return False
        try:
            img = fwimage.parse(self.mbx.image())
            if not img.manifest["abi_min"] <= mailbox.MAILBOX_ABI <= img.manifest["abi_max"]:
                raise fwimage.ImageError(
                    f"image speaks mailbox ABI {img.manifest['abi_min']}..{img.manifest['abi_max']}, "
                    f"boot ROM {mailbox.MAILBOX_ABI}"
                )
            if self.mbx.boot_flags & mailbox.BootFlag.FAIL_BOOT:
                raise fwimage.ImageError("injected boot failure (debugfs fw_boot_fail)")
        except fwimage.ImageError as exc:
            self.mbx.set_fw_state(mailbox.FwState.BOOT_FAILED, errno.EIO, f"boot ROM: {exc}")
            self.interrupt()
            return False
        config = fwimage.partition_config(img.config, self.engine_share)
        self.heartbeat_s = config.get("heartbeat_interval_ms", 50) / 1000
        residency = memory.Residency(self.counters, self.vram_size)
        self.sched = Scheduler(config, residency, self.counters, self.jit_cache_dir)
        self.sched.contexts = self.contexts
        self.sched.on_fault = self._report_fault
        self._poller.register(self.sched.wake_fd, select.POLLIN)
        if has_cache_entries(self.jit_cache_dir):
            self.sched.kernels.warm_up()  # kernels ran here before: have the JIT ready
        self.mbx.set_versions(img.version, str(img.manifest["isa_version"]))
        self.mbx.beat(time.monotonic_ns())
        self.mbx.set_fw_state(mailbox.FwState.READY)
        self.interrupt()
        return True

    # to the driver -------------------------------------------------------------------
    def interrupt(self) -> None:
        try:
            os.write(self.irq_fd, b"\1")
        except BlockingIOError:
            pass  # the driver has not drained earlier interrupts; it will see the ring

    def post(self, op: mailbox.Op, ctx_id: int, payload: Struct, status: int = 0) -> None:
        """Queue a completion for the driver (any thread) and raise an interrupt."""
        with self._cpl_lock:
            self._backlog.append((op, ctx_id, payload, status))
            self._flush_locked()

    def _flush_locked(self) -> None:
        posted = 0
        while self._backlog:
            op, ctx_id, payload, status = self._backlog[0]
            if not self.mbx.cpl.push(op, ctx_id, payload, status):
                break  # ring full: the driver drains it on this interrupt; retried later
            self._backlog.pop(0)
            posted += 1
        if posted:
            self.mbx.set_stats(self.counters.snapshot())
            self.interrupt()

    def _report_fault(self, ring: Ring, fault: tuple[int, int, int, int]) -> None:
        """A ring's first fault, for the driver's fault log (any thread)."""
        seqno, code, opcode, address = fault
        self.post(mailbox.Op.FAULT, ring.ctx.id, mailbox.fw_fault(
            queue_id=ring.id, seqno=seqno, address=address & 0xFFFFFFFFFFFFFFFF,
            opcode=opcode & 0xFFFFFFFF), code)

    # control messages ----------------------------------------------------------------
    def handle(self, op: int, ctx_id: int, payload: bytes) -> None:
        """Decode one message and run its handler."""
        msg = mailbox.decode(mailbox.COMMANDS, op, payload)
        handler = self.device_handlers.get(mailbox.Op(op))
        if handler is not None:
            handler(ctx_id, msg)
        elif (ctx := self.contexts.get(ctx_id)) is None:
            self._drop(msg)  # the driver never names a context it did not create
        else:
            self.context_handlers[mailbox.Op(op)](ctx, msg)

    def _drop(self, msg: Struct) -> None:
        """A message for a context that is gone: its descriptors are closed, unused."""
        cookie = getattr(msg, "cookie", 0)
        if cookie:
            for fd in self.fdchan.take(cookie):
                os.close(fd)

    def _on_hang(self, ctx_id: int, msg: mailbox.fw_hang) -> None:
        assert self.sched is not None
        self.hung = self.sched.hung = True

    def _on_hold(self, ctx_id: int, msg: mailbox.fw_hold) -> None:
        assert self.sched is not None
        self.sched.held = bool(msg.hold)

    def _on_set_budget(self, ctx_id: int, msg: mailbox.fw_set_budget) -> None:
        assert self.sched is not None
        self.sched.residency.device_bytes = msg.device_bytes

    def _on_link(self, ctx_id: int, msg: mailbox.fw_link) -> None:
        assert self.sched is not None
        if msg.up:
            self.sched.links_down.discard(msg.device)
        else:
            self.sched.links_down.add(msg.device)
        self.post(mailbox.Op.LINK, 0, mailbox.fw_link(device=msg.device, up=msg.up))

    def _on_ctx_create(self, ctx_id: int, msg: mailbox.fw_ctx_create) -> None:
        fds = self.fdchan.take(msg.cookie)
        table = fds.pop() if len(fds) > 3 else None  # a schedule's decision table
        ctx = self._create_context(ctx_id, fds)
        ctx.live_table, ctx.live_slot = self.mbx.live, msg.live_slot
        # the default schedule makes no decisions; recording it keeps the fault position
        if msg.schedule & (schedule.SCHED_MODE_MASK | schedule.SCHED_RECORD):
            try:
                ctx.adversary = Adversary(msg.schedule, msg.seed, table,
                                          functools.partial(self._replay_fault, ctx_id))
            finally:
                if table is not None:
                    os.close(table)
        elif table is not None:
            os.close(table)
        if not 0 <= msg.live_slot < mailbox.LIVE_SLOTS:  # a driver bug: fail closed
            ctx.live_table, ctx.lost = None, True
            log_unexpected("CTX_CREATE", ValueError(f"live slot {msg.live_slot}"))

    def _replay_fault(self, ctx_id: int, e: schedule.Entry) -> None:
        """A replayed schedule reached a FAULT entry: the driver injects it (or refuses),
        then answers (``_on_fault_replayed``)."""
        self.post(mailbox.Op.FAULT_REPLAY, ctx_id, mailbox.fw_fault_replay(
            queue=e.queue, seqno=e.seqno, value=e.value, address=e.address))

    def _on_fault_replayed(self, ctx: FwContext, msg: mailbox.fw_fault_replayed) -> None:
        if ctx.adversary is not None:
            ctx.adversary.fault_answered()

    def _on_ctx_lost(self, ctx: FwContext, msg: mailbox.fw_ctx_lost) -> None:
        ctx.lost = True  # its device is being reset (or failed): the reset forgets it

    def _on_ctx_destroy(self, ctx: FwContext, msg: mailbox.fw_ctx_destroy) -> None:
        ctx.lost = True
        del self.contexts[ctx.id]
        if ctx.stats_slot >= 0:  # a context gone has no fdinfo
            self.mbx.set_ctx_stats(ctx.stats_slot, 0, (0, 0))
            self._free_stats_slots.append(ctx.stats_slot)
            ctx.stats_slot = -1
        for ring in ctx.queues.values():
            ring.faulted = True  # what is still queued completes as cancelled, unrun
        self._teardowns.append(ctx)

    def _on_map(self, ctx: FwContext, msg: mailbox.fw_map) -> None:
        self._map(ctx, msg.va, msg.size, msg.kind, msg.owner, msg.offset, msg.cookie)

    def _on_unmap(self, ctx: FwContext, msg: mailbox.fw_unmap) -> None:
        targets = {r: r.wptr for r in ctx.queues.values() if not r.fence_only}
        self._deferred_unmaps.append((ctx, msg.va, targets))

    def _on_queue_create(self, ctx: FwContext, msg: mailbox.fw_queue_create) -> None:
        self._add_ring(mailbox.Op.QUEUE_CREATE, ctx, msg.queue_id, msg.priority,
                       msg.doorbell_slot, msg.cookie, fence_only=False,
                       depth=min(max(1, msg.depth), userq.RING_SLOTS))

    def _on_queue_import(self, ctx: FwContext, msg: mailbox.fw_queue_import) -> None:
        self._add_ring(mailbox.Op.QUEUE_IMPORT, ctx, msg.queue_id, 0, -1, msg.cookie,
                       fence_only=True)

    def _on_queue_destroy(self, ctx: FwContext, msg: mailbox.fw_queue_destroy) -> None:
        ring = ctx.queues.get(msg.queue_id)
        if ring is not None and ring.fence_only:  # a name for another device's queue
            del ctx.queues[msg.queue_id]
            ring.close()
        elif ring is not None:
            ring.closing = True
            self._closing.append(ring)

    def _on_module_load(self, ctx: FwContext, msg: mailbox.fw_module_load) -> None:
        self._load_module(ctx, msg.module_id, msg.size, msg.cookie)

    def _on_module_unload(self, ctx: FwContext, msg: mailbox.fw_module_unload) -> None:
        ctx.unload(msg.module_id)

    def _create_context(self, ctx_id: int, fds: list[int]) -> FwContext:
        doorbell, event, db_fd = fds
        try:
            db = userq.SharedWords(db_fd, userq.ACCEL_DB_PAGE_SIZE)
        finally:
            os.close(db_fd)
        ctx = self.contexts[ctx_id] = FwContext(ctx_id, doorbell, event, db)
        self._poller.register(doorbell, select.POLLIN)
        ctx.seen_seq = db.get(userq.DB_SEQ)
        if self._free_stats_slots:
            ctx.stats_slot = self._free_stats_slots.pop()
            self.mbx.set_ctx_stats(ctx.stats_slot, ctx_id, ctx.engine_time.snapshot())
        return ctx

    def _publish_stats(self) -> None:
        """The counters and every context's engine time, for the driver (control loop
        only: it alone changes the contexts)."""
        self.mbx.set_stats(self.counters.snapshot())
        for ctx in self.contexts.values():
            if ctx.stats_slot >= 0:
                self.mbx.set_ctx_stats(ctx.stats_slot, ctx.id, ctx.engine_time.snapshot())

    def _map(self, ctx: FwContext, va: int, size: int, kind: int, owner: int, offset: int,
             cookie: int) -> None:
        try:
            if kind == uapi.MemKind.DEVICE:
                data = self.backings.vram_window(owner, size, offset)
            else:
                (fd,) = self.fdchan.take(cookie)
                try:
                    data = memory.Backings.host(fd, size)
                finally:
                    os.close(fd)
        except (OSError, ValueError, memory.Fault) as exc:
            # unmappable (the firmware's address space is full?): say so; packets that
            # touch it fault with EFAULT, as for any address the context lacks
            code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.ENOMEM
            self.post(mailbox.Op.MAP, ctx.id, mailbox.fw_map_done(va=va), status=code)
            return
        resident = None
        if kind == uapi.MemKind.MANAGED:
            resident = np.zeros(-(-size // memory.MANAGED_PAGE), bool)
        ctx.space.add(memory.Mapping(va, size, kind, owner, data, resident))

    def _add_ring(self, op: int, ctx: FwContext, qid: int, priority: int, slot: int,
                  cookie: int, fence_only: bool, depth: int = userq.RING_SLOTS) -> None:
        assert self.sched is not None
        (fd,) = self.fdchan.take(cookie)
        try:
            ring = Ring(ctx, qid, priority, slot, fd, fence_only=fence_only, depth=depth)
        except (OSError, ValueError) as exc:
            self.post(op, ctx.id, mailbox.fw_queue_done(queue_id=qid),
                      status=getattr(exc, "errno", 0) or errno.ENOMEM)
            return
        finally:
            os.close(fd)
        ctx.queues[qid] = ring
        if not fence_only:
            if ctx.adversary is not None:
                ctx.adversary.queue_added(ring)
            self.sched.add(ring)

    def _load_module(self, ctx: FwContext, module_id: int, size: int, cookie: int) -> None:
        """Read the (sealed, checked) image now -- a bounded copy, ACCEL_MODULE_MAX -- and
        leave the parsing to the scheduler's loader thread."""
        assert self.sched is not None
        (fd,) = self.fdchan.take(cookie)
        try:
            raw = os.pread(fd, min(size, uapi.ACCEL_MODULE_MAX), 0)
        finally:
            os.close(fd)
        self.sched.kernels.load_module(ctx, module_id, raw)

    def _housekeeping(self) -> None:
        """Unmaps, queue closes and context teardowns whose work has completed."""
        assert self.sched is not None
        for ctx in [c for c in self._teardowns if not any(r.busy for r in c.queues.values())]:
            self._teardowns.remove(ctx)
            self._teardown(ctx)
        done = [d for d in self._deferred_unmaps  # a closed ring runs nothing any more
                if all(r.mem.closed or r.completed >= w for r, w in d[2].items())]
        for d in done:
            self._deferred_unmaps.remove(d)
            self._unmap(d[0], d[1])
            self.post(mailbox.Op.UNMAP, d[0].id, mailbox.fw_unmap_done(va=d[1]))
        for ring in [r for r in self._closing if r.completed >= r.wptr and not r.busy]:
            self._closing.remove(ring)
            self.sched.remove(ring)
            if ring.ctx.queues.get(ring.id) is ring:
                del ring.ctx.queues[ring.id]
            ring.close()

    def _unmap(self, ctx: FwContext, va: int) -> None:
        m = ctx.space.remove(va)
        ctx.drop_bindings()
        if m is not None and m.resident is not None:
            assert self.sched is not None
            self.sched.residency.drop(m)

    def _teardown(self, ctx: FwContext) -> None:
        """Forget a stopped context and give back everything it held: rings, mappings,
        pipes, its doorbell page (the driver settles the unmaps it still owed)."""
        assert self.sched is not None
        for ring in ctx.queues.values():
            self.sched.remove(ring)
        self._closing = [r for r in self._closing if r.ctx is not ctx]
        self._deferred_unmaps = [d for d in self._deferred_unmaps if d[0] is not ctx]
        for m in ctx.space.mappings():
            self._unmap(ctx, m.va)
        if ctx.doorbell not in self._dead_doorbells:
            self._poller.unregister(ctx.doorbell)
        self._dead_doorbells.discard(ctx.doorbell)
        ctx.close()
        self.post(mailbox.Op.CTX_DESTROY, ctx.id, mailbox.fw_ctx_destroy_done())

    # run ----------------------------------------------------------------------------
    def drain_mailbox(self) -> int:
        done = 0
        while not self.hung and done < MAILBOX_BATCH and (item := self.mbx.cmd.pop()) is not None:
            op, _status, ctx_id, payload = item
            try:
                self.handle(op, ctx_id, payload)
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the device
                log_unexpected(f"control message {op}", exc)
            done += 1
        if self._backlog:
            with self._cpl_lock:
                self._flush_locked()
        return done

    def _sleep(self, timeout: float, stats: bool = True) -> None:
        """Mark the contexts sleeping, re-check, and sleep until a doorbell or the timeout
        (``stats``: publish the counters first, as whenever the device idles; a nap while
        the engines run skips that)."""
        assert self.sched is not None
        if stats:
            self._publish_stats()
        contexts = list(self.contexts.values())
        for c in contexts:
            c.db.set(userq.DB_FW_SLEEPING, 1)
        userq.full_barrier()  # producers store their slot then load "sleeping"; we store, load
        # Always poll, if only for a moment: a held or hung firmware with work queued must
        # still notice the driver going away (the doorbell's EOF), or it would outlive a
        # killed daemon spinning a CPU.
        runnable = not (self.hung or self.sched.held) and (
            self.sched.pending() or self.sched.doorbells_moved() or self.mbx.cmd.pending())
        if runnable:
            timeout = 0.0
        timeout = min(timeout, self.sched.held_for_s(), self.sched.poll_in_s())
        for fd, _events in self._poller.poll(timeout * 1000):
            self._drain_fd(fd)
        for c in contexts:
            if not c.db.mem.closed:
                c.db.set(userq.DB_FW_SLEEPING, 0)

    def _drain_fd(self, fd: int) -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        if fd == self.doorbell_fd and data == b"":
            self.mbx.set_fw_state(mailbox.FwState.HALTED)
            sys.exit(0)  # the driver closed the doorbell: it is gone or resetting us
        if self.sched is not None and fd == self.sched.wake_fd:
            self.sched.drain_wakeups()
        elif data == b"" and fd != self.doorbell_fd:
            # every writer of a context's doorbell is gone (its process exited): stop
            # polling it, or poll(2) would report it readable forever
            self._poller.unregister(fd)
            self._dead_doorbells.add(fd)

    def run(self) -> int:
        assert self.sched is not None
        host_cpu.short_slice()
        boost = host_cpu.Boost()
        last_beat = time.monotonic()
        last_work = 0.0
        while True:
            self.sched.scan_doorbells()
            self.sched.publish()  # before the mailbox is drained: see publish()
            work = self.drain_mailbox() + self.sched.poll(self._news)
            if self._deferred_unmaps or self._closing or self._teardowns:
                self._housekeeping()
            now = time.monotonic()
            if work:
                last_work = now
            if self.sched.user_taken:
                boost.working(now)
            else:
                boost.idle()
            if not self.hung and now - last_beat >= self.heartbeat_s:
                self.mbx.beat(time.monotonic_ns())
                self._publish_stats()
                last_beat = now
            if now - last_work < SPIN_AFTER_ACTIVITY_S and not self.hung:
                if self.sched.compute.busy():  # lend the CPU; wake for a doorbell or its end
                    self._sleep(SPIN_AFTER_ACTIVITY_S - (now - last_work), stats=False)
                    continue
                if not work:  # idle: let others run, but stay awake (SPIN_AFTER_ACTIVITY_S)
                    os.sched_yield()
                self._poll_doorbell()
                continue
            self._sleep(max(0.0, self.heartbeat_s - (now - last_beat)))

    def _news(self) -> bool:
        """A doorbell moved or the driver sent a message: what a pass stops early for."""
        assert self.sched is not None
        return self.sched.doorbells_moved() or self.mbx.cmd.pending() > 0

    def _poll_doorbell(self) -> None:
        """While spinning, still notice the driver closing the doorbell (it went away)."""
        ready, _, _ = select.select([self.doorbell_fd], [], [], 0)
        if ready:
            self._drain_fd(self.doorbell_fd)


def has_cache_entries(cache_dir: str | os.PathLike[str]) -> bool:
    """Whether the persistent kernel cache holds anything (its entries live in
    two-character shard directories). Then the JIT warms up at boot, off the hot path:
    a firmware on a machine that never ran a kernel does not pay for numba."""
    try:
        with os.scandir(cache_dir) as it:
            return any(e.is_dir() and len(e.name) == 2 for e in it)
    except OSError:
        return False


def _vram_fds(text: str) -> dict[int, int]:
    """'0:5,1:6' -> {device 0: fd 5, device 1: fd 6}."""
    pairs = (item.split(":") for item in text.split(",") if item)
    return {int(dev): int(fd) for dev, fd in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firmware", description=__doc__)
    parser.add_argument("--mailbox-fd", type=int, required=True)
    parser.add_argument("--doorbell-fd", type=int, required=True)
    parser.add_argument("--irq-fd", type=int, required=True)
    parser.add_argument("--vram-fds", type=_vram_fds, required=True,
                        help="DEV:FD,... every device's VRAM memfd (peers included)")
    parser.add_argument("--vram-size", type=int, required=True)
    parser.add_argument("--fd-channel", type=int, required=True,
                        help="socket on which the driver hands over client descriptors")
    parser.add_argument("--jit-cache", required=True, help="the persistent kernel cache")
    parser.add_argument("--engine-share", type=int, default=1,
                        help="a compute partition: the engines are shared among this many")
    args = parser.parse_args(argv)
    # The driver stops us by closing the doorbell or with SIGTERM/SIGKILL; a Ctrl-C meant
    # for the daemon's terminal must not crash the device.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.setswitchinterval(0.0002)  # engine threads get the GIL back quickly from the loop
    os.set_blocking(args.irq_fd, False)
    os.set_blocking(args.doorbell_fd, False)
    buf = mmap.mmap(args.mailbox_fd, mailbox.MAILBOX_SIZE)
    backings = memory.Backings.open(args.vram_fds, args.vram_size)
    chan = socket.socket(fileno=args.fd_channel)
    chan.setblocking(False)  # what a message names was sent before it: never wait for it
    fdchan = mailbox.FdChannel(chan)
    fw = Firmware(mailbox.Mailbox(memoryview(buf)), args.doorbell_fd, args.irq_fd, backings,
                  args.vram_size, fdchan, args.jit_cache, args.engine_share)
    if not fw.boot():
        return 1
    return fw.run()
