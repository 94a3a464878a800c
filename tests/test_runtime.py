"""The runtime surface: discovery without side effects, lazy init, devices, contexts, fences."""

from __future__ import annotations

import json


def counters(d, dev: int = 0) -> tuple[str, str, str]:
    return d.attr(dev, "open_files"), d.attr(dev, "contexts"), d.attr(dev, "clients")


def test_import_is_light_and_discovery_opens_no_device(daemon):
    out = daemon.run_py("""
        import json, os, sys, time
        import runtime
        heavy = [m for m in ("numba", "firmware", "pyfuse3", "trio", "kmod_emul.drv") if m in sys.modules]
        n, avail = runtime.device_count(), runtime.is_available()
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{fd}"))
            except FileNotFoundError:
                pass  # the descriptor listdir itself used
        files = open(os.path.join(os.environ["ACCEL_EMU_ROOT"], "sys/class/accel/accel0/open_files")).read()
        print(json.dumps({"heavy": heavy, "n": n, "avail": avail, "init": runtime.is_initialized(),
                          "dev_fds": [f for f in fds if "/dev/accel/" in f], "open_files": files.strip()}))
    """)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"heavy": [], "n": 2, "avail": True, "init": False, "dev_fds": [],
                   "open_files": got["open_files"]}
    assert got["open_files"] == daemon.attr(0, "open_files")  # discovery opened nothing


def test_lazy_init_and_current_device_per_thread(daemon):
    out = daemon.run_py("""
        import threading, runtime
        assert not runtime.is_initialized()
        assert runtime.get_device_properties(1).index == 1  # first device call initialises
        assert runtime.is_initialized()
        seen = {}
        def worker(i):
            runtime.set_device(i)
            runtime.synchronize()
            seen[i] = (runtime.current_device(), runtime.get_device_properties().physical_index)
        ts = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
        [t.start() for t in ts]; [t.join() for t in ts]
        assert runtime.current_device() == 0  # other threads' choices do not leak here
        with runtime.device(1):
            assert runtime.current_device() == 1
            with runtime.device(0):
                assert runtime.current_device() == 0
            assert runtime.current_device() == 1
        assert runtime.current_device() == 0
        print(sorted(seen.items()))
    """)
    assert out.stdout.strip() == "[(0, (0, 0)), (1, (1, 1))]", out.stderr


def test_invalid_device_index(daemon):
    out = daemon.run_py("""
        import runtime
        for bad in (2, -1):
            try:
                runtime.set_device(bad)
            except runtime.InvalidValueError as exc:
                print(exc)
    """)
    assert out.stdout.splitlines() == [
        "invalid device index 2: 2 device(s) visible",
        "invalid device index -1: 2 device(s) visible",
    ]


def test_contexts_are_independent(daemon):
    out = daemon.run_py("""
        import runtime
        a, b = runtime.new_context(0), runtime.new_context(0)
        fa = [a.submit_noop() for _ in range(5)]
        fb = b.submit_noop()
        assert [f.seqno for f in fa] == [1, 2, 3, 4, 5] and fb.seqno == 1
        ts = fa[-1].wait(timeout=5)
        assert ts > 0 and all(f.query() for f in fa)
        a.close()
        fb.wait(timeout=5)                    # closing one context leaves the other working
        b.synchronize(timeout=5)
        try:
            a.submit_noop()
        except runtime.InvalidValueError as exc:
            print(exc)
    """)
    assert out.stdout.strip() == "context on accel0 is closed", out.stderr


def test_fence_timeout_on_hung_device(make_daemon):
    d = make_daemon(extra=["--heartbeat-timeout", "60"])
    out = d.run_py(f"""
        import time, runtime
        ctx = runtime.new_context(0)
        open("{d.debug(0, 'fw_hang')}", "w").write("1")
        f = ctx.submit_noop()
        assert not f.query()
        t = time.monotonic()
        try:
            f.wait(timeout=0.35)
        except runtime.AccelTimeoutError as exc:
            print(type(exc).__mro__[1].__name__, isinstance(exc, TimeoutError), exc.errno,
                  round(time.monotonic() - t, 1) >= 0.3)
    """)
    assert out.stdout.split() == ["AccelError", "True", "62", "True"], out.stderr


def test_synchronize_waits_for_every_stream_and_raises_the_first_fault(daemon):
    """Like torch.cuda.synchronize: every stream of the process on the device has finished
    what was queued before the call, and a pending fault is raised with its record."""
    out = daemon.run_py("""
        import numpy as np, runtime
        from abi import userq
        streams = [runtime.Stream(0) for _ in range(2)]
        bufs = [runtime.empty(96 << 20, np.uint8) for _ in streams]
        for s, b in zip(streams, bufs):
            for _ in range(4):
                b.memset(7, stream=s)
        runtime.synchronize(0)
        print(all(s.query() for s in streams), int(bufs[1].copy_to_host()[-1]))
        streams[1].submit([userq.accel_packet(opcode=userq.Op.MEMSET, a=(0x10, 64, 0, 0, 0, 0, 0))])
        for _ in range(2):  # sticky, as CUDA's: the stream keeps its fault
            try:
                runtime.synchronize(0)
                print("no fault")
            except runtime.DeviceFaultError as exc:
                print(exc.record["errno"], exc.record["queue"] == streams[1].queue_id)
        try:
            runtime.synchronize(1, timeout=10)  # the other device has nothing of it
            print("device 1 clean")
        except runtime.AccelError as exc:
            print(repr(exc))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == ["True 7", "EFAULT True", "EFAULT True",
                                            "device 1 clean"]


def test_torch_habits_are_refused_loudly(daemon):
    """Positional device/stream, np.asarray of device memory, out-of-range priorities and
    the kernel compiler's error class behave as a torch user expects, or say why not."""
    out = daemon.run_py("""
        import numpy as np, runtime
        x = np.arange(8, dtype=np.float32)
        for call in (lambda: runtime.to_device(x, 1), lambda: runtime.empty(8, np.float32, 0),
                     lambda: runtime.pinned_empty(8, np.float32, 0)):
            try:
                call(); print("accepted")
            except TypeError:
                print("TypeError")
        d = runtime.to_device(x, device=1)
        try:
            np.asarray(d)
        except TypeError as exc:
            print("asarray", "copy_to_host" in str(exc))
        print(runtime.Stream.priority_range(), runtime.Stream(priority=-1).priority)
        for p in (1, -2, 0.5, True):
            try:
                runtime.Stream(priority=p); print("accepted", p)
            except runtime.InvalidValueError as exc:
                print("refused", "priority_range" in str(exc))
        try:
            runtime.compile("def k(x):\\n    import os\\n")
        except runtime.KernelCompileError as exc:
            print("compile", isinstance(exc, runtime.InvalidValueError), exc.lineno)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["TypeError"] * 3 + [
        "asarray True", "(0, -1) -1"] + ["refused True"] * 4 + ["compile True 2"]


def test_synchronize_honours_its_timeout(daemon):
    out = daemon.run_py("""
        import os, time, numpy as np, runtime
        hold = os.environ["ACCEL_EMU_ROOT"] + "/sys/kernel/debug/accel/accel0/sched_hold"
        s = runtime.Stream(0)
        open(hold, "w").write("1")
        try:
            s.submit_nop()
            t0 = time.monotonic()
            try:
                runtime.synchronize(0, timeout=0.3)
                print("returned")
            except runtime.AccelTimeoutError as exc:
                print("timeout", round(time.monotonic() - t0, 1) >= 0.3, exc.errno == 62)
        finally:
            open(hold, "w").write("0")
        runtime.synchronize(0, timeout=10)
        print(s.query())
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["timeout True True", "True"]
