"""Containment of memory: no kernel, packet or file trick reaches another tenant's memory or
takes the device down (docs/containment.md, findings 1, 2, 8 and 9).

Each test replays an attack, as another uid where the attack is a tenant's, and then
checks what every containment test checks (testkit/contained.py): the attacker got an
error of the smallest scope, a bystander tenant's data and work are intact, the daemon and
firmware are the same live processes, and nothing leaked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot
from testkit.daemon import Daemon
from testkit.tenants import OtherUser, tenant_code

RAW = "from rawdev import RawDev, errname"  # on the path of root's tests and other_user's


@dataclass
class Tenants:
    """A 2-device daemon that another uid can reach, a bystander of root's on each device,
    and the other user, who attacks."""

    d: Daemon
    bystanders: tuple[Bystander, Bystander]
    user: OtherUser

    def attack(self, code: str, *, as_root: bool = False, timeout: float = 120) -> list[str]:
        """Run ``code`` as the other user (or as root); its output lines."""
        body = tenant_code(code, imports=RAW)
        out = (self.d.run_py(body, timeout=timeout) if as_root
               else self.user.run(self.d, body, timeout=timeout))
        assert out.returncode == 0, out.stderr + out.stdout
        return out.stdout.splitlines()


@pytest.fixture
def tenants(make_daemon, other_user):
    d = make_daemon(devices=2, tenants=True)
    with Bystander(d, 0) as b0, Bystander(d, 1) as b1:
        yield Tenants(d, (b0, b1), other_user)


def test_mma_tile_origin_near_2_63_faults_and_touches_nothing(tenants):
    """Finding 1: an mma whose tile origin is near 2**63 used to pass the range check by
    wrapping around and read and write another tenant's memory. Every wrapping origin and
    size is a bounds fault now; the attacker's c is untouched; the bystanders' data too."""
    d, bystanders = tenants.d, tenants.bystanders
    before = snapshot(d)
    lines = tenants.attack("""
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
        print(np.unique(c.copy_to_host()).tolist())
    """)
    assert lines == ["EFAULT"] * 11 + ["[5.0]"]
    for b in bystanders:
        b.check()
    assert_contained(d, before)


def test_truncating_client_memory_is_refused_and_unsealed_memory_is_not_taken(tenants):
    """Finding 2: a client that truncated its own ring or pinned file killed the firmware
    (SIGBUS) for every tenant. Rings and host memory are the client's sealed memfds now:
    truncating them fails for everyone, and the driver refuses memory not sealed so (or not
    a memfd at all) before the device ever maps it."""
    d, bystanders = tenants.d, tenants.bystanders
    before = snapshot(d)
    lines = tenants.attack("""
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
        pkt = userq.Memset(ok.va, 1 << 20, 9).encode()
        seq = dev.submit(q, [pkt])
        slot, ring = dev.rings[q]
        import time
        deadline = time.monotonic() + 30
        while ring.completed < seq and time.monotonic() < deadline:
            dev.sleep_event(0.05)
        import mmap
        print(ring.completed - seq, ring.read_fault()[0], mmap.mmap(pinned, 1 << 20)[:4].hex())
        # a destroyed queue's ring: truncating it still fails, waiting on it still works
        dev.call(uapi.ACCEL_CMD_QUEUE_DESTROY, uapi.accel_queue_destroy(ctx_id=ctx, queue_id=q))
        print(errname(lambda: os.ftruncate(os.open(f"/proc/self/fd/{ring_fd}", os.O_RDWR), 0)),
              ring.completed - seq)
    """)
    assert lines[0].split() == ["EMEDIUMTYPE", "EMEDIUMTYPE", "EMEDIUMTYPE", "EINVAL",
                                "EMEDIUMTYPE", "EMEDIUMTYPE", "EMEDIUMTYPE", "EBADF", "EBADF"]
    assert lines[1].split() == ["EMEDIUMTYPE", "EMEDIUMTYPE", "EINVAL", "EMEDIUMTYPE",
                                "EMEDIUMTYPE"]
    assert lines[2] == "EINVAL"
    assert lines[3].split() == ["EPERM"] * 4
    assert lines[4] == "0 0 09090909"  # completed to seq, no fault, the memset's bytes
    assert lines[5] == "EPERM 0"

    for b in bystanders:
        b.check()
    assert_contained(d, before)


#: A tenant's process with a stream, pinned memory and data on device 0; it prints its pid
#: and its descriptors of the memory and pipes it shares with the device, then prints
#: what it reads of its data once told. It is the other user's fresh interpreter,
#: dumpable as any program its user starts is (a process that dropped root's uid would be
#: non-dumpable by itself): what keeps the same user's other process out must be the
#: runtime's doing.
VICTIM = """
s = runtime.Stream(0)
pin = runtime.pinned_empty(1 << 16, np.uint8)
pin[:] = 5
a = runtime.to_device(pin, stream=s)
s.synchronize()
fds = {}
for n in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{n}")
    except OSError:
        continue  # the listing's own descriptor
    if int(n) > 2 and target.startswith(("/memfd:accel-", "pipe:")):  # not the test's pipes
        fds[n] = target
print(json.dumps({"pid": os.getpid(), "fds": fds}), flush=True)
sys.stdin.readline()
a.copy_to_host(pin, stream=s)
s.synchronize(timeout=30)
print("read back", np.unique(pin).tolist(), flush=True)
"""

#: The other process: opens each of the victim's descriptors by path (what they all
#: answered), then its memory (Yama's ptrace_scope may refuse that to a dumpable one too).
PEEK = """
def try_open(path):
    try:
        os.close(os.open(path, os.O_RDWR))
        return "opened"
    except OSError as e:
        return errno.errorcode[e.errno]
pid, fds = int(sys.argv[1]), sys.argv[2].split(",")
print(",".join(sorted({try_open(f"/proc/{pid}/fd/{n}") for n in fds})),
      try_open(f"/proc/{pid}/mem"))
"""


def test_same_uid_process_cannot_open_rings_pinned_memory_or_pipes_by_path(tenants):
    """Finding: another process of the same uid opened a process's ring, pinned memory,
    doorbell page and pipes through /proc/PID/fd (and its memory through /proc/PID/mem),
    though the contract shares device memory only through an IPC export. The runtime makes
    its process non-dumpable before it brings the driver anything, which is the ptrace
    check those paths make: EACCES for the same uid. Root passes that check whatever the
    flag (CAP_SYS_PTRACE), and ``ACCEL_ALLOW_PTRACE=1`` keeps the process dumpable (core
    dumps, a debugger of the same user) with the old exposure."""
    d, bystanders = tenants.d, tenants.bystanders
    before = snapshot(d)
    for env, as_nobody in (({}, "EACCES EACCES"), ({"ACCEL_ALLOW_PTRACE": "1"}, "opened opened")):
        victim = tenants.user.popen(d, tenant_code(VICTIM), **env)
        try:
            shown = json.loads(victim.stdout.readline() or "null")
            assert shown is not None, victim.stderr.read()
            kinds = {t.split(" ")[0].split("[")[0] for t in shown["fds"].values()}
            assert kinds == {"/memfd:accel-ring", "/memfd:accel-doorbell-page",
                             "/memfd:accel-host_pinned", "pipe:"}, shown
            args = (str(shown["pid"]), ",".join(shown["fds"]))
            peeks = [tenants.user.run(d, tenant_code(PEEK), *args, timeout=60),
                     d.run_py("import sys; sys.argv[1:] = " + repr(list(args)) + "\n"
                              + tenant_code(PEEK), timeout=60)]
            got = [p.stdout.strip() for p in peeks]
            assert got == [as_nobody, "opened opened"], (
                env, got, [p.stderr for p in peeks])
            victim.stdin.write("\n")
            victim.stdin.flush()
            read = victim.stdout.readline().strip()
            assert read == "read back [5]", (read, victim.stderr.read())  # intact

            assert victim.wait(timeout=30) == 0
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait()
    for b in bystanders:
        b.check()
    assert_contained(d, before)
