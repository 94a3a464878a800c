"""A hostile module corpus through the raw uAPI: MODULE_LOAD, KERNEL_GET, LAUNCH.

The attacker (another uid when the daemon's root is world-reachable, else root) talks to
the device node itself -- no runtime front end: it builds each module's JSON, puts it in a
sealed immutable memfd of its own, loads it with ``ACCEL_CMD_MODULE_LOAD``, resolves
kernels with ``ACCEL_CMD_KERNEL_GET`` and writes LAUNCH packets into rings of its own, their
argument blocks in its own pinned memory (docs/kernels.md, "Launch ABI"). What it throws:

* images that are not JSON, not UTF-8, truncated, too deep, over ``ACCEL_MODULE_MAX``, or
  named by a descriptor that is not a sealed immutable memfd; wrong formats and targets;
  every field of the wrong type, huge, negative, NaN or infinite; huge strings and sources
  over ``ACCEL_KERNEL_SOURCE_MAX`` (and exactly at both limits, which must work);
* the firmware-level corpus of tests/unit/test_jit_hostile.py (its ``REJECTED`` IR, imported,
  not copied) and sources the firmware's validator must refuse, each as a module the
  driver accepts or refuses as it can tell;
* launches whose every field is hostile: handles of unknown, unloaded or another
  context's modules, grids and blocks of 0 or over the limits, dynamic shared memory over
  the limit, argument blocks too long, misaligned, unmapped, wrapping the address space,
  records of the wrong kind, dtype or shape;
* kernels indexing far out of bounds -- tests/unit/test_jit_hostile.py's ``IDX_MISSES``, the 2-D
  and ``MMA_MISSES`` tile cases, at 2**62, near 2**63, negative, wrapping -- which must fault
  with EFAULT at the address of the miss saturated into the 64-bit space, touching nothing;
* kernels that never end (one, two when the image's ``watchdog_ms`` is short: each
  costs that long): ETIMEDOUT;
* ``count`` random mutants: a valid module with a field replaced, deleted, added or
  wrapped (a hostile value), loaded and launched; or a kernel whose indices are hostile
  integer expressions (wrapping, shifting, dividing near 2**63), compiled and launched.

Then two sections of their own: 1 MiB modules loaded and unloaded ``churn`` times (no
growth in /dev/shm, the daemon's and the firmware's RSS within ``RSS_BOUND``; the figures
go into the report's notes), and the per-context module limits
(``limits/max_modules_per_context``, ``max_module_bytes_per_context``) answered with EDQUOT.

Expected: MODULE_LOAD answers EINVAL / ENOEXEC / EOPNOTSUPP (EBADF, EMEDIUMTYPE for the
descriptor) for what the driver can see; launches of kernels the firmware refuses fault
the attacker's own queue with EINVAL (EOPNOTSUPP for a capability the device lacks,
whatever the IR's flags claim); never EIO; bystanders intact; nothing leaked -- sysfs
books, descriptors, the firmware's mappings, /dev/shm, files in the daemon's state
directory and files in the JIT cache that are not complete entries. An answer outside what
is expected counts in ``Report.unexpected`` (with a note); containment failures count in
the Report's other fields. ``MODULE_CORPUS_LOG=FILE`` writes every case's answer there.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import os
import queue
import random
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from abi import fwimage, kernel_lang, uapi, userq
from stress.report import Report
from testkit import REPO
from testkit.bystander import Bystander
from testkit.contained import Snapshot, assert_contained, snapshot
from testkit.daemon import Daemon
from testkit.tenants import as_user, world_reachable

#: mutants in a full stress run
STRESS_COUNT = 2000
#: most growth of the daemon's or the firmware's RSS over the module churn
RSS_BOUND = 24 << 20
TESTS = REPO / "tests"  # rawdev.py, the raw client the attacker uses
#: the firmware-level corpus (test_jit_hostile.py) and the unit tests it builds on
UNIT_TESTS = TESTS / "unit"
#: where to write every case's answer (one JSON line each), for a look by hand
LOG = os.environ.get("MODULE_CORPUS_LOG")
U64 = (1 << 64) - 1
I64_MAX = (1 << 63) - 1

#: the attacker's device buffers: name -> (dtype, shape); each its own allocation
BUFFERS: dict[str, tuple[str, tuple[int, ...]]] = {
    "x": ("float64", (8,)), "out": ("float64", (8,)),
    "x2": ("float64", (3, 5)), "out2": ("float64", (3, 5)),
    "a": ("float64", (4, 3)), "b": ("float64", (3, 5)), "c": ("float64", (4, 5)),
}
ITEM = {name: (code, size) for name, (code, size) in kernel_lang.DTYPES.items()}

# --------------------------------------------------------------------------- the attacker

_ATTACKER = r"""
import os, sys, json, base64, time, mmap, fcntl, errno as E
sys.path.insert(0, TESTS)
from rawdev import RawDev
from abi import kernel_lang, uapi, userq
from runtime._shm import sealed_memfd
ROOT = os.environ["ACCEL_EMU_ROOT"]
U64 = (1 << 64) - 1

def name(e):
    return E.errorcode.get(e.errno, str(e.errno))

cfg = json.loads(sys.stdin.readline())
node = os.path.join(ROOT, "dev/accel/accel%d" % cfg["dev"])
dev = RawDev(node)
ctx = dev.ctx_create()
vas, sizes = {}, {}
for bname, n in cfg["buffers"].items():
    vas[bname], sizes[bname] = dev.mem_alloc(ctx, n).va, n
PIN = 4 << 20
ARGS, CHECK = 0, 2 << 20
pfd = sealed_memfd("pinned", PIN)
pin = dev.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
    ctx_id=ctx, size=PIN, kind=uapi.MemKind.HOST_PINNED, fd=pfd))
pmem = mmap.mmap(pfd, PIN)
vas["pinned"], sizes["pinned"] = pin.va, PIN
checkq = dev.queue_create(ctx)
# a second context of ours, with a module of its own: its handles are not this context's
other = RawDev(node)
octx = other.ctx_create()

def load(d, c, raw, size=None, flags=0):
    fd = sealed_memfd("module", len(raw), raw)
    try:
        return d.call(uapi.ACCEL_CMD_MODULE_LOAD, uapi.accel_module_load(
            ctx_id=c, size=len(raw) if size is None else size, fd=fd, flags=flags))
    finally:
        os.close(fd)

omod = load(other, octx, base64.b64decode(cfg["good"])).module_id
vas["other_ctx"] = other.mem_alloc(octx, 4096).va
if cfg.get("peer") is not None:  # a context of ours on another device, no peer access
    peer = RawDev(os.path.join(ROOT, "dev/accel/accel%d" % cfg["peer"]))
    pctx = peer.ctx_create()
    vas["peer"] = peer.mem_alloc(pctx, 4096).va

def pkt(op, *a, flags=0):
    a = [v & U64 for v in a]
    return userq.RAW_PACKET.pack(op & 0xFFFFFFFF, flags & 0xFFFFFFFF, *a, *(0,) * (7 - len(a)))

def run(q, pkts, timeout):
    seq = dev.submit(q, pkts)
    ring = dev.rings[q][1]
    deadline = time.monotonic() + timeout
    while ring.completed < seq:
        if time.monotonic() > deadline:
            return ring, True
        time.sleep(0.0005)
    return ring, False

def zero_all():
    ring, late = run(checkq, [pkt(userq.Op.MEMSET, vas[b], sizes[b], 0) for b in cfg["buffers"]], 60)
    if late or ring.read_fault()[0]:
        raise RuntimeError("the check queue could not clear the buffers")

def dirty():
    pk, off = [], CHECK
    for b in cfg["buffers"]:
        pk.append(pkt(userq.Op.COPY, pin.va + off, vas[b], sizes[b]))
        off += sizes[b]
    ring, late = run(checkq, pk, 60)
    if late or ring.read_fault()[0]:
        raise RuntimeError("the check queue could not read the buffers back")
    out, off = [], CHECK
    for b in cfg["buffers"]:
        if pmem[off:off + sizes[b]].count(0) != sizes[b]:
            out.append(b)
        off += sizes[b]
    return out

def value(v):
    if isinstance(v, list):  # ["va", buffer, delta]
        return (vas[v[1]] + v[2]) & U64
    return v & U64

def block(items):
    raw = b""
    for it in items:
        if it[0] == "buf":  # ["buf", buffer, code, shape, nbytes]
            _, b, code, shape, nbytes = it
            raw += userq.ARG_RECORD.pack(userq.ARG_BUFFER, code, vas[b], nbytes & U64)
            dims = list(shape)
            for i in range(0, len(dims), 2):
                pair = dims[i:i + 2]
                raw += userq.ARG_RECORD.pack(userq.ARG_SHAPE, len(pair), pair[0] & U64,
                                            (pair[1] if len(pair) > 1 else 0) & U64)
        elif it[0] == "scalar":  # ["scalar", code, bits]
            raw += userq.ARG_RECORD.pack(userq.ARG_SCALAR, it[1], it[2] & U64, 0)
        else:  # ["rec", kind, code, value, nbytes]
            raw += userq.ARG_RECORD.pack(it[1] & 0xFFFFFFFF, it[2] & 0xFFFFFFFF, value(it[3]),
                                        it[4] & U64)
    return raw

def launch(L, handles, mid):
    if "kernel" in L:
        h = handles.get(L["kernel"])
        if h is None:
            return {"skipped": "no handle"}
    else:
        base = omod if L["handle"][0] == "foreign" else mid + L["handle"][0]
        h = ((base << 16) | L["handle"][1]) & U64
    raw = block(L.get("args", []))
    pmem[ARGS:ARGS + len(raw)] = raw
    args_va = value(L["args_va"]) if "args_va" in L else pin.va + ARGS
    args_len = L.get("args_len", len(raw))
    grid, blk = L.get("grid", [1, 1, 1]), L.get("block", [1, 1, 1])
    grid = grid if isinstance(grid, int) else userq.pack_dims(tuple(grid))
    blk = blk if isinstance(blk, int) else userq.pack_dims(tuple(blk))
    q = dev.queue_create(ctx)
    t = time.monotonic()
    ring, late = run(q, [pkt(userq.Op.LAUNCH, h, grid, blk, L.get("dyn", 0), args_va, args_len,
                             flags=L.get("flags", 0))], L.get("timeout", 60))
    seq, code, op, addr = ring.read_fault()
    res = {"fault": E.errorcode.get(code, str(code)) if seq else "", "addr": addr,
           "late": late, "s": round(time.monotonic() - t, 3)}
    dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=ctx, queue_id=q))
    dev.rings.pop(q)[1].close()
    if not late:
        res["dirty"] = dirty()
        if res["dirty"] or not seq:
            zero_all()
    return res

def case(c):
    res = {"id": c["id"]}
    raw = base64.b64decode(c["raw"])
    kind = c.get("fd", "sealed")
    fds = []
    if kind == "sealed":
        fds.append(sealed_memfd("module", len(raw), raw))
    elif kind in ("unsealed", "pinned"):
        fds.append(os.memfd_create("module", os.MFD_ALLOW_SEALING))
        os.ftruncate(fds[0], len(raw))
        os.pwrite(fds[0], raw, 0)
        if kind == "pinned":
            fcntl.fcntl(fds[0], uapi.F_ADD_SEALS, uapi.ACCEL_SEALS_PINNED)
    elif kind == "pipe":
        fds.extend(os.pipe())
    fd = fds[0] if fds else c.get("fdnum", 99999)
    size = c.get("size", len(raw))
    try:
        reply = dev.call(uapi.ACCEL_CMD_MODULE_LOAD, uapi.accel_module_load(
            ctx_id=ctx, size=size & U64, fd=fd, flags=c.get("flags", 0)))
        res["load"], mid = "", reply.module_id
        res["kernel_count"] = reply.kernel_count
    except OSError as e:
        res["load"], mid = name(e), None
    finally:
        for f in fds:
            os.close(f)
    if c.get("foreign"):
        res["foreign"] = []
        for call in (lambda: dev.call(uapi.ACCEL_CMD_KERNEL_GET, uapi.accel_kernel_get(
                         ctx_id=ctx, module_id=omod, name=b"k")),
                     lambda: dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(
                         ctx_id=ctx, module_id=omod))):
            try:
                call()
                res["foreign"].append("")
            except OSError as e:
                res["foreign"].append(name(e))
    if mid is None:
        return res
    handles, res["get"] = {}, []
    for g in c.get("get", []):
        try:
            r = dev.call(uapi.ACCEL_CMD_KERNEL_GET, uapi.accel_kernel_get(
                ctx_id=ctx, module_id=mid, name=base64.b64decode(g)))
            handles[g] = r.handle
            res["get"].append([r.handle - (mid << 16), r.param_count, r.shared_mem])
        except OSError as e:
            res["get"].append(name(e))
    res["launches"] = [launch(L, handles, mid) for L in c.get("launches", [])
                       if not L.get("after_unload")]
    try:
        dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(ctx_id=ctx, module_id=mid))
        res["unload"] = ""
    except OSError as e:
        res["unload"] = name(e)
    res["launches"] += [launch(L, handles, mid) for L in c.get("launches", [])
                        if L.get("after_unload")]
    return res

def quota(c):
    # as many tiny modules as the limit allows, then one more
    tiny, big = base64.b64decode(c["tiny"]), base64.b64decode(c["big"])
    res, mods = {}, []
    def fill(raw, most):
        n = 0
        while n <= most + 1:
            try:
                mods.append(load(dev, ctx, raw).module_id)
                n += 1
            except OSError as e:
                return n, name(e)
        return n, ""
    def unload_all():
        while mods:
            dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(
                ctx_id=ctx, module_id=mods.pop()))
    res["tiny"] = fill(tiny, c["max_modules"])
    unload_all()
    res["big"] = fill(big, c["max_bytes"] // len(big))
    # one unloaded makes room for one more, and only one
    dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(ctx_id=ctx,
                                                                    module_id=mods.pop()))
    # (nearly) full: the harness looks at the firmware now, what a context's quota costs it
    print(json.dumps({"full": len(mods), "synced": sync()}), flush=True)
    sys.stdin.readline()
    res["again"] = fill(big, 0)
    # a second context has a quota of its own, while this one is full
    mods2 = []
    try:
        mods2.append(load(other, octx, big).module_id)
        res["other"] = ""
    except OSError as e:
        res["other"] = name(e)
    for m in mods2:
        other.call(uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(ctx_id=octx, module_id=m))
    unload_all()
    return res

def churn(c):
    big = base64.b64decode(c["big"])
    t = time.monotonic()
    for _ in range(c["n"]):
        mid = load(dev, ctx, big).module_id
        dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(ctx_id=ctx, module_id=mid))
    s = round(time.monotonic() - t, 2)
    return {"n": c["n"], "s": s, "synced": sync()}

def sync():
    # the firmware parses modules in order on one thread: a launch of a module loaded now
    # waits for every parse before it, so the firmware is done with those after it
    mid = load(dev, ctx, base64.b64decode(cfg["good"])).module_id
    h = dev.call(uapi.ACCEL_CMD_KERNEL_GET, uapi.accel_kernel_get(
        ctx_id=ctx, module_id=mid, name=b"k")).handle
    raw = userq.ARG_RECORD.pack(userq.ARG_BUFFER, 10, vas["x"], 64) + userq.ARG_RECORD.pack(
        userq.ARG_SHAPE, 1, 8, 0)
    pmem[ARGS:ARGS + len(raw)] = raw
    ring, late = run(checkq, [pkt(userq.Op.LAUNCH, h, userq.pack_dims((1, 1, 1)),
                                  userq.pack_dims((1, 1, 1)), 0, pin.va + ARGS, len(raw))], 120)
    dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(ctx_id=ctx, module_id=mid))
    ok = not late and not ring.read_fault()[0]
    zero_all()
    return ok

print(json.dumps({"vas": vas, "pid": os.getpid(), "uid": os.getuid()}), flush=True)
for line in sys.stdin:
    c = json.loads(line)
    try:
        if c.get("op") == "quota":
            res = quota(c)
        elif c.get("op") == "churn":
            res = churn(c)
        else:
            res = case(c)
    except Exception as exc:
        res = {"id": c.get("id"), "error": repr(exc)[:500]}
    print(json.dumps(res), flush=True)
"""


class Attacker:
    """The attacker process, driven one request at a time (each answer within a bound)."""

    def __init__(self, d: Daemon, dev: int, uid: int, good: bytes) -> None:
        code = f"TESTS = {str(TESTS)!r}\n" + _ATTACKER
        if uid:  # what it imports, imported before it drops to ``uid``
            code = as_user(code, uid, imports=(
                f"import mmap, base64, time, fcntl; sys.path.insert(0, {str(TESTS)!r})\n"
                "from rawdev import RawDev\nfrom runtime._shm import sealed_memfd"))
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=d.env(), cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()
        sizes = {n: max(uapi.ACCEL_PAGE_SIZE, math.prod(s) * ITEM[t][1])
                 for n, (t, s) in BUFFERS.items()}
        peer = next((i for i in range(d.devices) if i != dev), None)
        head = self.ask({"dev": dev, "buffers": sizes, "good": _b64(good), "peer": peer}, 120)
        if head is None or "vas" not in head:
            self.close()
            raise RuntimeError(f"attacker did not start: {head} {''.join(self.err)[-2000:]}")
        self.vas: dict[str, int] = head["vas"]
        self.uid = head["uid"]

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            if len(self.err) < 200:
                self.err.append(line)

    def ask(self, req: dict, timeout: float) -> dict | None:
        """Send one request; its answer, or None if the attacker died or took too long."""
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            return None
        try:
            return json.loads(line)
        except ValueError:
            return {"error": f"not an answer: {line[:300]!r}"}

    def close(self) -> int | None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# --------------------------------------------------------------------------- building cases

def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def module_of(kernels: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"format": 1, "isa": kernel_lang.ISA, "isa_version": kernel_lang.ISA_VERSION,
            "kernels": kernels, **top}


def dump(mod: Any) -> bytes:
    return json.dumps(mod, allow_nan=True).encode()


def _bits(dtype: str, v: float) -> int:
    if dtype.startswith("float"):
        fmt = "<d" if dtype == "float64" else "<f"
        return int.from_bytes(struct.pack(fmt, v).ljust(8, b"\0"), "little")
    return int(v) & U64


def scalar(dtype: str, v: float) -> list:
    return ["scalar", ITEM[dtype][0], _bits(dtype, v)]


def buf(name: str, shape: tuple[int, ...] | None = None, dtype: str | None = None,
        nbytes: int | None = None) -> list:
    """A buffer record for one of the attacker's buffers: its dtype, shape and bytes unless
    told otherwise (a declared shape does not change the bytes named)."""
    t, s = BUFFERS[name]
    dtype = dtype or t
    if nbytes is None:
        nbytes = math.prod(s) * ITEM[t][1]
    return ["buf", name, ITEM[dtype][0], list(shape if shape is not None else s), nbytes]


def _honest(k: dict[str, Any]) -> dict[str, Any]:
    """An IR with the capability flags its source really needs."""
    src = k.get("source", "") if isinstance(k, dict) else ""
    if not isinstance(src, str):
        return k
    return {**k, "uses_barrier": "barrier()" in src, "uses_atomics": "atomic_add" in src,
            "uses_mma": "mma(" in src}


X = {"name": "x", "kind": "buffer", "dtype": None, "ndim": 1}
GOOD_SRC = "def k(x):\n    x[0] = 1.0\n"
GOOD = {"params": [X], "source": GOOD_SRC, "shared_mem": 0}


class Corpus:
    """The cases, each with what the device must answer."""

    def __init__(self, caps: set[str], shared_limit: int, watchdog_ms: int) -> None:
        self.caps, self.shared_limit, self.watchdog_ms = caps, shared_limit, watchdog_ms
        self.cases: list[dict[str, Any]] = []

    # expectations: "load" a set of errno names ("" = loads); each launch a set of fault
    # names ("" = runs) and optionally the exact fault address [buffer, index, itemsize]
    def add(self, name: str, raw: bytes, load: set[str], launches: list[dict] = (),
            launch_expect: list[dict] = (), get: list[bytes] = (b"k",), **extra: Any) -> None:
        self.cases.append({"id": len(self.cases), "name": name, "raw": _b64(raw),
                           "get": [_b64(g) for g in get], "launches": list(launches),
                           "expect": {"load": sorted(load), "launch": list(launch_expect)},
                           **extra})

    def needs(self, kernels: dict[str, Any]) -> set[str]:
        """Capabilities the device lacks that the kernels' (honest) flags name."""
        out = set()
        for k in kernels.values():
            if isinstance(k, dict):
                for flag, cap in kernel_lang.KERNEL_FLAG_CAPS:
                    if k.get(flag) and cap not in self.caps:
                        out.add(cap)
        return out

    def kernel(self, name: str, ir: dict[str, Any], launches: list[dict],
               answers: list[dict], load: set[str] | None = None, **extra: Any) -> None:
        """A module of one kernel ``k`` (honest flags), its launches and their answers; a
        kernel that needs a capability the device lacks is refused instead (EOPNOTSUPP)."""
        kernels = {"k": _honest(ir)}
        if load is None:
            load = {"EOPNOTSUPP"} if self.needs(kernels) else {""}
        self.add(name, dump(module_of(kernels)), load, launches, answers, **extra)


def launch_of(args: list, **kw: Any) -> dict:
    return {"kernel": _b64(b"k"), "args": args, **kw}


def expect(fault: str | set[str], addr: list | None = None, dirty_ok: bool = False) -> dict:
    """A launch's expected answer: its fault (a set of names, "" = success), the exact
    address of an EFAULT ([buffer, index, itemsize]), and whether a launch that faulted
    may have written its buffers in bounds before it did (else they must be untouched)."""
    return {"fault": sorted({fault} if isinstance(fault, str) else fault), "addr": addr,
            "dirty_ok": dirty_ok}


def _driver_visible(k: Any, shared_limit: int) -> str:
    """What the driver can tell about one kernel entry without compiling it: "load" (it
    must refuse the module), "either" (a malformed parameter entry: the driver or the
    firmware refuses it), or "" (only the firmware can tell)."""
    if not isinstance(k, dict):
        return "load"
    src, shared = k.get("source"), k.get("shared_mem")
    if not isinstance(src, str) or len(src) > uapi.ACCEL_KERNEL_SOURCE_MAX:
        return "load"
    if type(shared) is not int or not 0 <= shared <= shared_limit:
        return "load"
    params = k.get("params")
    if not isinstance(params, list):
        return "load"
    for p in params:
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            return "either"
        if p.get("kind") not in ("scalar", "buffer") or not isinstance(p.get("kind"), str):
            return "either"
        dt = p.get("dtype")
        if dt is not None and (not isinstance(dt, str) or dt not in kernel_lang.DTYPES):
            return "either"
    return ""


def _args_for(params: Any) -> list:
    """An argument block that fits ``params`` when they are well-formed (so a fault says
    the firmware refused the kernel, not the arguments); else one buffer."""
    if not isinstance(params, list):
        return [buf("x")]
    out = []
    for p in params:
        if isinstance(p, dict) and p.get("kind") == "scalar":
            out.append(scalar("int64", 0))
        elif isinstance(p, dict) and p.get("ndim") == 2:
            out.append(buf("x2"))
        else:
            out.append(buf("x"))
    return out


def fixed_corpus(caps: set[str], shared_limit: int, watchdog_ms: int) -> Corpus:
    """Every fixed case, for a device with ``caps``, ``shared_limit`` bytes of block-shared
    memory and a watchdog of ``watchdog_ms``."""
    if str(UNIT_TESTS) not in sys.path:  # the firmware-level corpus lives with its unit tests
        sys.path.insert(0, str(UNIT_TESTS))
    import test_jit_hostile as hostile

    c = Corpus(caps, shared_limit, watchdog_ms)
    good = module_of({"k": GOOD})
    good_raw = dump(good)
    ok_launch = [launch_of([buf("x")])]
    ok = [expect("")]
    einval = [expect("EINVAL")]

    # --- controls: what works must work (then a fault below is the attack's) ----------
    c.add("control", good_raw, {""}, ok_launch, ok)
    MAX = uapi.ACCEL_MODULE_MAX
    c.add("module-exactly-max", good_raw[:-1] + b" " * (MAX - len(good_raw)) + b"}", {""},
          ok_launch, ok)
    at_max = GOOD_SRC + "#" * (uapi.ACCEL_KERNEL_SOURCE_MAX - len(GOOD_SRC))
    c.add("source-exactly-max", dump(module_of({"k": {**GOOD, "source": at_max}})), {""},
          ok_launch, ok)
    c.add("name-63", dump(module_of({"k" * 63: {**GOOD, "source": GOOD_SRC.replace(
        "def k", "def " + "k" * 63)}})), {""}, [launch_of([buf("x")], kernel=_b64(b"k" * 63))], ok,
          get=[b"k" * 63])
    c.add("many-kernels", dump(module_of({f"k{i}": {**GOOD, "source": GOOD_SRC.replace(
        "def k", f"def k{i}")} for i in range(300)})), {""},
          [launch_of([buf("x")], kernel=_b64(b"k299"))], ok, get=[b"k299", b"k0", b"k300"])
    c.add("duplicate-keys", good_raw[:-1] + b', "kernels": ' + dump({"k": GOOD}) + b"}", {""},
          ok_launch, ok)
    # json.loads(bytes) takes UTF-16 and UTF-32 and a UTF-8 BOM: driver and firmware alike
    for name, raw in {"utf16": json.dumps(good).encode("utf-16"),
                      "utf32-be": json.dumps(good).encode("utf-32-be"),
                      "bom": b"\xef\xbb\xbf" + good_raw}.items():
        c.add(name, raw, {"", "EINVAL"}, ok_launch, [expect({"", "EINVAL"})])

    # --- the image and its descriptor --------------------------------------------------------
    c.add("size-zero", b"", {"EINVAL"})
    c.add("size-over-max", good_raw[:-1] + b" " * (MAX + 1 - len(good_raw)) + b"}", {"EINVAL"})
    c.add("size-past-file", good_raw, {"EINVAL"}, size=len(good_raw) + 1)
    c.add("size-u64", good_raw, {"EINVAL"}, size=U64)
    c.add("size-truncated", good_raw, {"EINVAL"}, size=len(good_raw) - 3)
    c.add("flags", good_raw, {"EINVAL"}, flags=1)
    c.add("flags-high", good_raw, {"EINVAL"}, flags=1 << 31)
    c.add("fd-unsealed", good_raw, {"EMEDIUMTYPE"}, fd="unsealed")
    c.add("fd-writable", good_raw, {"EMEDIUMTYPE"}, fd="pinned")
    c.add("fd-pipe", good_raw, {"EMEDIUMTYPE"}, fd="pipe")
    c.add("fd-none", good_raw, {"EBADF"}, fd="none", fdnum=99999)
    c.add("fd-negative", good_raw, {"EBADF"}, fd="none", fdnum=-1)

    # --- not JSON, or not a module ------------------------------------------------------------
    for name, raw in {
        "garbage": b"\xff\xfe\x00\x01" * 64, "text": b"hello", "open-brace": b"{",
        "list": b"[]", "null": b"null", "number": b"1", "string": b'"module"', "nan": b"NaN",
        "empty-object": b"{}",
        "trailing": good_raw + b" x", "nul": good_raw[:10] + b"\0" + good_raw[10:],
        "bad-utf8": good_raw.replace(b'"k"', b'"\xff"', 1),
        "deep-100000": good_raw[:-1] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "deep-in-params": dump(module_of({"k": {**GOOD, "params": []}})).replace(
            b'"params": []', b'"params": ' + b"[" * 5000 + b"]" * 5000),
        "int-digits": good_raw.replace(b'"shared_mem": 0', b'"shared_mem": ' + b"9" * 5000),
    }.items():
        c.add(name, raw, {"EINVAL"})
    c.add("deep-500", good_raw[:-1] + b', "x": ' + b"[" * 500 + b"]" * 500 + b"}", {""},
          ok_launch, ok)
    for name, val in {"format-2": 2, "format-str": "1", "format-null": None,
                      "format-list": [1], "format-huge": 1 << 80, "format-nan": math.nan}.items():
        c.add(name, dump({**good, "format": val}), {"EINVAL"})
    c.add("format-missing", dump({k: v for k, v in good.items() if k != "format"}), {"EINVAL"})
    for name, top in {"isa-other": {"isa": "x86-64"}, "isa-int": {"isa": 5},
                      "isa-null": {"isa": None}, "isa-version": {"isa_version": "2.0"},
                      "isa-version-float": {"isa_version": 1.0},
                      "isa-huge": {"isa": "i" * 900_000}}.items():
        c.add(name, dump({**good, **top}), {"ENOEXEC"})
    c.add("isa-missing", dump({k: v for k, v in good.items() if k != "isa"}), {"ENOEXEC"})
    for name, val in {"kernels-list": [GOOD], "kernels-str": "k", "kernels-null": None,
                      "kernels-empty": {}, "kernels-int": 1}.items():
        c.add(name, dump({**good, "kernels": val}), {"EINVAL"})
    c.add("kernels-missing", dump({k: v for k, v in good.items() if k != "kernels"}),
          {"EINVAL"})
    for name, kname in {"name-empty": "", "name-digit": "1k", "name-dash": "k-1",
                        "name-64": "k" * 64, "name-huge": "k" * 500_000, "name-e-acute": "\xe9",
                        "name-surrogate": "\ud800", "name-nul": "k\0", "name-space": "k ",
                        "name-newline": "k\n"}.items():
        c.add(name, dump(module_of({kname: GOOD})), {"EINVAL"})
    for name, val in {"kernel-list": [GOOD], "kernel-str": GOOD_SRC, "kernel-null": None,
                      "kernel-int": 7}.items():
        c.add(name, dump(module_of({"k": val})), {"EINVAL"})
    for name, val in {"shared-true": True, "shared-neg": -1, "shared-float": 0.0,
                      "shared-nan": math.nan, "shared-inf": math.inf, "shared-str": "0",
                      "shared-over": shared_limit + 1, "shared-2**64": 1 << 64,
                      "shared-huge": 10 ** 4000, "shared-null": None}.items():
        c.add(name, dump(module_of({"k": {**GOOD, "shared_mem": val}})), {"EINVAL"})
    c.add("shared-missing", dump(module_of({"k": {"params": [X], "source": GOOD_SRC}})),
          {"EINVAL"})
    for name, val in {"source-over-max": GOOD_SRC + "#" * (uapi.ACCEL_KERNEL_SOURCE_MAX
                                                           - len(GOOD_SRC) + 1),
                      "source-huge": GOOD_SRC + "#" * 900_000, "source-int": 7,
                      "source-null": None, "source-list": [GOOD_SRC]}.items():
        c.add(name, dump(module_of({"k": {**GOOD, "source": val}})), {"EINVAL"})
    for name, params in {"params-str": "x", "params-null": None, "params-dict": {"x": X},
                         "param-kind": [{**X, "kind": "pointer"}],
                         "param-kind-int": [{**X, "kind": 1}],
                         "param-name-int": [{**X, "name": 1}],
                         "param-dtype": [{**X, "dtype": "float128"}],
                         "param-dtype-alias": [{**X, "dtype": "f64"}],
                         "param-dtype-int": [{**X, "dtype": 10}]}.items():
        visible = _driver_visible({**GOOD, "params": params}, shared_limit)
        c.add(name, dump(module_of({"k": {**GOOD, "params": params}})),
              {"EINVAL"} if visible == "load" else {"EINVAL", ""}, ok_launch, einval)

    # --- the firmware's corpus (tests/unit/test_jit_hostile.py), each as a module ------------------
    for name, (ir, types) in hostile.REJECTED.items():
        if name.startswith("types-"):
            continue  # argument types come from the argument block: attacked below
        visible = _driver_visible(ir, shared_limit)
        entry = _honest(ir) if isinstance(ir, dict) else ir
        load = {"EINVAL"} if visible == "load" else {"EINVAL", ""} if visible else {""}
        if load == {""} and c.needs({"k": entry}):
            load = {"EOPNOTSUPP"}
        args = _args_for(ir.get("params") if isinstance(ir, dict) else None)
        c.add("jit-" + name, dump(module_of({"k": entry})), load, [launch_of(args)], einval)
    for name, body in {
        "import": "    import os\n", "two-functions": None, "decorator": None,
        "global": "    global q\n", "fstring": '    x[0] = len(f"{x}")\n',
        "walrus": "    x[(y := 0)] = 1.0\n", "lambda": "    f = lambda: 1\n",
        "comprehension": "    y = [i for i in range(3)]\n", "attribute": "    y = x.ctypes\n",
        "dunder": "    y = x.__class__\n", "exec": '    exec("1")\n', "eval": '    eval("1")\n',
        "with": "    with x:\n        pass\n",
        "try": "    try:\n        pass\n    except:\n        pass\n",
        "yield": "    yield 1\n", "del": "    del x\n", "free-name": "    x[0] = os\n",
        "builtin-rebound": "    range = 1\n", "keyword-arg": "    y = abs(x=1)\n",
        "starred": "    y = max(*x)\n", "bytes": '    x[0] = b"a"\n', "complex": "    x[0] = 1j\n",
        "barrier-divergent": "    if global_id(0) == 0:\n        barrier()\n",
        "nested-def": "    def f():\n        pass\n", "deep": "    x[0] = " + "abs(" * 150 + "0"
        + ")" * 150 + "\n", "too-many-nodes": "    x[0] = 1.0\n" * 1000,
        "open": '    f = open("/etc/passwd")\n', "class-access": "    y = type(x)\n",
    }.items():
        src = GOOD_SRC + body if body else (
            GOOD_SRC + "def j(x):\n    x[0] = 2.0\n" if name == "two-functions"
            else "@njit\n" + GOOD_SRC)
        c.kernel("fw-" + name, {**GOOD, "source": src}, [launch_of([buf("x")])], einval)
    c.kernel("fw-source-name-differs", {**GOOD, "source": GOOD_SRC.replace("def k", "def j")},
             [launch_of([buf("x")])], [expect({"", "EINVAL"})])
    c.kernel("fw-params-differ", {**GOOD, "params": [{**X, "name": "y"}]},
             [launch_of([buf("x")])], einval)
    c.kernel("fw-shared-understated", {**GOOD, "source": GOOD_SRC + '    s = shared_array(1024, '
                                       '"float64")\n    s[0] = 1.0\n'},
             [launch_of([buf("x")])], einval)

    # --- launches with hostile fields ---------------------------------------------------------
    def attack(name: str, launches: list[dict], expect: list[dict], **extra: Any) -> None:
        c.add("launch-" + name, good_raw, {""}, launches, expect, **extra)

    attack("handle-unknown-module", [{"handle": [1000, 0], "args": [buf("x")]}], einval)
    attack("handle-index", [{"handle": [0, 1], "args": [buf("x")]}], einval)
    attack("handle-index-max", [{"handle": [0, 0xFFFF], "args": [buf("x")]}], einval)
    attack("handle-u64", [{"handle": [0, U64], "args": [buf("x")]}], einval)
    attack("handle-foreign", [{"handle": ["foreign", 0], "args": [buf("x")]}], einval,
           foreign=True)
    attack("after-unload", [launch_of([buf("x")], after_unload=True)], einval)
    for name, kw in {"grid-0": {"grid": [0, 1, 1]}, "grid-y0": {"grid": [1, 0, 1]},
                     "grid-word-0": {"grid": 0}, "block-0": {"block": [1, 1, 0]},
                     "block-1025": {"block": [1025, 1, 1]}, "block-2048": {"block": [32, 32, 2]},
                     "block-word-u64": {"block": U64}, "dyn-over": {"dyn": shared_limit + 1},
                     "dyn-u64": {"dyn": U64}, "dyn-2**63": {"dyn": 1 << 63},
                     "flags": {"flags": 1}, "args-len-over": {"args_len": userq.ACCEL_ARGS_MAX + 1},
                     "args-len-u64": {"args_len": U64}, "args-len-odd": {"args_len": 23},
                     "args-len-0": {"args_len": 0}, "args-in-device-memory": {"args_va": ["va",
                                                                                       "out", 0]},
                     }.items():
        attack(name, [launch_of([buf("x")], **kw)], einval)
    efault = [expect("EFAULT")]
    attack("args-va-unaligned", [launch_of([buf("x")], args_va=["va", "pinned", 1])],
           [expect({"", "EINVAL"})])
    for name, va in {"args-va-0": 0, "args-va-u64": U64, "args-va-low": 0x1000,
                     "args-va-past-pinned": ["va", "pinned", 4 << 20],
                     "args-va-straddles": ["va", "pinned", (4 << 20) - 8]}.items():
        attack(name, [launch_of([buf("x")], args_va=va, args_len=24)], efault)
    x_va = ["va", "x", 0]
    code64 = ITEM["float64"][0]
    for name, args, want in [
        ("records-none", [], einval),
        ("records-extra", [buf("x"), scalar("int64", 1)], einval),
        ("record-scalar-for-buffer", [scalar("int64", 1)], einval),
        ("record-kind-3", [["rec", 3, code64, x_va, 64]], einval),
        ("record-kind-u32", [["rec", 0xFFFFFFFF, code64, x_va, 64]], einval),
        ("record-dtype-0", [["rec", 1, 0, x_va, 64]], einval),
        ("record-dtype-12", [["rec", 1, 12, x_va, 64]], einval),
        ("record-dtype-u32", [["rec", 1, 0xFFFFFFFF, x_va, 64]], einval),
        ("buffer-misaligned-bytes", [buf("x", nbytes=7)], einval),
        ("buffer-unmapped", [["rec", 1, code64, 0x1000, 64]], [expect("EFAULT")]),
        ("buffer-past-allocation", [buf("x", shape=(1024,), nbytes=8192)], [expect("EFAULT")]),
        ("buffer-wraps", [["rec", 1, code64, U64 - 7, 16]], [expect("EFAULT")]),
        ("buffer-bytes-u64", [["rec", 1, code64, x_va, U64 - 7]], [expect({"EFAULT",
                                                                             "EINVAL"})]),
        ("buffer-va-minus", [["rec", 1, code64, ["va", "x", -8], 64]], [expect("EFAULT")]),
        ("buffer-other-context", [["rec", 1, code64, ["va", "other_ctx", 0], 64]],
         [expect("EFAULT")]),
        ("buffer-unaligned", [["rec", 1, code64, ["va", "x", 1], 64]],
         [expect({"", "EINVAL"})]),
        ("shape-count-3", [buf("x"), ["rec", 2, 3, 8, 1]], einval),
        ("shape-count-0", [buf("x"), ["rec", 2, 0, 8, 1]], einval),
        ("shape-product", [buf("x", shape=(3, 3))], einval),
        ("shape-overflow", [buf("x", shape=(1 << 32, 1 << 32), nbytes=64)], einval),
        ("shape-wraps-to-8", [buf("x", shape=(1 << 63, 2, 8), nbytes=64)], einval),
        ("shape-negative", [buf("x", shape=(U64, U64 - 7), nbytes=64)], einval),
        ("shape-9d", [buf("x", shape=(1,) * 7 + (8, 1), nbytes=64)], einval),
        ("shape-orphan", [["rec", 2, 1, 8, 0], buf("x")], einval),
        ("shape-2d-for-1d", [buf("x", shape=(2, 4))], einval),
        ("shape-empty", [buf("x", shape=(0,), nbytes=0)], [expect("EFAULT", ["x", 0, 8])]),
        ("dtype-annotated-mismatch", None, einval),
    ]:
        if args is None:
            c.add("launch-" + name, dump(module_of({"k": {**GOOD, "params": [{**X, "dtype":
                                                                                "float32"}]}})),
                  {""}, [launch_of([buf("x")])], want)
        else:
            attack(name, [launch_of(args)], want)

    # --- capabilities the device lacks: refused when the IR says so, and the firmware does
    # not run what the IR hides
    for cap, flag, body in (("matrix", "uses_mma", "    mma(c, a, b, 0, 0, 0, 4, 5, 3, 0.0)\n"),
                            ("atomics", "uses_atomics", "    atomic_add(c, (0, 0), 1.0)\n"),
                            ("shared_mem", "uses_barrier", "    barrier()\n")):
        if cap in caps:
            continue
        ir = {"params": [{**X, "name": n, "ndim": 2} for n in "abc"], "shared_mem": 0,
              "source": "def k(a, b, c):\n" + body}
        args = [buf("a"), buf("b"), buf("c")]
        c.add(f"caps-{cap}-declared", dump(module_of({"k": {**ir, flag: True}})), {"EOPNOTSUPP"})
        c.add(f"caps-{cap}-hidden", dump(module_of({"k": {**ir, flag: False}})), {"", "EOPNOTSUPP"},
              [launch_of(args, block=[32, 1, 1])], [expect("EOPNOTSUPP")])

    # --- far out of bounds: the miss's address, saturated ---------------------------------
    idx = hostile.IDX
    idx_launches, idx_expect = [], []
    for (sel, i, u, f), (param, index, _sat) in hostile.IDX_MISSES:
        idx_launches.append(launch_of([buf("x"), buf("out"), scalar("int64", i),
                                       scalar("uint64", u), scalar("float64", f),
                                       scalar("int64", sel)]))
        idx_expect.append(expect("EFAULT", [param, index, 8]))
    c.kernel("oob-1d", {**idx}, idx_launches, idx_expect)
    idx2_launches, idx2_expect = [], []
    for sel in (0, 1, 2, 3):
        for i, j, (index, _sat) in [(1 << 62, 1 << 62, (hostile.INDEX_MAX, True)),
                                    (-(1 << 62), -(1 << 62), (hostile.INDEX_MIN, True)),
                                    (I64_MAX, I64_MAX, (hostile.INDEX_MAX, True)),
                                    (0, 5, (5, False)), (1, -1, (4, False)),
                                    (-1, 0, (-5, False))]:
            idx2_launches.append(launch_of([buf("x2"), buf("out2"), scalar("int64", i),
                                          scalar("int64", j), scalar("int64", sel)]))
            idx2_expect.append(expect("EFAULT", ["out2" if sel in (1, 2) else "x2", index, 8]))
    c.kernel("oob-2d", {**hostile.IDX2}, idx2_launches, idx2_expect)
    tile_launches, tile_expect = [], []
    for args, (operand, index, _sat) in hostile.MMA_MISSES:
        tile_launches.append(launch_of([buf("a"), buf("b"), buf("c"),
                                      *[scalar("int64", v) for v in args],
                                      scalar("float64", 1.0)], block=[32, 1, 1]))
        tile_expect.append(expect("EFAULT", [operand, index, 8]))
    for args, (operand, index) in [((U64, 0, 0, 1, 5, 3), ("c", I64_MAX)),
                                   ((0, 0, 0, U64, 5, 3), ("c", I64_MAX)),
                                   ((0, 0, U64, 4, 5, 1), ("a", I64_MAX)),
                                   ((0, 0, 0, 4, U64, 3), ("c", I64_MAX))]:
        tile_launches.append(launch_of([buf("a"), buf("b"), buf("c"),
                                      *[scalar("uint64", v) for v in args],
                                      scalar("float64", 1.0)]))
        tile_expect.append(expect("EFAULT", [operand, index, 8]))
    c.kernel("oob-mma", {**hostile.TILE}, tile_launches, tile_expect)
    for name, index in {"far": 1 << 62, "far-negative": -(1 << 62), "minus-one": -1,
                        "i64-max": I64_MAX}.items():
        c.kernel("oob-const-" + name, {**GOOD, "source": f"def k(x):\n    x[{index}] = 1.0\n"},
                 [launch_of([buf("x")]), launch_of([buf("x")], grid=[64, 1, 1], block=[512, 1, 1])],
                 [expect("EFAULT", ["x", index, 8])] * 2)

    # --- kernels that never end: the watchdog stops them ----------------------------------
    late = watchdog_ms / 1000 + 60
    c.kernel("forever-while", {**GOOD, "source": "def k(x):\n    while x[0] == 0.0:\n"
                                                  "        x[1] = 0.0\n"},
             [launch_of([buf("x")], timeout=late)], [expect("ETIMEDOUT")])
    if watchdog_ms <= 3000:  # cheap enough for a second one, on the other loop kind
        c.kernel("forever-range", {**GOOD, "source": "def k(x):\n    for i in range(1 << 62):\n"
                                                      "        x[1] = 0.0\n"},
                 [launch_of([buf("x")], timeout=late, grid=[4, 1, 1])], [expect("ETIMEDOUT")])
    return c


# --------------------------------------------------------------------------- mutants

def _hostile_values(rng: random.Random) -> list[Any]:
    nest: Any = 0
    for _ in range(rng.randint(20, 200)):
        nest = [nest]
    return [None, True, False, 0, -1, 1, 2, 1 << 31, 1 << 63, 1 << 64, -(1 << 63), 10 ** 30,
            0.5, -0.0, math.nan, math.inf, -math.inf, "", "x" * rng.randint(1, 70_000),
            "\ud800", "\0", "float64", "uint8", "buffer", "scalar", "k", [], {}, [GOOD],
            {"a": 1}, nest, "def k(x):\n    import os\n", "def k(x):\n    x[1 << 62] = 1.0\n",
            "def k(x, y):\n    x[0] = y\n", kernel_lang.ISA]


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, path + (i,))
    return out


def _mutate(mod: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any] | Any, str]:
    mod = copy.deepcopy(mod)
    path = rng.choice(_paths(mod)[1:])
    parent: Any = mod
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    value = rng.choice(_hostile_values(rng))
    op = rng.random()
    if op < 0.6:
        parent[last] = value
        what = f"{'/'.join(map(str, path))} = {str(value)[:40]!r}"
    elif op < 0.75 and isinstance(parent, dict):
        del parent[last]
        what = f"del {'/'.join(map(str, path))}"
    elif op < 0.9 and isinstance(parent, dict):
        key = rng.choice(["extra", "", "k2", "\ud800", "params", "x" * 1000])
        parent[key] = value
        what = f"{'/'.join(map(str, path[:-1]))}/{key[:10]!r} += {str(value)[:40]!r}"
    else:
        parent[last] = [parent[last]]
        what = f"{'/'.join(map(str, path))} wrapped in a list"
    return mod, what


MUTANT_BASE = {
    "k": GOOD,
    "saxpy": {"params": [{"name": "a", "kind": "scalar", "dtype": "float64"}, X,
                         {"name": "out", "kind": "buffer", "dtype": None, "ndim": 1}],
              "source": "def saxpy(a, x, out):\n    i = global_id(0)\n    if i < out.shape[0]:"
                        "\n        out[i] = a * x[i]\n", "shared_mem": 0},
}


#: kernel sources with a hole for a hostile integer (each distinct one is compiled)
SOURCE_TEMPLATES = [
    "def k(x):\n    x[{v}] = 1.0\n",
    "def k(x):\n    x[global_id(0) * {v}] = 1.0\n",
    "def k(x):\n    x[{v} + {w}] = 1.0\n",
    "def k(x):\n    x[{v} * {w}] = 1.0\n",
    "def k(x):\n    x[{v} % 8] = 1.0\n",
    "def k(x):\n    x[{v} >> {w}] = 1.0\n",
    "def k(x):\n    x[{v} << {w}] = 1.0\n",
    "def k(x):\n    x[{v} // {w}] = 1.0\n",
    "def k(x):\n    for i in range({v}, {w}):\n        x[i] = 1.0\n",
    "def k(x):\n    for i in range(0, 16, {v}):\n        x[i] = 1.0\n",
    "def k(x):\n    x[int({v} * 1.5)] = 1.0\n",
    "def k(x):\n    x[min({v}, {w})] = 1.0\n",
]
HOSTILE_INTS = [0, 1, 7, 8, -1, -8, 63, 64, 1 << 31, 1 << 32, 1 << 62, -(1 << 62), I64_MAX,
                -I64_MAX - 1, 1 << 63, U64]


def mutants(rng: random.Random, count: int, corpus: Corpus) -> None:
    """``count`` modules: a valid one with one field replaced, deleted, added or wrapped
    (loaded, then each of its kernels launched), or a third of the time a kernel whose
    source has hostile integers in its indices (compiled and launched). Any answer but EIO
    or a crash will do; a fault must still leave other tenants' memory alone."""
    args = {"k": [buf("x")], "saxpy": [scalar("float64", 2.0), buf("x"), buf("out")]}
    for n in range(count):
        if rng.random() < 0.3:
            v, w = rng.choice(HOSTILE_INTS), rng.choice(HOSTILE_INTS)
            src = rng.choice(SOURCE_TEMPLATES).format(v=v, w=w)
            corpus.kernel(f"mutant-{n}: source {src[10:].strip()!r}", {**GOOD, "source": src},
                          [launch_of([buf("x")], grid=[rng.choice([1, 2, 40]), 1, 1],
                                     block=[rng.choice([1, 32, 512]), 1, 1])],
                          [expect({"", "EINVAL", "EFAULT"}, dirty_ok=True)])
            continue
        mod, what = _mutate(module_of(copy.deepcopy(MUTANT_BASE)), rng)
        kernels = mod.get("kernels") if isinstance(mod, dict) else None
        names = [k for k in (list(kernels)[:4] if isinstance(kernels, dict) else ["k"])
                 if isinstance(k, str)]
        enc = [k.encode("utf-8", "surrogatepass")[:uapi.ACCEL_KERNEL_NAME_MAX] for k in names]
        launches = [launch_of(args.get(k, [buf("x")]), kernel=_b64(e)) for k, e in zip(names, enc)]
        corpus.add(f"mutant-{n}: {what}", dump(mod), {"", "EINVAL", "ENOEXEC", "EOPNOTSUPP"},
                   launches, [expect({"", "EINVAL", "EFAULT"}, dirty_ok=True)] * len(launches),
                   get=enc)


# --------------------------------------------------------------------------- judging

def _norm(name: str) -> str:
    """One name per errno (Linux's ENOTSUP is EOPNOTSUPP)."""
    return "EOPNOTSUPP" if name == "ENOTSUP" else name

def _saturated(va: int, index: int, itemsize: int) -> int:
    return min(max(0, va + index * itemsize), U64)


def judge(case: dict, res: dict | None, vas: dict[str, int], report: Report,
          wrong: list[str]) -> None:
    name = case["name"][:120]
    if res is None:
        wrong.append(f"{name}: no answer")
        return
    for key in ("load", "unload"):
        if res.get(key) == "EIO":
            report.errnos["EIO"] = report.errnos.get("EIO", 0) + 1
    if "error" in res:
        wrong.append(f"{name}: attacker error {res['error']}")
        return
    got = _norm(res.get("load", "?"))
    if got:
        report.errnos[got] = report.errnos.get(got, 0) + 1
    exp = case["expect"]
    if got not in exp["load"]:
        wrong.append(f"{name}: MODULE_LOAD answered {got or 'success'}, expected "
                     f"{' or '.join(e or 'success' for e in exp['load'])}")
    for ans in res.get("foreign", []):  # an isolation refusal, counted by the driver
        if ans != "EPERM":
            wrong.append(f"{name}: another context's module answered {ans or 'success'}, "
                         "expected EPERM")
    if got:
        return
    if res.get("unload") not in ("", None):
        wrong.append(f"{name}: MODULE_UNLOAD answered {res.get('unload')}")
    for L, want, ans in zip(case["launches"], exp["launch"], res.get("launches", [])):
        if "skipped" in ans:
            if "" in want["fault"] and len(want["fault"]) == 1:
                wrong.append(f"{name}: KERNEL_GET failed ({res.get('get')}), no launch")
            continue
        fault = _norm(ans["fault"])
        if fault:
            report.errnos[fault] = report.errnos.get(fault, 0) + 1
        if ans.get("late"):
            report.hangs += 1
            wrong.append(f"{name}: launch never completed ({ans})")
            continue
        if fault not in want["fault"]:
            wrong.append(f"{name}: launch answered {fault or 'success'}, expected "
                         f"{' or '.join(e or 'success' for e in want['fault'])} ({ans})")
        elif fault == "EFAULT" and want.get("addr"):
            bname, index, size = want["addr"]
            param_va = vas[_param_buffer(L, bname)]
            if ans["addr"] != _saturated(param_va, index, size):
                wrong.append(f"{name}: EFAULT at {ans['addr']:#x}, expected "
                             f"{_saturated(param_va, index, size):#x} ({bname}[{index}])")
        if fault and ans.get("dirty") and not want.get("dirty_ok"):
            report.escapes += 1
            wrong.append(f"{name}: a launch that faulted ({fault}) changed {ans['dirty']}")


def _param_buffer(launch: dict, pname: str) -> str:
    """The buffer the launch passed for kernel parameter ``pname`` (the corpus names
    buffers after parameters, 2-D ones with a 2)."""
    for it in launch.get("args", []):
        if it[0] == "buf" and it[1] in (pname, pname + "2"):
            return it[1]
    return pname


# --------------------------------------------------------------------------- the run

def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _memfd_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum("/memfd:" in line for line in f)


def _state_files(d: Daemon) -> set[str]:
    """Files under the daemon's state directory, but the JIT cache and logs."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(d.state_dir):
        rel = os.path.relpath(dirpath, d.state_dir)
        if rel.split(os.sep)[0] == "jit-cache":
            continue
        out |= {os.path.join(rel, f) for f in filenames if not f.endswith(".log")}
    return out


def jit_cache_orphans(d: Daemon) -> list[str]:
    """What the JIT cache holds that is not a complete entry: temporary build directories,
    lock files without their entry, empty shard directories."""
    root = d.jit_cache_dir
    out = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for n in names:
        p = root / n
        if n.endswith(".lock"):
            key = n[:-5]
            if not (root / key[:2] / key / "manifest.json").exists():
                out.append(n)
        elif p.is_dir() and len(n) == 2:
            subs = os.listdir(p)
            if not subs:
                out.append(n + "/")
            out += [f"{n}/{s}" for s in subs if s.startswith(".tmp")]
    return out


def jit_cache_usage(d: Daemon) -> tuple[int, int]:
    """(complete entries, bytes) of the daemon's JIT cache."""
    entries = size = 0
    for dirpath, _dirs, files in os.walk(d.jit_cache_dir):
        entries += "manifest.json" in files
        for f in files:
            try:
                size += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return entries, size


def _watchdog_ms(d: Daemon) -> int:
    try:
        img = fwimage.parse((d.firmware_dir / fwimage.IMAGE_NAME).read_bytes())
        return int(img.config.get("watchdog_ms", 10_000))
    except Exception:  # noqa: BLE001 - the device answers anyway; assume the default
        return 10_000


def _good_module() -> bytes:
    return dump(module_of({"k": GOOD}))


def _big_module(size: int) -> bytes:
    """A valid module of exactly ``size`` bytes: 15 kernels with sources near the limit."""
    kernels = {}
    for i in range(15):
        src = GOOD_SRC.replace("def k", f"def k{i}")
        kernels[f"k{i}"] = {**GOOD, "source": src + "#" * (60_000 - len(src))}
    raw = dump(module_of(kernels))
    assert len(raw) < size, len(raw)
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


class Run:
    def __init__(self, d: Daemon, report: Report, dev: int) -> None:
        self.d, self.report, self.dev = d, report, dev
        self.uid = 65534 if os.geteuid() == 0 and world_reachable(d.root) else 0
        self.wrong: list[str] = []

    def bump(self, key: str, n: int = 1) -> None:
        self.report.done[key] = self.report.done.get(key, 0) + n

    def note(self, text: str) -> None:
        if len(self.report.notes) < 300:
            self.report.notes.append(text)

    def contained(self, before: Snapshot, what: str) -> bool:
        try:
            assert_contained(self.d, before)
            return True
        except AssertionError as exc:
            msg = str(exc)
        except OSError as exc:
            msg = f"processes: daemon unreachable ({exc!r})"
        self.note(f"{what}: {msg[:1500]}")
        if "processes" in msg or "died" in msg or "states" in msg:
            try:
                now = snapshot(self.d)
                daemon_same = now.daemon_pid == before.daemon_pid
            except (OSError, ValueError, AssertionError):
                daemon_same = False
            if daemon_same:
                self.report.firmware_crashes += 1
            else:
                self.report.daemon_crashes += 1
            return False
        self.report.leaks += 1
        return False

    def check_bystanders(self, bystanders: list[Bystander]) -> None:
        for b in bystanders:
            try:
                b.check()
            except AssertionError as exc:
                if "corrupt" in str(exc) or "died" in str(exc):
                    self.report.escapes += 1
                else:
                    self.report.hangs += 1
                self.note(f"bystander: {exc}")

    def attacker(self) -> Attacker:
        return Attacker(self.d, self.dev, self.uid, _good_module())

    def corpus(self, cases: list[dict], watchdog_ms: int) -> None:
        a = self.attacker()
        try:
            for case in cases:
                wire = {k: v for k, v in case.items() if k not in ("expect", "name")}
                budget = 60 + sum(L.get("timeout", 0) + 5 for L in case["launches"])
                res = a.ask(wire, budget)
                if res is None:
                    alive = a.proc.poll() is None
                    self.report.hangs += alive
                    why = f"no answer in {budget} s" if alive else "attacker died"
                    self.wrong.append(f"{case['name'][:120]}: {why}: {''.join(a.err)[-800:]}")
                    break
                judge(case, res, a.vas, self.report, self.wrong)
                if LOG:
                    with open(LOG, "a") as f:
                        f.write(json.dumps({"name": case["name"][:200], "res": res}) + "\n")
                self.bump("modules")
                self.bump("launches", len(res.get("launches", [])))
        finally:
            a.close()

    def churn(self, n: int) -> None:
        big = _big_module(uapi.ACCEL_MODULE_MAX)
        a = self.attacker()
        try:
            warm = a.ask({"op": "churn", "n": 5, "big": _b64(big)}, 120)
            fw = int(self.d.debug(self.dev, "fw_pid").read_text())
            shm0 = set(os.listdir("/dev/shm"))
            rss0 = _rss(self.d.pid), _rss(fw)
            res = a.ask({"op": "churn", "n": n, "big": _b64(big)}, 60 + n * 2)
            rss1 = _rss(self.d.pid), _rss(fw)
            shm1 = set(os.listdir("/dev/shm"))
        finally:
            a.close()
        if warm is None or res is None or "error" in res:
            self.wrong.append(f"churn: {warm} {res}")
            return
        if not res.get("synced"):
            self.wrong.append(f"churn: the launch after the churn did not run: {res}")
        self.bump("churn_loads", n + 5)
        mib = 1 << 20
        self.note(f"churn: {n} loads+unloads of a {len(big) // mib} MiB module in {res['s']} s; "
                  f"RSS daemon {rss0[0] / mib:.1f} -> {rss1[0] / mib:.1f} MiB, firmware "
                  f"{rss0[1] / mib:.1f} -> {rss1[1] / mib:.1f} MiB; /dev/shm "
                  f"{'unchanged' if shm0 == shm1 else sorted(shm1 ^ shm0)}")
        self.report.done["churn_rss_daemon_kib"] = (rss1[0] - rss0[0]) // 1024
        self.report.done["churn_rss_firmware_kib"] = (rss1[1] - rss0[1]) // 1024
        if shm1 - shm0:
            self.report.leaks += 1
        for who, before, after in (("daemon", rss0[0], rss1[0]), ("firmware", rss0[1], rss1[1])):
            if after - before > RSS_BOUND:
                self.report.leaks += 1
                self.note(f"churn: the {who}'s RSS grew {(after - before) / mib:.1f} MiB "
                          f"(bound {RSS_BOUND / mib:.0f} MiB)")

    def quota(self) -> None:
        lim = {k: int(self.d.attr(self.dev, f"limits/{k}"))
               for k in ("max_modules_per_context", "max_module_bytes_per_context")}
        big = _big_module(uapi.ACCEL_MODULE_MAX)
        a = self.attacker()
        fw = int(self.d.debug(self.dev, "fw_pid").read_text())
        try:
            rss0 = _rss(fw)
            full = a.ask({"op": "quota", "tiny": _b64(_good_module()), "big": _b64(big),
                          "max_modules": lim["max_modules_per_context"],
                          "max_bytes": lim["max_module_bytes_per_context"]}, 600)
            res = None
            if full is not None and "full" in full:
                rss1 = _rss(fw)
                per_process = self.d.attr(self.dev, "limits/max_contexts_per_process")
                res = a.ask({"op": "continue"}, 600)
                mib = 1 << 20
                self.report.done["quota_rss_firmware_kib"] = (rss1 - rss0) // 1024
                self.note(f"quota: a context holding {full['full']} modules of "
                          f"{len(big) / mib:.0f} MiB grew the firmware's RSS "
                          f"{rss0 / mib:.0f} -> {rss1 / mib:.0f} MiB "
                          f"({'settled' if full.get('synced') else 'unsettled'}); "
                          f"a process may hold {per_process} contexts, the device "
                          f"{self.d.attr(self.dev, 'limits/max_contexts')}")
            else:
                res = full
        finally:
            a.close()
        if res is None or "error" in res:
            self.wrong.append(f"quota: {res}")
            return
        self.bump("quota_loads", res["tiny"][0] + res["big"][0] + res["again"][0])
        want_big = lim["max_module_bytes_per_context"] // len(big)
        want = {"tiny": [min(lim["max_modules_per_context"], 10 ** 9), "EDQUOT"],
                "big": [min(want_big, lim["max_modules_per_context"]), "EDQUOT"],
                "again": [1, "EDQUOT"], "other": ""}
        for key, w in want.items():
            if res.get(key) != w:
                self.wrong.append(f"quota: {key} answered {res.get(key)}, expected {w} "
                                  f"(limits {lim})")
        self.note(f"quota: {res} with limits {lim}")


def attack(d: Daemon, cases: list[dict], dev: int = 0, uid: int | None = None,
           timeout: float = 120) -> tuple[dict[str, int], list[dict | None]]:
    """Run ``cases`` (built with :class:`Corpus`) in one attacker; its buffers' addresses
    and each case's raw answer (None: no answer). For regression tests."""
    if uid is None:
        uid = 65534 if os.geteuid() == 0 and world_reachable(d.root) else 0
    a = Attacker(d, dev, uid, _good_module())
    try:
        return a.vas, [a.ask({k: v for k, v in c.items() if k not in ("expect", "name")},
                             timeout) for c in cases]
    finally:
        a.close()


def run(d: Daemon, *, count: int, seed: int, churn: int = 100, quota: bool = True,
        dev: int = 0) -> Report:
    """The fixed corpus, ``count`` mutants (from ``seed``), the 1 MiB churn (``churn``
    loads) and the module quotas, against device ``dev`` of ``d``."""
    report = Report("module_corpus")
    t0 = time.monotonic()
    r = Run(d, report, dev)
    caps = set(d.attr(dev, "capabilities").split())
    shared_limit = int(d.attr(dev, "max_shared_mem_per_block"))
    watchdog_ms = _watchdog_ms(d)
    corpus = fixed_corpus(caps, shared_limit, watchdog_ms)
    report.done["fixed_cases"] = len(corpus.cases)
    mutants(random.Random(seed), count, corpus)
    if not r.uid:
        report.notes.append("root not world-reachable (or not run as root): attacking as root")
    report.notes.append(f"watchdog {watchdog_ms} ms; capabilities {sorted(caps)}")
    base = snapshot(d)
    state0 = _state_files(d)
    orphans0 = set(jit_cache_orphans(d))
    cache0 = jit_cache_usage(d)
    maps0 = [_memfd_maps(p) for p in base.fw_pids]
    bystanders: list[Bystander] = []
    try:
        bystanders = [Bystander(d, i) for i in range(d.devices)]
        r.check_bystanders(bystanders)  # their staging buffers exist from here on
        mid = snapshot(d)
        maps_mid = [_memfd_maps(p) for p in mid.fw_pids]
        sections = [("corpus", lambda: r.corpus(corpus.cases, watchdog_ms))]
        if churn:
            sections.append(("churn", lambda: r.churn(churn)))
        if quota:
            sections.append(("quota", r.quota))
        for what, fn in sections:
            fn()
            r.check_bystanders(bystanders)
            if not r.contained(mid, f"after the {what}"):
                if report.daemon_crashes or report.firmware_crashes:
                    break
                mid = snapshot(d)
            maps_now = [_memfd_maps(p) for p in mid.fw_pids]
            if maps_now != maps_mid:
                report.leaks += 1
                r.note(f"after the {what}: firmware memfd mappings {maps_mid} -> {maps_now}")
                maps_mid = maps_now
    except Exception as exc:  # noqa: BLE001 - the report says what went wrong
        report.notes.append(f"stopped by {exc!r}")
        report.hangs += 1
    finally:
        for b in bystanders:
            b.close()
    if not (report.daemon_crashes or report.firmware_crashes):
        r.contained(base, "at the end")
        if [_memfd_maps(p) for p in base.fw_pids] != maps0:
            report.leaks += 1
            r.note(f"firmware memfd mappings {maps0} -> "
                   f"{[_memfd_maps(p) for p in base.fw_pids]}")
    state1 = _state_files(d)
    if state1 != state0:
        report.leaks += 1
        r.note(f"files in the state directory: {sorted(state1 ^ state0)[:20]}")
    orphans = sorted(set(jit_cache_orphans(d)) - orphans0)
    cache1 = jit_cache_usage(d)
    r.note(f"JIT cache: {cache0[0]} -> {cache1[0]} entries, {cache0[1] >> 10} -> "
           f"{cache1[1] >> 10} KiB (at most jit.MAX_CACHE_ENTRIES entries)")
    if orphans:
        report.leaks += 1
        r.note(f"JIT cache files without an entry: {len(orphans)} (e.g. {orphans[:4]})")
    report.unexpected = len(r.wrong)
    for w in r.wrong[:100]:
        r.note("unexpected: " + w)
    report.seconds = time.monotonic() - t0
    return report


__all__ = [
    "GOOD",
    "RSS_BOUND",
    "STRESS_COUNT",
    "Corpus",
    "X",
    "attack",
    "buf",
    "dump",
    "expect",
    "fixed_corpus",
    "jit_cache_orphans",
    "launch_of",
    "module_of",
    "run",
    "scalar",
]
