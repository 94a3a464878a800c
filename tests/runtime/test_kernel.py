"""Kernels end to end: compile, load, launch, results against numpy, launch checks, faults,
the watchdog, preemption between blocks, and the persistent JIT cache across processes.

Numba compiles take seconds on this machine, so the scenarios share one daemon (and its
JIT cache) per module and run several kernels per process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from firmware import image
from scenario import REPORT, reports

# Scenario bodies are dedented and appended to this; they must not start inside ``stat``.
PRELUDE = """
import os, sys, time, numpy as np, runtime
from runtime import kernel_lib
ROOT = os.environ["ACCEL_EMU_ROOT"]
def stat(name, dev=0, at_least=0):
    deadline = time.monotonic() + 30
    while True:
        v = int(open(f"{ROOT}/sys/class/accel/accel{dev}/{name}").read())
        if v >= at_least or time.monotonic() > deadline:
            return v
        time.sleep(0.02)
""" + REPORT + "\n"


@pytest.fixture(scope="module")
def kdaemon(tmp_path_factory):
    """A daemon whose firmware has a short watchdog (the image's payload sets it)."""
    from testkit.daemon import Daemon

    base = tmp_path_factory.mktemp("kernels")
    fw_dir = image.build_into(base / "firmware", watchdog_ms=1500)
    d = Daemon(base / "root", base / "state", fw_dir, 1)
    d.start()
    try:
        yield d
    finally:
        d.stop()


def run(d, body: str, timeout: float = 240, tmp_path=None) -> list[str]:
    """Run a scenario in a fresh process (from a file when given ``tmp_path``: the
    decorator reads its function's source, which ``python -c`` does not keep)."""
    code = PRELUDE + textwrap.dedent(body)
    if tmp_path is None:
        out = d.run_py(code, timeout=timeout)
    else:
        script = tmp_path / "scenario.py"
        script.write_text(code)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             env=d.env(), timeout=timeout)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout.split("\n")[:-1]


def test_library_kernels_match_numpy(kdaemon):
    r = reports(run(kdaemon, """
        lib = runtime.compile(kernel_lib.SOURCE)
        rng = np.random.default_rng(0)
        n = 10_000
        x, y = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
        dx, dy, out = runtime.to_device(x), runtime.to_device(y), runtime.empty(n, np.float32)
        grid = (n + 255) // 256
        lib.saxpy[grid, 256](np.float32(2.5), dx, dy, out)
        report(saxpy=misses(out.copy_to_host(), 2.5 * x + y))
        lib.fill[grid, 256](out, np.float32(7))
        report(fill=np.unique(out.copy_to_host()))
        lib.copy[grid, 256](out, dx)
        report(copy_wrong=np.count_nonzero(out.copy_to_host() != x))
        xd = runtime.to_device(rng.random(100_000))
        total = runtime.to_device(np.zeros(1))
        lib.reduce_sum[32, 256](xd, total)
        report(reduce=misses(total.copy_to_host()[0], xd.copy_to_host().sum()))
        m = 64
        a, b = rng.random((m, m), dtype=np.float32), rng.random((m, m), dtype=np.float32)
        c = runtime.empty((m, m), np.float32)
        lib.gemm[(m // 16, m // 16), (16, 16)](runtime.to_device(a), runtime.to_device(b), c, m)
        report(gemm=misses(c.copy_to_host(), a @ b, rtol=1e-4))
        s = rng.random((50, 30))
        so = runtime.empty(s.shape, np.float64)
        lib.softmax_rows[1, 64](runtime.to_device(s), so, 50, 30)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        report(softmax=misses(so.copy_to_host(), e / e.sum(axis=1, keepdims=True)))
    """))
    assert r["fill"] == [7] and r["copy_wrong"] == 0, r
    assert all(r[k]["apart"] == 0 for k in ("saxpy", "reduce", "gemm", "softmax")), r


def test_decorator_and_launch_checks(kdaemon, tmp_path):
    lines = run(kdaemon, tmp_path=tmp_path, body="""
        @runtime.kernel
        def scale(x: "float32", k):
            i = global_id(0)
            if i < x.size:
                x[i] = x[i] * k
        d = runtime.to_device(np.ones(100, np.float32))
        scale[1, 128](d, 3.0)
        print(d.copy_to_host()[:2])
        checks = [
            ("arity", lambda: scale[1, 128](d)),
            ("host array", lambda: scale[1, 128](np.ones(4, np.float32), 1.0)),
            ("dtype", lambda: scale[1, 128](runtime.empty(4, np.float64), 1.0)),
            ("block", lambda: scale[1, 2048](d, 1.0)),
            ("grid", lambda: scale[0, 32](d, 1.0)),
            ("dims", lambda: scale[(1, 1, 1, 1), 32](d, 1.0)),
            ("shared", lambda: scale[1, 32](d, 1.0, shared_mem=48 * 1024 + 1)),
            ("negative shared", lambda: scale[1, 32](d, 1.0, shared_mem=-1)),
        ]
        for name, bad in checks:
            try:
                bad()
                print(name, "allowed")
            except runtime.InvalidValueError as e:
                print(name, "refused")
        try:
            runtime.compile("def bad(x):\\n    import os\\n")
        except runtime.InvalidValueError as e:
            print("compile refused, line", e.lineno)
        from abi import uapi
        mod = runtime.compile(kernel_lib.SOURCE)
        other = runtime.new_context(0)                 # handles belong to their context
        try:
            other.channel.call(uapi.ACCEL_CMD_KERNEL_GET, uapi.accel_kernel_get(
                ctx_id=other.id, module_id=mod.id, name=b"saxpy"))
        except runtime.InvalidValueError as e:
            print("foreign module", e.errno)
    """)
    assert lines[0] == "[3. 3.]"
    assert lines[1:9] == [f"{n} refused" for n in ("arity", "host array", "dtype", "block",
                                                     "grid", "dims", "shared",
                                                     "negative shared")]
    assert lines[9] == "compile refused, line 2"
    assert lines[10] == "foreign module 1"  # EPERM: another context's handle



def test_each_launch_reads_its_own_argument_block_past_the_queues_depth(kdaemon):
    """A stream keeps its launches' argument blocks in slots of its own, one per seqno
    modulo the queue's depth + 1, reused without a completion check (runtime/stream.py
    ``ArgArena``): 3,000 launches with distinct arguments, queued while the firmware holds
    still, each write their own value. A block longer than a short slot (12 buffers) takes
    its seqno's long slot, which its packet names. ``module.name`` stays the same kernel from launch to launch, and
    a kernel named like a module attribute does not hide that attribute."""
    r = reports(run(kdaemon, """
        src = (
            "def put(x, i, v):\\n"
            "    if global_id(0) == 0:\\n"
            "        x[i] = v\\n"
            "def wide(" + ", ".join(f"a{k}" for k in range(11)) + ", out):\\n"
            "    if global_id(0) == 0:\\n"
            "        out[0] = " + " + ".join(f"a{k}[0]" for k in range(11)) + "\\n"
            "def kernels(x):\\n"
            "    x[0] = 1.0\\n")
        mod = runtime.compile(src)
        n = 3000
        x = runtime.empty(n, np.float32)
        s = runtime.Stream()
        mod.put[1, 32](x, 0, np.float32(-1.0), stream=s)
        s.synchronize()  # compiled: the rest is queued faster than it runs
        hold = f"{ROOT}/sys/kernel/debug/accel/accel0/sched_hold"
        open(hold, "w").write("1")
        try:
            for i in range(n - 1, -1, -1):
                if i == n - 1000:
                    open(hold, "w").write("0")  # the rest wait for room as the ring drains
                mod.put[1, 32](x, i, np.float32(i * 0.5), stream=s)
        finally:
            open(hold, "w").write("0")
        s.synchronize()
        report(own_blocks_wrong=np.count_nonzero(x.copy_to_host() != np.arange(n, dtype=np.float32) * 0.5))
        parts = [runtime.to_device(np.full(1, k, np.float32)) for k in range(11)]
        out = runtime.empty(1, np.float32)
        mod.wide[1, 32](*parts, out, stream=s)
        s.synchronize()
        report(long_block=out.copy_to_host()[0],
               same_kernel=mod.put is mod.put is mod.get_kernel("put"))
        k = mod.get_kernel("kernels")
        report(attribute=mod.kernels, kernel_name=k.name)
    """))
    assert r == {"own_blocks_wrong": 0, "long_block": 55.0, "same_kernel": True,
                 "attribute": ["put", "wide", "kernels"], "kernel_name": "kernels"}, r

def test_every_kind_of_launch_names_its_streams_arena(kdaemon):
    """Launches of every kind on one stream, read back from its ring: each LAUNCH names
    address 0 (its short slot, which the ring names: the arena's) or its long slot in the
    same arena, and computed what it should have. (tests/unit/test_launch_path.py checks
    by the source that no other path exists.)"""
    lines = run(kdaemon, """
        from abi import userq
        from runtime.stream import LONG_ARGS
        src = ("def wide(" + ", ".join(f"a{k}" for k in range(11)) + ", out):\\n"
               "    if global_id(0) == 0:\\n"
               "        out[0] = " + " + ".join(f"a{k}[0]" for k in range(11)) + "\\n")
        lib, wide = runtime.compile(kernel_lib.SOURCE), runtime.compile(src).wide
        s = runtime.Stream()
        x = runtime.empty(256, np.float32)
        lib.fill[1, 256](x, np.float32(1), stream=s)              # the generated launcher
        lib.fill.launch([1], [256], (x, np.float32(2)), s)       # the checked path
        parts = [runtime.to_device(np.full(1, k, np.float32)) for k in range(11)]
        total = runtime.empty(1, np.float32)
        wide[1, 32](*parts, total, stream=s)                      # a long block
        g = runtime.Graph()
        with runtime.graph(g, s):
            lib.fill[1, 256](x, np.float32(3), stream=s)
            wide[1, 32](*parts, total, stream=s)
        g.replay(); g.replay()
        s.synchronize()
        a = s.arena()
        print("ring names the arena", s._ring.get(userq.RING_ARGS_VA) == a.va,
              s._ring.get(userq.RING_ARGS_SLOTS) == a.slots)
        for seqno in range(1, s.last_seqno + 1):
            p = userq.decode(s._ring.read_packet(seqno))
            if isinstance(p, userq.Launch):
                long_slot = a.long_va + seqno % a.slots * LONG_ARGS
                print(seqno, "short" if p.args_va == 0
                      else "long" if p.args_va == long_slot else hex(p.args_va))
        print("values", float(x.copy_to_host()[0]), float(total.copy_to_host()[0]))
    """)
    assert lines == ["ring names the arena True True", "1 short", "2 short", "3 long",
                     "4 short", "5 long", "6 short", "7 long", "values 3.0 55.0"]


@pytest.mark.timeout(240)
def test_a_launch_on_another_devices_stream_is_refused_and_queues_nothing(daemon):
    """The kernel is loaded on accel:0 and the stream is on accel:1: InvalidValueError
    naming the stream's device, nothing queued there, and the kernel still runs on its
    own device."""
    r = reports(run(daemon, """
        lib = runtime.compile(kernel_lib.SOURCE, 0)
        x = runtime.empty(256, np.float32, device=0)
        s1 = runtime.Stream(1)
        try:
            lib.fill[1, 256](x, np.float32(1), stream=s1)
        except runtime.InvalidValueError as e:
            report(refused=str(e))
        report(queued_on_1=s1.last_seqno)
        s0 = runtime.Stream(0)
        lib.fill[1, 256](x, np.float32(2), stream=s0)
        s0.synchronize()
        report(ran_on_0=np.unique(x.copy_to_host()))
    """))
    assert r == {"refused": "fill: stream is on accel:1", "queued_on_1": 0,
                 "ran_on_0": [2]}, r


def test_out_of_bounds_is_a_device_fault_with_a_record(kdaemon):
    """An out-of-bounds store faults its launch with a record and leaves other streams
    working. The record names the kernel from its packet's handle however the launch was
    queued: through ``kernel[grid, block]``, replayed from a graph, or written by hand as a
    LAUNCH packet through ``Stream.submit`` (which no launcher saw); a packet that is no
    launch names none."""
    r = reports(run(kdaemon, """
        from abi import userq
        mod = runtime.compile('''
            def oob(x, n):
                i = global_id(0)
                x[i + n] = 1.0
        ''')
        x = runtime.to_device(np.zeros(64, np.float32))
        s = runtime.Stream()
        mod.oob[1, 64](x, 10, stream=s)
        try:
            s.synchronize()
        except runtime.KernelFaultError as e:
            r = e.record
            report(kernel=r["kernel"], errno=r["errno"], offset=r["address"] - x.va,
                   queue=r["queue"], stream_queue=s.queue_id)
        report(written=np.count_nonzero(x.copy_to_host()))   # nothing past the buffer
        other = runtime.Stream()
        mod.oob[1, 8](x, 0, stream=other); other.synchronize()    # other streams still work
        report(alive_written=np.count_nonzero(x.copy_to_host(stream=other)))
        def fault(s):
            try:
                s.synchronize()
            except runtime.KernelFaultError as e:
                return e.record["kernel"], e.record["seqno"]
        s, g = runtime.Stream(), runtime.Graph()
        with runtime.graph(g, s):
            mod.oob[1, 64](x, 10, stream=s)
        s.submit_nop()
        g.replay()
        report(graph=fault(s), nop_kernel=s.kernel_name(1))
        s = runtime.Stream()
        mod.oob[1, 64](x, 0, stream=s)  # in bounds: the stream's arena slot 2 is next
        s.synchronize()
        s.arena().mem[2 * 256 : 2 * 256 + 72] = s.arena().mem[256 : 256 + 72]
        s.submit([userq.Launch(mod.oob.handle, userq.pack_dims((2, 1, 1)),
                               userq.pack_dims((64, 1, 1)), 0, 0, 72)])  # x[64:128], past it
        report(by_hand=fault(s))
    """))
    assert (r["kernel"], r["errno"]) == ("oob", "EFAULT"), r
    assert r["offset"] >= 64 * 4 and r["queue"] == r["stream_queue"], r
    assert r["written"] <= 64 and r["alive_written"] >= 8, r  # nothing past the buffer
    assert r["graph"] == ["oob", 2] and r["nop_kernel"] is None and r["by_hand"] == ["oob", 2], r


def test_watchdog_stops_a_runaway_kernel(kdaemon):
    r = reports(run(kdaemon, """
        mod = runtime.compile('''
            def spin(x):
                i = 0
                while i >= 0:
                    i = i + 1
                    x[0] = i
        ''')
        x = runtime.empty(1, np.int64)
        warm = runtime.to_device(np.ones(256, np.float32))  # saxpy compiled before the spin
        runtime.compile(kernel_lib.SOURCE).saxpy[1, 256](np.float32(1), warm, warm, warm)
        runtime.current_stream().synchronize()
        s = runtime.Stream()
        t = time.monotonic()
        mod.spin[1, 1](x, stream=s)
        # another process (another context) computes on the other engine meanwhile
        import subprocess
        other = subprocess.run([sys.executable, "-c", '''if True:
            import numpy as np, runtime
            from runtime import kernel_lib
            lib = runtime.compile(kernel_lib.SOURCE)
            x = np.arange(4096, dtype=np.float32)
            out = runtime.empty(4096, np.float32)
            lib.saxpy[16, 256](np.float32(2), runtime.to_device(x), runtime.to_device(x), out)
            print(np.count_nonzero(out.copy_to_host() != 3 * x))
        '''], capture_output=True, text=True, timeout=120)
        report(other_context_wrong=other.stdout.strip(), other_stderr=other.stderr[-500:],
               spin_completed=s.completed, spin_last=s.last_seqno)

        try:
            s.synchronize(timeout=60)
        except runtime.KernelFaultError as e:
            report(fault=[e.record["errno"], e.record["code"], e.record["name"], e.record["scope"]],
                   message=str(e), fault_after_s=time.monotonic() - t)
        ok = runtime.Stream()
        ok.submit_nop(); ok.synchronize(timeout=10)
        report(state=open(f"{ROOT}/sys/class/accel/accel0/state").read().strip())
    """))
    # another context computed while the kernel spun
    assert r["other_context_wrong"] == "0" and r["spin_completed"] < r["spin_last"], r
    assert r["fault"] == ["ETIMEDOUT", 43, "KERNEL_TIMEOUT", "queue"], r
    assert "watchdog" in r["message"] and r["fault_after_s"] < 30, r
    assert r["state"] == "operational", r


def test_high_priority_kernel_preempts_a_long_one_between_blocks(kdaemon):
    r = reports(run(kdaemon, """
        lib = runtime.compile(kernel_lib.SOURCE)
        n = 1 << 22
        x = runtime.to_device(np.ones(n, np.float32))
        low, high = runtime.Stream(priority=0), runtime.Stream(priority=-1)
        small = runtime.empty(256, np.float32)
        lib.fill[1, 256](small, np.float32(0)); runtime.current_stream().synchronize()
        for _ in range(300):      # 65536 blocks each: ~0.5 s of low-priority work, so a
                                  # client descheduled for tens of ms (a loaded CI) still
                                  # submits its high-priority launch while it runs
            lib.saxpy[n // 64, 64](np.float32(1.0), x, x, x, stream=low)
        while low.completed < 1:  # it is running (shared-memory fence: no delay)
            pass
        lib.fill[1, 256](small, np.float32(5), stream=high)
        hi = high.record_event(); lo = low.record_event()
        high.synchronize(); low.synchronize()
        # the high-priority launch ran before the low stream's queued launches finished:
        # it took an engine at the next block-slice boundary (or between two launches)
        report(high_ns=high.timestamp(hi.seqno), low_ns=low.timestamp(lo.seqno))
    """))
    assert r["high_ns"] < r["low_ns"], r


def test_jit_cache_is_persistent_across_firmware_restarts(kdaemon):
    body = """
        mod = runtime.compile(kernel_lib.SOURCE)
        x = runtime.to_device(np.arange(1000, dtype=np.float32))
        out = runtime.empty(1000, np.float32)
        mod.saxpy[4, 256](np.float32(3), x, x, out)
        report(saxpy=misses(out.copy_to_host(), 4 * np.arange(1000)),
               jit_compiles=stat("jit_compiles"), jit_hits=stat("jit_hits", at_least=1))
    """
    first = reports(run(kdaemon, body))
    kdaemon.stop()
    kdaemon.start()  # a fresh firmware: only the on-disk cache remembers
    # kernels ran here before: the firmware warms its JIT at boot, before any launch
    kdaemon.wait_attrs(0, {"jit_ready": "1", "launches": "0"}, timeout=60)
    second = reports(run(kdaemon, body))
    assert first["saxpy"]["apart"] == second["saxpy"]["apart"] == 0, (first, second)
    assert second["jit_compiles"] == 0, second  # nothing compiled: loaded from the cache
    assert second["jit_hits"] >= 1, second
    assert any((kdaemon.state_dir / "jit-cache").rglob("manifest.json"))


def test_graph_captures_kernel_launches(kdaemon):
    r = reports(run(kdaemon, """
        lib = runtime.compile(kernel_lib.SOURCE)
        n = 4096
        x = runtime.to_device(np.arange(n, dtype=np.float32))
        acc = runtime.to_device(np.zeros(n, np.float32))
        s = runtime.Stream()
        scratch = runtime.empty(n, np.float32)  # a launch before: s has its argument arena,
        lib.saxpy[n // 256, 256](np.float32(0), x, x, scratch, stream=s)  # so the capture
        s.synchronize()  # below is what keeps the launchers from writing to its ring
        g = runtime.Graph()
        with runtime.graph(g, s):
            lib.saxpy[n // 256, 256](np.float32(2), x, acc, acc, stream=s)   # acc += 2x
            lib.saxpy[n // 256, 256](np.float32(1), x, acc, acc, stream=s)   # acc += x
        # captured, nothing ran yet
        report(launches=len(g), written_at_capture=np.count_nonzero(acc.copy_to_host()))
        runtime.current_stream().synchronize()
        for _ in range(5):
            g.replay()
        s.synchronize()
        report(replayed=misses(acc.copy_to_host(stream=s), 15 * np.arange(n)))
        del x
        try:
            g.replay()
            report(replay_after_free="allowed")
        except runtime.InvalidValueError:
            report(replay_after_free="refused")
    """))
    assert r["launches"] == 2 and r["written_at_capture"] == 0, r
    assert r["replayed"]["apart"] == 0 and r["replay_after_free"] == "refused", r


def test_matrix_unit_matmul_matches_numpy_and_faults_with_a_record(kdaemon):
    r = reports(run(kdaemon, """
        lib = runtime.compile(kernel_lib.SOURCE)
        rng = np.random.default_rng(5)
        for dt in (np.float32, np.float64):
            a, b = rng.random((300, 200)).astype(dt), rng.random((200, 170)).astype(dt)
            c = runtime.to_device(np.full((300, 170), np.nan, dt))
            lib.matmul[(2, 3), 32](runtime.to_device(a), runtime.to_device(b), c)
            report(**{dt.__name__: misses(c.copy_to_host(), a @ b, rtol=1e-5)})
        a = runtime.to_device(np.ones((64, 32), np.float32))
        short = runtime.to_device(np.ones((16, 64), np.float32))  # a needs 32 rows of b
        c = runtime.to_device(np.full((64, 64), -1, np.float32))
        s = runtime.Stream()
        lib.matmul[(1, 1), 32](a, short, c, stream=s)
        try:
            s.synchronize()
        except runtime.KernelFaultError as e:
            r = e.record
            report(fault=[r["kernel"], r["errno"]],
                   past_b_by=r["address"] - (short.va + 16 * 64 * 4))
        report(c_after=np.unique(c.copy_to_host(stream=runtime.Stream())))
    """))
    assert r["float32"]["apart"] == 0 and r["float64"]["apart"] == 0, r
    assert r["fault"] == ["matmul", "EFAULT"] and r["past_b_by"] >= 0, r
    assert r["c_after"] == [-1], r  # c untouched


def _maps_mkl(d) -> bool:
    """Whether the device's firmware process has torch's library (MKL) mapped."""
    fw_pid = int(d.debug(0, "fw_pid").read_text())
    with open(f"/proc/{fw_pid}/maps") as f:
        return any(line.rstrip().endswith("/libtorch_cpu.so") for line in f)


#: One mma over the whole of c: a product of m x m x k is one BLAS call up to the chunks.
WHOLE = '''
def whole(a, b, c):
    mma(c, a, b, 0, 0, 0, c.shape[0], c.shape[1], a.shape[1], 0.0)
'''


def test_matrix_unit_loads_mkl_only_after_a_big_product(kdaemon):
    """Small products leave the firmware on OpenBLAS (MKL's library is not even loaded);
    a BLAS call of ``ASK_MKL_MACS`` multiply-adds makes it load MKL (when torch is
    installed) after the launch; products stay right on either BLAS. That product (512 x
    40 @ 40 x 512) runs inline on the control loop (launches.INLINE_WORK), so the module
    loader, not an engine, serves its request."""
    from firmware import matrix
    from testkit.waiting import wait_until

    def product(m: int, k: int) -> str:  # c = a @ b, [m, k] @ [k, m]
        return f"""
            lib = runtime.compile({WHOLE!r})
            rng = np.random.default_rng(9)
            a = rng.random(({m}, {k})).astype(np.float32)
            b = rng.random(({k}, {m})).astype(np.float32)
            c = runtime.to_device(np.full(({m}, {m}), np.nan, np.float32))
            lib.whole[1, 1](runtime.to_device(a), runtime.to_device(b), c)
            report(apart=misses(c.copy_to_host(), a @ b, rtol=1e-4)["apart"])
        """

    assert reports(run(kdaemon, product(128, 512))) == {"apart": 0}
    assert not _maps_mkl(kdaemon)
    big = product(512, matrix.ASK_MKL_MACS // (512 * 512))
    assert reports(run(kdaemon, big)) == {"apart": 0}
    if matrix.mkl_library() is None:  # no torch: OpenBLAS stays
        assert not _maps_mkl(kdaemon)
    else:
        wait_until(lambda: _maps_mkl(kdaemon), 30, "the firmware to load MKL")
    assert reports(run(kdaemon, big)) == {"apart": 0}  # on MKL now (when there is one)


def test_a_device_without_a_matrix_unit_refuses_mma_modules(tmp_path):
    from testkit.daemon import Daemon

    caps = [c for c in image.DEFAULT_PAYLOAD["capabilities"] if c != "matrix"]
    fw_dir = image.build_into(tmp_path / "firmware", capabilities=caps)
    d = Daemon(tmp_path / "root", tmp_path / "state", fw_dir, 1)
    d.start()
    try:
        assert "matrix" not in d.attr(0, "capabilities").split()
        r = reports(run(d, """
            try:
                runtime.compile(kernel_lib.SOURCE)
            except runtime.AccelError as e:
                report(refused=[type(e).__name__, e.errno], message=str(e))
            mod = runtime.compile(kernel_lib.SOURCE.split("def matmul")[0])  # the rest loads
            x = runtime.to_device(np.ones(256, np.float32))
            mod.fill[1, 256](x, np.float32(2))
            report(total=x.copy_to_host().sum())
        """))
    finally:
        d.stop()
    assert r["refused"] == ["InvalidValueError", 95] and "matmul needs matrix" in r["message"], r
    assert r["total"] == 512.0, r


def test_dynamic_shared_memory_sized_per_launch(kdaemon):
    r = reports(run(kdaemon, """
        mod = runtime.compile('''
            def rev(x):
                t = dynamic_shared("float32")
                i = local_id(0)
                base = group_id(0) * local_size(0)
                t[i] = x[base + i]
                barrier()
                x[base + i] = t[local_size(0) - 1 - i]
        ''')
        x = runtime.to_device(np.arange(256, dtype=np.float32))
        mod.rev[2, 128](x, shared_mem=128 * 4)
        want = np.concatenate([np.arange(127, -1, -1), np.arange(255, 127, -1)])
        report(reversed_wrong=np.count_nonzero(x.copy_to_host() != want))
        s = runtime.Stream()
        mod.rev[2, 128](x, shared_mem=64 * 4, stream=s)     # too small for the block
        try:
            s.synchronize()
        except runtime.KernelFaultError as e:
            report(short=[e.record["errno"], e.record["kernel"]])
        # the firmware checks the shared bytes itself: a raw packet over the limit faults EINVAL
        from runtime.memory import pinned_empty
        k = mod.rev
        buf = pinned_empty(4096, np.uint8)
        block = k._record_args([x])
        buf[:len(block)] = np.frombuffer(block, np.uint8)
        length = len(block)
        raw = runtime.Stream()
        from abi import userq
        one = userq.pack_dims((1, 1, 1))
        raw.submit([userq.Launch(k.handle, one, one, 48 * 1024 + 4, buf.device_va, length)])
        try:
            raw.synchronize()
        except runtime.DeviceFaultError as e:
            report(raw=e.record["errno"])
        ok = runtime.Stream()
        mod.rev[2, 128](x, shared_mem=128 * 4, stream=ok); ok.synchronize()
        report(again_wrong=np.count_nonzero(x.copy_to_host(stream=ok) != np.arange(256)))
    """))
    assert r == {"reversed_wrong": 0, "short": ["EFAULT", "rev"], "raw": "EINVAL",
                 "again_wrong": 0}, r



def test_threads_launching_first_on_one_stream_all_run(kdaemon):
    """A stream's argument arena is made on its first launch and named in its ring: threads
    that launch first on one stream at once must end with one arena, the one the ring
    names, so that every launch reads its own block (two once made a launch read a slot
    of the arena the ring no longer named: EINVAL)."""
    lines = run(kdaemon, """
        import threading
        lib = runtime.compile(kernel_lib.SOURCE)
        outs = [runtime.empty(256, np.float32) for _ in range(6)]
        failed, wrong = [], 0
        for trial in range(15):
            s, barrier = runtime.Stream(), threading.Barrier(len(outs))
            def work(i):
                barrier.wait()
                try:
                    lib.fill[1, 256](outs[i], np.float32(trial * 10 + i), stream=s)
                except runtime.AccelError as e:
                    failed.append(repr(e))
            threads = [threading.Thread(target=work, args=(i,)) for i in range(len(outs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            try:
                s.synchronize()
            except runtime.AccelError as e:
                failed.append(repr(e))
                continue
            wrong += sum(not (o.copy_to_host() == trial * 10 + i).all() for i, o in enumerate(outs))
        print(failed[:1], wrong)
    """)
    assert lines == ["[] 0"]
