"""Memory classes, protection, copy engines and the driver's books, on a real mount
(IPC: test_ipc.py).

Scenarios run in fresh processes (``run_py``): the runtime's state is per process, and
several tests need a process to exit or die to prove that it leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from scenario import IDLE
from testkit.contained import shm_names
from scenario import MEMORY_PRELUDE as PRELUDE
from scenario import run_json, run_scenario


def run(d, body: str, **env) -> list[str]:
    return run_scenario(d, PRELUDE, body, **env)


def test_device_local_memory_is_never_mapped_into_the_process(daemon):
    r = run_json(daemon, PRELUDE, """
        x = np.arange(1 << 18, dtype=np.float64)
        d = runtime.to_device(x)
        maps = [l.split()[5] for l in open("/proc/self/maps") if len(l.split()) > 5]
        report(accel_maps=sorted({m for m in maps if "accel" in m or "vram" in m}),
               wrong=np.count_nonzero(d.copy_to_host() != x))
    """)
    # staging is pinned, VRAM never
    assert not any("vram" in m for m in r["accel_maps"]), r
    assert any("memfd:accel-host_pinned" in m for m in r["accel_maps"]), r
    assert r["wrong"] == 0, r


def test_pinned_memory_is_the_process_own_sealed_memfd(daemon):
    """Pinned memory is a memfd of the process (no path anyone else could open), sealed so
    that nobody can shrink it under the device; the daemon creates no file for it."""
    before = shm_names()
    lines = run(daemon, """
        import errno
        p = runtime.pinned_empty(1000, np.uint8)
        line = next(l.split() for l in open("/proc/self/maps") if "accel-host_pinned" in l)
        print(line[5])
        try:  # the mapping's file, as root may reach it: still sealed
            os.truncate(f"/proc/self/map_files/{line[0]}", 0)
        except OSError as e:
            print(errno.errorcode[e.errno])
    """)
    assert lines[0].startswith("/memfd:accel-host_pinned")
    assert lines[1] == "EPERM"  # sealed: not even the owner shrinks it
    assert shm_names() == before


def test_copies_h2d_d2h_d2d_memset_ordered_on_one_stream(daemon):
    r = run_json(daemon, PRELUDE, """
        s = runtime.Stream()
        x = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
        a, b = runtime.empty(x.shape, np.uint8), runtime.empty(x.shape, np.uint8)
        pin = runtime.pinned_empty(x.shape, np.uint8); pin[:] = x
        out = runtime.pinned_empty(x.shape, np.uint8)
        # every step depends on the previous one; only stream order makes the result right
        a.copy_from_host(pin, stream=s)
        b.memset(7, stream=s)
        b.copy_(a, stream=s)
        a.memset(0, stream=s)
        b.copy_to_host(out, stream=s)
        s.synchronize()
        report(wrong=np.count_nonzero(out != x), a_nonzero=np.count_nonzero(a.copy_to_host(stream=s)))
        y = np.arange(100_001, dtype=np.float32)            # pageable: staged, any size
        report(pageable_wrong=np.count_nonzero(runtime.to_device(y).copy_to_host() != y))
    """)
    assert r == {"wrong": 0, "a_nonzero": 0, "pageable_wrong": 0}, r


def test_views_share_their_base_and_keep_it_alive(daemon):
    """``DeviceArray.view``: bytes of one allocation under another dtype, shape and offset
    (what a torch storage does for its tensors); copies and kernels see the same memory,
    a view past the end is refused, and the base is freed only after its last view."""
    r = run_json(daemon, PRELUDE, """
        import gc
        base = runtime.to_device(np.arange(16, dtype=np.float32))
        v = base.view(np.float32, (2, 3), offset=8)            # elements 2..7
        report(view=v.copy_to_host())
        v.copy_from_host(np.zeros((2, 3), np.float32))
        report(base_after=base.copy_to_host()[:9])
        refused = []
        for args in ((np.float32, 5, 48), (np.float32, 1, -4), (np.float64, 9, 0)):
            try:
                base.view(*args)
            except runtime.InvalidValueError as e:
                refused.append(str(e).split(" does not fit")[0])
        w = v.view(np.uint8, 4, offset=4)                      # a view of a view: same base
        report(refused=refused, same_base=w.base is base, offset=w.va - base.va)
        before = runtime.memory_allocated()
        del base, v; gc.collect()
        report(allocated_before=before, allocated_with_w=runtime.memory_allocated())
        del w; gc.collect()
        report(allocated_after=runtime.memory_allocated())
    """)
    assert r["view"] == [[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]], r
    assert r["base_after"] == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0], r
    assert r["refused"] == ["a view of (5,) float32 at byte 48",
                            "a view of (1,) float32 at byte -4",
                            "a view of (9,) float64 at byte 0"], r
    assert r["same_base"] is True and r["offset"] == 0xc, r
    assert r["allocated_with_w"] == r["allocated_before"], r  # w still holds it
    assert r["allocated_after"] < r["allocated_before"], r


def test_bad_copies_fail_clearly_and_change_no_byte(daemon):
    lines = run(daemon, """
        d = runtime.to_device(np.full(4096, 9, np.uint8))
        try:
            d.copy_from_host(np.zeros(4095, np.uint8))
        except runtime.InvalidValueError as e:
            print("size:", e)
        p = runtime.pinned_empty(4096, np.uint8)
        nowhere = (1 << 44) + (1 << 43)                      # no allocation of anyone's
        for packet in (pkt(userq.Op.COPY, d.va, nowhere, 16),
                       pkt(userq.Op.COPY, d.va, p.device_va + 4000, 200),   # runs past the end
                       pkt(userq.Op.MEMSET, d.va, 16, 300)):                # not a byte value
            s = runtime.Stream()
            s.submit([packet, pkt(userq.Op.MEMSET, d.va, 4096, 0)])  # cancelled after the fault
            try:
                s.synchronize()
            except runtime.DeviceFaultError as e:
                r = e.record
                print("fault:", r["errno"], r["opcode"], r["seqno"], hex(r["address"]))
            try:
                s.submit([pkt(userq.Op.NOP)])
            except runtime.AccelError as e:
                print("refused:", e.errno)
        print(hex(nowhere), hex(p.device_va + 4096))
        print(np.unique(d.copy_to_host()).tolist())
        print(runtime.current_stream().query())   # other streams are unaffected
    """)
    assert lines[0].startswith("size: copy_from_host: host array has 4095 bytes")
    nowhere, end_of_p = lines[7].split()
    assert lines[1:7] == [f"fault: EFAULT COPY 1 {nowhere}", "refused: 125",
                          f"fault: EFAULT COPY 1 {end_of_p}", "refused: 125",
                          "fault: EINVAL MEMSET 1 0x0", "refused: 125"]  # ECANCELED
    assert lines[8:] == ["[9]", "True"]


def test_capacity_per_process_limit_and_mem_get_info(make_daemon):
    d = make_daemon(extra=["--process-memory-limit", "96M"])
    lines = run(d, """
        free0, total = runtime.mem_get_info()
        a = runtime.empty(64 << 20, np.uint8)
        free1, _ = runtime.mem_get_info()
        print(total, free0 - free1, runtime.memory_allocated(), runtime.memory_reserved())
        try:
            runtime.empty(64 << 20, np.uint8)
        except runtime.OutOfMemoryError as e:
            print("limit")
        print(open(os.environ["ACCEL_EMU_ROOT"] + "/sys/class/accel/accel0/processes").read().split())
        print(os.getpid())
    """)
    total, grew, allocated, reserved = lines[0].split()
    assert total == str(256 << 20) and int(grew) >= 64 << 20, lines[0]
    assert allocated == str(64 << 20) and reserved == str(64 << 20)
    assert lines[1] == "limit"
    assert lines[2] == str(["pid", "device_bytes", lines[3], str(64 << 20)])
    d.wait_attrs(0, {"processes": "pid device_bytes", "memory_used": "0"})  # all released


#: a tenant that takes all its limit allows (16 MiB pieces), says how much, then holds it
GREEDY = PRELUDE + """
held = []
try:
    while True:
        held.append(runtime.empty(16 << 20, np.uint8))
except runtime.OutOfMemoryError:
    pass
print(sum(a.nbytes for a in held), flush=True)
sys.stdin.readline()
"""


def test_a_tenant_at_its_limit_leaves_the_others_theirs(make_daemon):
    """Two tenants under ``--process-memory-limit 96M`` on a 256 MiB device: the first
    takes all it may (and is refused the next piece), and the second still gets its whole
    96 MiB while the first holds on; what is left is the third's."""
    d = make_daemon(extra=["--process-memory-limit", "96M"])
    greedy = d.popen_py(GREEDY)
    try:
        assert greedy.stdout.readline().strip() == str(96 << 20), greedy.stderr.read()
        lines = run(d, """
            mine = [runtime.empty(16 << 20, np.uint8) for _ in range(6)]
            print(sum(a.nbytes for a in mine), runtime.mem_get_info()[0] >> 20)
        """)
        assert lines == [f"{96 << 20} 64"]  # its 96 MiB; 256 - 2 * 96 free for a third
    finally:
        greedy.stdin.close()
        greedy.wait(timeout=60)
    d.wait_attrs(0, {"processes": "pid device_bytes", "memory_used": "0"})


def test_out_of_memory_message_and_recovery(make_daemon):
    d = make_daemon()
    lines = run(d, """
        keep = [runtime.empty(60 << 20, np.uint8) for _ in range(3)]
        spare = runtime.empty(40 << 20, np.uint8); del spare          # cached, not in use
        try:
            runtime.empty(100 << 20, np.uint8)
        except runtime.OutOfMemoryError as e:
            print(e)
        st = runtime.memory_stats()
        print(st["num_alloc_retries"], st["num_ooms"])
        x = runtime.empty(60 << 20, np.uint8)     # fits once the cache was released
        print(runtime.memory_reserved() >> 20)
        del keep, x
        runtime.empty_cache()
        print(runtime.memory_reserved(), runtime.mem_get_info()[0] >> 20)
    """)
    assert lines[0].startswith("accel out of memory. Tried to allocate 100.00 MiB. Device 0 "
                               "has a total capacity of 256.00 MiB of which ")
    assert "180.00 MiB is allocated by the runtime" in lines[0]
    assert lines[1] == "1 1"
    assert lines[2] == "240"
    assert lines[3] == "0 256"


def test_caching_allocator_stream_safe_reuse(daemon):
    r = run_json(daemon, PRELUDE, """
        s1, s2 = runtime.Stream(), runtime.Stream()
        a = runtime.empty(1 << 20, np.uint8, stream=s1); va = a.va; del a
        b = runtime.empty(1 << 20, np.uint8, stream=s1)
        report(freed_va=va, s1_again_va=b.va)
        del b
        c = runtime.empty(1 << 20, np.uint8, stream=s2)
        report(s2_va=c.va)
        c.record_stream(s1)
        s1.submit([pkt(userq.Op.NOP)])
        cva = c.va; del c
        d = runtime.empty(1 << 20, np.uint8, stream=s2)
        report(recorded_va=cva, s2_again_va=d.va, s1_done=s1.query())
        report(stats=sorted(runtime.memory_stats()))
    """)
    assert r["s1_again_va"] == r["freed_va"], r  # freed block reused at once on its stream
    assert r["s2_va"] != r["freed_va"], r        # not on another stream
    # reuse waits for s1's use to complete
    assert r["s2_again_va"] != r["recorded_va"] or r["s1_done"], r
    assert {"allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
            "active_bytes.small_pool.freed", "num_alloc_retries"} <= set(r["stats"]), r


def test_managed_memory_migrates_oversubscribes_and_reports(make_daemon):
    d = make_daemon(extra=[])  # 256 MiB device
    r = run_json(d, PRELUDE, """
        n = 320 << 20                                   # more than the device holds
        m = runtime.managed_empty(n, np.uint8)
        m[:] = 3
        m[n - 1] = 4
        dev = runtime.empty(8 << 20, np.uint8)
        s = runtime.current_stream()
        for off in range(0, n, 8 << 20):                # the device touches every page
            dev.copy_from_host(m[off:off + (8 << 20)], stream=s)
        s.synchronize()
        report(last=dev.copy_to_host()[-1], first=dev.copy_to_host()[0])
        root = os.environ["ACCEL_EMU_ROOT"] + "/sys/class/accel/accel0/"
        report(**{k: int(open(root + k).read()) for k in ("managed_faults", "managed_bytes_to_device",
                  "managed_evictions", "managed_resident", "memory_total")})
        m[:1].prefetch(to_device=False)
        report(managed_bytes_to_host=int(open(root + "managed_bytes_to_host").read()))
    """, timeout=120)
    n = 320 << 20
    assert (r["last"], r["first"]) == (4, 3), r
    assert r["managed_faults"] == n // 65536 and r["managed_bytes_to_device"] == n, r
    assert r["managed_evictions"] > 0, r
    assert r["managed_resident"] <= r["memory_total"] - (8 << 20), r
    assert r["managed_bytes_to_host"] > 0, r


#: Kernels on managed memory: ``counters()`` reads the device's managed_* counters, and
#: ``delta(before, **expect)`` polls until they reach ``before`` + ``expect`` (the firmware
#: publishes them a moment after the packet completes), then prints the exact deltas.
MANAGED_KERNELS = '''
import time
ROOT = os.environ["ACCEL_EMU_ROOT"] + "/sys/class/accel/accel0/managed_"
NAMES = ("faults", "bytes_to_device", "bytes_to_host", "evictions", "resident")
def counters():
    return {k: int(open(ROOT + k).read()) for k in NAMES}
def delta(before, **expect):
    deadline = time.monotonic() + 30
    while True:
        now = counters()
        d = {k: now[k] - before[k] for k in expect}
        if d == expect or time.monotonic() > deadline:
            print(*(f"{k}={v}" for k, v in d.items()))
            return now
        time.sleep(0.01)
mod = runtime.compile("""
def pick(x, out, k):
    out[0] = x[k]

def scale(x, a):
    i = global_id(0)
    if i < x.shape[0]:
        x[i] = x[i] * a

def scale_one_block(x, a):
    for i in range(local_id(0), x.shape[0], local_size(0)):
        x[i] = x[i] * a

def oob(x, n):
    i = global_id(0)
    x[i + n] = 1.0
""")
PAGE = 65536 // 4                                # float32 elements per 64 KiB page
'''


def run_managed(d, body: str) -> list[str]:
    return run(d, MANAGED_KERNELS + textwrap.dedent(body), timeout=150)


@pytest.mark.timeout(180)
def test_kernels_on_managed_memory_migrate_the_pages_they_touch(make_daemon):
    d = make_daemon()
    lines = run_managed(d, """
        n = 64 * PAGE                               # 4 MiB: 64 pages
        x = runtime.managed_empty(n, np.float32)
        x[:] = np.arange(n) % 7
        out = runtime.empty(1, np.float32)
        c = counters()
        mod.pick[1, 1](x, out, 20 * PAGE + 3); runtime.synchronize()
        c = delta(c, faults=1, bytes_to_device=65536, resident=65536)
        print(out.copy_to_host()[0] - x[20 * PAGE + 3])
        y = runtime.managed_empty(n, np.float32)
        y[:] = 1
        for faults in (64, 0):                      # all pages once, then all resident
            mod.scale[n // 256, 256](y, 3.0); runtime.synchronize()
            c = delta(c, faults=faults, bytes_to_device=faults * 65536)
        print(np.unique(y).tolist())                # the kernels' writes, read on the host
        small = runtime.managed_empty(4 * PAGE, np.float32)  # 4 pages: inline once compiled
        small[:] = 5
        for page, faults in ((0, 1), (2, 1), (2, 0)):
            mod.pick[1, 1](small, out, page * PAGE); runtime.synchronize()
            c = delta(c, faults=faults)
        print(out.copy_to_host()[0], c["evictions"], c["bytes_to_host"])
    """)
    assert lines == ["faults=1 bytes_to_device=65536 resident=65536", "0.0",
                     "faults=64 bytes_to_device=4194304", "faults=0 bytes_to_device=0", "[9.0]",
                     "faults=1", "faults=1", "faults=0", "5.0 0 0"]


@pytest.mark.timeout(180)
def test_kernel_on_oversubscribed_managed_memory_evicts_and_is_correct(make_daemon):
    d = make_daemon(extra=["--memory", "16M"])       # 256 pages of device memory
    lines = run_managed(d, """
        n = 384 * PAGE                              # 24 MiB of managed memory
        x = runtime.managed_empty(n, np.float32)
        x[:] = 1
        c = counters()
        # one block (never cut, so its pages migrate in order after it): the first 256
        # pages fill the device, the last 128 evict the least recently used
        mod.scale_one_block[1, 256](x, 3.0); runtime.synchronize()
        c = delta(c, faults=384, evictions=128, bytes_to_host=128 * 65536, resident=16 << 20)
        print(np.unique(x).tolist())
        mod.scale_one_block[1, 256](x, 2.0); runtime.synchronize()  # LRU: every page again
        c = delta(c, faults=384, evictions=384, resident=0)
        print(np.unique(x).tolist())
    """)
    assert lines == ["faults=384 evictions=128 bytes_to_host=8388608 resident=16777216", "[3.0]",
                     "faults=384 evictions=384 resident=0", "[6.0]"]


@pytest.mark.timeout(180)
def test_bounds_fault_on_managed_memory_has_the_same_record(make_daemon):
    d = make_daemon()
    lines = run_managed(d, """
        dev = runtime.to_device(np.zeros(64, np.float32))
        man = runtime.managed_empty(64, np.float32)
        records = []
        for x, va, faults in ((dev, dev.va, 0), (man, man.device_va, 1)):
            s = runtime.Stream()
            c = counters()
            mod.oob[1, 64](x, 10, stream=s)       # threads 0-53 write page 0, 54 misses
            try:
                s.synchronize()
            except runtime.KernelFaultError as e:
                r = e.record
                records.append((r["kernel"], r["errno"], r["address"] - va))
            c = delta(c, faults=faults)
        print(*records)
    """)
    assert lines == ["faults=0", "faults=1", "('oob', 'EFAULT', 256) ('oob', 'EFAULT', 256)"]


@pytest.mark.timeout(180)
def test_process_killed_mid_kernel_on_managed_memory_leaves_nothing_resident(make_daemon):
    d = make_daemon()
    code = PRELUDE + MANAGED_KERNELS + """
slow = runtime.compile('''
def slow(x, n):
    i = global_id(0)
    for k in range(n):
        x[i] = x[i] + 1.0
''').slow
x = runtime.managed_empty(64 * PAGE, np.float32)
slow[1, 1](x, 1); runtime.synchronize()                # compiled, page 0 resident
slow[64 * PAGE // 256, 256](x, 4_000_000)               # blocks of ~1 s on both engines
print("running", flush=True)
time.sleep(60)
"""
    proc = d.popen_py(code)
    try:
        assert proc.stdout.readline().strip() == "running"
        time.sleep(0.5)  # inside the first blocks: their pages are marked, not yet migrated
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # the context's teardown waits for the running blocks, whose pages then migrate, and
    # drops them with the mapping
    d.wait_attrs(0, {**IDLE, "managed_resident": "0"}, timeout=60)


def test_peer_access_needs_enabling(daemon):
    r = run_json(daemon, PRELUDE, """
        x = np.arange(4096, dtype=np.uint8)
        a = runtime.to_device(x, device=0)
        b = runtime.empty(4096, np.uint8, device=1)
        s1 = runtime.Stream(1)
        b.copy_(a, stream=s1)
        try:
            s1.synchronize()
        except runtime.DeviceFaultError as e:
            report(before=e.record["errno"])
        runtime.enable_peer_access(0, device=1)
        s1 = runtime.Stream(1)
        s1.wait_stream(runtime.current_stream(0))
        b.copy_(a, stream=s1); s1.synchronize()
        report(wrong=np.count_nonzero(b.copy_to_host() != x))
        late = runtime.to_device(x[::-1].copy(), device=0)     # allocated after enabling
        s1.wait_stream(runtime.current_stream(0))   # its upload is on device 0's stream
        b.copy_(late, stream=s1); s1.synchronize()
        report(late_wrong=np.count_nonzero(b.copy_to_host() != x[::-1]))
    """)
    assert r == {"before": "EFAULT", "wrong": 0, "late_wrong": 0}, r



def test_process_killed_mid_copy_leaves_no_memory(daemon):
    daemon.wait_attrs(0, IDLE)  # earlier tests' processes are gone; their teardown too
    code = PRELUDE + """
a = runtime.empty(64 << 20, np.uint8)
b = runtime.empty(64 << 20, np.uint8)
p = runtime.pinned_empty(64 << 20, np.uint8)
s = runtime.Stream()
for _ in range(50):
    b.copy_(a, stream=s); a.copy_from_host(p, stream=s)
print("copying", flush=True)
import time; time.sleep(60)
"""
    proc = daemon.popen_py(code)
    try:
        assert proc.stdout.readline().strip() == "copying"
        assert int(daemon.attr(0, "memory_used")) >= 128 << 20
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    daemon.wait_attrs(0, {**IDLE, "pinned_bytes": "0", "host_allocations": "0"}, timeout=30)


def test_daemon_creates_no_shared_files(make_daemon):
    """Everything shared with a process is the process's own memfd or pipe: the driver
    puts nothing in /dev/shm (where another process of the user could open it by name)."""
    before = shm_names()
    d = make_daemon()
    out = d.run_py(PRELUDE + """
s = runtime.Stream(); p = runtime.pinned_empty(1 << 20, np.uint8); m = runtime.managed_empty(4096)
a = runtime.to_device(np.ones(1000, np.float32)); s.synchronize()
print(sorted(n for n in os.listdir("/dev/shm") if not n.startswith("sem.mp-")))
""")
    assert out.returncode == 0, out.stderr
    assert set(eval(out.stdout)) == before


def test_mem_get_info_sysfs_and_smi_agree_per_process(daemon):
    daemon.wait_attrs(0, IDLE)
    code = PRELUDE + """
a = runtime.empty(48 << 20, np.uint8)
b = runtime.empty(3 << 20, np.uint8, device=0)
free, total = runtime.mem_get_info()
print(free, total, runtime.memory_reserved(), os.getpid(), flush=True)
sys.stdin.readline()
"""
    proc = daemon.popen_py(code)
    try:
        free, total, reserved, pid = map(int, proc.stdout.readline().split())
        used = int(daemon.attr(0, "memory_used"))
        assert free == total - used == int(daemon.attr(0, "memory_free"))
        # device bytes held = the caching allocator's segments (pinned staging is host memory)
        assert daemon.attr(0, "processes").splitlines()[1:] == [f"{pid} {reserved}"]
        assert used == reserved
        smi = subprocess.run([sys.executable, "-m", "tools.accel_smi", "--query-device=memory.used",
                              "--format=csv,noheader,nounits", "-i", "0"], env=daemon.env(),
                             capture_output=True, text=True)
        assert smi.stdout.strip() == str(used >> 20)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    daemon.wait_attrs(0, IDLE)
