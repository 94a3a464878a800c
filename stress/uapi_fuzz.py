"""A structure-aware fuzzer of the command channel (the device node's write/read
transactions, :mod:`abi.uapi`).

The attacker is a separate process per round (:mod:`stress._common`: a watchdog kills it
when one transaction blocks longer than ``HANG_S``; the containment checks run after every
round). It knows every command of ``uapi.COMMANDS`` and its struct, and keeps a pool of
valid state made the way the runtime makes it: open files on every device, contexts
created with real pipes and a sealed doorbell page, queues with sealed rings, allocations of
every kind (device-local, pinned and managed from sealed memfds), exports and imports,
peer access, imported queues, modules loaded from sealed immutable memfds holding the IR
``runtime.kernels.compile_module`` makes, and kernel handles. Each transaction is one of:

* a valid command (it keeps the pool alive and growing);
* the same with fields drawn from interesting values: 0, 1, -1, 2**31-1, 2**32-1, 2**63-1,
  2**64-1 and neighbours, handles of its own of another kind, of its other contexts, stale
  handles (freed, destroyed, unloaded), guesses near the device's handle counter (other
  tenants' handles), and descriptors of every kind (its own memfds sealed wrongly or too
  small, pipes with and without a peer, a FIFO, regular files, /dev/null, a socket, an
  eventfd, a directory, the device nodes themselves, a sysfs file, closed and absurd
  numbers), nonzero flags and reserved fields;
* a header mutation: unknown, resized and re-directed command codes, flags, tags at and
  past the limit, duplicate tags, truncated, empty and oversized writes, random payloads;
* a read at a random tag, or of a pending reply with a short, long or empty size;
* DEVICE_RESET, from contexts that do not hold the device exclusively (EPERM: one that
  succeeded would be an escape). It is never sent from a context that does -- which only
  happens without bystanders, as theirs keep the device open -- since that reset is
  allowed and would change the very firmware the containment checks compare;
* lifecycle: close and reopen files with everything in them, destroy and recreate
  contexts, 257 unread replies, contexts up to the per-process limit, a thread swapping a
  descriptor number between a good and a bad file while it is named;
* MODULE_LOAD of mutated module JSON from a sealed memfd: wrong types in every field,
  missing and extra keys, deep nesting, huge strings and numbers, too many kernels, bad
  names, byte-level damage (truncation, invalid UTF-8, trailing garbage).

Every answer's errno is counted (EIO is a bug: bad input never answers it). A command
that succeeds where it must not -- naming a context, allocation, export, queue or module
not its own, or pinning memory that is not a fitting sealed memfd -- is an escape.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import fcntl
import itertools
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from abi import uapi, userq
from stress._common import (
    FUZZ_KERNELS,
    Progress,
    client_args,
    fuzz_rounds,
    write_result,
)
from stress.report import Report

#: ``python -m stress`` runs this many transactions at scale 1.
STRESS_COUNT = 1_000_000
#: Transactions per client process (the containment checks run between rounds).
ROUND = 1000
#: A transaction that blocks this long is a hang.
HANG_S = 5.0


def run(d, *, count: int, seed: int, bystanders: Any = True, round_size: int = ROUND,
        hang_s: float = HANG_S) -> Report:
    """Fuzz daemon ``d``'s command channel with ``count`` transactions; see the module doc.
    ``bystanders``: True starts one per device, or pass running ones, or None."""
    rep = Report("uapi_fuzz")
    return fuzz_rounds(d, rep, module=__name__, count=count, seed=seed, round_size=round_size,
                       unit="transactions", bystanders=bystanders, hang_s=hang_s,
                       options={"devices": d.devices})


# --- the attacking client ----------------------------------------------------------------
HDR = ctypes.sizeof(uapi.accel_cmd_hdr)
CMDS = list(uapi.COMMANDS.values())
BY_NAME = {c.name: c for c in CMDS}
#: Commands whose reply names a new object: always read, so the pool knows every object.
CREATING = {"CTX_CREATE", "MEM_ALLOC", "MEM_IMPORT", "QUEUE_CREATE", "QUEUE_IMPORT",
            "MODULE_LOAD"}

U64 = (0, 1, 2, 3, 7, 0xFF, 0x100, 4095, 4096, 4097, 0xFFFF, 1 << 20, (1 << 31) - 1, 1 << 31,
       (1 << 32) - 1, 1 << 32, (1 << 32) + 1, 1 << 44, (1 << 44) + 1, 1 << 48, 1 << 62,
       (1 << 63) - 1, 1 << 63, (1 << 64) - 4096, (1 << 64) - 2, (1 << 64) - 1)
U32 = (0, 1, 2, 3, 4, 0x7F, 0xFF, 0xFFFF, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1)
I32 = (-1, -2, 0, 1, 2, 3, 255, 1023, 1024, 4096, 1 << 20, (1 << 30) - 1, 1 << 30,
       (1 << 31) - 1, -(1 << 31))
KERNEL_SRC = FUZZ_KERNELS


def base_module() -> dict[str, Any]:
    from runtime.kernels import compile_module

    return compile_module(KERNEL_SRC)


def _memfd(name: str, size: int, seals: int | None, data: bytes = b"",
           flags: int = os.MFD_ALLOW_SEALING) -> int:
    fd = os.memfd_create(f"fuzz-{name}", os.MFD_CLOEXEC | flags)
    try:
        os.ftruncate(fd, size)
        if data:
            os.pwrite(fd, data, 0)
        if seals:
            fcntl.fcntl(fd, uapi.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class FdInfo:
    kind: str  # pinned, immutable, pipe, other
    size: int = 0


@dataclass(eq=False)
class File:
    dev: int
    fd: int
    ctx: int | None = None
    exclusive: bool = False  # the context holds the device exclusively (CTX_CREATE flag)
    allocs: dict[int, tuple[int, int]] = field(default_factory=dict)  # handle -> (kind, backing)
    queues: set[int] = field(default_factory=set)
    imported: set[int] = field(default_factory=set)
    modules: dict[int, list[str]] = field(default_factory=dict)
    submitted: int = 0
    pending: dict[int, str] = field(default_factory=dict)  # tag -> command name
    peers: set[int] = field(default_factory=set)


class _Stop(Exception):
    pass


class Client:
    def __init__(self, root: str, devices: int, seed: int, rnd: int, count: int,
                 progress: Progress, result_path: str) -> None:
        self.root, self.devices, self.count = root, devices, count
        self.rng = random.Random(f"uapi/{seed}/{rnd}")
        self.progress, self.result_path = progress, result_path
        self.files: list[File] = []
        #: files closed lately, with when: FUSE delivers a release after close() returned,
        #: so the driver may still see their contexts (and queues) for a moment
        self.closed: list[tuple[float, File]] = []
        self.stale: dict[str, list[int]] = {k: [] for k in ("ctx", "alloc", "export", "queue",
                                                            "module")}
        #: per device: export id -> [token, holders {(file, handle)}]
        self.exports: list[dict[int, list]] = [{} for _ in range(devices)]
        self.max_id = 0
        self.errnos: Counter[str] = Counter()
        self.by_label: Counter[str] = Counter()  # "COMMAND ERRNO" -> count ($FUZZ_TRACE)
        self.done = self.ok = self.client_errors = 0
        self.escapes = 0
        self.notes: list[str] = []
        self.tags = itertools.count(1)
        self.fdinfo: dict[int, FdInfo] = {}
        self.zoo: list[int] = []
        self.named: dict[str, int] = {}
        #: module image fd -> the kernel names it holds (for KERNEL_GET's judge)
        self._loaded_kernels: dict[int, list[str]] = {}
        self.module_ir = base_module()
        self.module_raw = json.dumps(self.module_ir).encode()
        self.stop: str | None = None
        self._make_zoo()

    # --- descriptors of every kind ---------------------------------------------------------
    def _keep(self, fd: int, kind: str, size: int = 0, name: str = "") -> int:
        self.fdinfo[fd] = FdInfo(kind, size)
        self.zoo.append(fd)
        if name:
            self.named[name] = fd
        return fd

    def _make_zoo(self) -> None:
        P, I = uapi.ACCEL_SEALS_PINNED, uapi.ACCEL_SEALS_IMMUTABLE
        for size in (4096, 1 << 20, 2 << 30, 1 << 44):
            self._keep(_memfd("pin", size, P), "pinned", size, f"pin{size}")
        self.ring = self._keep(_memfd("ring", userq.RING_FILE_SIZE, P), "pinned", userq.RING_FILE_SIZE)
        self._keep(_memfd("db", userq.ACCEL_DB_PAGE_SIZE, P), "pinned", userq.ACCEL_DB_PAGE_SIZE)
        self.module_fd = self._keep(_memfd("mod", len(self.module_raw), I, self.module_raw),
                                    "immutable", len(self.module_raw))
        self._keep(_memfd("unsealed", 1 << 20, None), "bad", name="unsealed")
        self._keep(_memfd("noseal", 1 << 20, None, flags=0), "bad")
        self._keep(_memfd("partial", 1 << 20, uapi.F_SEAL_SHRINK | uapi.F_SEAL_SEAL), "bad")
        self._keep(_memfd("immut", 1 << 20, I), "immutable", 1 << 20, "immut")
        self._keep(_memfd("futurew", 1 << 20, P | uapi.F_SEAL_FUTURE_WRITE), "bad")
        self._keep(_memfd("small", 100, P), "pinned", 100)
        self._keep(_memfd("pinmod", len(self.module_raw), P, self.module_raw), "pinned",
                   len(self.module_raw), "pinmod")
        try:
            self._keep(_memfd("huge", 2 << 20, None, flags=os.MFD_HUGETLB | os.MFD_ALLOW_SEALING), "bad")
        except OSError:
            pass
        r, w = os.pipe()
        self._keep(r, "pipe")
        self._keep(w, "pipe")
        r2, w2 = os.pipe()
        os.close(w2)
        self._keep(r2, "pipe")  # no writer left
        r3, w3 = os.pipe()
        os.close(r3)
        self._keep(w3, "pipe")  # no reader left
        fifo_dir = tempfile.mkdtemp(prefix="fuzz-fifo-")
        fifo = os.path.join(fifo_dir, "f")
        os.mkfifo(fifo)
        self._keep(os.open(fifo, os.O_RDWR | os.O_NONBLOCK), "other")
        os.unlink(fifo)
        os.rmdir(fifo_dir)
        try:
            self._keep(os.open("/tmp", os.O_TMPFILE | os.O_RDWR), "other")
        except OSError:
            pass
        self._keep(os.open(sys.executable, os.O_RDONLY), "other")
        self._keep(os.open("/dev/null", os.O_RDWR), "other")
        self._keep(os.open("/dev/zero", os.O_RDWR), "other")
        a, b = socket.socketpair()
        self._sockets = (a, b)
        self._keep(a.fileno(), "other")
        self._keep(os.eventfd(0), "other")
        self._keep(os.open("/", os.O_RDONLY | os.O_DIRECTORY), "other")
        for dev in range(self.devices):
            self._keep(os.open(self.node(dev), os.O_RDWR), "other")
        self._keep(os.open(f"{self.root}/{uapi.CLASS_DIR}/accel0/state", os.O_RDONLY), "other")
        self._keep(os.open("/proc/self/status", os.O_RDONLY), "other")
        closed = os.dup2(self.zoo[0], 999)
        os.close(closed)
        self.closed_fd = closed

    def node(self, dev: int) -> str:
        return f"{self.root}/{uapi.DEV_DIR}/accel{dev}"

    def pinned_ok(self, fd: int, size: int) -> bool:
        info = self.fdinfo.get(fd)
        return info is not None and info.kind == "pinned" and size <= info.size

    def any_fd(self) -> int:
        r = self.rng.random()
        if r < 0.75:
            return self.rng.choice(self.zoo)
        if r < 0.85:
            return self.closed_fd
        return self.rng.choice(I32)

    # --- transactions -------------------------------------------------------------------------
    def _answer(self, err: int, label: str, raw: bytes) -> None:
        name = errno.errorcode.get(err, str(err))
        self.errnos[name] += 1
        self.by_label[f"{label.split('/')[0]} {name}"] += 1
        if err == errno.EIO and self.errnos[name] <= 10:
            fds = {fd: self.fdinfo[fd].kind for fd in self.fdinfo}
            self.notes.append(f"EIO for {label}: {raw[:200].hex()} (descriptors {fds})")
        elif err in (errno.ENOTCONN, errno.ECONNABORTED):
            self.stop = f"the mount went away ({name}) at {label}"
            raise _Stop()
        elif err == errno.ENODEV and self.errnos[name] <= 3:
            self.notes.append(f"ENODEV (context or device lost) for {label}")

    def write(self, f: File, raw: bytes, label: str, offset: int = 0) -> int:
        """One write transaction; 0 or the errno it failed with."""
        self.progress.step(f"#{self.done} write {label} dev{f.dev} fd{f.fd}: {raw[:160].hex()}")
        self.done += 1
        try:
            os.pwrite(f.fd, raw, offset)
        except OSError as exc:
            self._answer(exc.errno, label, raw)
            return exc.errno
        self.ok += 1
        return 0

    def read(self, f: File, size: int, tag: int, label: str) -> bytes | int:
        self.progress.step(f"#{self.done} read {label} dev{f.dev} fd{f.fd}: size {size} tag {tag}")
        self.done += 1
        try:
            out = os.pread(f.fd, size, tag)
        except OSError as exc:
            self._answer(exc.errno, label, b"")
            return exc.errno
        self.ok += 1
        return out

    def transact(self, f: File, cmd: uapi.Command, arg: Any, *, tag: int | None = None,
                 leave_unread: bool = False, raw: bytes | None = None) -> Any:
        """Write ``cmd`` (``raw`` bytes if given), and on success read its reply unless
        ``leave_unread``; judge and absorb the outcome. Returns the reply, True (success
        without reply), or the errno."""
        tag = next(self.tags) if tag is None else tag
        if raw is None:
            raw = bytes(uapi.accel_cmd_hdr(cmd=cmd.code, tag=tag)) + bytes(arg)
        err = self.write(f, raw, cmd.name)
        if err:
            return err
        self.judge(f, cmd, arg)
        if not cmd.has_reply:
            self.absorb(f, cmd, arg, None)
            return True
        if cmd.name == "SUBMIT_NOOP":
            f.submitted += 1
        if leave_unread and cmd.name not in CREATING:
            f.pending[tag] = cmd.name
            return True
        out = self.read(f, ctypes.sizeof(cmd.struct), tag, f"reply {cmd.name}")
        if isinstance(out, int):
            return out
        reply = cmd.struct.from_buffer_copy(out)
        self.absorb(f, cmd, arg, reply)
        return reply

    # --- what must not succeed ------------------------------------------------------------------
    def escape(self, f: File, cmd: uapi.Command, why: str) -> None:
        self.escapes += 1
        if len(self.notes) < 40:
            self.notes.append(f"ESCAPE {cmd.name} on dev{f.dev}: {why}")

    def live_files(self, dev: int | None = None) -> list[File]:
        return [g for g in self.files if g.ctx is not None and dev in (None, g.dev)]

    def maybe_live_files(self, dev: int) -> list[File]:
        """Files with a context on ``dev`` as the driver may still see them: the live ones
        and those closed in the last 2 s (their release may not have arrived yet)."""
        now = time.monotonic()
        self.closed = [(t, g) for t, g in self.closed if now - t < 2.0]
        return self.live_files(dev) + [g for _, g in self.closed if g.dev == dev]

    def judge(self, f: File, cmd: uapi.Command, arg: Any) -> None:
        """A command just succeeded: was it allowed to?"""
        name = cmd.name
        if name in ("GET_VERSION", "DEVICE_QUERY"):
            return
        if name == "CTX_CREATE":
            if not self.pinned_ok(arg.db_page_fd, userq.ACCEL_DB_PAGE_SIZE):
                self.escape(f, cmd, f"took doorbell page fd {arg.db_page_fd} "
                                    f"({self.fdinfo.get(arg.db_page_fd)})")
            for fd in (arg.doorbell_fd, arg.event_fd):
                if getattr(self.fdinfo.get(fd), "kind", None) != "pipe":
                    self.escape(f, cmd, f"took pipe fd {fd} ({self.fdinfo.get(fd)})")
            return
        if arg.ctx_id != f.ctx:
            self.escape(f, cmd, f"named context {arg.ctx_id}; this file's is {f.ctx}")
            return
        if name == "DEVICE_RESET":  # never sent from an exclusive context (commands_for)
            self.escape(f, cmd, f"reset dev{f.dev} from context {f.ctx}, not exclusive")
        elif name == "MEM_ALLOC":
            if arg.kind != uapi.MemKind.DEVICE and not self.pinned_ok(arg.fd, arg.size):
                self.escape(f, cmd, f"pinned {arg.size} bytes of fd {arg.fd} "
                                    f"({self.fdinfo.get(arg.fd)})")
        elif name in ("MEM_FREE", "MEM_EXPORT"):
            a = f.allocs.get(arg.handle)
            if a is None or (name == "MEM_EXPORT" and a[0] != uapi.MemKind.DEVICE):
                self.escape(f, cmd, f"allocation {arg.handle} is not this context's "
                                    f"device memory ({a})")
        elif name == "MEM_IMPORT":
            e = self.exports[f.dev].get(arg.export_handle)
            if e is None or e[0] != arg.token or not e[1]:
                self.escape(f, cmd, f"imported {arg.export_handle} with token {arg.token:#x} "
                                    f"(known: {e and (hex(e[0]), len(e[1]))})")
        elif name == "QUEUE_CREATE":
            if not self.pinned_ok(arg.ring_fd, userq.RING_FILE_SIZE):
                self.escape(f, cmd, f"took ring fd {arg.ring_fd} ({self.fdinfo.get(arg.ring_fd)})")
        elif name == "QUEUE_DESTROY":
            if arg.queue_id not in f.queues | f.imported:
                self.escape(f, cmd, f"queue {arg.queue_id} is not this context's")
        elif name == "QUEUE_IMPORT":
            ok = any(arg.peer_queue_id in g.queues for g in self.maybe_live_files(arg.peer_index))
            if not ok or arg.peer_index == f.dev:
                self.escape(f, cmd, f"imported queue {arg.peer_queue_id} of device "
                                    f"{arg.peer_index}, not this process's")
        elif name == "PEER_ENABLE":
            if arg.peer_index == f.dev or not self.maybe_live_files(arg.peer_index):
                self.escape(f, cmd, f"peer {arg.peer_index} without a context there")
        elif name in ("MODULE_UNLOAD", "KERNEL_GET"):
            kernels = f.modules.get(arg.module_id)
            kname = arg.name.decode(errors="replace") if name == "KERNEL_GET" else ""
            if kernels is None or (name == "KERNEL_GET" and kname not in kernels):
                self.escape(f, cmd, f"module {arg.module_id} kernel {arg.name!r} is not "
                                    f"this context's")
        elif name == "MODULE_LOAD":
            info = self.fdinfo.get(arg.fd)
            if info is None or info.kind != "immutable" or arg.size > info.size:
                self.escape(f, cmd, f"loaded {arg.size} bytes of fd {arg.fd} ({info})")
        elif name == "WAIT" and arg.seqno > f.submitted and len(self.notes) < 40:
            self.notes.append(f"WAIT for seqno {arg.seqno} succeeded; {f.submitted} submitted")

    def see(self, *ids: int) -> None:
        self.max_id = max(self.max_id, *ids)

    def forget_file_objects(self, f: File) -> None:
        """Its context is gone: everything in it is stale now."""
        self.stale["ctx"].append(f.ctx or 0)
        self.stale["alloc"] += list(f.allocs)
        self.stale["queue"] += list(f.queues | f.imported)
        self.stale["module"] += list(f.modules)
        for h in f.allocs:
            self._drop_holder(f, h)
        f.ctx = None
        f.exclusive = False
        f.allocs.clear()
        f.queues.clear()
        f.imported.clear()
        f.modules.clear()
        f.peers.clear()
        f.submitted = 0
        for v in self.stale.values():
            if len(v) > 64:
                del v[: len(v) - 64]

    def _drop_holder(self, f: File, handle: int) -> None:
        exports = self.exports[f.dev]
        for eid, e in list(exports.items()):
            e[1].discard((id(f), handle))
            if not e[1]:
                del exports[eid]
                self.stale["export"].append(eid)

    def absorb(self, f: File, cmd: uapi.Command, arg: Any, reply: Any) -> None:
        """Learn the objects a successful command made or ended."""
        name = cmd.name
        if name == "CTX_CREATE":
            f.ctx = reply.ctx_id
            f.exclusive = bool(arg.flags & uapi.ACCEL_CTX_EXCLUSIVE)
            self.see(reply.ctx_id)
        elif name == "CTX_DESTROY":
            self.forget_file_objects(f)
        elif name == "MEM_ALLOC":
            f.allocs[reply.handle] = (arg.kind, 0)
            self.see(reply.handle)
        elif name == "MEM_FREE":
            if f.allocs.pop(arg.handle, None) is not None:
                self.stale["alloc"].append(arg.handle)
                self._drop_holder(f, arg.handle)
        elif name == "MEM_EXPORT" and reply is not None:
            e = self.exports[f.dev].setdefault(reply.export_id, [reply.token, set()])
            e[1].add((id(f), arg.handle))
            self.see(reply.export_id)
        elif name == "MEM_IMPORT":
            f.allocs[reply.handle] = (reply.kind, arg.export_handle)
            e = self.exports[f.dev].get(arg.export_handle)
            if e is not None:
                e[1].add((id(f), reply.handle))
            self.see(reply.handle)
        elif name == "QUEUE_CREATE":
            f.queues.add(reply.queue_id)
            self.see(reply.queue_id)
        elif name == "QUEUE_IMPORT":
            f.imported.add(reply.queue_id)
            self.see(reply.queue_id)
        elif name == "QUEUE_DESTROY":
            f.queues.discard(arg.queue_id)
            f.imported.discard(arg.queue_id)
            self.stale["queue"].append(arg.queue_id)
        elif name == "MODULE_LOAD":
            f.modules[reply.module_id] = self._loaded_kernels.get(arg.fd, [])
            self.see(reply.module_id)
        elif name == "MODULE_UNLOAD":
            f.modules.pop(arg.module_id, None)
            self.stale["module"].append(arg.module_id)
        elif name == "PEER_ENABLE":
            f.peers.add(arg.peer_index)

    # --- valid commands ------------------------------------------------------------------------
    def valid(self, f: File, cmd: uapi.Command) -> tuple[Any, list[int]]:
        """A valid struct for ``cmd`` on ``f`` (as valid as the pool allows), and the
        descriptors made for it (closed after the transaction)."""
        S, rng, name = cmd.struct, self.rng, cmd.name
        ctx = f.ctx or 0
        temp: list[int] = []
        if name == "CTX_CREATE":
            db = _memfd("db", userq.ACCEL_DB_PAGE_SIZE, uapi.ACCEL_SEALS_PINNED)
            bell_r, bell_w = os.pipe2(os.O_NONBLOCK)
            ev_r, ev_w = os.pipe2(os.O_NONBLOCK)
            temp += [db, bell_r, bell_w, ev_r, ev_w]
            self.fdinfo[db] = FdInfo("pinned", userq.ACCEL_DB_PAGE_SIZE)
            for p in (bell_r, bell_w, ev_r, ev_w):
                self.fdinfo[p] = FdInfo("pipe")
            return S(abi_major=uapi.ACCEL_ABI_MAJOR, abi_minor=uapi.ACCEL_ABI_MINOR,
                     doorbell_fd=bell_r, event_fd=ev_w, db_page_fd=db), temp
        if name == "MEM_ALLOC":
            kind = rng.choice(list(uapi.MemKind))
            if kind == uapi.MemKind.DEVICE:
                return S(ctx_id=ctx, size=rng.choice((1, 100, 4096, 65536, 1 << 20)),
                         kind=kind, fd=-1), temp
            fd = rng.choice([z for z in self.zoo if self.fdinfo[z].kind == "pinned"
                             and self.fdinfo[z].size <= 2 << 30])
            size = self.fdinfo[fd].size
            return S(ctx_id=ctx, size=rng.choice((size, max(1, size // 2), 1)), kind=kind,
                     fd=fd), temp
        if name == "MEM_FREE":
            return S(ctx_id=ctx, handle=self.pick_own(f, "alloc")), temp
        if name == "MEM_EXPORT":
            dev = [h for h, (k, _) in f.allocs.items() if k == uapi.MemKind.DEVICE]
            return S(ctx_id=ctx, handle=rng.choice(dev) if dev else self.pick_own(f, "alloc")), temp
        if name == "MEM_IMPORT":
            ex = self.exports[f.dev]
            if ex:
                eid = rng.choice(list(ex))
                return S(ctx_id=ctx, export_handle=eid, token=ex[eid][0]), temp
            return S(ctx_id=ctx, export_handle=self.guess(), token=rng.getrandbits(64)), temp
        if name == "PEER_ENABLE":
            return S(ctx_id=ctx, peer_index=(f.dev + 1) % self.devices), temp
        if name == "QUEUE_CREATE":
            if rng.random() < 0.8:
                ring = _memfd("ring", userq.RING_FILE_SIZE, uapi.ACCEL_SEALS_PINNED)
                temp.append(ring)
                self.fdinfo[ring] = FdInfo("pinned", userq.RING_FILE_SIZE)
            else:
                ring = self.ring
            return S(ctx_id=ctx, priority=rng.randint(0, 1), ring_fd=ring), temp
        if name == "QUEUE_DESTROY":
            return S(ctx_id=ctx, queue_id=self.pick_own(f, "queue")), temp
        if name == "QUEUE_IMPORT":
            peers = [(g.dev, q) for g in self.live_files() if g.dev != f.dev for q in g.queues]
            if peers:
                dev, q = rng.choice(peers)
                return S(ctx_id=ctx, peer_index=dev, peer_queue_id=q), temp
            return S(ctx_id=ctx, peer_index=(f.dev + 1) % self.devices,
                     peer_queue_id=self.guess()), temp
        if name == "MODULE_LOAD":
            self._loaded_kernels[self.module_fd] = list(self.module_ir["kernels"])
            return S(ctx_id=ctx, size=len(self.module_raw), fd=self.module_fd), temp
        if name == "MODULE_UNLOAD":
            return S(ctx_id=ctx, module_id=self.pick_own(f, "module")), temp
        if name == "KERNEL_GET":
            mid = self.pick_own(f, "module")
            names = f.modules.get(mid) or ["fill"]
            return S(ctx_id=ctx, module_id=mid, name=rng.choice(names).encode()), temp
        if name == "WAIT":
            return S(ctx_id=ctx, seqno=rng.randint(0, f.submitted)), temp
        if hasattr(S, "ctx_id"):
            return S(ctx_id=ctx), temp
        return S(), temp

    def pick_own(self, f: File, kind: str) -> int:
        pool = {"alloc": list(f.allocs), "queue": list(f.queues | f.imported),
                "module": list(f.modules)}[kind]
        return self.rng.choice(pool) if pool else self.hostile_handle(f, kind)

    def guess(self) -> int:
        return self.rng.randint(1, self.max_id + 32)

    def hostile_handle(self, f: File, kind: str) -> int:
        rng = self.rng
        r = rng.random()
        others = [g for g in self.files if g is not f]
        if r < 0.25 and others:
            g = rng.choice(others)
            pool = {"ctx": [g.ctx or 0], "alloc": list(g.allocs),
                    "queue": list(g.queues | g.imported), "module": list(g.modules),
                    "export": list(self.exports[g.dev])}[kind]
            if pool:
                return rng.choice(pool)
        if r < 0.45:
            stale = self.stale.get(kind) or self.stale["alloc"]
            if stale:
                return rng.choice(stale)
        if r < 0.6:  # this context's object of another kind
            pool = list(f.allocs) + list(f.queues) + list(f.modules) + [f.ctx or 0]
            return rng.choice(pool)
        if r < 0.8:
            return self.guess()
        return rng.choice(U64)

    # --- mutation ------------------------------------------------------------------------------
    HANDLE_FIELDS: ClassVar[dict[str, str]] = {"ctx_id": "ctx", "handle": "alloc", "export_handle": "export",
                     "queue_id": "queue", "peer_queue_id": "queue", "module_id": "module"}
    FD_FIELDS: ClassVar[set[str]] = {"fd", "ring_fd", "doorbell_fd", "event_fd", "db_page_fd"}

    def mutate(self, f: File, arg: Any) -> None:
        fields = arg._fields_
        n = max(1, int(self.rng.expovariate(1.0)) + 1)
        for fname, ftype, *_ in self.rng.sample(fields, min(n, len(fields))):
            self.mutate_field(f, arg, fname, ftype)

    def mutate_field(self, f: File, arg: Any, fname: str, ftype: Any) -> None:
        rng = self.rng
        if fname.startswith(("pad", "reserved")):
            desc = getattr(type(arg), fname)
            buf = (ctypes.c_uint8 * ctypes.sizeof(arg)).from_buffer(arg)
            buf[desc.offset + rng.randrange(desc.size)] = rng.randint(1, 255)
            return
        if fname == "name":
            choices = [os.urandom(64), b"\xff\xfe" + os.urandom(8), b"A" * 64, b"",
                       b"fill\0junk", "ünï".encode(), b"inc" + b"\x00" * 61, b"../../etc"]
            raw = rng.choice(choices)[:64].ljust(64, b"\0")
            ctypes.memmove(ctypes.addressof(arg) + type(arg).name.offset, raw, 64)
            return
        if issubclass(ftype, ctypes.Array):  # char fields of replies
            n = ctypes.sizeof(ftype)
            ctypes.memmove(ctypes.addressof(arg) + getattr(type(arg), fname).offset,
                           os.urandom(n), n)
            return
        if fname in self.HANDLE_FIELDS:
            value = self.hostile_handle(f, self.HANDLE_FIELDS[fname])
        elif fname in self.FD_FIELDS:
            value = self.any_fd()
        elif ftype in (ctypes.c_uint64,):
            value = rng.choice(U64) if rng.random() < 0.8 else rng.getrandbits(64)
        elif ftype in (ctypes.c_int32,):
            value = rng.choice(I32)
        else:
            value = rng.choice(U32) if rng.random() < 0.8 else rng.getrandbits(32)
        setattr(arg, fname, value)

    # --- actions ---------------------------------------------------------------------------------
    def a_command(self, mutate: bool) -> None:
        f = self.pick_file()
        cmd = self.pick_command(f)
        arg, temp = self.valid(f, cmd)
        try:
            if mutate:
                self.mutate(f, arg)
            self.transact(f, cmd, arg, leave_unread=self.rng.random() < 0.1)
        finally:
            for fd in temp:
                os.close(fd)
                self.fdinfo.pop(fd, None)

    def pick_file(self) -> File:
        live = self.live_files()
        if live and self.rng.random() < 0.85:
            return self.rng.choice(live)
        return self.rng.choice(self.files)

    def pick_command(self, f: File) -> uapi.Command:
        rng = self.rng
        if f.ctx is None and rng.random() < 0.7:
            return BY_NAME["CTX_CREATE"]
        weights = {"CTX_DESTROY": 0.2, "CTX_CREATE": 0.3, "MEM_FREE": 0.7, "QUEUE_DESTROY": 0.6,
                   "MODULE_LOAD": 0.5, "MODULE_UNLOAD": 0.4}
        while True:
            cmd = rng.choice(self.commands_for(f))
            if rng.random() < weights.get(cmd.name, 1.0):
                return cmd

    def commands_for(self, f: File) -> list[uapi.Command]:
        """What may be sent on ``f``: every command, but DEVICE_RESET only from a context
        that does not hold the device exclusively (see the module doc)."""
        return [c for c in CMDS if not (f.exclusive and c.name == "DEVICE_RESET")]

    def a_raw(self) -> None:
        """Header and length mutations, and random payloads."""
        rng = self.rng
        f = self.pick_file()
        cmd = rng.choice(self.commands_for(f))
        arg, temp = self.valid(f, cmd)
        try:
            tag = next(self.tags)
            hdr = uapi.accel_cmd_hdr(cmd=cmd.code, tag=tag)
            payload = bytes(arg)
            how = rng.choice(("cmd_random", "cmd_size", "cmd_dir", "cmd_type", "flags",
                              "tag_big", "tag_dup", "short", "long", "huge", "empty",
                              "hdr_only", "random_payload", "random_payload", "offset"))
            judged = False
            offset = 0
            if how == "cmd_random":
                hdr.cmd = rng.getrandbits(32)
            elif how == "cmd_size":
                size = uapi.ioc_size(cmd.code) + rng.choice((-8, -1, 1, 8, 4096))
                hdr.cmd = (cmd.code & ~(((1 << 14) - 1) << 16)) | ((size & 0x3FFF) << 16)
            elif how == "cmd_dir":
                hdr.cmd = cmd.code ^ (rng.randint(1, 3) << 30)
            elif how == "cmd_type":
                hdr.cmd = (cmd.code & ~0xFF00) | (rng.randrange(256) << 8)
            elif how == "flags":
                hdr.flags = rng.choice(U32[1:])
            elif how == "tag_big":
                hdr.tag = rng.choice((uapi.ACCEL_TAG_LIMIT, uapi.ACCEL_TAG_LIMIT + 1,
                                      (1 << 63) - 1, (1 << 64) - 1))
            elif how == "tag_dup":
                hdr.tag = rng.choice(list(f.pending)) if f.pending else uapi.ACCEL_TAG_LIMIT - 1
            elif how == "random_payload":
                payload = os.urandom(len(payload))
                judged = True
            elif how == "offset":
                offset = rng.choice((1, 4096, 1 << 40, (1 << 62) - 1))
                judged = True
            raw = bytes(hdr) + payload
            if how == "short":
                raw = raw[: rng.randrange(len(raw))]
            elif how == "long":
                raw += os.urandom(rng.choice((1, 7, 8, 64, 4096)))
            elif how == "huge":
                raw += os.urandom(rng.choice((128 << 10, 300 << 10)))
            elif how == "empty":
                raw = b""
            elif how == "hdr_only":
                raw = bytes(hdr)
            if judged:
                decoded = cmd.struct.from_buffer_copy(payload)
                err = self.write(f, raw, f"{cmd.name}/{how}", offset)
                if not err:
                    self.judge(f, cmd, decoded)
                    self.settle(f, cmd, decoded, tag)
                return
            err = self.write(f, raw, f"{cmd.name}/{how}", offset)
            if not err and len(raw) == HDR + ctypes.sizeof(cmd.struct) and hdr.cmd == cmd.code:
                # an accepted mutation (the tag or offset changes nothing the driver checks)
                self.judge(f, cmd, arg)
                self.settle(f, cmd, arg, hdr.tag)
            elif not err and raw and len(self.notes) < 40:
                self.notes.append(f"{cmd.name}/{how} accepted: {raw[:64].hex()}")
        finally:
            for fd in temp:
                os.close(fd)
                self.fdinfo.pop(fd, None)

    def settle(self, f: File, cmd: uapi.Command, arg: Any, tag: int) -> None:
        """A raw write was accepted: read its reply (by its tag) and learn from it."""
        if cmd.name == "SUBMIT_NOOP":
            f.submitted += 1
        if not cmd.has_reply:
            self.absorb(f, cmd, arg, None)
            return
        out = self.read(f, ctypes.sizeof(cmd.struct), tag, f"reply {cmd.name}")
        if not isinstance(out, int):
            self.absorb(f, cmd, arg, cmd.struct.from_buffer_copy(out))

    def a_read(self) -> None:
        rng = self.rng
        f = rng.choice(self.files)
        if f.pending and rng.random() < 0.7:
            tag = rng.choice(list(f.pending))
            name = f.pending[tag]
            size = ctypes.sizeof(BY_NAME[name].struct)
            r = rng.random()
            if r < 0.2:
                self.read(f, max(0, size - rng.randint(1, size)), tag, f"short {name}")
                return
            if r < 0.3:
                size = rng.choice((size + 1, 4096, 1 << 20))
            out = self.read(f, size, tag, f"pending {name}")
            if not isinstance(out, int):
                f.pending.pop(tag, None)
            return
        tag = rng.choice((0, 1, next(self.tags), uapi.ACCEL_TAG_LIMIT - 1, uapi.ACCEL_TAG_LIMIT,
                          (1 << 63) - 1))
        self.read(f, rng.choice((0, 1, 24, 64, 4096)), tag, "random tag")

    def a_lifecycle(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.3 and len(self.files) < 4 * self.devices:
            self.open_file(rng.randrange(self.devices))
        elif r < 0.55 and len(self.files) > 1:
            self.close_file(rng.choice(self.files))
        elif r < 0.75:
            live = self.live_files()
            if live:
                f = rng.choice(live)
                self.transact(f, BY_NAME["CTX_DESTROY"], uapi.accel_ctx_destroy(ctx_id=f.ctx))
        elif r < 0.8:
            self.flood_replies()
        elif r < 0.84:
            self.exhaust_contexts()
        elif r < 0.9:
            self.swap_storm()
        else:
            f = rng.choice(self.files)
            self.close_file(f)
            self.open_file(f.dev)

    def open_file(self, dev: int) -> File | None:
        self.progress.step(f"#{self.done} open accel{dev}")
        self.done += 1
        try:
            f = File(dev, os.open(self.node(dev), os.O_RDWR))
        except OSError as exc:
            self._answer(exc.errno, f"open accel{dev}", b"")
            return None
        self.ok += 1
        self.files.append(f)
        return f

    def close_file(self, f: File) -> None:
        self.progress.step(f"#{self.done} close dev{f.dev} fd{f.fd} ctx {f.ctx}")
        self.files.remove(f)
        if f.ctx is not None:
            self.closed.append((time.monotonic(), File(f.dev, -1, f.ctx, queues=set(f.queues))))
            self.forget_file_objects(f)
        os.close(f.fd)

    def flood_replies(self) -> None:
        """More unread replies than a file may hold (EBUSY), then read them all."""
        f = self.pick_file()
        cmd = BY_NAME["GET_VERSION"]
        for _ in range(uapi.ACCEL_MAX_PENDING_REPLIES + 2 - len(f.pending)):
            tag = next(self.tags)
            if self.write(f, bytes(uapi.accel_cmd_hdr(cmd=cmd.code, tag=tag)) + bytes(cmd.struct()),
                          "flood") == 0:
                f.pending[tag] = cmd.name
        for tag in list(f.pending)[: self.rng.randint(0, len(f.pending))]:
            out = self.read(f, ctypes.sizeof(BY_NAME[f.pending[tag]].struct), tag, "drain")
            if not isinstance(out, int):
                del f.pending[tag]

    def exhaust_contexts(self) -> None:
        """Contexts on one device up to the per-process limit (EDQUOT), then close them."""
        dev = self.rng.randrange(self.devices)
        extra: list[File] = []
        for _ in range(20):
            f = self.open_file(dev)
            if f is None:
                break
            extra.append(f)
            arg, temp = self.valid(f, BY_NAME["CTX_CREATE"])
            try:
                out = self.transact(f, BY_NAME["CTX_CREATE"], arg)
            finally:
                for fd in temp:
                    os.close(fd)
                    self.fdinfo.pop(fd, None)
            if isinstance(out, int):
                break
        for f in extra:
            self.close_file(f)

    def swap_storm(self) -> None:
        """A thread swaps one descriptor number between a good and a bad file while the
        command naming it runs (the driver checks what it opened, not the number)."""
        rng = self.rng
        f = self.pick_file()
        n = self.named
        good, bad = rng.choice([(self.ring, n["unsealed"]), (self.module_fd, n["pinmod"]),
                                (n[f"pin{1 << 20}"], n["immut"])])
        num = 900
        os.dup2(good, num)
        self._loaded_kernels[num] = list(self.module_ir["kernels"])
        stop = threading.Event()

        def swap() -> None:
            while not stop.is_set():
                os.dup2(bad, num)
                os.dup2(good, num)

        t = threading.Thread(target=swap, daemon=True)
        t.start()
        try:
            for _ in range(rng.randint(3, 10)):
                cmd = rng.choice([BY_NAME["MEM_ALLOC"], BY_NAME["QUEUE_CREATE"],
                                  BY_NAME["MODULE_LOAD"]])
                arg, temp = self.valid(f, cmd)
                for fname in self.FD_FIELDS & {n for n, *_ in arg._fields_}:
                    setattr(arg, fname, num)
                if cmd.name == "MEM_ALLOC":
                    arg.kind, arg.size = uapi.MemKind.HOST_PINNED, 4096
                try:
                    err = self.write(f, bytes(uapi.accel_cmd_hdr(cmd=cmd.code, tag=(tag := next(self.tags))))
                                     + bytes(arg), f"{cmd.name}/swap")
                    if not err:
                        self.settle(f, cmd, arg, tag)
                finally:
                    for fd in temp:
                        os.close(fd)
                        self.fdinfo.pop(fd, None)
        finally:
            stop.set()
            t.join()
            os.close(num)

    def a_module(self) -> None:
        """MODULE_LOAD of a mutated module from a sealed memfd."""
        f = self.pick_file()
        raw, kernels = mutate_module(self.rng, self.module_ir)
        try:
            fd = _memfd("mut", max(1, len(raw)), uapi.ACCEL_SEALS_IMMUTABLE, raw)
        except OSError:
            return
        self.fdinfo[fd] = FdInfo("immutable", max(1, len(raw)))
        self._loaded_kernels[fd] = kernels
        try:
            size = len(raw) if self.rng.random() < 0.9 else self.rng.choice(U64)
            self.transact(f, BY_NAME["MODULE_LOAD"],
                          uapi.accel_module_load(ctx_id=f.ctx or 0, size=size, fd=fd))
        finally:
            os.close(fd)
            self.fdinfo.pop(fd, None)
            self._loaded_kernels.pop(fd, None)

    # --- the round ------------------------------------------------------------------------------
    def run(self) -> None:
        for dev in range(self.devices):
            for _ in range(2):
                f = self.open_file(dev)
                if f is not None:
                    arg, temp = self.valid(f, BY_NAME["CTX_CREATE"])
                    try:
                        self.transact(f, BY_NAME["CTX_CREATE"], arg)
                    finally:
                        for fd in temp:
                            os.close(fd)
                            self.fdinfo.pop(fd, None)
        actions = ((0.35, lambda: self.a_command(False)), (0.35, lambda: self.a_command(True)),
                   (0.1, self.a_raw), (0.07, self.a_read), (0.05, self.a_module),
                   (0.03, self.a_lifecycle))
        cum = list(itertools.accumulate(w for w, _ in actions))
        last_save = 0
        try:
            while self.done < self.count and self.stop is None:
                if not self.files:
                    self.open_file(self.rng.randrange(self.devices))
                    continue
                x = self.rng.random() * cum[-1]
                act = next(a for c, (_, a) in zip(cum, actions) if x < c)
                try:
                    act()
                except _Stop:
                    raise
                except Exception:  # the fuzzer's own bug: say so, go on
                    self.client_errors += 1
                    if self.client_errors <= 3:
                        self.notes.append(f"fuzzer error: {traceback.format_exc()[-800:]}")
                    if self.client_errors > 100:
                        raise
                if self.done - last_save >= 250:
                    last_save = self.done
                    self.save()
        except _Stop:
            pass
        self.save()

    def save(self) -> None:
        if trace := os.environ.get("FUZZ_TRACE"):
            with open(trace, "a") as f:
                f.write(json.dumps(dict(self.by_label)) + "\n")
            self.by_label.clear()
        write_result(self.result_path, {
            "done": {"transactions": self.done, "successful": self.ok,
                     **({"fuzzer errors": self.client_errors} if self.client_errors else {})},
            "errnos": dict(self.errnos), "escapes": self.escapes, "notes": self.notes[:40],
            "stop": self.stop})


# --- mutated modules --------------------------------------------------------------------------
_HOSTILE: tuple[Any, ...] = (None, True, False, 0, -1, 1.5, 1 << 64, -(1 << 63), "", "x",
                             [], {}, [[]], {"a": {}}, float("nan"), float("inf"), "\ud800",
                             "\u0000", 2 ** 31, "int32", "buffer", "scalar", {"format": 1})
_BIG_INT = "9" * 5000  # past the interpreter's int-from-string limit


def _nodes(obj: Any, path: tuple = ()) -> list[tuple]:
    """Paths to the nodes of a JSON value (not below depth 8, at most 64 list items)."""
    out = [path]
    if len(path) >= 8:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _nodes(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            out += _nodes(v, path + (i,))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return obj


def _hostile_value(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.6:
        return copy.deepcopy(rng.choice(_HOSTILE))
    if r < 0.7:
        return "A" * rng.choice((64, 65, 70000, 300_000))
    if r < 0.8:
        depth = rng.choice((50, 500, 900))
        v: Any = 0
        for _ in range(depth):
            v = [v]
        return v
    if r < 0.9:
        return [rng.choice((0, "x", None))] * rng.choice((1000, 100_000))
    return "@BIGINT@"


def mutate_module(rng: random.Random, ir: dict[str, Any]) -> tuple[bytes, list[str]]:
    """A damaged copy of the module's JSON, and the kernel names it claims."""
    m = copy.deepcopy(ir)
    r = rng.random()
    if r < 0.08:
        raw = rng.choice((b"[" * 100_000 + b"]" * 100_000, b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000,
                          b"", b"\0" * 100, b"null", b"\xef\xbb\xbf" + json.dumps(m).encode(),
                          json.dumps(m).encode("utf-16"), os.urandom(256)))
        return raw, list(m["kernels"])  # a BOM or UTF-16 is still JSON to Python
    if r < 0.15:  # many kernels, or none, or bad names
        k = next(iter(m["kernels"].values()))
        choice = rng.randrange(4)
        if choice == 0:
            m["kernels"] = {f"k{i}": k for i in range(rng.choice((1000, 65536)))}
        elif choice == 1:
            m["kernels"] = {}
        elif choice == 2:
            m["kernels"] = {rng.choice(("", "1a", "a" * 63, "a" * 64, "ünï", "a-b", "__x",
                                        "a\0b")): k}
        else:
            m["kernels"] = [k]
    else:
        for _ in range(rng.randint(1, 3)):
            paths = _nodes(m)
            path = rng.choice(paths)
            op = rng.random()
            if op < 0.65:
                m = _set(m, path, _hostile_value(rng))
            elif op < 0.85 and path:
                parent = m
                try:
                    for p in path[:-1]:
                        parent = parent[p]
                    del parent[path[-1]]
                except (KeyError, IndexError, TypeError):
                    pass
            else:
                target = m
                try:
                    for p in path:
                        target = target[p]
                except (KeyError, IndexError, TypeError):
                    target = None
                if isinstance(target, dict):
                    target[rng.choice(("extra", "__proto__", "source", "params", ""))] = \
                        _hostile_value(rng)
                elif isinstance(target, list):
                    target.append(_hostile_value(rng))
            if not isinstance(m, dict):
                break
    try:
        raw = json.dumps(m).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        raw = b"{}"
    raw = raw.replace(b'"@BIGINT@"', _BIG_INT.encode())
    r = rng.random()
    if r < 0.05:
        raw = raw[: rng.randrange(max(1, len(raw)))]
    elif r < 0.1:
        raw += rng.choice((b"garbage", b"\xff", b" ", b"\0", b"{}"))
    elif r < 0.13 and raw:
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([raw[i] ^ (1 << rng.randrange(8))]) + raw[i + 1 :]
    kernels = m.get("kernels") if isinstance(m, dict) else None
    names = [k for k in kernels if isinstance(k, str)] if isinstance(kernels, dict) else []
    return raw[: uapi.ACCEL_MODULE_MAX + 4096], names


def client_main(argv: list[str]) -> int:
    progress_path, result_path, opts = client_args(argv)
    client = Client(os.environ["ACCEL_EMU_ROOT"], int(opts.get("devices", 2)),
                    int(opts.get("seed", 1)), int(opts.get("round", 0)),
                    int(opts.get("count", ROUND)), Progress(progress_path), result_path)
    client.run()
    return 0


if __name__ == "__main__":
    sys.exit(client_main(sys.argv[1:]))
