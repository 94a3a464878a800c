"""Memory objects: allocation classes, their backings, address spaces, IPC and peers.

The driver's ``gem``: it owns the books, the firmware owns the bytes' use.

* **Backings** are where bytes live. Device-local memory is a range of the device's VRAM
  (one memfd per device, handed to every firmware at boot so peers can reach it; never
  mapped into a user process). Host-visible kinds are tmpfs files in the daemon's private
  shm directory, owned by the caller, mode 0600, with an unguessable name.
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

import trio

from firmware import abi
from kmod_emul import uapi
from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.context import Context
    from kmod_emul.device import AccelDevice

_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
VA_GUARD = 64 * 1024  # unmapped gap after each allocation: an overrun faults


def create_user_file(path: str, size: int, uid: int, gid: int) -> None:
    """A new tmpfs file for one user: created exclusively, mode 0600, owned by them."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.fchown(fd, uid, gid)
    finally:
        os.close(fd)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class VramAllocator:
    """First-fit over a sorted free list with coalescing; offsets page aligned."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self._free: list[tuple[int, int]] = [(0, total)]  # (offset, size), sorted

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
    token: int = 0  # host kinds: part of the file name; every kind: the export secret
    path: str = ""  # host kinds
    exported: bool = False
    pid: int = 0  # the allocating process, charged until the bytes are released
    refs: int = 0  # allocations referring to it
    pending: int = 0  # firmware mappings whose removal is not yet confirmed
    #: set once the bytes are back in the pool (MEM_FREE waits a little for it)
    released: trio.Event = field(default_factory=trio.Event)

    def release_if_unused(self) -> None:
        if self.refs or self.pending or self.released.is_set():
            return
        self.released.set()
        if self.kind == uapi.MemKind.DEVICE:
            self.owner.memory.release_vram(self.offset, self.size, self.pid)
        else:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.owner.memory.backings.pop(self.id, None)


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

    def __init__(self, device: AccelDevice, vram_fd: int, shm_dir: str,
                 process_limit: int) -> None:
        self.device = device
        self.vram_fd = vram_fd
        self.vram = VramAllocator(device.memory_total)
        self.shm_dir = shm_dir
        self.process_limit = process_limit
        self.backings: dict[int, Backing] = {}
        #: (ctx id, va) -> backing, for UNMAPs the firmware has not confirmed yet
        self.unmapping: dict[tuple[int, int], Backing] = {}
        #: ctx id -> backings, for context teardowns the firmware has not confirmed yet
        self.teardown: dict[int, list[Backing]] = {}
        self._va_next: dict[int, int] = {}
        self._pid_bytes: dict[int, int] = {}

    # --- accounting ----------------------------------------------------------------------
    def process_bytes(self, pid: int) -> int:
        """Device-local bytes allocated by ``pid`` here and not yet released."""
        return self._pid_bytes.get(pid, 0)

    def pid_bytes(self) -> dict[int, int]:
        return dict(self._pid_bytes)

    def context_bytes(self, ctx: Context) -> int:
        return sum(a.backing.size for a in ctx.allocations.values()
                   if a.backing.kind == uapi.MemKind.DEVICE)

    def release_vram(self, offset: int, size: int, pid: int) -> None:
        self._pid_bytes[pid] -= size
        if not self._pid_bytes[pid]:
            del self._pid_bytes[pid]
        if _libc.fallocate(self.vram_fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                           ctypes.c_long(offset), ctypes.c_long(size)) != 0:
            os.pwrite(self.vram_fd, bytes(size), offset)  # no hole punching: zero it
        self.vram.free(offset, size)
        self.device.send_budget()

    # --- allocate / free ----------------------------------------------------------------------
    def _new_va(self, pid: int, size: int) -> int:
        base = (self.device.index + 1) << uapi.ACCEL_VA_DEVICE_SHIFT
        nxt = self._va_next.get(pid, 1 << 32)
        self._va_next[pid] = nxt + _round_up(max(size, 1), VA_GUARD) + VA_GUARD
        return base + nxt

    def alloc(self, ctx: Context, size: int, kind: uapi.MemKind) -> Allocation:
        dev = self.device
        if size == 0 or size > 1 << 44:
            raise DriverError(errno.EINVAL, f"allocation size {size} out of range")
        handle = dev.new_id()
        token = secrets.randbits(64)
        backing = Backing(handle, kind, size, dev, token=token)
        if kind == uapi.MemKind.DEVICE:
            pid = ctx.file.pid
            if self.process_limit and self.process_bytes(pid) + size > self.process_limit:
                raise DriverError(
                    errno.ENOMEM, f"process {pid} would hold {self.process_bytes(pid) + size} "
                                  f"bytes of {dev.name}, over its limit {self.process_limit}")
            offset = self.vram.alloc(size)
            if offset is None:
                raise DriverError(errno.ENOMEM, f"{dev.name}: {size} bytes requested, "
                                                f"{self.free_bytes()} free")
            backing.offset, backing.pid = offset, pid
            self._pid_bytes[pid] = self._pid_bytes.get(pid, 0) + size
        else:
            backing.path = os.path.join(self.shm_dir, abi.host_backing_name(kind, handle, token))
            create_user_file(backing.path, size, ctx.file.uid, ctx.file.gid)
        self.backings[handle] = backing
        alloc = self._attach(ctx, backing)
        if kind == uapi.MemKind.DEVICE:
            dev.send_budget()
            for peer_dev, peer_ctx in dev.peer_contexts_of(ctx.file.pid):
                self.map_into(alloc, peer_dev, peer_ctx)
        return alloc

    def _attach(self, ctx: Context, backing: Backing) -> Allocation:
        alloc = Allocation(self.device.new_id(), ctx, self._new_va(ctx.file.pid, backing.size),
                           backing)
        backing.refs += 1
        ctx.allocations[alloc.handle] = alloc
        self.map_into(alloc, self.device, ctx)
        return alloc

    def map_into(self, alloc: Allocation, dev: AccelDevice, ctx: Context) -> None:
        b = alloc.backing
        where = b.offset if b.kind == uapi.MemKind.DEVICE else b.id
        dev.fw_send(abi.Op.MAP, ctx.id, (alloc.va, b.size, int(b.kind), b.owner.index, where,
                                         b.token))
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
                dev.fw_send(abi.Op.UNMAP, map_ctx.id, (alloc.va,))
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
        held: list[Backing] = []
        for alloc in list(ctx.allocations.values()):
            # peer mappings of this allocation live in other contexts: unmap those normally;
            # its own mapping goes with the firmware context, confirmed by CTX_DESTROY
            if firmware_has_it and any(c is ctx for _, c in alloc.maps):
                alloc.backing.pending += 1
                held.append(alloc.backing)
            alloc.maps = [(d, c) for d, c in alloc.maps if c is not ctx]
            self.free(ctx, alloc)
        # this context's peer mappings of other devices' memory go with it as well
        for dev in self.device.all_devices:
            for alloc in [a for c in dev.contexts.values() for a in c.allocations.values()]:
                alloc.maps = [(d, c) for d, c in alloc.maps if c is not ctx]
        if firmware_has_it:
            self.teardown[ctx.id] = held

    def context_destroyed(self, ctx_id: int) -> None:
        """The firmware confirmed a context teardown."""
        for b in self.teardown.pop(ctx_id, []):
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
        alloc.backing.exported = True
        return alloc.backing.token

    def import_(self, ctx: Context, export_id: int, token: int) -> Allocation:
        b = self.backings.get(export_id)
        if b is None or not b.exported or not secrets.compare_digest(
                b.token.to_bytes(8, "little"), token.to_bytes(8, "little")):
            raise DriverError(errno.ENOENT, f"no exported allocation {export_id} with that token")
        if b.refs == 0:
            raise DriverError(errno.ENOENT, f"allocation {export_id} was freed by every holder")
        return self._attach(ctx, b)

    def free_bytes(self) -> int:
        return max(0, self.device.memory_total - self.vram.used
                   - self.device.fw_stats().get("managed_resident", 0))
