"""Containment in the firmware: no packet, argument block or kernel takes a device down or
holds it from the other tenants (docs/containment.md, findings 3, 4, 5 and 13), and no
word of a process's own memory tells the firmware a context is lost.

The tests share one 2-device daemon (numba compiles take seconds here, and the session's
kernel cache, tests/conftest.py, makes the second compile of a kernel a cache hit); each
attack is followed by the harness's checks (testkit/contained.py): the same daemon and
firmware processes live, devices operational, the bystanders' data intact, books and
descriptors back to where they were.
"""

from __future__ import annotations

import time

import pytest

from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot
from testkit.daemon import Daemon
from testkit.tenants import tenant_code

PRELUDE = """
import os, sys, time, errno, numpy as np, runtime
from abi import kernel_lang, userq
ROOT = os.environ["ACCEL_EMU_ROOT"]
def fault(s):
    try:
        s.synchronize(timeout=60)
        return "none"
    except runtime.DeviceFaultError as exc:
        return f"{exc.record['errno']}@{exc.record['address']:#x}"
"""


@pytest.fixture(scope="module")
def fw_daemon(tmp_path_factory, jit_cache_dir):
    from firmware.image import IMAGE_DIR

    base = tmp_path_factory.mktemp("contain-fw")
    d = Daemon(base / "root", base / "state", IMAGE_DIR, 2, jit_cache=jit_cache_dir)
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def guarded(fw_daemon):
    """The shared daemon with a bystander on each device; after the test, the checks."""
    d = fw_daemon
    with Bystander(d, 0) as b0, Bystander(d, 1) as b1:
        before = snapshot(d)
        yield d
        for b in (b0, b1):
            b.check()
        assert_contained(d, before)


def run(d, code: str, timeout: float = 180) -> list[str]:
    out = d.run_py(PRELUDE + code, timeout=timeout)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout.splitlines()


def test_malformed_launch_argument_blocks_fault_only_their_queue(guarded):
    """Finding 3: only the firmware's own fault type was caught while decoding a LAUNCH's
    argument block, so a ValueError or MemoryError (an element count not a multiple of the
    dtype, a shape product overflowing, a 16 TiB buffer) killed the firmware."""
    lines = run(guarded, """
mod = runtime.compile("def k(x, n):\\n    i = global_id(0)\\n    if i < n:\\n        x[i] = 1.0\\n")
k = mod.get_kernel("k")
x = runtime.empty(1024, np.float32)
args = runtime.pinned_empty(8192, np.uint8)
rec = userq.ARG_RECORD.pack
f32, i64 = kernel_lang.DTYPE_CODES["float32"], kernel_lang.DTYPE_CODES["int64"]
n = rec(userq.ARG_SCALAR, i64, 1024, 0)
def buf(nbytes, *shape, va=None, kind=userq.ARG_BUFFER, code=f32):
    out = rec(kind, code, x.va if va is None else va, nbytes)
    for i in range(0, len(shape), 2):
        pair = shape[i:i + 2]
        out += rec(userq.ARG_SHAPE, len(pair), pair[0], pair[1] if len(pair) > 1 else 0)
    return out
cases = {
    "not-a-multiple": buf(10) + n,
    "shape-overflow": buf(4096, 1 << 32, 1 << 32) + n,
    "shape-negative": buf(4096, (1 << 64) - 1, (1 << 64) - 1024) + n,
    "16-TiB": buf(16 << 40) + n,
    "beyond-2**64": buf(64, va=(1 << 64) - 8) + n,
    "scalar-for-buffer": n + n,
    "unknown-dtype": buf(4096, code=99) + n,
    "shape-count-5": rec(userq.ARG_BUFFER, f32, x.va, 4096) + rec(userq.ARG_SHAPE, 5, 1, 1) + n,
    "missing": buf(4096),
    "trailing": buf(4096) + n + n,
    "ragged": (buf(4096) + n)[:-5],
}
for name, block in cases.items():
    args[:len(block)] = np.frombuffer(block, np.uint8)
    s = runtime.Stream()
    s.submit([userq.Launch(k.handle, userq.pack_dims((4, 1, 1)),
                           userq.pack_dims((256, 1, 1)), 0, args.device_va, len(block))])
    print(name, fault(s).split("@")[0])
for name, length, va, block in (("too-long", userq.ACCEL_ARGS_MAX + 24, args.device_va, (1024, 1, 1)),
                                ("unmapped", 48, 0x10, (1024, 1, 1)),
                                ("block-too-big", 48, args.device_va, (2048, 1, 1))):
    s = runtime.Stream()
    s.submit([userq.Launch(k.handle, userq.pack_dims((1, 1, 1)),
                           userq.pack_dims(block), 0, va, length)])
    print(name, fault(s).split("@")[0])
s = runtime.Stream()
k[4, 256](x, np.int64(1024), stream=s)
print("valid", fault(s), float(x.copy_to_host(stream=s).sum()))
""")
    assert lines == [
        "not-a-multiple EINVAL", "shape-overflow EINVAL", "shape-negative EINVAL",
        "16-TiB EFAULT", "beyond-2**64 EFAULT", "scalar-for-buffer EINVAL",
        "unknown-dtype EINVAL", "shape-count-5 EINVAL", "missing EINVAL", "trailing EINVAL",
        "ragged EINVAL", "too-long EINVAL", "unmapped EFAULT", "block-too-big EINVAL",
        "valid none 1024.0"]


def test_a_fault_past_2_64_is_reported_and_leaves_every_engine_working(guarded):
    """Finding 4: ``x[1 << 62]`` (legal source) faulted at an address past 2**64; writing
    it killed a compute engine's thread (its queue never completed; two such launches left
    no engine) or, run inline, the firmware. The address now saturates at 2**64 - 1."""
    lines = run(guarded, """
mod = runtime.compile("def far(x):\\n    x[1 << 62] = 1.0\\n"
                      "def near(x):\\n    x[global_id(0)] = 2.0\\n")
x = runtime.empty(1 << 16, np.float32)
for grid, block in ((1, 32), (1, 32), (64, 1024), (64, 1024)):  # inline, then on engines
    s = runtime.Stream()
    mod.far[grid, block](x, stream=s)
    print(fault(s))
s = runtime.Stream()
mod.near[64, 1024](x, stream=s)     # both compute engines still take blocks
print(fault(s), int(x.copy_to_host(stream=s).sum()))
""")
    assert lines == ["EFAULT@0xffffffffffffffff"] * 4 + [f"none {2 * (1 << 16)}"]


def test_ring_pointer_jumps_fault_the_ring_in_one_step(guarded):
    """Finding 5: a write-pointer jump of +10**6 or +2**63 was consumed packet by packet
    with no bound per pass, holding the control loop past its 2 s heartbeat (the device
    failed). The ring faults (EINVAL) and is cancelled at once; the device beats on."""
    d = guarded
    beats = int(d.attr(0, "heartbeat"))
    lines = run(d, """
for jump in (1024 + 1, 10 ** 6, 1 << 63, -5):
    s = runtime.Stream()
    for _ in range(3):
        s.submit_nop()
    s.synchronize()
    wptr = (s.last_seqno + jump) % (1 << 64)
    s._ring.set(userq.RING_WPTR, wptr)
    s.ctx.knock(s._slot, wptr)
    deadline = time.monotonic() + 10
    while not s._ring.read_fault()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    seqno, code, op, addr = s._ring.read_fault()
    try:
        s.submit_nop()
        refused = "accepted"
    except runtime.DeviceFaultError as exc:
        refused = errno.errorcode[exc.errno]
    print(seqno, errno.errorcode.get(code, code), refused)
""")
    assert lines == ["4 EINVAL ECANCELED"] * 4
    time.sleep(2.5)  # longer than the heartbeat timeout: the device must still be beating
    assert d.attr(0, "state") == "operational"
    assert int(d.attr(0, "heartbeat")) > beats


def test_long_kernels_never_hold_the_control_loop(guarded):
    """Finding 5: small launches of compiled kernels ran inline on the scheduler thread
    under a 10 s watchdog, and a long compile held the kernel cache's lock while an inline
    launch waited for it. A small launch of a looping kernel runs on an engine (other
    tenants' work and the heartbeat go on), and small launches of a compiled kernel run
    while another kernel compiles."""
    d = guarded
    warm = run(d, """
mod = runtime.compile("def tiny(x):\\n    x[global_id(0)] = 3.0\\n")
x = runtime.empty(64, np.float32); s = runtime.Stream()
mod.tiny[1, 64](x, stream=s); print(fault(s))
""")
    assert warm == ["none"]
    spinner = d.popen_py(PRELUDE + """
src = ("def spin(x, n):\\n    acc = 0.0\\n    for j in range(n):\\n        acc = acc + 1.0\\n"
       f"    x[global_id(0)] = acc + {time.time_ns()}.0\\n")   # a fresh kernel: a compile
x = runtime.empty(32, np.float32); s = runtime.Stream()
mod = runtime.compile(src)
print("launching", flush=True)
mod.spin[1, 32](x, np.int64(30_000_000), stream=s)
print("done", fault(s), time.monotonic(), flush=True)
""")
    try:
        assert spinner.stdout.readline().strip() == "launching"
        lines = run(d, """
mod = runtime.compile("def tiny(x):\\n    x[global_id(0)] = 3.0\\n")
x = runtime.empty(64, np.float32); s = runtime.Stream()
for _ in range(20):
    mod.tiny[1, 64](x, stream=s)
s.synchronize(timeout=60)
print(time.monotonic(), float(x.copy_to_host(stream=s)[0]))
""")
        out, err = spinner.communicate(timeout=180)
    finally:
        if spinner.poll() is None:
            spinner.kill()
    small_done, value = lines[0].split()
    spin_done = float(out.split()[-1])
    assert value == "3.0"
    assert float(small_done) < spin_done, "the small launches waited for the compile or the loop"
    assert d.attr(0, "state") == "operational"


def test_a_giant_grid_shares_the_compute_engines(guarded):
    """Finding 13: one giant grid held both compute engines for the whole 10 s watchdog (a
    bystander's first kernel waited 6.7 s). Launches run in time slices and give way to
    waiting work: another tenant's kernel completes while the giant grid still runs."""
    d = guarded
    giant = d.popen_py(PRELUDE + """
mod = runtime.compile("def churn(x, n):\\n    acc = 0.0\\n    for j in range(n):\\n"
                      "        acc = acc + 1.0\\n    x[global_id(0) % 1024] = acc\\n")
x = runtime.empty(1024, np.float32); s = runtime.Stream()
mod.churn[1, 32](x, np.int64(1), stream=s); s.synchronize()   # compiled
mod.churn[1 << 14, 256](x, np.int64(2000), stream=s)          # ~3 s of both engines
print("started", flush=True)
print("done", fault(s), time.monotonic(), flush=True)
""")
    try:
        assert giant.stdout.readline().strip() == "started"
        time.sleep(0.3)
        lines = run(d, """
mod = runtime.compile("def churn(x, n):\\n    acc = 0.0\\n    for j in range(n):\\n"
                      "        acc = acc + 1.0\\n    x[global_id(0) % 1024] = acc\\n")
x = runtime.empty(1024, np.float32); s = runtime.Stream()
t0 = time.monotonic()
mod.churn[4, 256](x, np.int64(10), stream=s)
s.synchronize(timeout=120)
print(time.monotonic(), time.monotonic() - t0)
""")
        out, err = giant.communicate(timeout=180)
    finally:
        if giant.poll() is None:
            giant.kill()
    small_done, waited = map(float, lines[0].split())
    giant_done = float(out.split()[-1])
    assert small_done < giant_done, (f"the small kernel ({waited:.2f} s) finished after the "
                                     "giant grid")


_SCRIBBLE_LOST = """
import time
from rawdev import RawDev, errname
ROOT = os.environ["ACCEL_EMU_ROOT"]
NOP = userq.Nop().encode()
def until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
dev = RawDev(f"{ROOT}/dev/accel/accel0")
ctx = dev.ctx_create()
q = dev.queue_create(ctx)
slot, ring = dev.rings[q]
dev.wait_done(ctx, dev.noop(ctx))                      # both queues idle: only a doorbell
first = dev.submit(q, [NOP])                           # wakes them from now on
assert until(lambda: ring.completed == first)
dev.db.set(userq.DB_LOST, errno.ENODEV)                # the process's own page: it may
seqno = dev.noop(ctx)                                  # the driver's queue, this context's
print("completed past the noop", dev.wait_done(ctx, seqno, timeout=10).completed - seqno)
w = dev.submit(q, [NOP, NOP])                          # its own ring
until(lambda: ring.completed == w)
print("ring behind", w - ring.completed, ring.read_fault())
print(errname(lambda: dev.call(uapi.ACCEL_CMD_MEM_INFO, uapi.accel_mem_info(ctx_id=ctx))))
# the runtime reads the word as the driver's news: its own context's error, at once
s = runtime.Stream()
x = runtime.to_device(np.ones(1024, np.float32), stream=s)
s.synchronize()
runtime.primary_context().db.set(userq.DB_LOST, errno.ENODEV)
t0 = time.monotonic()
try:
    x.copy_to_host(stream=s)
    s.synchronize(timeout=10)
    print("no error")
except runtime.DeviceLostError:
    print("DeviceLostError", time.monotonic() - t0)
"""


def test_a_tenant_writing_its_doorbell_pages_lost_word_stalls_nothing(make_daemon, other_user):
    """The firmware read the doorbell page's "lost" word -- the process's own memory --
    to stop a lost context's rings before the driver's destroy arrived. A process that
    wrote it stalled its own context for good: SUBMIT_NOOPs accepted that never
    completed, WAIT answering ETIME instead of ENODEV, its rings never run. The firmware
    learns a loss from the driver's mailbox now (CTX_LOST, CTX_DESTROY, sent before the
    word is written): the scribbling process's work runs as if it had not written it
    (the runtime, which reads the word for the driver's news, raises its own context's
    DeviceLostError at once); the bystanders on both devices and the books are intact."""
    d = make_daemon(devices=2, tenants=True)
    with Bystander(d, 0) as b0, Bystander(d, 1) as b1:
        before = snapshot(d)
        out = other_user.run(d, tenant_code(_SCRIBBLE_LOST), timeout=120)
        assert out.returncode == 0, out.stderr + out.stdout
        lines = out.stdout.splitlines()
        assert len(lines) == 4 and lines[0].startswith("completed past the noop "), lines
        assert int(lines[0].split()[-1]) >= 0, lines
        assert lines[1:3] == ["ring behind 0 (0, 0, 0, 0)", ""], lines
        assert lines[3].startswith("DeviceLostError ") and float(lines[3].split()[1]) < 5, lines

        for b in (b0, b1):
            b.check()
        assert_contained(d, before)
