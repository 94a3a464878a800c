"""A device's tenants: open files, contexts, queues and peers (ivpu's drv and job parts).

Everything a process makes through its file lives here: the open, the context with its
doorbell page and default queue, the queues it adds (rings it brings, or names imported
from its queues on a peer device), the peers it enables, and the losses that end them.
The tables themselves (``files``, ``contexts``) are the device's, which every subsystem
reads; this is who fills and empties them, bounded by :mod:`kmod_emul.limits`.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from abi import mailbox, uapi, userq
from abi import schedule as sched
from kmod_emul import limits, userfd
from kmod_emul.context import Context, DefaultQueue, OpenFile, Queue, new_ring_memfd, tgid_of
from kmod_emul.errors import DriverError
from kmod_emul.isolation import foreign_or_unknown

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice


class Tenants:
    """The open files, contexts, queues and peers of one device."""

    def __init__(self, dev: AccelDevice) -> None:
        self.dev = dev

    # --- open files ----------------------------------------------------------------------
    def open(self, tid: int, uid: int, gid: int) -> OpenFile:
        dev = self.dev
        dev.check_present()
        if dev.partition_mode > 1:
            raise DriverError(errno.EBUSY, f"{dev.name} is split into {dev.partition_mode} "
                                           "partitions; open one of them (accel-smi partition)")
        dev.check_usable()
        pid = tgid_of(tid)
        owner = self.exclusive_owner()
        if owner is not None and owner.file.pid != pid:
            raise DriverError(
                errno.EBUSY,
                f"{dev.name} is held exclusively by pid {owner.file.pid} (uid {owner.file.uid})",
            )
        f = OpenFile(dev, pid, uid, gid)
        dev.files.add(f)
        return f

    def release(self, f: OpenFile) -> None:
        if f.ctx is not None:
            self.destroy_context(f.ctx)
        f.replies.clear()
        self.dev.files.discard(f)

    def exclusive_owner(self) -> Context | None:
        return next((c for c in self.dev.contexts.values() if c.exclusive and c.lost is None),
                    None)

    def client_pids(self) -> set[int]:
        return {f.pid for f in self.dev.files}

    # --- usage, for the limits -----------------------------------------------------------
    def live_contexts(self) -> list[Context]:
        return [c for c in self.dev.contexts.values() if c.lost is None]

    def queue_count(self, pid: int | None = None) -> int:
        """Queues (rings and imported names) of live contexts, of ``pid`` or of everyone."""
        return sum(len(c.queues) for c in self.live_contexts() if pid in (None, c.file.pid))

    # --- contexts ------------------------------------------------------------------------
    def create_context(self, f: OpenFile, exclusive: bool, doorbell_fd: int, event_fd: int,
                       db_page_fd: int, *, diagnostic: bool = False, schedule: int = 0,
                       schedule_fd: int = -1, seed: int = 0) -> Context:
        """CTX_CREATE: the process brings its doorbell pipe, event pipe and doorbell page
        (imported here), and the decision table of a schedule that records or replays;
        the driver adds the default queue, a ring of its own."""
        dev = self.dev
        dev.check_usable()
        if exclusive:
            others = sorted(p for p in self.client_pids() if p != f.pid)
            if others:
                raise DriverError(errno.EBUSY, f"{dev.name} is open in other processes {others}")
        owner = self.exclusive_owner()
        if owner is not None and owner.file.pid != f.pid:
            raise DriverError(errno.EBUSY,
                              f"{dev.name} is held exclusively by pid {owner.file.pid}")
        live = self.live_contexts()
        lim = dev.limits
        limits.check(len(live), 1, lim.max_contexts, f"{dev.name} contexts", device_wide=True)
        limits.check(sum(c.file.pid == f.pid for c in live), 1, lim.max_contexts_per_process,
                     f"contexts of process {f.pid} on {dev.name}", device_wide=False)
        ctx_id = dev.new_id()
        # no firmware (kmod_emul/offline.py): no messages either, so no entry
        live = dev.fw.live.claim(ctx_id) if dev.fw is not None and dev.fw.live else None
        mine: list[int] = []
        table: userq.SharedWords | None = None
        try:
            mine.append(userfd.import_pipe(f.pid, doorbell_fd, False, "doorbell pipe"))
            mine.append(userfd.import_pipe(f.pid, event_fd, True, "event pipe"))
            mine.append(userfd.import_memfd(f.pid, db_page_fd, userq.ACCEL_DB_PAGE_SIZE,
                                            uapi.ACCEL_SEALS_PINNED, "doorbell page"))
            if _needs_table(schedule):  # before the page's mapping, which nothing here undoes
                mine.append(userfd.import_memfd(f.pid, schedule_fd, sched.SCHED_FILE_SIZE,
                                                uapi.ACCEL_SEALS_PINNED, "schedule table"))
            sent = mine[:]
            db = userq.SharedWords(mine[2], userq.ACCEL_DB_PAGE_SIZE)
            # a recording's faults are the driver's to note (its own mapping of the table)
            table = (userq.SharedWords(mine[3], sched.SCHED_FILE_SIZE)
                     if schedule & sched.SCHED_RECORD else None)
            ring_fd = new_ring_memfd(f"{dev.name}-default-queue")
            mine.append(ring_fd)
            ring = DefaultQueue(ring_fd)
            event_keep = os.dup(mine[1])
        except BaseException:
            if live is not None:
                live.clear()
            if table is not None:
                table.close()
            for fd in mine:
                os.close(fd)
            raise
        ctx = Context(ctx_id, f, exclusive, db, event_keep, ring, live=live,
                      diagnostic=diagnostic, schedule_table=table)
        dev.fw_send(ctx.id, mailbox.fw_ctx_create(live_slot=live.slot if live else 0,
                                                  schedule=schedule, seed=seed), fds=sent)
        dev.fw_send(ctx.id, mailbox.fw_queue_create(
            queue_id=0, priority=uapi.ACCEL_QUEUE_PRIORITY_LOW,
            doorbell_slot=userq.ACCEL_DB_DEFAULT_SLOT, depth=dev.limits.max_queue_depth),
            fds=[ring_fd])
        dev.contexts[ctx.id] = ctx
        f.ctx = ctx
        return ctx

    def destroy_context(self, ctx: Context) -> None:
        """Tear down in reverse order of creation: queues and mappings go with the firmware
        context, whose teardown the firmware confirms before the memory is reused. The
        driver's own descriptors and mappings of the context go at once."""
        dev = self.dev
        firmware_has_it = ctx.lost is None and dev.fw is not None
        dev.contexts.pop(ctx.id, None)
        ctx.file.ctx = None
        dev.memory.release_context(ctx, firmware_has_it)
        for mod in ctx.modules.values():
            mod.release()
        ctx.modules.clear()
        if firmware_has_it:
            dev.fw_send(ctx.id, mailbox.fw_ctx_destroy())
        ctx.lose("context destroyed")
        ctx.close()

    def lose_context(self, ctx: Context, reason: str) -> None:
        """Lose one context (a fault of context scope) and no other: the firmware stops its
        queues and tears it down as for a destroy (the memory mapped in it is held until
        that is confirmed); the driver keeps it, answering ENODEV, until its process closes
        it, as a context a reset lost."""
        if ctx.lost is not None:
            return
        if self.dev.fw is not None:
            self.dev.memory.hold_for_teardown(ctx)
            self.dev.fw_send(ctx.id, mailbox.fw_ctx_destroy())
        ctx.lose(reason)

    def lose_contexts(self, reason: str) -> list[int]:
        """Lose every live context; their ids (what a device-scope record names). The
        firmware, which runs on until the reset stops it, is told first (CTX_LOST), so
        nothing its processes ring once they are told starts."""
        lost = self.live_contexts()
        for ctx in lost:
            self.dev.fw_send(ctx.id, mailbox.fw_ctx_lost())
            ctx.lose(reason)
        return [c.id for c in lost]

    # --- peers ---------------------------------------------------------------------------
    def enable_peer(self, ctx: Context, peer_index: int) -> None:
        """Let ``ctx``'s work reach device ``peer_index``'s memory held by the same process:
        map that process's device-local allocations there into ``ctx`` (and later ones as
        they are made, see ``DeviceMemory.alloc``)."""
        peer = self.peer(peer_index)
        holders = [c for c in peer.tenants.live_contexts() if c.file.pid == ctx.file.pid]
        if not holders:
            raise self.dev.isolation.refuse("peer", ctx.file.pid, ctx.file.uid,
                                            f"process {ctx.file.pid} holds no context on "
                                            f"{peer.name}")
        if peer_index in ctx.peers:
            return
        ctx.peers.add(peer_index)
        for holder in holders:
            for alloc in holder.allocations.values():
                if alloc.backing.kind == uapi.MemKind.DEVICE and alloc.backing.owner is peer:
                    peer.memory.map_into(alloc, self.dev, ctx)

    def peer(self, index: int) -> AccelDevice:
        peer = next((d for d in self.dev.all_devices if d.index == index), None)
        if peer is None or peer is self.dev:
            raise DriverError(errno.EINVAL, f"no peer device {index} for {self.dev.name}")
        return peer

    def peer_contexts_of(self, pid: int) -> list[tuple[AccelDevice, Context]]:
        """Live contexts of ``pid`` on other devices that enabled access to this one."""
        me = self.dev
        return [(d, c) for d in me.all_devices if d is not me for c in d.contexts.values()
                if c.file.pid == pid and me.index in c.peers and c.lost is None]

    # --- queues --------------------------------------------------------------------------
    def _check_queue_limits(self, ctx: Context) -> None:
        dev = self.dev
        lim = dev.limits
        limits.check(self.queue_count(), 1, lim.max_queues, f"{dev.name} queues",
                     device_wide=True)
        limits.check(self.queue_count(ctx.file.pid), 1, lim.max_queues_per_process,
                     f"queues of process {ctx.file.pid} on {dev.name}", device_wide=False)
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
        q = Queue(self.dev.new_id(), priority, slot, fd)
        ctx.queues[q.id] = q
        self.dev.fw_send(ctx.id, mailbox.fw_queue_create(queue_id=q.id, priority=priority,
                                                         doorbell_slot=slot,
                                                         depth=self.dev.limits.max_queue_depth),
                         fds=[os.dup(fd)])
        return q

    def destroy_queue(self, ctx: Context, q: Queue) -> None:
        """The queue's work already queued still runs (its process waits for it in its own
        ring); the firmware forgets the queue once it drained. An imported name just goes."""
        del ctx.queues[q.id]
        q.close()
        self.dev.fw_send(ctx.id, mailbox.fw_queue_destroy(queue_id=q.id))

    def import_queue(self, ctx: Context, peer_index: int, peer_qid: int) -> Queue:
        """Make a queue of this process on another device waitable by ``ctx``'s queues."""
        peer = self.peer(peer_index)
        source = next((q for c in peer.tenants.live_contexts() if c.file.pid == ctx.file.pid
                       for q in c.queues.values() if q.id == peer_qid and not q.imported), None)
        if source is None:
            raise foreign_or_unknown(ctx.file, "queue", peer_qid, peer.contexts.values(),
                                     f"queue {peer_qid} on {peer.name} is not this process's")
        self._check_queue_limits(ctx)
        local = Queue(self.dev.new_id(), 0, -1, -1, imported=True)
        ctx.queues[local.id] = local
        self.dev.fw_send(ctx.id, mailbox.fw_queue_import(queue_id=local.id,
                                                         peer_index=peer_index,
                                                         peer_queue_id=peer_qid),
                         fds=[os.dup(source.fd)])
        return local

    def submit_noop(self, ctx: Context) -> int:
        """The driver as producer on the context's default queue: the packet, its doorbell
        slot, the page's sequence word, then the firmware's doorbell."""
        seqno = ctx.default_queue.push(userq.Nop().encode(),
                                       self.dev.limits.max_queue_depth)
        ctx.db.set(userq.DB_SLOTS + 8 * userq.ACCEL_DB_DEFAULT_SLOT, seqno)
        ctx.db.set(userq.DB_SEQ, ctx.db.get(userq.DB_SEQ) + 1)
        if self.dev.fw is not None:
            self.dev.fw.ring_doorbell()
        return seqno


def _needs_table(schedule: int) -> bool:
    """Whether a context's schedule (``accel_ctx_create.schedule``, checked) reads or
    writes its decision table: a replay or a recording."""
    return bool(schedule & sched.SCHED_RECORD) \
        or schedule & sched.SCHED_MODE_MASK == sched.Mode.REPLAY
