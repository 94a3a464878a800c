"""accl's same-host transport: the ranks of one host reduce their host buffers through
shared memory instead of gloo's loopback sockets, as NCCL's SHM transport does within a
node (docs/distributed.md, "Cost").

Each rank creates one segment in ``/dev/shm`` and maps every other rank's; once all have
mapped all, each unlinks its own, so nothing is left behind whatever happens to the job.
A segment is a header (a step counter, and the byte count of each slot's step) and two
slots of ``SLOT_BYTES``. One step of an all_reduce: a rank copies its chunk into the slot
of the step's parity, then publishes the step number; once every rank published it, each
reduces all the ranks' slots in rank order into its own buffer, so every rank computes the
same bits (gloo's results are identical across ranks too). A rank writes a slot again two
steps later, which it reaches only after every rank published the next step, that is,
finished reading this one: one wait per step is the whole protocol.

A rank waiting for the others yields the CPU for ``SPIN_S``, then sleeps in the kernel on
a late rank's step word (a futex: every rank wakes its word's sleepers when it publishes a
step), leaving the CPUs to the late rank and the devices' control loops instead of polling
(docs/distributed.md, "Cost"). Every ``FAULT_POLL_S`` it runs the group's fault check
(another rank's lost device, published in the store) and looks whether a late rank's
process exited (through a pidfd of each, opened when the group was made; gloo would see
its socket close), and it gives up at the group's timeout. The ranks join when the group
is made (``join``): all of them, or none, use this transport, decided from what every rank
published in the store. A rank started with ``ACCL_SHM_DISABLE=1`` (NCCL's
``NCCL_SHM_DISABLE``) publishes that it cannot, so the whole group stays with gloo.

Stores are published after the data they cover with a full barrier between (x86's order:
a store is not reordered with an earlier store, nor a load with a later load).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import secrets
import select
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from abi.userq import full_barrier

#: bytes of one slot: an all_reduce larger than this goes in steps of it
SLOT_BYTES = 4 << 20
#: the header: the step counter, then each slot's byte count (u64 words), a cache line
_HEADER = 64
#: how long a waiting rank only yields the CPU between looks before it sleeps in the kernel
#: until the late rank publishes (a futex on the late rank's step word)
SPIN_S = 50e-6
#: how often a waiting rank runs the group's fault check and looks for the others' exit
FAULT_POLL_S = 0.2
_DIR = "/dev/shm"
#: reductions by gloo's op, as torch functions with ``out=``
_OPS: dict[Any, Callable[..., torch.Tensor]] = {
    dist.ReduceOp.SUM: torch.add, dist.ReduceOp.PRODUCT: torch.mul,
    dist.ReduceOp.MIN: torch.minimum, dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.BAND: torch.bitwise_and, dist.ReduceOp.BOR: torch.bitwise_or,
    dist.ReduceOp.BXOR: torch.bitwise_xor}
_BITWISE = {dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR}
#: futex(2) on x86-64, whose store order the protocol already relies on (module docstring)
_SYS_FUTEX = 202
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    """futex(2)'s relative timeout (the kernel's struct timespec): a sleeping rank still
    wakes for the fault check every ``FAULT_POLL_S``."""

    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(addr: int, seen: int, timeout_s: float) -> None:
    """Sleep until the u32 at ``addr`` (the low half of a step word) is woken, changes from
    ``seen`` or ``timeout_s`` passes; an early return is harmless, the caller looks again."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT,
                  ctypes.c_uint32(seen & 0xFFFFFFFF), ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    """Wake every rank sleeping on the u32 at ``addr`` (none is cheap: one system call)."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
           torch.int8, torch.int16, torch.int32, torch.int64}


def _host_identity() -> str:
    """What ranks sharing ``/dev/shm`` and process ids have in common: the kernel's boot
    and the pid and IPC namespaces (containers on one machine differ there)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    ns = [os.stat(f"/proc/self/ns/{n}").st_ino for n in ("pid", "ipc")]
    shm = os.stat(_DIR)
    return f"{boot}:{ns[0]}:{ns[1]}:{shm.st_dev}:{shm.st_ino}"


class IntraHost:
    """The mapped segments of a group's ranks, all on this host."""

    def __init__(self, rank: int, maps: list[mmap.mmap], pidfds: dict[int, int],
                 timeout_s: float) -> None:
        self.rank, self._maps, self._timeout_s = rank, maps, timeout_s
        #: the other ranks' processes (pidfds: readable once one exited, zombie or reaped)
        self._pidfds = pidfds
        self._words = [np.frombuffer(m, dtype=np.uint64, count=3) for m in maps]
        #: each rank's step word's address, the futex its waiters sleep on
        self._addrs = [int(w.ctypes.data) for w in self._words]
        self._slots = [[torch.frombuffer(m, dtype=torch.uint8, count=SLOT_BYTES,
                                         offset=_HEADER + s * SLOT_BYTES) for s in (0, 1)]
                       for m in maps]
        self._step = 0

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int,
             timeout_s: float) -> IntraHost | None:
        """Every rank of the group calls this when the group is made: the transport, when
        every rank is on this host and mapped every segment, else None for all of them."""
        if size < 2:
            return None
        path, fd, me = None, -1, {"host": None}
        if os.environ.get("ACCL_SHM_DISABLE", "0") in ("", "0"):
            try:
                path = f"{_DIR}/accl-{os.getpid()}-{secrets.token_hex(8)}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, _HEADER + 2 * SLOT_BYTES)
                me = {"host": _host_identity(), "path": path, "pid": os.getpid()}
            except OSError:
                pass  # no /dev/shm here: this rank publishes that it cannot
        maps: list[mmap.mmap] = []
        pidfds: dict[int, int] = {}
        try:
            store.set(f"rank/{rank}", json.dumps(me))
            peers = [json.loads(store.get(f"rank/{r}")) for r in range(size)]
            ok = me["host"] is not None and all(p["host"] == me["host"] for p in peers)
            if ok:
                try:
                    for p in peers:
                        pfd = fd if p["path"] == path else os.open(p["path"], os.O_RDWR)
                        try:
                            maps.append(mmap.mmap(pfd, _HEADER + 2 * SLOT_BYTES))
                        finally:
                            if pfd != fd:
                                os.close(pfd)
                    pidfds = {r: os.pidfd_open(p["pid"]) for r, p in enumerate(peers)
                              if r != rank}
                except OSError:
                    ok = False
            store.set(f"mapped/{rank}", "1" if ok else "0")
            ok = all(store.get(f"mapped/{r}") == b"1" for r in range(size))
        finally:
            # every rank has mapped it (or given up) once it answered above: the name can go
            if path is not None and fd >= 0:
                os.unlink(path)
                os.close(fd)
        if not ok:
            for m in maps:
                m.close()
            for pfd in pidfds.values():
                os.close(pfd)
            return None
        return cls(rank, maps, pidfds, timeout_s)

    @staticmethod
    def takes(tensors: Sequence[torch.Tensor], op: Any) -> bool:
        """Whether this transport reduces these host buffers with gloo's ``op`` (the same
        answer on every rank: it depends on what all_reduce requires to match)."""
        return op in _OPS and all(t.dtype in _DTYPES and t.is_contiguous() for t in tensors) \
            and (op not in _BITWISE or not any(t.is_floating_point() for t in tensors))

    def allreduce(self, tensors: Sequence[torch.Tensor], op: Any,
                  check: Callable[[], None]) -> None:
        """Reduce each contiguous host tensor across the ranks in place; ``check`` is the
        group's fault check, run while waiting."""
        fn = _OPS[op]
        for t in tensors:
            flat = t.view(-1)
            per = SLOT_BYTES // t.element_size()
            for start in range(0, flat.numel(), per):
                self._reduce(flat[start:start + per], fn, check)

    def _reduce(self, chunk: torch.Tensor, fn: Callable[..., torch.Tensor],
                check: Callable[[], None]) -> None:
        self._step += 1
        step, s = self._step, self._step & 1
        nbytes = chunk.numel() * chunk.element_size()
        self._slots[self.rank][s][:nbytes].view(chunk.dtype).copy_(chunk)
        words = self._words[self.rank]
        words[1 + s] = nbytes
        full_barrier()
        words[0] = step
        _futex_wake(self._addrs[self.rank])
        self._wait(step, check)
        full_barrier()
        for r, w in enumerate(self._words):
            if int(w[1 + s]) != nbytes:
                raise ValueError(f"accl: rank {r} all-reduces {int(w[1 + s])} bytes where "
                                 f"rank {self.rank} does {nbytes} (step {step})")
        slot = [self._slots[r][s][:nbytes].view(chunk.dtype) for r in range(len(self._maps))]
        fn(slot[0], slot[1], out=chunk)
        for other in slot[2:]:
            fn(chunk, other, out=chunk)

    def _wait(self, step: int, check: Callable[[], None]) -> None:
        """Until every rank published ``step`` (module docstring)."""
        if all(int(w[0]) >= step for w in self._words):
            return
        start = now = time.monotonic()
        next_check = start + FAULT_POLL_S
        while True:
            # a late rank and the step it had: the futex sleeps only while it still has it
            late = next(((r, seen) for r, w in enumerate(self._words)
                         if (seen := int(w[0])) < step), None)
            if late is None:
                return
            if now - start < SPIN_S:
                os.sched_yield()
            else:
                _futex_wait(self._addrs[late[0]], late[1], max(next_check - now, 0.0))
            now = time.monotonic()
            if now >= next_check:
                next_check = now + FAULT_POLL_S
                check()
                self._check_peers(step, now - start)

    def _check_peers(self, step: int, waited: float) -> None:
        late = [r for r, w in enumerate(self._words) if int(w[0]) < step]
        exited, _, _ = select.select([self._pidfds[r] for r in late], [], [], 0)
        if exited:
            r = next(r for r in late if self._pidfds[r] in exited)
            raise RuntimeError(f"accl: rank {r} exited during an all_reduce; rank {self.rank} "
                               f"cannot complete it")
        if waited > self._timeout_s:
            raise RuntimeError(f"accl: rank {self.rank} waited {waited:.0f} s for rank(s) "
                               f"{late} in an all_reduce, past the group's timeout")

    def close(self) -> None:
        for pfd in self._pidfds.values():
            os.close(pfd)
        self._pidfds.clear()
        self._words.clear()
        self._slots.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor still views it: it goes with the last one
                pass
