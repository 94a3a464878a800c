"""A fuzzer of the user-mode rings: random and mutated 64-byte packets straight into rings of
its own, as a process that writes its rings itself (no runtime in between) would.

Each round is a separate client process (:mod:`stress._common`) holding three contexts: A
on device 0 (the one it attacks through), B on device 0 (another context of its own:
memory and kernels A must not reach) and C on device 1 (a peer A enabled, and a queue A
imported). A has device-local, pinned and managed memory, a pinned arena for argument
blocks, a module with three small kernels (``compile_module``), a module it unloaded
(stale handles) and B's handles. Each *ring episode* writes 1 to 12 packets into one of A's
rings and knocks, then waits, bounded, for the outcome:

* every opcode of ``userq.Op`` and unknown ones, nonzero flags, with random and boundary
  argument words: addresses of A's allocations (inside, straddling the end, in the guard
  gap after), of its peer's memory, of B's and of C's host memory (not A's), of nothing,
  near 2**63 and 2**64; sizes 0, 1, exact, one too many, 16 TiB, 2**64-1;
* LAUNCH with kernel handles valid, of B, of an unloaded module, with a kernel index past
  the module's, random; grids and blocks empty, too large, huge; dynamic shared memory at
  and past the limit; argument blocks (in A's pinned arena) valid, truncated, with extra,
  missing or wrong-kind records, wrong dtype codes, element counts not a multiple of the
  dtype, shapes whose product overflows or does not match, more than 8 dimensions, 16 TiB
  buffers, buffers of B, blocks past ``ACCEL_ARGS_MAX`` or outside A's memory;
* WAIT_VALUE and WRITE_VALUE with those addresses and a width no word has (each must
  fault);
* WAIT_QUEUE on itself, unknown queues, B's queues, A's other rings, the default queue
  and the imported queue of device 1 (for seqnos reached later, already reached, never);
* lies: write-pointer jumps (+1024, +10**6, +2**63, to 2**64-1, backwards), doorbell-slot
  values that do not match the ring, another ring's slot, a sequence word not bumped;
  rings created with consumer words (read pointer, fence, fault record) already set;
  consumer words scribbled while packets run; queues destroyed with work in flight; and a
  process that exits with work queued (every round), or in the middle of a huge launch.
  A's packets may write its doorbell page (pinned as memory too), its "lost" word
  included, which is left as they wrote it: the firmware must not stop for it.

For each ring the fuzzer must see every packet complete (faulted ones too: a fault cancels
the rest) or, for a write pointer that lied, a fault record (EINVAL) -- never a firmware
crash, a lost context, or a ring that neither completes nor faults within the bound (a
hang; a ring blocked by a wait that can never be satisfied must drain once destroyed). A
packet that names memory A cannot reach must fault, at or before it (else an escape), and
B's memory must never change. Fault records are counted by errno with the commands'
answers (EIO, an engine error, must not come from bad input).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import mmap
import os
import random
import select
import struct
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from abi import uapi, userq
from abi.userq import Op
from runtime._shm import sealed_memfd
from stress._common import (
    FUZZ_KERNELS,
    Progress,
    client_args,
    fuzz_rounds,
    write_result,
)
from stress.report import Report

#: ``python -m stress`` writes this many packets at scale 1.
STRESS_COUNT = 100_000
#: Packets per client process.
ROUND = 1000
#: A client call that blocks this long is a hang (the rings have their own bound).
HANG_S = 10.0
#: How long a ring may take to complete (or fault) before it counts as hung.
RING_BOUND_S = 20.0


def run(d, *, count: int, seed: int, bystanders: Any = True, round_size: int = ROUND,
        hang_s: float = HANG_S, ring_bound_s: float = RING_BOUND_S) -> Report:
    """Write ``count`` fuzzed packets into rings of a client's own on daemon ``d`` (2
    devices or more); see the module doc."""
    rep = Report("ring_fuzz")
    if d.devices < 2:
        raise ValueError("the ring fuzzer needs a daemon with 2 devices (peer and import)")
    return fuzz_rounds(d, rep, module=__name__, count=count, seed=seed, round_size=round_size,
                       unit="packets", bystanders=bystanders, hang_s=hang_s,
                       options={"bound": ring_bound_s})


# --- the attacking client ----------------------------------------------------------------
U64 = (0, 1, 2, 7, 8, 63, 64, 4095, 4096, 1 << 20, (1 << 31) - 1, (1 << 32) - 1, 1 << 32,
       1 << 44, 16 << 40, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 4096, (1 << 64) - 2,
       (1 << 64) - 1)
KERNELS = FUZZ_KERNELS + '''
def rows(m: "float64"):
    i = global_id(0)
    if i < m.shape[0]:
        m[i, 0] = 1.0
'''
#: kernel -> its buffer params' (dtype code, itemsize, ndim), and its scalar params' codes
SIGS = {"fill": ([(9, 4, 1)], [9]), "inc": ([(5, 4, 1), (5, 4, 1)], []),
        "rows": ([(10, 8, 2)], [])}
ARG_SLOT = 512
_HDR = ctypes.sizeof(uapi.accel_cmd_hdr)
_tags = itertools.count(1)


class _Lost(Exception):
    pass


@dataclass
class Mem:
    handle: int
    va: int
    size: int
    kind: int
    view: memoryview | None = None  # host kinds: our mapping


@dataclass(eq=False)
class Ctx:
    dev: int
    fd: int
    ctx: int
    bell_w: int
    event_r: int
    db: userq.SharedWords
    mems: dict[str, Mem] = field(default_factory=dict)
    rings: dict[int, tuple[int, userq.RingView, int]] = field(default_factory=dict)  # qid -> (slot, view, memfd)
    #: the doorbell page's "lost" word as our own packets last left it (check_lost)
    scribbled: int = 0


@dataclass
class Pkt:
    raw: bytes
    must_fault: bool = False  # names what A cannot reach, or is malformed for sure
    blocks: bool = False  # a wait that may never be satisfied
    slow: bool = False  # may need a kernel compiled first
    arrange: Any = None  # called after the knock (pushes the fence a wait needs)
    waits_on: int | None = None  # the queue a blocking wait names
    what: str = ""


class Client:
    def __init__(self, root: str, seed: int, rnd: int, count: int, bound: float,
                 progress: Progress, result_path: str) -> None:
        self.root, self.count, self.bound = root, count, bound
        self.rng = random.Random(f"ring/{seed}/{rnd}")
        self.progress, self.result_path = progress, result_path
        self.errnos: Counter[str] = Counter()
        self.packets = self.rings_done = 0
        self.escapes = self.hangs = 0
        self.notes: list[str] = []
        self.stop: str | None = None
        self.arg_next = 0
        self.warming = False

    # --- plumbing --------------------------------------------------------------------------
    def call(self, c: Ctx, cmd: uapi.Command, arg: Any) -> Any:
        tag = next(_tags)
        self.progress.step(f"{cmd.name} on dev{c.dev}")
        try:
            os.pwrite(c.fd, bytes(uapi.accel_cmd_hdr(cmd=cmd.code, tag=tag)) + bytes(arg), 0)
            if not cmd.has_reply:
                return None
            return cmd.struct.from_buffer_copy(os.pread(c.fd, ctypes.sizeof(cmd.struct), tag))
        except OSError as exc:
            name = errno.errorcode.get(exc.errno, str(exc.errno))
            self.errnos[name] += 1
            if exc.errno == errno.EIO:
                self.notes.append(f"EIO for {cmd.name}")
            raise

    def open_ctx(self, dev: int, keep_db: bool = False) -> Ctx:
        fd = os.open(f"{self.root}/{uapi.DEV_DIR}/accel{dev}", os.O_RDWR)
        db_fd = sealed_memfd("db", userq.ACCEL_DB_PAGE_SIZE)
        bell_r, bell_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        event_r, event_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            reply = self.call(Ctx(dev, fd, 0, -1, -1, None), uapi.ACCEL_CMD_CTX_CREATE,  # type: ignore[arg-type]
                              uapi.accel_ctx_create(abi_major=uapi.ACCEL_ABI_MAJOR,
                                                    abi_minor=uapi.ACCEL_ABI_MINOR,
                                                    doorbell_fd=bell_r, event_fd=event_w,
                                                    db_page_fd=db_fd))
            db = userq.SharedWords(db_fd, userq.ACCEL_DB_PAGE_SIZE)
            if keep_db:
                self.db_fd = os.dup(db_fd)
        finally:
            for x in (db_fd, bell_r, event_w):
                os.close(x)
        return Ctx(dev, fd, reply.ctx_id, bell_w, event_r, db)

    def alloc(self, c: Ctx, name: str, size: int, kind: uapi.MemKind, fd: int | None = None
              ) -> Mem:
        """``fd``: pin this memfd of ours (a copy of it) instead of a new one."""
        if fd is not None:
            fd = os.dup(fd)
        else:
            fd = -1 if kind == uapi.MemKind.DEVICE else sealed_memfd(name, size)
        try:
            r = self.call(c, uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
                ctx_id=c.ctx, size=size, kind=kind, fd=fd))
            view = memoryview(mmap.mmap(fd, size)) if fd >= 0 else None
        finally:
            if fd >= 0:
                os.close(fd)
        m = c.mems[name] = Mem(r.handle, r.va, size, kind, view)
        return m

    def queue(self, c: Ctx, priority: int = 0, header: dict[int, int] | None = None,
              memfd: int | None = None) -> int:
        """A new queue on a new ring, or on ring memory ``memfd`` of ours."""
        fd = os.dup(memfd) if memfd is not None else sealed_memfd("ring", userq.RING_FILE_SIZE)
        view = userq.RingView(fd)
        for off, value in (header or {}).items():
            view.set(off, value)
        try:
            r = self.call(c, uapi.ACCEL_CMD_QUEUE_CREATE, uapi.accel_queue_create(
                ctx_id=c.ctx, priority=priority, ring_fd=fd))
        except OSError:
            view.close()
            raise
        finally:
            os.close(fd)
        c.rings[r.queue_id] = (r.doorbell, view, 0)
        return r.queue_id

    def destroy_queue(self, c: Ctx, qid: int) -> None:
        self.call(c, uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=c.ctx,
                                                                            queue_id=qid))

    def knock(self, c: Ctx, slot: int, value: int, bump: bool = True) -> None:
        c.db.set(userq.DB_SLOTS + 8 * slot, value)
        if bump:
            c.db.set(userq.DB_SEQ, c.db.get(userq.DB_SEQ) + 1)
        userq.full_barrier()
        if c.db.get(userq.DB_FW_SLEEPING):
            try:
                os.write(c.bell_w, b"\1")
            except BlockingIOError:
                pass

    def publish(self, c: Ctx, qid: int, wptr: int, bump: bool = True) -> None:
        slot, ring, _ = c.rings[qid]
        ring.set(userq.RING_WPTR, wptr)
        self.knock(c, slot, wptr, bump)

    def submit(self, c: Ctx, qid: int, packets: list[bytes]) -> int:
        _, ring, _ = c.rings[qid]
        w = ring.wptr
        for p in packets:
            ring.write_packet(w, p)
            w += 1
        self.publish(c, qid, w)
        return w

    def check_lost(self) -> None:
        """Stop the round if a context is lost. Our own packets may write the "lost" word
        (A's doorbell page is pinned too): a value the driver's answer says is theirs is
        left as they wrote it, since the firmware must not care (one that read it
        stalled the context for good)."""
        for c in self.ctxs:
            word = c.db.get(userq.DB_LOST)
            if word and word != c.scribbled:
                try:
                    self.call(c, uapi.ACCEL_CMD_MEM_INFO, uapi.accel_mem_info(ctx_id=c.ctx))
                except OSError:
                    self.stop = f"context {c.ctx} on dev{c.dev} lost ({word})"
                    raise _Lost() from None
                c.scribbled = word

    def wait_until(self, cond: Any, timeout: float, what: str, ring: userq.RingView | None = None,
                   knock: tuple[int, int] | None = None) -> bool:
        """Poll ``cond`` up to ``timeout``; ``knock`` (queue, wptr): knock again now and then,
        as a producer may (A's own packets may have written over its doorbell page)."""
        deadline = time.monotonic() + timeout
        pause = 0.0002
        next_knock = time.monotonic() + 0.5
        while not cond():
            self.check_lost()
            now = time.monotonic()
            if now > deadline:
                return False
            if knock is not None and now > next_knock and knock[0] in self.A.rings:
                self.publish(self.A, *knock)
                next_knock = now + 0.5
            self.progress.beat()
            if ring is not None:
                ring.set(userq.RING_IRQ_SEQNO, ring.wptr)
            select.select([self.A.event_r], [], [], pause)
            try:
                os.read(self.A.event_r, 4096)
            except BlockingIOError:
                pass
            pause = min(0.005, pause * 2)
        return True

    # --- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        from runtime.kernels import compile_module

        self.A = A = self.open_ctx(0, keep_db=True)
        self.B = B = self.open_ctx(0)
        self.C = C = self.open_ctx(1)
        self.ctxs = [A, B, C]
        self.alloc(A, "dev", 1 << 20, uapi.MemKind.DEVICE)
        self.alloc(A, "dev_small", 4096, uapi.MemKind.DEVICE)
        self.alloc(A, "pin", 1 << 20, uapi.MemKind.HOST_PINNED)
        self.alloc(A, "man", 1 << 20, uapi.MemKind.MANAGED)
        self.alloc(A, "args", 64 << 10, uapi.MemKind.HOST_PINNED)
        # A's own control structures as memory its packets may write: its doorbell page,
        # and the memory of a ring (which gets a queue of its own now and then)
        self.alias_ring_fd = sealed_memfd("alias-ring", userq.RING_FILE_SIZE)
        self.alloc(A, "db_alias", userq.ACCEL_DB_PAGE_SIZE, uapi.MemKind.HOST_PINNED, self.db_fd)
        self.alloc(A, "ring_alias", userq.RING_FILE_SIZE, uapi.MemKind.HOST_PINNED,
                   self.alias_ring_fd)
        bpin = self.alloc(B, "pin", 64 << 10, uapi.MemKind.HOST_PINNED)
        self.alloc(B, "dev", 64 << 10, uapi.MemKind.DEVICE)
        self.pattern = bytes(random.Random(7).randbytes(64 << 10))
        bpin.view[:] = self.pattern
        self.alloc(C, "dev", 64 << 10, uapi.MemKind.DEVICE)
        self.alloc(C, "pin", 64 << 10, uapi.MemKind.HOST_PINNED)
        self.call(A, uapi.ACCEL_CMD_PEER_ENABLE, uapi.accel_peer_enable(ctx_id=A.ctx, peer_index=1))
        # what A may reach: its own allocations and its peer's device-local memory
        self.reach = [(m.va, m.size, m.kind) for m in A.mems.values()] + \
                     [(C.mems["dev"].va, C.mems["dev"].size, uapi.MemKind.DEVICE)]
        self.foreign = [B.mems["pin"], B.mems["dev"], C.mems["pin"]]
        self.cq = self.queue(C)
        self.imported = self.call(A, uapi.ACCEL_CMD_QUEUE_IMPORT, uapi.accel_queue_import(
            ctx_id=A.ctx, peer_index=1, peer_queue_id=self.cq)).queue_id
        self.bq = self.queue(B)
        raw = self.module_raw = json.dumps(compile_module(KERNELS)).encode()
        self.extra_modules: list[int] = []
        self.handles = self.load(A, raw)
        self.b_handles = self.load(B, raw)
        stale = self.load(A, raw)
        self.call(A, uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(
            ctx_id=A.ctx, module_id=next(iter(stale.values())) >> 16))
        self.stale_handles = list(stale.values())
        self.pool: list[int] = [self.queue(A, p) for p in (0, 1)]
        self.warm_up()

    def load(self, c: Ctx, raw: bytes) -> dict[str, int]:
        fd = sealed_memfd("module", len(raw), raw)
        try:
            mid = self.call(c, uapi.ACCEL_CMD_MODULE_LOAD, uapi.accel_module_load(
                ctx_id=c.ctx, size=len(raw), fd=fd)).module_id
        finally:
            os.close(fd)
        out = {}
        for name in SIGS:
            out[name] = self.call(c, uapi.ACCEL_CMD_KERNEL_GET, uapi.accel_kernel_get(
                ctx_id=c.ctx, module_id=mid, name=name.encode())).handle
        return out

    def warm_up(self) -> None:
        """One valid launch of each kernel: the firmware compiles them (seconds, once per
        daemon: the JIT cache persists), so the episodes' bounds do not include it."""
        qid = self.pool[0]
        self.warming = True  # every buffer the same: no bounds fault
        pkts = [self.launch_packet(name, valid=True).raw for name in SIGS]
        self.warming = False
        w = self.submit(self.A, qid, pkts)
        _, ring, _ = self.A.rings[qid]
        if not self.wait_until(lambda: ring.completed >= w, 240, "warm-up", ring):
            self.stop = "warm-up launches did not complete in 240 s"
            self.hangs += 1
            raise _Lost()
        fault = ring.read_fault()
        if fault[0]:
            self.notes.append(f"warm-up launch faulted: {fault}")
            self.destroy_queue(self.A, qid)
            self.pool[0] = self.queue(self.A)

    # --- addresses -------------------------------------------------------------------------------
    def reachable(self, va: int, n: int) -> bool:
        """Would the firmware's resolve() find [va, va + n) inside one of A's mappings."""
        for base, size, _ in self.reach:
            if base <= va < base + size:
                return va + n <= base + size
        return False

    def kind_at(self, va: int) -> int | None:
        for base, size, kind in self.reach:
            if base <= va < base + size:
                return kind
        return None

    def address(self, write: bool = False) -> int:
        """An address to name: mostly A's (never its argument arena for a write: a copy
        there could turn a launch the oracle expects to fault into a valid one)."""
        rng = self.rng
        r = rng.random()
        if r < 0.55:
            args = self.A.mems["args"].va
            base, size, _ = rng.choice([m for m in self.reach if not (write and m[0] == args)])
            return base + rng.choice((0, 0, rng.randrange(size), size - 1, size - 64))
        if r < 0.7:
            m = rng.choice(self.foreign)
            return m.va + rng.randrange(m.size)
        if r < 0.8:
            base, size, _ = rng.choice(self.reach)
            return base + size + rng.choice((0, 1, 4096, 60 << 10))  # the guard gap
        return rng.choice(U64 + (rng.getrandbits(64), (3 << 44) + 4096, 1 << 44))

    def length(self, va: int) -> int:
        rng = self.rng
        r = rng.random()
        if r < 0.6:
            for base, size, _ in self.reach:
                if base <= va < base + size:
                    room = base + size - va
                    return rng.choice((0, 1, room, rng.randint(0, min(room, 300 << 10)),
                                       min(room, 8)))
            return rng.choice((0, 1, 64, 4096))
        if r < 0.75:
            for base, size, _ in self.reach:
                if base <= va < base + size:
                    return base + size - va + rng.choice((1, 8, 4096))
        return rng.choice(U64)

    # --- packets -----------------------------------------------------------------------------------
    def packet(self, qid: int) -> Pkt:
        rng = self.rng
        op = rng.choice(list(Op) * 3 + [len(Op), len(Op) + 1, 255, 1 << 16, (1 << 32) - 1])
        flags = 0 if rng.random() < 0.93 else rng.choice((1, 2, 1 << 31, (1 << 32) - 1))
        p = self._packet(int(op), qid)
        if flags:
            opcode, _, *a = userq.RAW_PACKET.unpack(p.raw)
            p.raw = userq.RAW_PACKET.pack(opcode, flags, *a)
            p.must_fault, p.blocks, p.arrange, p.slow = True, False, None, False
        return p

    def _packet(self, op: int, qid: int) -> Pkt:
        rng = self.rng
        words = [rng.choice(U64) if rng.random() < 0.5 else rng.getrandbits(64) for _ in range(7)]

        def pkt(*a: int) -> bytes:
            a = tuple(a) + tuple(words[len(a):])
            return userq.RAW_PACKET.pack(op & 0xFFFFFFFF, 0, *(x & userq.U64_MAX for x in a))

        if op == Op.NOP:
            return Pkt(pkt(), what="nop")
        if op == Op.COPY:
            dst, src = self.address(write=True), self.address()
            n = self.length(dst if rng.random() < 0.5 else src)
            bad = not (self.reachable(dst, n) and self.reachable(src, n))
            return Pkt(pkt(dst, src, n), must_fault=bad, what=f"copy {dst:#x}<-{src:#x} {n}")
        if op == Op.MEMSET:
            dst = self.address(write=True)
            n = self.length(dst)
            value = rng.choice((0, 0x5A, 0xFF, 0x100, (1 << 64) - 1))
            bad = not self.reachable(dst, n) or value > 0xFF
            return Pkt(pkt(dst, n, value), must_fault=bad, what=f"memset {dst:#x} {n} {value}")
        if op == Op.PREFETCH:
            va = self.address()
            n = self.length(va)
            to = rng.choice((0, 1, 1, 2, (1 << 64) - 1))
            bad = (not self.reachable(va, n) or self.kind_at(va) != uapi.MemKind.MANAGED
                   or to > 1)
            return Pkt(pkt(va, n, to), must_fault=bad, what=f"prefetch {va:#x} {n} {to}")
        if op == Op.WAIT_QUEUE:
            return self.wait_packet(qid, pkt)
        if op == Op.LAUNCH:
            return self.launch_packet(rng.choice(list(SIGS)), valid=rng.random() < 0.35)
        if op in (Op.WAIT_VALUE, Op.WRITE_VALUE):  # a width no word has: refused, whatever
            va, width = self.address(), rng.choice((0, 1, 2, 3, 16, (1 << 64) - 1))
            return Pkt(pkt(va, rng.getrandbits(64), width), must_fault=True,
                       what=f"{Op(op).name.lower()} {va:#x} width {width}")
        return Pkt(pkt(), must_fault=True, what=f"opcode {op}")

    def wait_packet(self, qid: int, pkt: Any) -> Pkt:
        rng = self.rng
        r = rng.random()
        others = [q for q in self.pool if q != qid]
        if r < 0.15:
            return Pkt(pkt(qid, rng.choice((0, 1, 1 << 63))), must_fault=True, what="wait self")
        if r < 0.35:
            bad = rng.choice((self.bq, self.cq, rng.getrandbits(64), (1 << 64) - 1,
                              max(self.A.rings) + 1000))
            return Pkt(pkt(bad, 1), must_fault=True, what=f"wait unknown {bad}")
        if r < 0.55:  # the default queue (0): reached later by SUBMIT_NOOPs
            k = rng.randint(0, 2)
            done = self.noops

            def arrange() -> None:
                for _ in range(k):
                    self.call(self.A, uapi.ACCEL_CMD_SUBMIT_NOOP,
                              uapi.accel_submit_noop(ctx_id=self.A.ctx))
                    self.noops += 1
            return Pkt(pkt(0, done + k), arrange=arrange, what=f"wait default {done + k}")
        if r < 0.75:  # device 1's queue, imported: reached later by NOPs there
            _, cring, _ = self.C.rings[self.cq]
            target = cring.completed + rng.randint(0, 2)

            def arrange() -> None:
                self.submit(self.C, self.cq, [userq.RAW_PACKET.pack(0, 0, *(0,) * 7)] *
                            max(0, target - self.C.rings[self.cq][1].wptr))
            return Pkt(pkt(self.imported, target), arrange=arrange, what=f"wait imported {target}")
        if others and r < 0.9:
            other = rng.choice(others)
            _, oring, _ = self.A.rings[other]
            target = rng.choice((0, oring.completed))
            return Pkt(pkt(other, target), what=f"wait ring {other} {target}")
        target = rng.choice(((1 << 63), (1 << 64) - 1, self.noops + 1000))
        q = rng.choice([0, self.imported] + others)
        return Pkt(pkt(q, target), blocks=True, waits_on=q, what=f"wait forever {q} {target}")

    def arg_slot(self) -> tuple[int, memoryview]:
        m = self.A.mems["args"]
        i = self.arg_next
        self.arg_next = (i + 1) % (m.size // ARG_SLOT)
        assert m.view is not None
        return m.va + i * ARG_SLOT, m.view[i * ARG_SLOT : (i + 1) * ARG_SLOT]

    def buffer_for(self, code: int, itemsize: int, ndim: int) -> tuple[list[bytes], bool, bool]:
        """Records of a buffer argument: (records, must fault, may need a compile)."""
        rng = self.rng
        R = userq.ARG_RECORD.pack
        targets = [m for m in self.A.mems.values() if m is not self.A.mems["args"]] \
            + [self.C.mems["dev"]]
        m = rng.choice(targets)
        elements = rng.choice((1, 16, 1000, m.size // itemsize))
        elements = min(elements, m.size // itemsize)
        if ndim == 2:
            shape = [elements // 4 or 1, 4] if elements >= 4 else [elements, 1]
            elements = shape[0] * shape[1]
        else:
            shape = [elements]
        va, nbytes, bad, slow = m.va, elements * itemsize, False, False
        mut = rng.random()
        if mut < 0.55:
            pass
        elif mut < 0.62:
            nbytes += rng.choice((1, itemsize - 1)) if itemsize > 1 else 0
            bad = itemsize > 1
        elif mut < 0.68:
            shape = [1 << 63, 1 << 63] if ndim == 2 else [(1 << 64) - 1]
            bad = True
        elif mut < 0.72:
            shape = shape + [1] * rng.choice((7, 8))  # more than 8 dimensions at most
            bad = len(shape) > 8
            slow = not bad
        elif mut < 0.78:
            nbytes = 16 << 40
            bad = True
        elif mut < 0.86:
            f = rng.choice(self.foreign)
            va, nbytes = f.va, min(nbytes, f.size)
            bad = True
        elif mut < 0.9:
            va = rng.choice(U64)
            bad = not self.reachable(va, nbytes)
        elif mut < 0.95:  # a shape record of an impossible count
            return [R(userq.ARG_BUFFER, code, va, nbytes),
                    R(userq.ARG_SHAPE, rng.choice((0, 3, (1 << 32) - 1)), elements, 1)], True, False
        else:
            shape = [elements + 1]
            bad = True
        return (self._shape(code, va, nbytes, shape), bad or not self.reachable(va, nbytes),
                slow)

    @staticmethod
    def _shape(code: int, va: int, nbytes: int, shape: list[int]) -> list[bytes]:
        R = userq.ARG_RECORD.pack
        out = [R(userq.ARG_BUFFER, code, va & userq.U64_MAX, nbytes & userq.U64_MAX)]
        for i in range(0, len(shape), 2):
            pair = shape[i : i + 2]
            out.append(R(userq.ARG_SHAPE, len(pair), pair[0] & userq.U64_MAX,
                         (pair[1] if len(pair) > 1 else 0) & userq.U64_MAX))
        return out

    def launch_packet(self, name: str, valid: bool) -> Pkt:
        rng = self.rng
        R = userq.ARG_RECORD.pack
        bufs, scalars = SIGS[name]
        records: list[bytes] = []
        bad = slow = False
        for code, itemsize, ndim in bufs:
            recs, b, sl = self.buffer_for(code, itemsize, ndim) if not valid else (
                self._shape(code, *self._valid_buffer(itemsize, ndim)), False, False)
            records += recs
            bad |= b
            slow |= sl
        for code in scalars:
            bits = struct.unpack("<I", struct.pack("<f", rng.uniform(-4, 4)))[0] \
                if rng.random() < 0.8 else rng.getrandbits(64)
            records.append(R(userq.ARG_SCALAR, code, bits, 0))
        handle = self.handles[name]
        grid = (rng.randint(1, 8), 1, 1)
        block = (rng.choice((1, 32, 64, 256)), 1, 1)
        dyn = 0
        what = f"launch {name}"
        damage_bad = extra_record = False
        if not valid:
            r = rng.random()
            if r < 0.12:
                handle = rng.choice((self.b_handles[name], rng.choice(self.stale_handles),
                                     (handle | 0xFFFF), rng.getrandbits(64), 0, (1 << 64) - 1))
                bad = True
                what += " bad handle"
            elif r < 0.2:
                grid = rng.choice(((0, 1, 1), (1, 0, 1), ((1 << 21) - 1,) * 3))
                block = (0, 1, 1) if grid[0] > 1 else block  # a huge grid never runs
                bad = True
                what += f" grid {grid} block {block}"
            elif r < 0.27:
                block = rng.choice(((1025, 1, 1), (32, 32, 2), (0, 1, 1), ((1 << 21) - 1, 1, 1)))
                bad = True
                what += f" block {block}"
            elif r < 0.33:
                dyn = rng.choice((48 << 10, (48 << 10) + 1, 1 << 32, (1 << 64) - 1))
                bad |= dyn > 48 << 10
                what += f" dynamic {dyn}"
            elif r < 0.45:  # record-level damage
                k = rng.randrange(len(records))
                kind, code, value, nbytes = userq.ARG_RECORD.unpack(records[k])
                d = rng.randrange(4)
                # a shape record whose count flips 1 <-> 2, or that is missing, may still
                # decode (as another shape): not sure to fault
                sure = not (kind == userq.ARG_SHAPE and d in (0, 3))
                if d == 0:
                    code = rng.choice((0, 12, 255, (1 << 32) - 1, 1 if code != 1 else 2))
                elif d == 1:
                    kind = rng.choice((3, 7, (1 << 32) - 1, userq.ARG_SHAPE if kind != 2 else 0))
                elif d == 2:
                    records.append(R(rng.choice((0, 1, 2)), 9, 0, 0))  # one record too many
                else:
                    del records[k]
                if d != 2 and d != 3:
                    records[k] = R(kind, code, value, nbytes)
                damage_bad, extra_record = sure, d == 2
                slow |= not sure
                what += f" record damage {d}"
        raw = b"".join(records)
        va, slot = self.arg_slot()
        slot[: len(raw)] = raw
        length = len(raw)
        if not valid and rng.random() < 0.15:
            length, va, why = rng.choice((
                (length - rng.randint(1, 23), va, "truncated"),
                (length - 24, va, "a record short"),
                (5000, va, "past ACCEL_ARGS_MAX"),
                (length, rng.choice(self.foreign).va, "of another context"),
                (length, rng.choice(U64), "anywhere"),
                (0, va, "empty"),
                ((1 << 64) - 1, va, "2**64-1")))
            length = max(0, length)
            if why == "a record short" and extra_record:
                damage_bad = False  # it drops the record too many: the block is valid again
            elif why == "a record short" and records and \
                    userq.ARG_RECORD.unpack(records[-1])[0] == userq.ARG_SHAPE:
                slow = True  # the last buffer loses its shape: decodes as 1-D
            elif why != "anywhere":
                bad = True
            what += f" args {why}"
        bad |= damage_bad
        if length > userq.ACCEL_ARGS_MAX or not self.reachable(va, length):
            bad = True
        a = (handle, userq.pack_dims(grid), userq.pack_dims(block), dyn, va, length, 0)
        return Pkt(userq.RAW_PACKET.pack(Op.LAUNCH, 0, *(x & userq.U64_MAX for x in a)), must_fault=bad,
                   slow=slow, what=what)

    def _valid_buffer(self, itemsize: int, ndim: int) -> tuple[int, int, list[int]]:
        rng = self.rng
        m = rng.choice([self.A.mems[k] for k in ("dev", "dev_small", "pin", "man")]
                       + [self.C.mems["dev"]])
        elements = min(rng.choice((1, 64, 256, 1024)), m.size // itemsize)
        if self.warming:
            m, elements = self.A.mems["dev"], 256
        shape = [elements // 2 or 1, 2 if elements >= 2 else 1] if ndim == 2 else [elements]
        n = shape[0] * (shape[1] if ndim == 2 else 1)
        return m.va, n * itemsize, shape

    # --- episodes --------------------------------------------------------------------------------
    def ring_for_episode(self) -> int:
        rng = self.rng
        if len(self.pool) < 4 and rng.random() < 0.2:
            self.pool.append(self.queue(self.A, rng.randint(0, 1)))
        return rng.choice(self.pool)

    def retire(self, qid: int) -> None:
        """A faulted (or abused) ring: destroy it; keep our mapping a while (the drain is
        watched)."""
        if qid in self.pool:
            self.pool.remove(qid)
        self.destroy_queue(self.A, qid)
        self.forget_later(qid)
        if len(self.pool) < 2:
            self.pool.append(self.queue(self.A, self.rng.randint(0, 1)))

    def forget(self, qid: int) -> None:
        _, ring, _ = self.A.rings.pop(qid)
        ring.close()

    def episode(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.04:
            return self.episode_preset()
        if r < 0.08:
            return self.episode_scribble()
        if r < 0.11:
            return self.episode_free()
        if r < 0.13:
            return self.episode_module()
        if r < 0.16:
            return self.episode_alias()
        qid = self.ring_for_episode()
        slot, ring, _ = self.A.rings[qid]
        base = ring.wptr
        n = rng.randint(1, 12) if rng.random() < 0.97 else rng.choice((64, 65, 200))
        pkts = [self.packet(qid) for _ in range(n)]
        for i, p in enumerate(pkts):
            ring.write_packet(base + i, p.raw)
        self.packets += n
        self.rings_done += 1
        w = base + n
        lie = None
        x = rng.random()
        if x < 0.06:
            lie = rng.choice(("+1024", "+1e6", "+2**63", "2**64-1", "back"))
            if lie == "back" and base == 0:
                lie = "+1e6"
            w = {"+1024": ring.rptr + 1024, "+1e6": base + n + 10**6, "+2**63": base + n + (1 << 63),
                 "2**64-1": userq.U64_MAX, "back": max(0, base - rng.randint(1, base or 1))}[lie]
            self.publish(self.A, qid, w)
        elif x < 0.14:
            how = rng.choice(("garbage slot", "no bump", "other slot", "stale slot"))
            ring.set(userq.RING_WPTR, w)
            if how == "garbage slot":
                self.knock(self.A, slot, rng.getrandbits(64))
            elif how == "no bump":
                self.knock(self.A, slot, w, bump=False)
                time.sleep(0.02)
            elif how == "other slot":
                self.knock(self.A, rng.choice([s for s, _, _ in self.A.rings.values()] + [999, 1023]), w)
            else:
                self.knock(self.A, slot, base)
            time.sleep(rng.choice((0, 0.005)))
            self.publish(self.A, qid, w)  # then the truth
        else:
            self.publish(self.A, qid, w)
        for p in pkts:
            if p.arrange is not None:
                p.arrange()
        destroy_now = rng.random() < 0.04
        if destroy_now:
            self.retire(qid)
        desc = f"ring {qid} base {base} +{n} lie {lie}: " + "; ".join(p.what for p in pkts)
        self.progress.step(desc[:3000])
        if lie in ("+1e6", "+2**63", "2**64-1", "back"):
            ok = self.wait_until(lambda: ring.read_fault()[0] != 0, self.bound, desc, ring,
                                 (qid, w))
            fault = ring.read_fault()
            if not ok:
                self.hang(f"a write-pointer lie was never faulted: {desc}")
            elif fault[1] != errno.EINVAL and fault[0] > base:
                self.note(f"lie faulted {errno.errorcode.get(fault[1])}, not EINVAL: {desc}")
            self.count_fault(fault, base)
            if not destroy_now:
                self.retire(qid)
            return
        blocks = lie == "+1024" or any(p.blocks for p in pkts)
        slow = any(p.slow for p in pkts)
        target = w
        done = self.wait_until(lambda: ring.completed >= target, 1.0 if blocks else
                               self.bound * (3 if slow else 1), desc, ring, (qid, w))
        if not done and blocks and not destroy_now:
            waited = next((p.waits_on for p in pkts if p.waits_on is not None), None)
            if waited is not None and rng.random() < 0.5:
                self.destroy_waited(waited)  # the queue it waits on goes first
            self.retire(qid)  # a blocked ring must drain once destroyed
            destroy_now = True
            done = self.wait_until(lambda: ring.completed >= target, self.bound, desc, ring,
                                   (qid, w))
        if not done:
            self.hang(f"ring neither completed nor faulted in {self.bound:.0f} s "
                      f"(rptr {ring.rptr}, completed {ring.completed}, fault "
                      f"{ring.read_fault()}): {desc}")
            if not destroy_now:
                self.retire(qid)
            return
        fault = ring.read_fault()
        self.count_fault(fault, base)
        first = next((base + 1 + i for i, p in enumerate(pkts) if p.must_fault), None)
        if first is not None and lie is None and (fault[0] == 0 or fault[0] > first):
            self.escape(f"packet {first} ran though it must fault (fault record {fault}): {desc}")
        if fault[0] == 0 and lie == "+1024":
            pass
        if (fault[0] or lie) and not destroy_now:
            self.retire(qid)
        self.check_b()

    def destroy_waited(self, waited: int) -> None:
        """Destroy the queue a blocked ring waits on (its fence must stay readable)."""
        if waited == self.imported:
            self.destroy_queue(self.A, waited)
            self.imported = self.call(self.A, uapi.ACCEL_CMD_QUEUE_IMPORT, uapi.accel_queue_import(
                ctx_id=self.A.ctx, peer_index=1, peer_queue_id=self.cq)).queue_id
        elif waited in self.pool:
            self.retire(waited)
        else:
            return
        time.sleep(0.02)  # the blocked ring looks at it a few times
        self.check_lost()

    def episode_alias(self) -> None:
        """Packets into a ring whose memory A's packets may write (and do, now and then),
        created again each time on that memory, with whatever its header says by then."""
        rng = self.rng
        qid = self.queue(self.A, memfd=self.alias_ring_fd)
        _, ring, _ = self.A.rings[qid]
        base = ring.rptr
        ring.set(userq.RING_WPTR, base)
        pkts = [self.packet(qid) for _ in range(rng.randint(1, 12))]
        for i, p in enumerate(pkts):
            ring.write_packet(base + i, p.raw)
        w = base + len(pkts)
        self.publish(self.A, qid, w)
        self.packets += len(pkts)
        self.rings_done += 1
        desc = f"alias ring {qid} base {base}: " + "; ".join(p.what for p in pkts)
        self.progress.step(desc[:3000])
        # its fence and fault words are memory the device writes too: not judged; what
        # counts is that the firmware lives and the context's other rings still run
        self.wait_until(lambda: ring.completed >= w or ring.read_fault()[0] != 0, 1.0, desc,
                        ring, (qid, w))
        self.destroy_queue(self.A, qid)
        self.forget_later(qid)
        self.check_b()

    def episode_free(self) -> None:
        """Memory freed while packets in flight use it: they complete unharmed; once the
        memory is back (MEM_INFO pending_free 0) a packet naming it must fault."""
        rng = self.rng
        A = self.A
        tmp = self.alloc(A, "tmp", rng.choice((4096, 64 << 10, 1 << 20)), uapi.MemKind.DEVICE)
        del A.mems["tmp"]
        qid = self.ring_for_episode()
        _, ring, _ = A.rings[qid]
        base = ring.wptr
        pkts = [userq.RAW_PACKET.pack(Op.MEMSET, 0, tmp.va, tmp.size, 0x33, 0, 0, 0, 0)
                for _ in range(rng.randint(1, 4))]
        w = self.submit(A, qid, pkts)
        self.call(A, uapi.ACCEL_CMD_MEM_FREE, uapi.accel_mem_free(ctx_id=A.ctx, handle=tmp.handle))
        self.packets += len(pkts)
        self.rings_done += 1
        desc = f"free while in use: ring {qid} base {base} memsets of {tmp.size} at {tmp.va:#x}"
        self.progress.step(desc)
        if not self.wait_until(lambda: ring.completed >= w, self.bound, desc, ring):
            self.hang(f"ring neither completed nor faulted: {desc}")
            return self.retire(qid)
        if ring.read_fault()[0] > base:
            self.note(f"memory freed while in use faulted its packets {ring.read_fault()}: {desc}")
            return self.retire(qid)
        info = lambda: self.call(A, uapi.ACCEL_CMD_MEM_INFO, uapi.accel_mem_info(ctx_id=A.ctx))
        if not self.wait_until(lambda: info().pending_free == 0, self.bound, desc):
            self.note(f"freed memory never came back: {desc}")
            return
        w = self.submit(A, qid, [userq.RAW_PACKET.pack(Op.MEMSET, 0, tmp.va, 1, 0x44, 0, 0, 0, 0)])
        self.packets += 1
        if not self.wait_until(lambda: ring.completed >= w, self.bound, desc, ring):
            self.hang(f"ring neither completed nor faulted: {desc}")
        elif ring.read_fault()[:2] != (w, errno.EFAULT):
            self.escape(f"a packet reached memory freed and given back ({ring.read_fault()}): {desc}")
        self.count_fault(ring.read_fault(), w - 1)
        self.retire(qid)

    def episode_module(self) -> None:
        """Launches of a module loaded a moment ago (parked until the firmware parsed it),
        sometimes unloaded right after the launch is queued."""
        rng = self.rng
        A = self.A
        handles = self.load(A, self.module_raw)
        mid = next(iter(handles.values())) >> 16
        qid = self.ring_for_episode()
        _, ring, _ = A.rings[qid]
        base = ring.wptr
        saved, self.handles = self.handles, handles
        try:
            pkts = [self.launch_packet(rng.choice(list(SIGS)), valid=True) for _ in range(rng.randint(1, 3))]
        finally:
            self.handles = saved
        w = self.submit(A, qid, [p.raw for p in pkts])
        unload = rng.random() < 0.5
        if unload:
            self.call(A, uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(ctx_id=A.ctx,
                                                                                module_id=mid))
        else:
            self.extra_modules.append(mid)
        self.packets += len(pkts)
        self.rings_done += 1
        desc = f"module {mid} just loaded, unloaded {unload}: ring {qid} base {base}: " + \
            "; ".join(p.what for p in pkts)
        self.progress.step(desc)
        if not self.wait_until(lambda: ring.completed >= w, self.bound * 3, desc, ring):
            self.hang(f"ring neither completed nor faulted: {desc}")
            return self.retire(qid)
        fault = ring.read_fault()
        self.count_fault(fault, base)
        if fault[0] > base:
            self.retire(qid)
        while len(self.extra_modules) > 8:
            self.call(A, uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(
                ctx_id=A.ctx, module_id=self.extra_modules.pop(0)))

    def episode_preset(self) -> None:
        """A ring whose consumer words were set before QUEUE_CREATE."""
        rng = self.rng
        rptr = rng.choice((0, 5, 1000, 1 << 63, (1 << 64) - 3, rng.getrandbits(64)))
        header = {userq.RING_RPTR: rptr, userq.RING_WPTR: rptr,
                  userq.RING_COMPLETED: rng.choice((0, rptr, rng.getrandbits(64))),
                  userq.RING_IRQ_SEQNO: rng.choice((0, 1, (1 << 64) - 1))}
        if rng.random() < 0.5:
            header[userq.RING_ERROR_SEQNO] = rng.choice((1, rptr, (1 << 64) - 1))
            header[userq.RING_ERROR_CODE] = rng.getrandbits(64)
        try:
            qid = self.queue(self.A, header=header)
        except OSError:
            return
        _, ring, _ = self.A.rings[qid]
        n = rng.randint(1, 8)
        pkts = [userq.RAW_PACKET.pack(0, 0, *(0,) * 7)] * n
        w = (rptr + n) & userq.U64_MAX
        for i, p in enumerate(pkts):
            ring.write_packet(rptr + i, p)
        self.packets += n
        self.rings_done += 1
        self.publish(self.A, qid, w)
        desc = f"preset ring {qid} header {header} +{n}"
        self.progress.step(desc)
        ok = self.wait_until(lambda: ring.completed == w or ring.read_fault()[0] != 0
                             or (w >= rptr and ring.rptr == w and ring.completed == w),
                             self.bound, desc, ring)
        if not ok:
            self.hang(f"a preset ring neither completed nor faulted: {desc} (rptr {ring.rptr}, "
                      f"completed {ring.completed})")
        self.destroy_queue(self.A, qid)
        self.forget_later(qid)

    def episode_scribble(self) -> None:
        """Consumer words scribbled while packets run; the ring is destroyed after."""
        rng = self.rng
        qid = self.queue(self.A)
        _, ring, _ = self.A.rings[qid]
        n = rng.randint(1, 8)
        pkts = [self.packet(qid) for _ in range(n)]
        pkts = [p for p in pkts if not p.blocks]
        w = self.submit(self.A, qid, [p.raw for p in pkts])
        self.packets += len(pkts)
        self.rings_done += 1
        for off in rng.sample((userq.RING_RPTR, userq.RING_COMPLETED, userq.RING_ERROR_SEQNO,
                               userq.RING_ERROR_CODE, userq.RING_ERROR_ADDR, userq.RING_IRQ_SEQNO,
                               userq.RING_ON_ENGINE), 2):
            ring.set(off, rng.choice(U64))
        self.publish(self.A, qid, w)
        time.sleep(0.005)
        self.destroy_queue(self.A, qid)
        self.forget_later(qid)
        self.check_b()

    def forget_later(self, qid: int) -> None:
        """Unmap a destroyed ring of ours once the firmware surely let go of it (our
        mapping is only for watching; the firmware has its own)."""
        self.retired.append(qid)
        while len(self.retired) > 8:
            self.forget(self.retired.pop(0))

    def count_fault(self, fault: tuple[int, int, int, int], base: int) -> None:
        if fault[0] > base:
            name = errno.errorcode.get(fault[1], str(fault[1]))
            self.errnos[name] += 1
            if fault[1] == errno.EIO:
                self.note(f"a ring fault record says EIO: {fault}")

    def check_b(self) -> None:
        view = self.B.mems["pin"].view
        if view is not None and view != self.pattern:
            self.escape("context B's pinned memory changed")
            view[:] = self.pattern

    def note(self, text: str) -> None:
        if len(self.notes) < 40:
            self.notes.append(text[:2500])

    def escape(self, text: str) -> None:
        self.escapes += 1
        self.note("ESCAPE " + text)

    def hang(self, text: str) -> None:
        self.hangs += 1
        self.note("HANG " + text)

    def runaway(self) -> None:
        """A valid launch of a huge grid, left running when the process exits: the context's
        teardown must still complete (the parent's containment check waits for it)."""
        qid = self.pool[0]
        va, nbytes, shape = self._valid_buffer(4, 1)
        raw = b"".join(self._shape(9, va, nbytes, shape)) + userq.ARG_RECORD.pack(
            userq.ARG_SCALAR, 9, 0, 0)
        args, slot = self.arg_slot()
        slot[: len(raw)] = raw
        a = (self.handles["fill"], userq.pack_dims(((1 << 21) - 1, (1 << 21) - 1, 1)),
             userq.pack_dims((256, 1, 1)), 0, args, len(raw), 0)
        self.submit(self.A, qid, [userq.RAW_PACKET.pack(Op.LAUNCH, 0, *a)])
        self.packets += 1
        self.progress.step("runaway launch queued; exiting")
        time.sleep(0.3)

    # --- the round ---------------------------------------------------------------------------
    def run(self) -> None:
        self.noops = 0
        self.retired: list[int] = []
        try:
            self.setup()
            while self.packets < self.count and self.stop is None:
                self.episode()
                if self.rings_done % 50 == 0:
                    self.save()
            if self.rng.random() < 0.25:
                self.runaway()
            else:  # leave some work in flight
                for _ in range(self.rng.randint(0, 3)):
                    self.submit(self.A, self.rng.choice(self.pool), [self.packet(0).raw])
        except _Lost:
            pass
        except OSError as exc:
            self.note(f"client call failed: {exc!r}: {traceback.format_exc()[-600:]}")
            if exc.errno == errno.EIO:
                pass
        self.save()

    def save(self) -> None:
        write_result(self.result_path, {
            "done": {"packets": self.packets, "rings": self.rings_done},
            "errnos": dict(self.errnos), "escapes": self.escapes, "hangs": self.hangs,
            "notes": self.notes, "stop": self.stop})


def client_main(argv: list[str]) -> int:
    progress_path, result_path, opts = client_args(argv)
    Client(os.environ["ACCEL_EMU_ROOT"], int(opts.get("seed", 1)), int(opts.get("round", 0)),
           int(opts.get("count", ROUND)), float(opts.get("bound", RING_BOUND_S)),
           Progress(progress_path), result_path).run()
    return 0


if __name__ == "__main__":
    sys.exit(client_main(sys.argv[1:]))
