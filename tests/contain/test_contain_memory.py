"""Containment of memory: no kernel, packet or file trick reaches another tenant's memory or
takes the device down (docs/containment.md, findings 1, 2, 8 and 9).

Each test replays an attack, as another uid where the attack is a tenant's, and then
checks what every containment test checks (stress/harness.py): the attacker got an
error of the smallest scope, a bystander tenant's data and work are intact, the daemon and
firmware are the same live processes, and nothing leaked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stress.harness import Bystander, as_user, assert_contained, snapshot

TESTS = Path(__file__).resolve().parent.parent  # tests/, where rawdev.py lives
RAW = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from rawdev import RawDev, errname"


@pytest.fixture
def tenants(make_daemon):
    """A 2-device daemon that another uid can reach, and a bystander on each device."""
    d = make_daemon(devices=2, tenants=True)
    with Bystander(d, 0) as b0, Bystander(d, 1) as b1:
        yield d, (b0, b1)


def attack(d, code: str, *, uid_root: bool = False, timeout: float = 120) -> list[str]:
    """Run ``code`` as the other tenant (or as root); its output lines."""
    body = code if uid_root else as_user(code, imports=RAW)
    if uid_root:
        body = "import os, sys, errno, json, numpy as np, runtime\nfrom abi import kernel_lang, uapi, userq\n" \
               + RAW + "\n" + body
    out = d.run_py(body, timeout=timeout)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout.splitlines()


def test_mma_tile_origin_near_2_63_faults_and_touches_nothing(tenants):
    """Finding 1: an mma whose tile origin is near 2**63 used to pass the range check by
    wrapping around and read and write another tenant's memory. Every wrapping origin and
    size is a bounds fault now; the attacker's c is untouched; the bystanders' data too."""
    d, bystanders = tenants
    before = snapshot(d)
    lines = attack(d, """
        src = "\\n".join(["def steal(c, a, b, row, col, k0, tm, tn, tk):",
                           "    mma(c, a, b, row, col, k0, tm, tn, tk, 0.0)", ""])
        mod = runtime.compile(src)
        c = runtime.to_device(np.full((64, 64), 5, np.float32))
        a = runtime.to_device(np.ones((64, 64), np.float32))
        b = runtime.to_device(np.ones((64, 64), np.float32))
        big = (1 << 63) - 1
        cases = [(big, 0, 0, 64, 64, 64), (big - 63, 0, 0, 64, 64, 64), (0, big, 0, 8, 8, 8),
                 (0, 0, big - 7, 8, 8, 8), (1 << 62, 1 << 62, 0, 64, 64, 64),
                 (0, 0, 0, big, 1, 1), (0, 0, 0, 1, big, 1), (0, 0, 0, 1, 1, big),
                 (-64, 0, 0, 64, 64, 64), (0, 0, 0, -1, 64, 64),
                 (np.uint64((1 << 64) - 64), 0, 0, 64, 64, 64)]
        for case in cases:
            s = runtime.Stream()
            mod.steal[1, 32](c, a, b, *case, stream=s)
            try:
                s.synchronize(timeout=60)
                print("no fault", case)
            except runtime.KernelFaultError as exc:
                print(exc.record["errno"])
        print(bool(np.all(c.copy_to_host() == 5)))
    """)
    assert lines == ["EFAULT"] * 11 + ["True"]
    for b in bystanders:
        b.check()
    assert_contained(d, before)


def test_truncating_client_memory_is_refused_and_unsealed_memory_is_not_taken(tenants):
    """Finding 2: a client that truncated its own ring or pinned file killed the firmware
    (SIGBUS) for every tenant. Rings and host memory are the client's sealed memfds now:
    truncating them fails for everyone, and the driver refuses memory not sealed so (or not
    a memfd at all) before the device ever maps it."""
    d, bystanders = tenants
    before = snapshot(d)
    lines = attack(d, """
        import fcntl
        from runtime._shm import sealed_memfd
        dev = RawDev(os.path.join(os.environ["ACCEL_EMU_ROOT"], "dev/accel/accel0"))
        ctx = dev.ctx_create()
        def alloc(fd, size=4096, kind=uapi.MemKind.HOST_PINNED):
            return errname(lambda: dev.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
                ctx_id=ctx, size=size, kind=kind, fd=fd)))
        def queue(fd):
            return errname(lambda: dev.call(uapi.ACCEL_CMD_QUEUE_CREATE,
                                            uapi.accel_queue_create(ctx_id=ctx, ring_fd=fd)))
        unsealed = os.memfd_create("x", os.MFD_ALLOW_SEALING); os.ftruncate(unsealed, 1 << 20)
        no_grow = os.memfd_create("x", os.MFD_ALLOW_SEALING); os.ftruncate(no_grow, 1 << 20)
        fcntl.fcntl(no_grow, uapi.F_ADD_SEALS, uapi.F_SEAL_SHRINK | uapi.F_SEAL_SEAL)
        ro = sealed_memfd("ro", 1 << 20, bytes(1 << 20))     # sealed against writing too
        small = sealed_memfd("small", 100)
        tmpfile = os.open("/tmp", os.O_TMPFILE | os.O_RDWR)
        r, w = os.pipe()
        node = os.open(os.path.join(os.environ["ACCEL_EMU_ROOT"], "dev/accel/accel1"), os.O_RDWR)
        print(alloc(unsealed), alloc(no_grow), alloc(ro), alloc(small), alloc(tmpfile),
              alloc(r), alloc(node), alloc(9999), alloc(-1))
        print(queue(unsealed), queue(ro), queue(small), queue(r), queue(node))
        print(alloc(unsealed, kind=uapi.MemKind.DEVICE))       # device memory takes no fd
        # a properly sealed ring and buffer: nobody can shrink or grow them
        q = dev.queue_create(ctx)
        ring_fd = sealed_memfd("ring", userq.RING_FILE_SIZE)
        pinned = sealed_memfd("pin", 1 << 20)
        ok = dev.call(uapi.ACCEL_CMD_MEM_ALLOC, uapi.accel_mem_alloc(
            ctx_id=ctx, size=1 << 20, kind=uapi.MemKind.HOST_PINNED, fd=pinned))
        out = []
        for fd in (ring_fd, pinned):
            for size in (0, 1 << 30):
                try:
                    os.ftruncate(fd, size)
                    out.append("truncated")
                except OSError as e:
                    out.append(errno.errorcode[e.errno])
        print(*out)
        # the device keeps using the pinned buffer and the ring: a memset of all of it
        pkt = bytes(userq.accel_packet(opcode=userq.Op.MEMSET, a=(ok.va, 1 << 20, 9, 0, 0, 0, 0)))
        seq = dev.submit(q, [pkt])
        slot, ring = dev.rings[q]
        import time
        deadline = time.monotonic() + 30
        while ring.completed < seq and time.monotonic() < deadline:
            dev.sleep_event(0.05)
        import mmap
        print(ring.completed == seq, ring.read_fault()[0], mmap.mmap(pinned, 1 << 20)[:4] == b"\\t" * 4)
        # a destroyed queue's ring: truncating it still fails, waiting on it still works
        dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=ctx, queue_id=q))
        print(errname(lambda: os.ftruncate(os.open(f"/proc/self/fd/{ring_fd}", os.O_RDWR), 0)),
              ring.completed == seq)
    """)
    assert lines[0].split() == ["EMEDIUMTYPE", "EMEDIUMTYPE", "EMEDIUMTYPE", "EINVAL",
                                "EMEDIUMTYPE", "EMEDIUMTYPE", "EMEDIUMTYPE", "EBADF", "EBADF"]
    assert lines[1].split() == ["EMEDIUMTYPE", "EMEDIUMTYPE", "EINVAL", "EMEDIUMTYPE",
                                "EMEDIUMTYPE"]
    assert lines[2] == "EINVAL"
    assert lines[3].split() == ["EPERM"] * 4
    assert lines[4] == "True 0 True"
    assert lines[5] == "EPERM True"
    for b in bystanders:
        b.check()
    assert_contained(d, before)
