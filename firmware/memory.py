"""The device's view of memory: per-context address spaces and managed-memory residency.

Each context has its own address space: the driver maps every allocation into it (MAP)
and the firmware resolves each packet's addresses against it, so a packet can only reach
memory its context owns, imported or was granted as a peer. Device-local memory is a
window into a device's VRAM (a memfd the driver created and handed to every firmware at
boot, so peers can reach it); host-visible kinds are the process's own memfds, sealed so
that their size never changes under the device, handed over by the driver.

Managed memory is host memory the device migrates in 64 KiB pages on first device access
(a "page fault"), within a residency budget of the device's free memory; exceeding it
evicts the least recently used pages back to the host. Migration is a real copy through a
scratch buffer, so oversubscription costs what it should, and every fault, migration and
eviction is counted in the device's counters (firmware/telemetry.py).
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from firmware.telemetry import Counters

MANAGED_PAGE = 64 * 1024


class Fault(Exception):
    """A packet touched memory its context cannot reach; ``addr`` is the first bad byte."""

    def __init__(self, addr: int, code: int = errno.EFAULT) -> None:
        super().__init__(f"fault at {addr:#x}")
        self.addr = addr
        self.code = code


@dataclass(eq=False)
class Mapping:
    va: int
    size: int
    kind: int
    owner: int  # device index whose memory it is
    data: np.ndarray  # uint8 view of the backing bytes
    #: managed only: which pages live on the device (False = on the host)
    resident: np.ndarray | None = None


class Residency:
    """Managed pages resident on this device, in LRU order, within a byte budget."""

    def __init__(self, counters: Counters, capacity: int) -> None:
        self.counters = counters
        self.capacity = capacity
        self.resident = 0  # bytes of managed pages on the device (under ``lock``)
        self.device_bytes = 0  # held by device-local allocations (Op.SET_BUDGET)
        self._lru: OrderedDict[tuple[int, int], Mapping] = OrderedDict()
        self._scratch = np.empty(MANAGED_PAGE, np.uint8)
        self.lock = threading.Lock()

    def budget(self) -> int:
        return max(0, self.capacity - self.device_bytes)

    def touch_device(self, m: Mapping, start: int, end: int) -> None:
        """Device access to bytes [start, end) of managed mapping ``m``: fault pages in."""
        self.touch_pages(m, range(start // MANAGED_PAGE, (end - 1) // MANAGED_PAGE + 1))

    def touch_pages(self, m: Mapping, pages: Iterable[int]) -> None:
        """Device access to these pages of managed mapping ``m`` (a copy's range, the
        pages a kernel marked): fault in the ones on the host, refresh the others' LRU
        position."""
        assert m.resident is not None
        with self.lock:
            for page in pages:
                key = (id(m), page)
                if m.resident[page]:
                    self._lru.move_to_end(key)
                    continue
                self.counters.add("managed_faults")
                self._make_room()
                self._migrate(m, page)
                m.resident[page] = True
                self._lru[key] = m
                self._resident(MANAGED_PAGE)
                self.counters.add("managed_bytes_to_device", MANAGED_PAGE)

    def to_host(self, m: Mapping, start: int, end: int) -> None:
        """Migrate pages of [start, end) back to the host (host access or prefetch)."""
        assert m.resident is not None
        with self.lock:
            for page in range(start // MANAGED_PAGE, (end - 1) // MANAGED_PAGE + 1):
                if m.resident[page]:
                    self._evict(m, page)

    def drop(self, m: Mapping) -> None:
        """Forget a managed mapping (unmapped): its resident pages no longer count."""
        assert m.resident is not None
        with self.lock:
            for page in np.flatnonzero(m.resident):
                self._lru.pop((id(m), int(page)), None)
                self._resident(-MANAGED_PAGE)
            m.resident[:] = False

    def _make_room(self) -> None:
        while self._lru and self.resident + MANAGED_PAGE > self.budget():
            (_, page), victim = next(iter(self._lru.items()))
            self.counters.add("managed_evictions")
            self._evict(victim, page)

    def _evict(self, m: Mapping, page: int) -> None:
        assert m.resident is not None
        self._lru.pop((id(m), page), None)
        m.resident[page] = False
        self._resident(-MANAGED_PAGE)
        self.counters.add("managed_bytes_to_host", MANAGED_PAGE)
        self._migrate(m, page)

    def _resident(self, delta: int) -> None:
        self.resident += delta
        self.counters.add("managed_resident", delta)

    def _migrate(self, m: Mapping, page: int) -> None:
        chunk = m.data[page * MANAGED_PAGE : (page + 1) * MANAGED_PAGE]
        self._scratch[: len(chunk)] = chunk  # the transfer a migration costs


class AddressSpace:
    """One context's mappings, sorted by address; resolving is a bisect."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._maps: list[Mapping] = []
        self._lock = threading.Lock()
        #: moves with every change of the mappings: what was resolved against an older
        #: generation must be resolved again (firmware/launches.py keeps bound launches)
        self.generation = 0
        #: (generation, mapping) of the last resolve: a stream's argument blocks, read on
        #: every launch, all lie in its one arena (no lock, no bisect while it holds)
        self._last: tuple[int, Mapping] | None = None

    def add(self, m: Mapping) -> None:
        with self._lock:
            self.generation += 1
            i = bisect.bisect_left(self._starts, m.va)
            self._starts.insert(i, m.va)
            self._maps.insert(i, m)

    def remove(self, va: int) -> Mapping | None:
        with self._lock:
            self.generation += 1
            i = bisect.bisect_left(self._starts, va)
            if i < len(self._starts) and self._starts[i] == va:
                del self._starts[i]
                return self._maps.pop(i)
        return None

    def mappings(self) -> list[Mapping]:
        with self._lock:
            return list(self._maps)

    def resolve(self, va: int, size: int) -> tuple[Mapping, int]:
        """(mapping, offset) holding all of [va, va + size); raises Fault otherwise."""
        last = self._last
        if last is not None and last[0] == self.generation:
            m = last[1]
            end = m.va + m.size
            if m.va <= va < end and va + size <= end:
                return m, va - m.va
        with self._lock:
            i = bisect.bisect_right(self._starts, va) - 1
            m = self._maps[i] if i >= 0 else None
            generation = self.generation
        if m is None or va >= m.va + m.size:
            raise Fault(va)
        if va + size > m.va + m.size:
            raise Fault(m.va + m.size)
        self._last = (generation, m)
        return m, va - m.va


@dataclass
class Backings:
    """Where the bytes live: every device's VRAM, and the host memory handed over."""

    vram: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def open(cls, vram_fds: dict[int, int], vram_size: int) -> Backings:
        b = cls()
        for dev, fd in vram_fds.items():
            mem = mmap.mmap(fd, vram_size)
            os.close(fd)
            b.vram[dev] = np.frombuffer(mem, np.uint8)
        return b

    def vram_window(self, owner: int, size: int, offset: int) -> np.ndarray:
        """The bytes of a device-local allocation: a window of its device's VRAM."""
        vram = self.vram.get(owner)
        if vram is None or offset < 0 or size < 0 or offset + size > len(vram):
            raise Fault(offset, errno.EINVAL)
        return vram[offset : offset + size]

    @staticmethod
    def host(fd: int, size: int) -> np.ndarray:
        """The first ``size`` bytes of a process's sealed memfd ``fd``, mapped (the caller
        closes ``fd``; the mapping keeps what it needs). Raises OSError."""
        mem = mmap.mmap(fd, size) if size else bytearray()
        return np.frombuffer(mem, np.uint8)
