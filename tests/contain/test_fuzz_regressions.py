"""Regressions for what the fuzzers (stress/uapi_fuzz.py, stress/ring_fuzz.py) found: each
replays the minimal reproduction against a real mount, checks the exact outcome, and that
nothing else was harmed -- the same firmware runs, a bystander tenant on each device is
intact, and the books, descriptors and /dev/shm come back (testkit/contained.py).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot

TESTS = Path(__file__).resolve().parent.parent  # tests/, where rawdev.py lives
PRELUDE = f"""
import errno, json, os, sys, time
sys.path.insert(0, {str(TESTS)!r})
from rawdev import RawDev, errname
from abi import uapi, userq
from runtime._shm import sealed_memfd
ROOT = os.environ["ACCEL_EMU_ROOT"]
NOP = userq.Nop().encode()
def wait_packet(queue_id, seqno):
    return userq.WaitQueue(queue_id, seqno).encode()
def until(cond, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: {{what}}")
        time.sleep(0.005)
def fw_pid(dev=0):
    return int(open(f"{{ROOT}}/sys/kernel/debug/accel/accel{{dev}}/fw_pid").read())
def firmware(pid):  # the firmware now against pid, the one before the attack
    now = fw_pid()
    return "same-firmware" if now == pid else f"firmware {{pid}}->{{now}}"
def fw_fds(pid, held):  # how many of firmware pid's descriptors held(path) says are ours
    found = 0
    for n in os.listdir(f"/proc/{{pid}}/fd"):
        try:
            found += held(f"/proc/{{pid}}/fd/{{n}}")
        except FileNotFoundError:  # closed meanwhile
            pass
    return found
FILL = '''
def fill(out: "float32", v: "float32"):
    i = global_id(0)
    if i < out.size:
        out[i] = v
'''
def load_fill():  # (module id, kernel handle) of FILL, loaded on ctx
    from runtime.kernels import compile_module
    raw = json.dumps(compile_module(FILL)).encode()
    fd = sealed_memfd("module", len(raw), raw)
    try:
        mid = dev.call(uapi.ACCEL_CMD_MODULE_LOAD, uapi.accel_module_load(ctx_id=ctx, size=len(raw), fd=fd)).module_id
    finally:
        os.close(fd)
    return mid, dev.call(uapi.ACCEL_CMD_KERNEL_GET, uapi.accel_kernel_get(ctx_id=ctx, module_id=mid, name=b"fill")).handle
dev = RawDev(f"{{ROOT}}/dev/accel/accel0")
ctx = dev.ctx_create()
"""


@pytest.fixture
def two(make_daemon):
    """A private 2-device daemon with a bystander tenant on each device."""
    d = make_daemon(devices=2)
    with Bystander(d, 0) as b0, Bystander(d, 1) as b1:
        yield d, (b0, b1)


def run(d, code: str, timeout: float = 180) -> list[str]:
    out = d.run_py(PRELUDE + code, timeout=timeout)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout.splitlines()


def harmless(d, before, bystanders) -> None:
    for b in bystanders:
        b.check()
    assert_contained(d, before)


def test_an_unmap_waiting_for_a_ring_destroyed_after_its_write_pointer_went_back(two):
    """uapi_fuzz seed 1 round 0 (the fuzzer's rings and doorbell pages shared a memfd, so
    the driver's doorbell writes moved a ring's write pointer): the firmware died with
    ValueError (a released memoryview) in its control loop. An UNMAP waits until every
    ring has completed what it held when the UNMAP came (5 packets here); the process then
    lowered its ring's write pointer to 2, the ring completed 2, was destroyed and closed
    -- and the next pass read the closed ring's fence. A closed ring runs nothing: the
    unmap completes, the memory comes back, the firmware lives."""
    d, bystanders = two
    before = snapshot(d)
    lines = run(d, """
pid = fw_pid()
q = dev.queue_create(ctx)
slot, ring = dev.rings[q]
buf = dev.mem_alloc(ctx, 1 << 20)
dev.submit(q, [wait_packet(0, 1)] + [NOP] * 4)      # blocks on the default queue's seqno 1
until(lambda: ring.rptr == 1, "the wait taken")
dev.call(uapi.ACCEL_CMD_MEM_FREE, uapi.accel_mem_free(ctx_id=ctx, handle=buf.handle))
time.sleep(0.3)                                       # the UNMAP now waits for packet 5
dev.publish(q, 2)                                     # the process takes 3 packets back
dev.wait_done(ctx, dev.noop(ctx))                     # the wait is satisfied
until(lambda: ring.completed == 2, "packets 1-2")
dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=ctx, queue_id=q))
time.sleep(0.5)
dev.wait_done(ctx, dev.noop(ctx))                     # the device still answers
info = lambda: dev.call(uapi.ACCEL_CMD_MEM_INFO, uapi.accel_mem_info(ctx_id=ctx))
until(lambda: info().pending_free == 0, "the freed memory back")
print(firmware(pid), ring.read_fault(), info().context_bytes)
""")
    assert lines == ["same-firmware (0, 0, 0, 0) 0"]
    harmless(d, before, bystanders)


def test_a_ring_blocked_on_a_queue_that_is_destroyed_keeps_its_final_fence(two):
    """ring_fuzz: a WAIT_QUEUE on another queue of the context (or on an imported queue of
    device 1) for a seqno it has not reached; then that queue is destroyed. The firmware
    closed it and the blocked ring read the closed ring's fence on its next pass: the
    firmware died (ValueError). A destroyed queue's fence keeps its final value: the waiter
    stays blocked (the fence never gets there) and drains once it is destroyed itself."""
    d, bystanders = two
    before = snapshot(d)
    lines = run(d, """
pid = fw_pid()
peer = RawDev(f"{ROOT}/dev/accel/accel1")
peer_ctx = peer.ctx_create()
peer_q = peer.queue_create(peer_ctx)
dev.call(uapi.ACCEL_CMD_PEER_ENABLE, uapi.accel_peer_enable(ctx_id=ctx, peer_index=1))
imported = dev.call(uapi.ACCEL_CMD_QUEUE_IMPORT, uapi.accel_queue_import(
    ctx_id=ctx, peer_index=1, peer_queue_id=peer_q)).queue_id
target = dev.queue_create(ctx)
for waited in (target, imported):
    q = dev.queue_create(ctx)
    slot, ring = dev.rings[q]
    dev.submit(q, [wait_packet(waited, 1), NOP])
    until(lambda: ring.rptr == 1, "the wait taken")
    dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=ctx, queue_id=waited))
    time.sleep(0.3)                                   # the waiter polls the destroyed queue
    dev.wait_done(ctx, dev.noop(ctx))                 # the device still answers
    still = (ring.rptr, ring.completed)
    dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=ctx, queue_id=q))
    until(lambda: ring.completed == 2, "the destroyed waiter drained")
    print(still, ring.read_fault(), firmware(pid))
""")
    assert lines == ["(1, 0) (0, 0, 0, 0) same-firmware"] * 2
    harmless(d, before, bystanders)


def test_a_destroyed_queue_blocked_on_its_last_packet_drains(two):
    """ring_fuzz: a queue whose last packet is a WAIT_QUEUE that is never satisfied, then
    QUEUE_DESTROY. A destroyed queue's waits are released so that it drains (docs/
    submission.md), but only when packets followed the wait: one blocked on its last packet
    stayed in the firmware for good, its ring mapped (one descriptor each) and polled on
    every pass -- outside the driver's queue limits, which stop counting a destroyed
    queue. 40 of them kept 40 firmware descriptors while the process lived; now each
    drains at once and the firmware's descriptors come back while the process still runs."""
    d, bystanders = two
    before = snapshot(d)
    lines = run(d, """
pid = fw_pid()
def rings_mapped():  # the firmware's descriptors of rings (the bystanders' come and go
    # with their copies' pinned memory, so the count of every descriptor is no measure)
    found = 0
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            found += os.readlink(f"/proc/{pid}/fd/{n}").startswith("/memfd:accel-ring")
        except FileNotFoundError:
            pass
    return found
base = rings_mapped()
rings = []
for _ in range(40):
    q = dev.queue_create(ctx)
    slot, ring = dev.rings[q]
    dev.submit(q, [wait_packet(0, 1 << 63)])          # never satisfied
    until(lambda: ring.rptr == 1, "the wait taken")
    dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=ctx, queue_id=q))
    rings.append(ring)
until(lambda: all(r.completed == 1 for r in rings), "every destroyed queue drained", 10)
until(lambda: rings_mapped() <= base, "the firmware's ring descriptors back", 20)
print({r.read_fault() for r in rings}, firmware(pid))
""")
    assert lines == ["{(0, 0, 0, 0)} same-firmware"]
    harmless(d, before, bystanders)


def test_a_context_torn_down_in_the_middle_of_a_huge_launch_stops_it(two):
    """ring_fuzz (a round ending with a launch of 2**42 blocks in flight): the context's
    teardown waited for the launch to finish, which it never would -- the memory, pinned
    pages and firmware descriptors of the dead process never came back, and the launch
    held both compute engines' time for good. A launch now stops at its next slice once
    its context is torn down: it completes as cancelled, like the context's other queued
    packets (no fault record: the context is gone), and the teardown finishes."""
    d, bystanders = two
    before = snapshot(d)
    lines = run(d, """
mid, kernel = load_fill()
out = dev.mem_alloc(ctx, 4096)
args_fd = sealed_memfd("args", 4096)
args = dev.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
    ctx_id=ctx, size=4096, kind=uapi.MemKind.HOST_PINNED, fd=args_fd))
block = userq.ARG_RECORD.pack(userq.ARG_BUFFER, 9, out.va, 4096) \\
    + userq.ARG_RECORD.pack(userq.ARG_SHAPE, 1, 1024, 0) + userq.ARG_RECORD.pack(userq.ARG_SCALAR, 9, 0, 0)
os.pwrite(args_fd, block, 0)
q = dev.queue_create(ctx)
slot, ring = dev.rings[q]
def launch(grid):
    return userq.Launch(kernel, userq.pack_dims(grid), userq.pack_dims((256, 1, 1)), 0,
                        args.va, len(block)).encode()
dev.submit(q, [launch((4, 1, 1))])                  # compiles the kernel (once)
until(lambda: ring.completed == 1, "a small launch", 150)
assert ring.read_fault() == (0, 0, 0, 0), ring.read_fault()
dev.submit(q, [launch(((1 << 21) - 1, (1 << 21) - 1, 1))])
until(lambda: ring.rptr == 2, "the huge launch taken")
time.sleep(0.5)
os.close(dev.fd); dev.fd = -1                       # the context goes; the ring stays mapped
until(lambda: ring.completed == 2, "the huge launch stopped", 10)
print(ring.read_fault())
""")
    assert lines == ["(0, 0, 0, 0)"]
    harmless(d, before, bystanders)


def test_a_process_overwriting_its_rings_fence_word_cannot_pin_firmware_state(two):
    """ring_fuzz (a ring whose consumer words were scribbled, then destroyed): the firmware
    read its fence back from the ring -- the process's memory -- to decide that a destroyed
    queue had drained and that an UNMAP could complete. A fence word overwritten with 0
    after the ring completed kept the destroyed queue in the firmware for good (a
    descriptor and a poll each, outside the driver's queue limits) and every later free of
    the context's memory from coming back (MEM_INFO pending_free stuck). The firmware goes
    by the fence it wrote itself now."""
    d, bystanders = two
    before = snapshot(d)
    lines = run(d, """
pid = fw_pid()
q = dev.queue_create(ctx)
slot, ring = dev.rings[q]
ours = {int(line.split()[4]) for line in open("/proc/self/maps") if "accel-ring" in line}
def rings_held():  # this test's ring, by its inode (the bystanders' go by the same name)
    return fw_fds(pid, lambda path: os.stat(path).st_ino in ours)
buf = dev.mem_alloc(ctx, 1 << 20)
dev.submit(q, [NOP])
until(lambda: ring.completed == 1, "the packet")
ring.set(userq.RING_COMPLETED, 0)                      # the process overwrites the fence word
dev.call(uapi.ACCEL_CMD_MEM_FREE, uapi.accel_mem_free(ctx_id=ctx, handle=buf.handle))
info = lambda: dev.call(uapi.ACCEL_CMD_MEM_INFO, uapi.accel_mem_info(ctx_id=ctx))
until(lambda: info().pending_free == 0, "the freed memory back", 10)
held = rings_held()
dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=ctx, queue_id=q))
until(lambda: rings_held() == 0, "the destroyed queue gone", 10)
print(held, ring.read_fault(), firmware(pid))
""")
    assert lines == ["1 (0, 0, 0, 0) same-firmware"]
    harmless(d, before, bystanders)


def test_a_ring_created_with_its_write_pointer_behind_its_read_pointer_faults(two):
    """ring_fuzz (a ring created with consumer words already set, 1 time in ~2,000): the
    firmware starts a new ring where its read pointer says; one whose write pointer was
    already behind it went idle on the first pass, before the check that faults a write
    pointer gone back looked at it, and never completed nor faulted. It faults now
    (EINVAL, at the packet after the read pointer), without a doorbell."""
    d, bystanders = two
    before = snapshot(d)
    lines = run(d, """
fd = sealed_memfd("ring", userq.RING_FILE_SIZE)
ring = userq.RingView(fd)
ring.set(userq.RING_RPTR, 10)
ring.set(userq.RING_WPTR, 3)
dev.call(uapi.ACCEL_CMD_QUEUE_CREATE, uapi.accel_queue_create(ctx_id=ctx, ring_fd=fd))
until(lambda: ring.read_fault()[0] != 0, "the fault", 10)
dev.wait_done(ctx, dev.noop(ctx))                     # the device still answers
print(ring.read_fault(), ring.completed)
""")
    assert lines == [f"(11, {errno.EINVAL}, 0, 0) 0"]
    harmless(d, before, bystanders)


def test_an_unloaded_modules_bound_launches_keep_no_pinned_memory(two):
    """ring_fuzz (an episode that loads a module, launches from it and unloads it at once;
    test_fuzz_ring's one firmware descriptor, 24 -> 25, a ``/memfd:accel-pin``, in about
    one run of ten): a small launch that runs inline is kept bound, its buffers' views in
    its module, until a mapping of the context changes. MODULE_UNLOAD only dropped the
    module from the context, bindings and all, so a teardown that forgot every mapping
    never reached them -- and the module loader's thread still held the module it parsed
    last. The pinned mapping and its descriptor outlived the process until another module
    was loaded on the device. An unloaded module keeps nothing of the context's memory."""
    d, bystanders = two
    before = snapshot(d)
    lines = run(d, """
pid = fw_pid()
def pins():  # the firmware's descriptors of pinned memory named as this test names it
    return fw_fds(pid, lambda path: os.readlink(path).startswith("/memfd:accel-leak-pin"))
mid, kernel = load_fill()
pin_fd = sealed_memfd("leak-pin", 4096)
pin = dev.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
    ctx_id=ctx, size=4096, kind=uapi.MemKind.HOST_PINNED, fd=pin_fd))
args_fd = sealed_memfd("args", 4096)
args = dev.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
    ctx_id=ctx, size=4096, kind=uapi.MemKind.HOST_PINNED, fd=args_fd))
block = userq.ARG_RECORD.pack(userq.ARG_BUFFER, 9, pin.va, 4096) \\
    + userq.ARG_RECORD.pack(userq.ARG_SCALAR, 9, 0x3F800000, 0)
os.pwrite(args_fd, block, 0)
q = dev.queue_create(ctx)
slot, ring = dev.rings[q]
launch = userq.Launch(kernel, userq.pack_dims((4, 1, 1)), userq.pack_dims((256, 1, 1)), 0,
                      args.va, len(block)).encode()
dev.submit(q, [launch])                              # the first compiles (an engine's)
until(lambda: ring.completed == 1, "the first launch", 150)
dev.submit(q, [launch, launch])                      # inline, then inline and bound
until(lambda: ring.completed == 3, "the inline launches")
ones = memoryview(__import__("mmap").mmap(pin_fd, 4096)).cast("f")
assert ring.read_fault() == (0, 0, 0, 0) and ones[0] == ones[1023] == 1.0, ring.read_fault()
dev.call(uapi.ACCEL_CMD_MODULE_UNLOAD, uapi.accel_module_unload(ctx_id=ctx, module_id=mid))
dev.wait_done(ctx, dev.noop(ctx))                    # the unload was taken
ones.release()
held = pins()
dev.close()                                          # the context goes, its mappings too
until(lambda: pins() == 0, "the pinned mapping let go", 10)
print(held, firmware(pid))
""")
    assert lines == ["1 same-firmware"]

    harmless(d, before, bystanders)
