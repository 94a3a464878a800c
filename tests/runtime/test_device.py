"""Devices through the runtime: discovery without side effects, lazy init, the current
device, contexts, the torch-shaped surface; and identity: what each device reports,
stable across restarts, and ACCEL_VISIBLE_DEVICES."""

from __future__ import annotations

import json
import re

import pytest

IDENTITY_ATTRS = {
    "index": r"\d+",
    "name": r"Accel-Emu A1",
    "uuid": r"ACCEL-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}",
    "serial": r"\d{13}",
    "pci_bus_id": r"0000:[0-9a-f]{2}:00\.0",
    "numa_node": r"\d+",
    "package_id": r"\d+",
    "partition_id": r"\d+",
    "fabric_endpoint": r"fabric0:port\d+",
    "driver_version": r"\d+\.\d+\.\d+",
    "firmware_version": r"\d+\.\d+\.\d+",
    "isa_version": r"\d+\.\d+",
    "isa_stepping": r"A1",
    "capabilities": r"noop( \w+)+",
    "memory_total": str(256 << 20),
    "state": "operational",
}


@pytest.mark.parametrize("dev", [0, 1])
def test_every_identity_attribute(daemon, dev):
    for name, pattern in IDENTITY_ATTRS.items():
        assert re.fullmatch(pattern, daemon.attr(dev, name)), name
    assert daemon.attr(dev, "index") == str(dev)


def test_devices_are_distinct(daemon):
    for name in ("uuid", "serial", "pci_bus_id", "fabric_endpoint"):
        assert daemon.attr(0, name) != daemon.attr(1, name), name


def test_properties_match_sysfs(daemon):
    out = daemon.run_py("""
        import dataclasses, json, runtime
        print(json.dumps([dataclasses.asdict(runtime.get_device_properties(i)) for i in range(2)]))
    """)
    props = json.loads(out.stdout)
    for i, p in enumerate(props):
        assert p["index"] == i and p["physical_index"] == i
        for name in ("uuid", "serial", "pci_bus_id", "fabric_endpoint", "firmware_version",
                     "isa_version", "isa_stepping", "state", "name"):
            assert p[name] == daemon.attr(i, name), name
        assert p["total_memory"] == int(daemon.attr(i, "memory_total"))
        assert " ".join(p["capabilities"]) == daemon.attr(i, "capabilities")


def test_identity_is_stable_across_restarts(make_daemon):
    d = make_daemon(devices=2)
    before = [(d.attr(i, "uuid"), d.attr(i, "serial")) for i in range(2)]
    d.stop()
    d.devices = 3
    d.start()
    after = [(d.attr(i, "uuid"), d.attr(i, "serial")) for i in range(3)]
    assert after[:2] == before  # the same physical slots keep their identity
    assert after[2] not in before  # a new slot gets a new one


@pytest.mark.parametrize("spec, expected", [
    (None, [0, 1]),
    ("1", [1]),
    ("1,0", [1, 0]),
    ("0,7,1", [0]),  # an invalid entry hides itself and everything after it
    ("1,1", [1]),  # so does a repeat
    ("", []),
])
def test_visible_devices_by_index(daemon, spec, expected):
    env = {} if spec is None else {"ACCEL_VISIBLE_DEVICES": spec}
    out = daemon.run_py("""
        import runtime
        n = runtime.device_count()
        print(" ".join(str(runtime.get_device_properties(i).physical_index) for i in range(n)))
    """, **env)
    assert out.returncode == 0, out.stderr
    assert [int(x) for x in out.stdout.split()] == expected


def test_visible_devices_by_uuid_and_prefix(daemon):
    uuid1 = daemon.attr(1, "uuid")
    out = daemon.run_py("""
        import runtime
        print(runtime.device_count(), runtime.get_device_properties(0).uuid)
    """, ACCEL_VISIBLE_DEVICES=f"{uuid1[:14]}")
    assert out.stdout.split() == ["1", uuid1], out.stderr


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


def test_a_process_touches_only_the_devices_it_uses(daemon):
    """``set_device(1)`` in a fresh process initialised the runtime, which opened the
    primary context of the device current then -- device 0: a context there that the
    process never used, which kept device 0 from changing its partitions and from being
    held exclusively by anyone else. Initialising opens nothing now (as torch.cuda's
    ``set_device`` creates no context on device 0): the device a call is about opens its
    context when used. Device 0's contexts and processes never show this process."""
    proc = daemon.popen_py("""
        import os, numpy as np, runtime
        runtime.set_device(1)
        x = runtime.to_device(np.arange(1 << 16, dtype=np.float32))
        s = runtime.Stream()
        y = runtime.empty(x.shape, np.float32, stream=s)
        y.copy_(x, stream=s)
        wrong = np.count_nonzero(y.copy_to_host(stream=s) != np.arange(1 << 16, dtype=np.float32))
        runtime.synchronize()
        print(os.getpid(), wrong, runtime.current_device(), x.device, runtime.devices.held(),
              flush=True)
        input()
    """)

    def holders(pid: str, dev: int) -> tuple[int, int]:
        """The process's rows in the device's debugfs contexts and sysfs processes."""
        rows = daemon.debug(dev, "contexts").read_text().splitlines()[1:]
        procs = daemon.attr(dev, "processes").splitlines()[1:]
        return (sum(r.split()[1] == pid for r in rows), sum(p.split()[0] == pid for p in procs))

    try:
        line = proc.stdout.readline().split()
        seen = [holders(line[0], dev) for dev in (0, 1)] if line else None
    finally:
        _, err = proc.communicate("\n", timeout=30)
    assert proc.returncode == 0, err
    assert line[1:] == ["0", "1", "1", "[1]"], line
    assert seen == [(0, 0), (1, 1)]


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
            print("asarray:", exc)
        print(runtime.Stream.priority_range(), runtime.Stream(priority=-1).priority)
        for p in (1, -2, 0.5, True):
            try:
                runtime.Stream(priority=p); print("accepted", p)
            except runtime.InvalidValueError as exc:
                print("refused:", exc)
        try:
            runtime.compile("def k(x):\\n    import os\\n")
        except runtime.KernelCompileError as exc:
            print("compile", type(exc).__mro__, exc.lineno)
    """)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:3] == ["TypeError"] * 3, lines
    assert lines[3].startswith("asarray:") and "copy_to_host" in lines[3], lines
    assert lines[4] == "(0, -1) -1", lines
    assert all(l.startswith("refused:") and "priority_range" in l for l in lines[5:9]), lines
    assert lines[9].startswith("compile") and "InvalidValueError" in lines[9], lines
    assert lines[9].endswith(" 2") and len(lines) == 10, lines


def test_a_dropped_device_is_rebuilt_and_what_came_before_refuses_cleanly(daemon):
    """runtime.devices.drop(i) gives up the process's whole hold on a device (primary
    context, allocator, streams, modules): the next call builds a new one that works, the
    driver has released everything the old one held, and what was kept from before raises
    InvalidValueError instead of reaching the new context (a copy from an old address would
    fault the new default stream)."""
    out = daemon.run_py("""
        import gc, time, numpy as np, runtime
        from runtime import devices, discovery
        from runtime.kernel_lib import SOURCE
        def used():
            return int(discovery.read_attr("accel1", "memory_used"))
        before = used()
        old_lib = runtime.compile(SOURCE, 1)
        x = runtime.to_device(np.arange(1 << 20, dtype=np.float32), device=1)
        s = runtime.Stream(1)
        old = devices.get(1)
        devices.drop(1)
        devices.drop(1)  # nothing left to drop: a no-op
        deadline = time.monotonic() + 30  # the firmware confirms the teardown, then it is freed
        while used() != before and time.monotonic() < deadline:
            time.sleep(0.01)
        print("freed", used() - before)
        new = devices.get(1)
        print("rebuilt", new is not old, new.context.id, old.context.id)
        lib = runtime.compile(SOURCE, 1)
        y = runtime.to_device(np.zeros(256, np.float32), device=1)
        lib.fill[1, 256](y, np.float32(3), stream=runtime.current_stream(1))
        print("works", float(y.copy_to_host().sum()))
        for what, fn in [("copy", lambda: x.copy_to_host()), ("memset", lambda: x.memset(0)),
                         ("device copy", lambda: y.copy_(x)),
                         ("launch", lambda: lib.fill[1, 256](x, np.float32(1))),
                         ("old module", lambda: old_lib.fill[1, 256](y, np.float32(1))),
                         ("old stream", lambda: lib.fill[1, 256](y, np.float32(1), stream=s))]:
            try:
                fn()
                print(what, "ran")
            except runtime.InvalidValueError as exc:
                print(what, "refused:", exc)
        runtime.synchronize(1)  # nothing from before reached the new streams
        print("synchronized", float(y.copy_to_host().sum()))
        del x, s, old_lib, old; gc.collect()
        print("freed silently")
    """)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "freed 0" and lines[2] == "works 768.0", lines
    rebuilt, new_id, old_id = lines[1].split()[1:]
    assert rebuilt == "True" and new_id != old_id, lines

    gone = ("DeviceArray(shape=(1048576,), dtype=float32, device=accel:1) was allocated "
            "before accel:1 was rebuilt; its memory is gone, allocate it again")
    closed = "context on accel1 is closed"
    assert lines[3:8] == [f"copy refused: {gone}", f"memset refused: {gone}",
                          f"device copy refused: {gone}", f"launch refused: {gone}",
                          f"old module refused: {closed}"]
    assert re.fullmatch(r"old stream refused: <Stream queue \d+ on accel:1 priority 0> is closed",
                        lines[8]), lines[8]
    assert lines[9] == "synchronized 768.0"
    assert lines[10] == "freed silently"
    assert "Exception ignored" not in out.stderr, out.stderr
