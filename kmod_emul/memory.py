"""Memory objects: allocation classes, their backings, address spaces, IPC and peers.

The driver's ``gem``: it owns the books, the firmware owns the bytes' use.

* **Backings** are where bytes live. Device-local memory is a range of the device's VRAM
  (one memfd per device, handed to every firmware at boot so peers can reach it; never
  mapped into a user process). Host-visible kinds are the caller's own memory: a memfd it
  sealed against shrinking (:mod:`kmod_emul.userfd`), handed to the firmware, which maps
  it; the driver keeps no descriptor of it. Pinned bytes and host allocations are
  counted per process and per device against :mod:`kmod_emul.limits`.
* **Allocations** are a context's handle on a backing, at a device virtual address. VAs are
  unique per (device, process), so a process's contexts never alias and peer devices can
  map the same address.
* **Lifetime**: a backing lives while any allocation refers to it (exporter or importer,
  like a dma-buf), and after that until every firmware that mapped it confirmed the unmap,
  which it does only once the work queued before the unmap completed. Freed VRAM is
  punched out of the memfd, so the next owner reads zeros, never a previous tenant's data.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from abi import mailbox, uapi
from kmod_emul import limits, userfd
from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.context import Context
    from kmod_emul.device import AccelDevice

_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
VA_GUARD = 64 * 1024  # unmapped gap after each allocation: an overrun faults
#: The device a MAP names to fail on purpose (debugfs ``map_fail``): no firmware has its
#: VRAM, so the firmware refuses the MAP through the path any unreachable memory takes.
NO_DEVICE = 0xFFFFFFFF


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class VramFile:
    """A device's VRAM: a sparse memfd this object creates and owns. The driver reaches it
    only through the object, never by a number kept elsewhere: once ``close`` has run,
    every use raises (ValueError, as a closed Python file does), so a descriptor number
    the kernel has since given to another file is never acted on. A bare number did
    outlive its file: a rolled-back partition's VRAM was closed while a tenant still held
    memory in it, the next mode change's memfds took the number, and that tenant's free
    punched a hole in another tenant's buffer (docs/partitions.md, "Removal")."""

    def __init__(self, label: str, size: int) -> None:
        self._fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)  # sparse: pages exist only once written
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def fileno(self) -> int:
        """The descriptor, while this object holds it (to hand to a firmware process)."""
        if self._fd < 0:
            raise ValueError("use of a closed VRAM file")
        return self._fd

    def punch(self, offset: int, size: int) -> None:
        """Give ``size`` bytes at ``offset`` back: the next owner reads zeros."""
        fd = self.fileno()
        if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                           ctypes.c_long(offset), ctypes.c_long(size)) != 0:
            os.pwrite(fd, bytes(size), offset)  # no hole punching: zero it

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class VramAllocator:
    """First-fit over a sorted free list with coalescing; offsets page aligned.

    Bad pages (kmod_emul/ras.py) are never in the free list, so no allocation can hold or
    span one: a free bad page is cut out of it at once, one inside an allocation when that
    allocation is freed. Their bytes are ``reserved``: neither used nor free, so that
    ``used + reserved + free == total`` whatever was retired."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.reserved = 0
        self._free: list[tuple[int, int]] = [(0, total)]  # (offset, size), sorted
        self._bad: list[int] = []  # page offsets kept out of allocation, sorted

    def alloc(self, size: int) -> int | None:
        size = _round_up(max(size, 1), uapi.ACCEL_PAGE_SIZE)
        for i, (off, avail) in enumerate(self._free):
            if avail >= size:
                if avail == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, avail - size)
                self.used += size
                return off
        return None

    def free(self, off: int, size: int) -> None:
        size = _round_up(max(size, 1), uapi.ACCEL_PAGE_SIZE)
        self.used -= size
        start = off
        for bad in self._bad[bisect.bisect_left(self._bad, off):
                             bisect.bisect_left(self._bad, off + size)]:
            self._insert(start, bad - start)
            self.reserved += uapi.ACCEL_PAGE_SIZE
            start = bad + uapi.ACCEL_PAGE_SIZE
        self._insert(start, off + size - start)

    def exclude(self, page: int) -> bool:
        """Keep the page at offset ``page`` out of every later allocation. True if it was
        free (it is reserved now); False if an allocation holds it (it is reserved once
        that is freed) or it was excluded before."""
        i = bisect.bisect_left(self._bad, page)
        if i < len(self._bad) and self._bad[i] == page:
            return False
        self._bad.insert(i, page)
        j = bisect.bisect_right(self._free, (page, self.total)) - 1
        if j < 0 or not self._free[j][0] <= page < self._free[j][0] + self._free[j][1]:
            return False
        off, size = self._free.pop(j)
        self._insert(off, page - off)
        self._insert(page + uapi.ACCEL_PAGE_SIZE, off + size - page - uapi.ACCEL_PAGE_SIZE)
        self.reserved += uapi.ACCEL_PAGE_SIZE
        return True

    def _insert(self, off: int, size: int) -> None:
        """Put a free range back, merged with its neighbours (an empty one is nothing)."""
        if size <= 0:
            return
        i = bisect.bisect_left(self._free, (off, 0))
        self._free.insert(i, (off, size))
        if i + 1 < len(self._free) and off + size == self._free[i + 1][0]:
            self._free[i] = (off, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])


@dataclass(eq=False)
class Backing:
    id: int
    kind: uapi.MemKind
    size: int
    owner: AccelDevice
    offset: int = 0  # VRAM offset (device-local)
    token: int = 0  # the export secret (device-local)
    #: host kinds: our descriptor of the process's memfd until the firmware took it
    fd: int = -1
    exported: bool = False
    pid: int = 0  # the allocating process, charged until the bytes are released
    refs: int = 0  # allocations referring to it
    pending: int = 0  # firmware mappings whose removal is not yet confirmed
    released: bool = False

    def release_if_unused(self) -> None:
        if self.refs or self.pending or self.released:
            return
        self.released = True
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.owner.memory.release(self)


@dataclass(eq=False)
class Allocation:
    handle: int
    ctx: Context
    va: int
    backing: Backing
    #: (device, context) pairs whose firmware maps it: its own, plus peer contexts
    maps: list[tuple[AccelDevice, Context]] = field(default_factory=list)


class DeviceMemory:
    """One device's memory books."""

    def __init__(self, device: AccelDevice, vram_file: VramFile, process_limit: int) -> None:
        self.device = device
        self.vram_file = vram_file
        #: the device was removed: its VRAM file closes once no allocation holds a byte
        #: of it (``retire``)
        self._retired = False
        self.vram = VramAllocator(device.memory_total)
        self.process_limit = process_limit
        self.backings: dict[int, Backing] = {}
        #: (ctx id, va) -> backing, for UNMAPs the firmware has not confirmed yet
        self.unmapping: dict[tuple[int, int], Backing] = {}
        #: ctx id -> backings, for context teardowns the firmware has not confirmed yet
        self.teardown: dict[int, list[Backing]] = {}
        self._va_next: dict[int, int] = {}
        #: per pid: device-local bytes, pinned (host) bytes, host allocations, all until
        #: released (after the firmware let go)
        self._pid_bytes: dict[int, int] = {}
        self._pid_pinned: dict[int, int] = {}
        self._pid_host_allocs: dict[int, int] = {}

    # --- accounting ----------------------------------------------------------------------
    def process_bytes(self, pid: int) -> int:
        """Device-local bytes allocated by ``pid`` here and not yet released."""
        return self._pid_bytes.get(pid, 0)

    def pid_bytes(self) -> dict[int, int]:
        return dict(self._pid_bytes)

    def pinned_bytes(self, pid: int | None = None) -> int:
        """Host memory pinned here (by ``pid``, or by everyone) and not yet released."""
        if pid is None:
            return sum(self._pid_pinned.values())
        return self._pid_pinned.get(pid, 0)

    def host_allocations(self, pid: int | None = None) -> int:
        if pid is None:
            return sum(self._pid_host_allocs.values())
        return self._pid_host_allocs.get(pid, 0)

    def pending_free(self, pid: int) -> int:
        """Bytes ``pid`` freed that are not back yet (the firmware has not let go)."""
        return sum(b.size for b in self.backings.values()
                   if b.pid == pid and b.refs == 0 and not b.released)

    def context_bytes(self, ctx: Context) -> int:
        return sum(a.backing.size for a in ctx.allocations.values()
                   if a.backing.kind == uapi.MemKind.DEVICE)

    @staticmethod
    def _charge(books: dict[int, int], pid: int, amount: int) -> None:
        books[pid] = books.get(pid, 0) + amount
        if not books[pid]:
            del books[pid]

    def release(self, b: Backing) -> None:
        """A backing's bytes are unused by everyone: give them back, tell the process."""
        size = _round_up(max(b.size, 1), uapi.ACCEL_PAGE_SIZE)
        if b.kind == uapi.MemKind.DEVICE:
            self._charge(self._pid_bytes, b.pid, -b.size)
            self.vram_file.punch(b.offset, size)
            self.vram.free(b.offset, b.size)
            self.device.send_budget()
        else:
            self._charge(self._pid_pinned, b.pid, -size)
            self._charge(self._pid_host_allocs, b.pid, -1)
        self.backings.pop(b.id, None)
        for ctx in self.device.tenants.live_contexts():  # a waiter for free memory looks again
            if ctx.file.pid == b.pid:
                ctx.signal()
        self._close_if_drained()

    def retire(self) -> None:
        """The device was removed (kmod_emul/partition.py): close its VRAM file once no
        device-local backing is left in it -- at once if none is, else when the lost
        contexts holding the last ones are closed by their processes (memory outlives a
        removed device until then, as after Linux's ``drm_dev_unplug``), and only after the
        firmware let go of every mapping (``firmware_gone`` releases what it owed)."""
        self._retired = True
        self._close_if_drained()

    def _close_if_drained(self) -> None:
        if self._retired and not any(b.kind == uapi.MemKind.DEVICE
                                     for b in self.backings.values()):
            self.vram_file.close()

    # --- allocate / free ----------------------------------------------------------------------
    def _new_va(self, pid: int, size: int) -> int:
        base = (self.device.index + 1) << uapi.ACCEL_VA_DEVICE_SHIFT
        nxt = self._va_next.get(pid, 1 << 32)
        self._va_next[pid] = nxt + _round_up(max(size, 1), VA_GUARD) + VA_GUARD
        return base + nxt

    def alloc(self, ctx: Context, size: int, kind: uapi.MemKind, fd: int) -> Allocation:
        """MEM_ALLOC: device-local memory from the VRAM (``fd`` -1), or the process's own
        sealed memfd ``fd`` pinned for the device."""
        dev = self.device
        if size == 0 or size > 1 << 44:
            raise DriverError(errno.EINVAL, f"allocation size {size} out of range")
        pid = ctx.file.pid
        handle = dev.new_id()
        backing = Backing(handle, kind, size, dev, token=secrets.randbits(64), pid=pid)
        if kind == uapi.MemKind.DEVICE:
            if fd != -1:
                raise DriverError(errno.EINVAL, f"device-local memory takes no descriptor "
                                                f"(fd must be -1, got {fd})")
            if self.process_limit and self.process_bytes(pid) + size > self.process_limit:
                raise DriverError(
                    errno.ENOMEM, f"process {pid} would hold {self.process_bytes(pid) + size} "
                                  f"bytes of {dev.name}, over its limit {self.process_limit}")
            offset = self.vram.alloc(size)
            if offset is None:
                raise DriverError(errno.ENOMEM, f"{dev.name}: {size} bytes requested, "
                                                f"{self.free_bytes()} free")
            backing.offset = offset
            self._charge(self._pid_bytes, pid, size)
        else:
            pinned = _round_up(size, uapi.ACCEL_PAGE_SIZE)
            lim = dev.limits
            limits.check(self.pinned_bytes(), pinned, lim.max_pinned_bytes,
                         f"bytes pinned on {dev.name}", device_wide=True)
            limits.check(self.pinned_bytes(pid), pinned, lim.max_pinned_bytes_per_process,
                         f"bytes pinned by process {pid} on {dev.name}", device_wide=False)
            limits.check(self.host_allocations(), 1, lim.max_host_allocations,
                         f"host allocations on {dev.name}", device_wide=True)
            limits.check(self.host_allocations(pid), 1, lim.max_host_allocations_per_process,
                         f"host allocations of process {pid} on {dev.name}", device_wide=False)
            backing.fd = userfd.import_memfd(pid, fd, size, uapi.ACCEL_SEALS_PINNED,
                                             f"{kind.name.lower()} memory")
            self._charge(self._pid_pinned, pid, pinned)
            self._charge(self._pid_host_allocs, pid, 1)
        self.backings[handle] = backing
        alloc = self._attach(ctx, backing)
        if kind == uapi.MemKind.DEVICE:
            dev.send_budget()
        return alloc

    def _attach(self, ctx: Context, backing: Backing) -> Allocation:
        """``ctx``'s new handle on ``backing`` (an allocation's or an import's), mapped in
        ``ctx`` and, for device-local memory, in every context of the same process that
        enabled access to this device already (``PEER_ENABLE`` maps what the process holds
        when it is called, this what it gets later). An import once missed that second
        step: a buffer imported after the process's first peer copy from this device was
        mapped nowhere else, and the peer's copy of it faulted (EFAULT)."""
        alloc = Allocation(self.device.new_id(), ctx, self._new_va(ctx.file.pid, backing.size),
                           backing)
        backing.refs += 1
        ctx.allocations[alloc.handle] = alloc
        self.map_into(alloc, self.device, ctx)
        if backing.kind == uapi.MemKind.DEVICE:
            for peer_dev, peer_ctx in self.device.tenants.peer_contexts_of(ctx.file.pid):
                self.map_into(alloc, peer_dev, peer_ctx)
        return alloc

    def map_into(self, alloc: Allocation, dev: AccelDevice, ctx: Context) -> None:
        """Map into a context's address space: VRAM by offset; host memory by handing the
        firmware the process's memfd (the driver keeps no copy: host memory is mapped into
        its allocating context only, never a peer's)."""
        b = alloc.backing
        owner = b.owner.index
        if b.kind == uapi.MemKind.DEVICE and dev.map_fail:  # debugfs fault injection
            dev.map_fail -= 1
            owner = NO_DEVICE  # the firmware fails it as any memory it cannot reach
        msg = mailbox.fw_map(va=alloc.va, size=b.size, kind=int(b.kind), owner=owner,
                             offset=b.offset)
        if b.kind == uapi.MemKind.DEVICE:
            dev.fw_send(ctx.id, msg)
        else:
            fd, b.fd = b.fd, -1
            dev.fw_send(ctx.id, msg, fds=[fd])
        alloc.maps.append((dev, ctx))

    def free(self, ctx: Context, alloc: Allocation) -> Backing:
        """Drop the handle now; release the bytes once every firmware is done with them."""
        del ctx.allocations[alloc.handle]
        b = alloc.backing
        b.refs -= 1
        for dev, map_ctx in alloc.maps:
            if map_ctx.lost is None and dev.fw is not None:
                b.pending += 1
                dev.memory.unmapping[(map_ctx.id, alloc.va)] = b
                dev.fw_send(map_ctx.id, mailbox.fw_unmap(va=alloc.va))
        alloc.maps.clear()
        b.release_if_unused()
        return b

    def unmapped(self, ctx_id: int, va: int) -> None:
        """The firmware confirmed an UNMAP."""
        b = self.unmapping.pop((ctx_id, va), None)
        if b is not None:
            b.pending -= 1
            b.release_if_unused()

    # --- contexts ----------------------------------------------------------------------------
    def release_context(self, ctx: Context, firmware_has_it: bool) -> None:
        """A context is destroyed: drop its allocations; its firmware confirms with CTX_DESTROY."""
        if firmware_has_it:
            self.hold_for_teardown(ctx)
        else:
            self._forget_mappings(ctx)
        # the mappings of its allocations in other contexts (peers) are unmapped normally
        for alloc in list(ctx.allocations.values()):
            self.free(ctx, alloc)

    def hold_for_teardown(self, ctx: Context) -> None:
        """The firmware is told to tear ``ctx`` down (CTX_DESTROY): every backing mapped in
        it stays held until the firmware confirms (``context_destroyed``), since work it
        had queued may still touch them; the mappings leave the books now, as they go with
        the firmware context, not by an unmap each."""
        held = [a.backing for a in self._allocations_mapped_in(ctx)]
        for b in held:
            b.pending += 1
        self._forget_mappings(ctx)
        self.teardown[ctx.id] = held

    def _allocations_mapped_in(self, ctx: Context) -> list[Allocation]:
        """Allocations of any device mapped in ``ctx`` (its own, imports, peers' memory)."""
        everywhere = [a for dev in self.device.all_devices for c in dev.contexts.values()
                      for a in c.allocations.values()]
        found = {id(a): a for a in [*ctx.allocations.values(), *everywhere]
                 if any(c is ctx for _, c in a.maps)}
        return list(found.values())

    def _forget_mappings(self, ctx: Context) -> None:
        for alloc in self._allocations_mapped_in(ctx):
            alloc.maps = [(d, c) for d, c in alloc.maps if c is not ctx]

    def context_destroyed(self, ctx_id: int) -> None:
        """The firmware confirmed a context teardown: its mappings are all gone, so the
        unmaps still owed in it are settled too (a peer's memory freed while the dying
        context had work queued would otherwise stay pending forever)."""
        owed = self.teardown.pop(ctx_id, [])
        for key in [k for k in self.unmapping if k[0] == ctx_id]:
            owed.append(self.unmapping.pop(key))
        for b in owed:
            b.pending -= 1
            b.release_if_unused()

    def firmware_gone(self) -> None:
        """The firmware was reset or died: confirmations it owed will never come."""
        owed = list(self.unmapping.values()) + [b for bs in self.teardown.values() for b in bs]
        self.unmapping.clear()
        self.teardown.clear()
        for b in owed:
            b.pending -= 1
            b.release_if_unused()

    # --- IPC and peers ---------------------------------------------------------------------------
    def export(self, alloc: Allocation) -> int:
        if alloc.backing.kind != uapi.MemKind.DEVICE:
            raise DriverError(errno.EINVAL, "only device-local memory is exported; host memory "
                                            "is the process's own to share")
        alloc.backing.exported = True
        return alloc.backing.token

    def import_(self, ctx: Context, export_id: int, token: int) -> Allocation:
        b = self.backings.get(export_id)
        if b is None:
            raise DriverError(errno.ENOENT, f"no exported allocation {export_id} with that token")
        if not b.exported or not secrets.compare_digest(
                b.token.to_bytes(8, "little"), token.to_bytes(8, "little")):
            raise self.device.isolation.refuse(  # another's allocation, without its export
                "export", ctx.file.pid, ctx.file.uid,
                f"allocation {export_id}: not exported, or not with that token", errno.EACCES)
        if b.refs == 0:
            raise DriverError(errno.ENOENT, f"allocation {export_id} was freed by every holder")
        return self._attach(ctx, b)

    # --- what holds a byte of VRAM (for a memory error, kmod_emul/ras.py) ----------------------
    def backing_at(self, offset: int) -> Backing | None:
        """The device-local backing whose pages hold VRAM byte ``offset``, if any."""
        for b in self.backings.values():
            if (b.kind == uapi.MemKind.DEVICE
                    and b.offset <= offset < b.offset + _round_up(b.size, uapi.ACCEL_PAGE_SIZE)):
                return b
        return None

    def holders(self, b: Backing) -> list[Context]:
        """The live contexts that can reach ``b``: those holding an allocation of it (the
        exporter, its importers) and those it is mapped in on peer devices."""
        found: dict[int, Context] = {}
        for ctx in self.device.tenants.live_contexts():
            for alloc in ctx.allocations.values():
                if alloc.backing is b:
                    for c in [ctx, *(c for _, c in alloc.maps)]:
                        if c.lost is None:
                            found[id(c)] = c
        return list(found.values())

    def free_bytes(self) -> int:
        """Bytes an allocation may still get: not held, not retired (``vram.reserved``),
        not resident managed memory."""
        return max(0, self.device.memory_total - self.vram.used - self.vram.reserved
                   - self.device.fw_stat("managed_resident"))
