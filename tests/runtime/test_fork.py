"""Fork, spawn and crash: the first rules.

* After init, every device call of a forked child raises UseAfterForkError naming the
  pre-fork initialisation and recommending spawn or forkserver; discovery still works and
  the parent carries on. Before init, the child may initialise.
* Spawn and forkserver children of an initialised parent use the device, many in turn too;
  children killed with SIGKILL mid-copy, mid-kernel, holding queues or an export the
  parent imported, or exiting cleanly, leave the parent's data and work intact and the
  books as they were (docs/driver.md, "The fork rule", has the matrix).
* A process killed with SIGKILL while holding contexts leaves nothing behind in the driver.
* A firmware that crashes or stops heart-beating marks its device failed and its contexts
  are told; a reset brings it back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import scale
from rawdev import RawDev, errname
from scenario import REPORT, reports


def counters(d, dev: int) -> dict[str, str]:
    return {k: d.attr(dev, k) for k in ("open_files", "contexts", "clients", "exclusive_owner")}


#: Every device call a child forked after init might make, by name: each must raise
#: UseAfterForkError. What they use (``s``, ``ev``, ``idle_ev``, ``a``, ``host``, ``pin``,
#: ``lib``, ``ctx``, ``h``) was made by the parent before the fork; ``idle``/``idle_ev``
#: had nothing queued, so a check that lived only on the wait path would miss them.
CHILD_CALLS = """
calls = {
    "init": runtime.init,
    "new_context": lambda: runtime.new_context(0),
    "set_device": lambda: runtime.set_device(1),
    "properties": lambda: runtime.get_device_properties(0),
    "empty": lambda: runtime.empty(16, np.float32),
    "to_device": lambda: runtime.to_device(host),
    "pinned_empty": lambda: runtime.pinned_empty(16, np.uint8),
    "managed_empty": lambda: runtime.managed_empty(16, np.uint8),
    "copy_to_host": lambda: a.copy_to_host(),
    "copy_from_host": lambda: a.copy_from_host(host, stream=s),
    "copy_": lambda: a.copy_(a, stream=s),
    "memset": lambda: a.memset(0, stream=s),
    "launch": lambda: lib.fill[1, 16](a, 1.0, stream=s),
    "compile": lambda: runtime.compile(kernel_lib.SOURCE),
    "synchronize": runtime.synchronize,
    "stream_synchronize": s.synchronize,
    "stream_query": s.query,
    "idle_stream_synchronize": idle.synchronize,
    "idle_stream_query": idle.query,
    "Stream": lambda: runtime.Stream(0),
    "current_stream": runtime.current_stream,
    "Event": runtime.Event,
    "event_record": lambda: ev.record(s),
    "event_synchronize": ev.synchronize,
    "event_query": ev.query,
    "idle_event_synchronize": idle_ev.synchronize,
    "idle_event_query": idle_ev.query,
    "context_synchronize": lambda: ctx.synchronize(timeout=5),
    "context_noop": ctx.submit_noop,
    "ipc_handle": a.ipc_handle,
    "open_ipc_handle": lambda: runtime.open_ipc_handle(h),
    "memory_allocated": runtime.memory_allocated,
    "mem_get_info": runtime.mem_get_info,
}
"""


def test_fork_after_init_every_device_call_raises_use_after_fork(daemon):
    """After init, a forked child shares the parent's device files, which the driver cannot
    tell apart: every device call raises UseAfterForkError naming the parent's pid and
    spawn/forkserver, discovery still answers, and the parent's data and work are intact."""
    out = daemon.run_py(REPORT + textwrap.dedent("""
        import os, numpy as np, runtime
        from runtime import kernel_lib
        host = np.arange(16, dtype=np.float32)
        s, idle = runtime.Stream(0), runtime.Stream(0)
        a = runtime.to_device(host, stream=s)
        pin = runtime.pinned_empty(16, np.float32)
        lib = runtime.compile(kernel_lib.SOURCE)
        ctx = runtime.new_context(1)
        ev, idle_ev = s.record_event(), idle.record_event()
        h = runtime.to_device(host).ipc_handle()
        runtime.synchronize()
        parent = os.getpid()
        """) + CHILD_CALLS + textwrap.dedent("""
        pid = os.fork()
        if pid == 0:
            report(count=runtime.device_count(), available=runtime.is_available())
            said = {}
            for name, call in calls.items():
                try:
                    call()
                    said[name] = "returned"
                except runtime.UseAfterForkError as exc:
                    said[name] = str(exc)
                except Exception as exc:
                    said[name] = repr(exc)
            report(said=said)
            os._exit(0)
        os.waitpid(pid, 0)
        lib.fill[1, 16](a, 7.0, stream=s)   # the parent carries on, on the same objects
        a.copy_to_host(pin, stream=s)
        s.synchronize()
        ctx.synchronize(timeout=5)
        report(parent=parent, parent_read=np.unique(pin), parent_init=runtime.is_initialized())
    """))
    r = reports(out.stdout.splitlines())
    assert r.get("count") == 2 and r.get("available") is True, (r, out.stderr)
    calls = sum(line.startswith('    "') for line in CHILD_CALLS.splitlines())
    said = r["said"]
    refused = {name: msg for name, msg in said.items()
               if all(w in msg for w in (str(r["parent"]), "initialised", "spawn", "forkserver"))}
    assert len(said) == calls and refused == said, ({n: said[n] for n in said.keys() - refused}, r)
    assert r["parent_read"] == [7] and r["parent_init"] is True, r


def test_fork_before_init_child_may_initialise(daemon):
    out = daemon.run_py("""
        import os, runtime
        assert runtime.device_count() == 2   # discovery does not poison a later fork
        pid = os.fork()
        if pid == 0:
            runtime.synchronize(1)
            os._exit(0 if runtime.is_initialized() else 1)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status), "parent init", runtime.is_initialized())
    """)
    assert out.stdout.strip() == "child 0 parent init False", out.stderr


def test_spawn_and_forkserver_children_work_repeatedly(daemon, tmp_path):
    script = tmp_path / "workers.py"  # spawn re-imports __main__, so it must be a file
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp, runtime

        def work(i):
            runtime.synchronize(i % 2)
            return runtime.get_device_properties(i % 2).physical_index

        if __name__ == "__main__":
            runtime.init()                  # the parent is initialised: spawn must still work
            for method in ("spawn", "forkserver"):
                with mp.get_context(method).Pool(2) as pool:
                    print(method, pool.map(work, range(4)))
            runtime.synchronize()
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=daemon.env(), timeout=120)
    assert out.stdout.splitlines() == ["spawn [0, 1, 0, 1]", "forkserver [0, 1, 0, 1]"], out.stderr


#: A parent that is initialised and holds data on both devices starts children through a
#: forkserver (each a fork of a fresh interpreter: never initialised) that hold something
#: on device 1 -- copies or a kernel in flight, queues, an IPC export the parent imported,
#: or nothing at a clean exit -- and kills them with SIGKILL (or lets one exit). After
#: each it checks its own data and work, and waits for the driver's books to be back to
#: what they were before the child; ``many:N`` runs N short-lived children, two at a time.
#: One line per case: what the child reported, its exit code, the bytes the parent found
#: wrong, the books.
MATRIX = '''
import multiprocessing as mp, os, signal, sys, time, numpy as np, runtime
from runtime import kernel_lib

ROOT = os.environ["ACCEL_EMU_ROOT"]
BOOKS = ("contexts", "memory_used", "queues", "pinned_bytes")
DATA = np.arange(1 << 16, dtype=np.int32)
#: the longest a child may take to answer before it counts as hung (s)
CHILD_S = 60


def books():
    return [{k: open(f"{ROOT}/sys/class/accel/accel{d}/{k}").read().strip() for k in BOOKS}
            for d in (0, 1)]


def child(case, conn):
    s = runtime.Stream(1)
    if case == "copy":
        a = runtime.empty(16 << 20, np.uint8, device=1, stream=s)
        b = runtime.empty(16 << 20, np.uint8, device=1, stream=s)
        for _ in range(32):
            b.copy_(a, stream=s)
        conn.send(f"in-flight {not s.query()}")
    elif case == "kernel":
        m = runtime.compile(kernel_lib.SOURCE, device=1)
        x = runtime.empty(4096 * 64, np.float64, device=1, stream=s)
        m.spin[1, 1](x, 1, stream=s)
        s.synchronize()  # compiled on the device: the next launch runs at once
        m.spin[4096, 64](x, 20000, stream=s)
        conn.send(f"in-flight {not s.query()}")
    elif case == "queues":
        streams = [runtime.Stream(1) for _ in range(8)]
        conn.send(f"queues {len(streams) + 1}")
    elif case == "ipc":
        x = runtime.to_device(DATA, device=1, stream=s)
        s.synchronize()
        conn.send(x.ipc_handle())
    else:  # "exit", "many": work, then a clean exit that gives nothing back by hand
        x = runtime.to_device(DATA, device=1, stream=s)
        conn.send(f"{case} wrong {int((x.copy_to_host() != DATA).sum())}")
        return
    conn.recv()  # holds on until killed


def wait_books(base):
    deadline = time.monotonic() + 20
    while books() != base:
        if time.monotonic() > deadline:
            return f"books {books()} != {base}"
        time.sleep(0.02)
    return "idle"


def start(fs, case):
    parent_end, child_end = fs.Pipe()
    proc = fs.Process(target=child, args=(case, child_end))
    proc.start()
    return proc, parent_end


def answer(conn):
    """A child's answer; a child that gives none within CHILD_S is a hang, whatever the
    machine's load (the run as a whole has no bound of its own but pytest's)."""
    if not conn.poll(CHILD_S):
        raise SystemExit(f"a child gave no answer within {CHILD_S} s")
    return conn.recv()


if __name__ == "__main__":
    fs = mp.get_context("forkserver")
    pattern = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
    streams = [runtime.Stream(d) for d in (0, 1)]
    keep = [runtime.to_device(pattern, device=d, stream=st) for d, st in enumerate(streams)]
    lib = runtime.compile(kernel_lib.SOURCE, device=1)
    out = runtime.empty(1 << 16, np.float32, device=1, stream=streams[1])
    pins = [runtime.pinned_empty(pattern.shape, np.uint8, device=d) for d in (0, 1)]

    def check():
        out.memset(0, stream=streams[1])
        lib.fill[256, 256](out, 3.0, stream=streams[1])
        for k, pin, st in zip(keep, pins, streams):
            k.copy_to_host(pin, stream=st)
            st.synchronize(timeout=60)
        return (sum(int((p != pattern).sum()) for p in pins)
                + int((out.copy_to_host() != 3).sum()))

    check()
    base = books()
    for case in sys.argv[1].split(","):
        case, _, n = case.partition(":")
        if case == "many":  # two at a time, each a process of its own
            said, codes = [], []
            for _ in range(int(n) // 2):
                pair = [start(fs, case) for _ in range(2)]
                said += [answer(conn) for _, conn in pair]
                for proc, _ in pair:
                    proc.join(30)
                    codes.append(proc.exitcode)
            print(case, said.count("many wrong 0"), codes.count(0), f"wrong {check()}",
                  wait_books(base), flush=True)
            continue
        proc, conn = start(fs, case)
        got = answer(conn)
        if case == "ipc":
            imported = runtime.open_ipc_handle(got)
            got = f"imported wrong {int((imported.copy_to_host() != DATA).sum())}"
        if case != "exit":
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        if case == "ipc":  # the exporter is gone: the import still maps the memory
            got += f" after-kill wrong {int((imported.copy_to_host() != DATA).sum())}"
            del imported
        print(case, got, proc.exitcode, f"wrong {check()}", wait_books(base), flush=True)
    runtime.synchronize()
'''


def run_matrix(daemon, tmp_path, cases: str, timeout: float) -> list[str]:
    """Run MATRIX (a file: forkserver children import __main__) for ``cases``; its lines.
    Every process is gone afterwards, so the shared daemon must be idle again."""
    script = tmp_path / "matrix.py"
    script.write_text(MATRIX)
    out = subprocess.run([sys.executable, str(script), cases], capture_output=True, text=True,
                         check=False, env=daemon.env(), timeout=timeout)
    assert out.returncode == 0, out.stderr + out.stdout
    for dev in (0, 1):
        daemon.wait_attrs(dev, {"contexts": "0", "memory_used": "0", "queues": "0",
                                "pinned_bytes": "0"})
    return out.stdout.splitlines()


def test_children_killed_mid_work_or_holding_leave_the_parent_and_the_books_intact(
        daemon, tmp_path):
    """SIGKILL mid-copy, mid-kernel, holding queues, and holding an IPC export the parent
    imported (an import outlives its exporter: the parent still reads the data after the
    kill, and the memory goes once the import does), and a clean exit: the driver reaps
    each child, the parent's data and work are intact, and the books are the parent's."""
    lines = run_matrix(daemon, tmp_path, "copy,kernel,queues,ipc,exit", timeout=120)
    assert lines == ["copy in-flight True -9 wrong 0 idle",
                     "kernel in-flight True -9 wrong 0 idle",
                     "queues queues 9 -9 wrong 0 idle",
                     "ipc imported wrong 0 after-kill wrong 0 -9 wrong 0 idle",
                     "exit exit wrong 0 0 wrong 0 idle"], lines


@pytest.mark.long_form
def test_children_in_turn_leave_nothing_behind(daemon, tmp_path):
    """Forkserver children of an initialised parent, two at a time, each initialising,
    using the device and exiting: every one works and exits 0, and nothing piles up.

    CI runs 20 (the parent's data, kernels and books are checked once the last has gone:
    a leak of one context or page per child is 20 of them); the long form
    (``ACCEL_TESTS_LONG=1``, tests/scale.py) runs 100. A hang is each child's bound
    (``answer``, ``join``), not the run's: the 100 took 20 s at load 4 and over 90 s in a
    suite run at load 11, which is no defect of the driver."""
    n = scale.count(20, 100)
    assert run_matrix(daemon, tmp_path, f"many:{n}", timeout=280) == [f"many {n} {n} wrong 0 idle"]



def test_sigkill_while_holding_contexts_leaves_nothing(daemon):
    baseline = {dev: counters(daemon, dev) for dev in (0, 1)}
    code = """
        import sys, runtime
        from abi import uapi
        ctxs = [runtime.new_context(0) for _ in range(3)] + [runtime.new_context(1, exclusive=True)]
        for c in ctxs:
            for _ in range(50):
                c.submit_noop()
        import os
        # and a reply left unread in the driver
        os.pwrite(ctxs[0].channel.fd, uapi.CMD_HDR.pack(uapi.ACCEL_CMD_GET_VERSION.code, 0, 4242)
                  + bytes(uapi.accel_version()), 0)
        print("holding", flush=True)
        sys.stdin.readline()
    """
    proc = daemon.popen_py(code)
    try:
        assert proc.stdout.readline().strip() == "holding"
        # the three it made (the runtime opens no primary context it was not asked for)
        assert int(daemon.attr(0, "contexts")) == int(baseline[0]["contexts"]) + 3
        assert daemon.attr(1, "exclusive_owner") == str(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while {dev: counters(daemon, dev) for dev in (0, 1)} != baseline:
        assert time.monotonic() < deadline, {dev: counters(daemon, dev) for dev in (0, 1)}
        time.sleep(0.02)
    assert daemon.attr(1, "state") == "operational"


def test_firmware_crash_marks_failed_and_tells_contexts(make_daemon):
    d = make_daemon(devices=2, extra=["--recovery", "manual"])  # auto: tests/runtime/test_recover.py
    with RawDev(d.node(0)) as dev, RawDev(d.node(1)) as other:
        ctx, other_ctx = dev.ctx_create(), other.ctx_create()
        os.kill(int(d.debug(0, "fw_pid").read_text()), signal.SIGKILL)
        d.wait_state(0, "failed")
        assert d.attr(0, "failure_code") == "ENODEV"
        assert "firmware process exited unexpectedly" in d.attr(0, "failure")
        assert errname(lambda: dev.noop(ctx)) == "ENODEV"
        assert dev.query().state == 4  # queries still answer, and say FAILED
        assert other.wait_done(other_ctx, other.noop(other_ctx)).completed == 1  # accel1 unharmed
    out = d.run_py("""
        import runtime
        try:
            runtime.init()
        except runtime.DeviceLostError as exc:
            print("lost:", exc)
    """)
    assert "lost:" in out.stdout and "exited unexpectedly" in out.stdout, out.stderr
    (d.root / "sys/class/accel/accel0/reset").write_text("1")
    d.wait_state(0, "operational")
    assert d.attr(0, "failure") == ""


def test_heartbeat_loss_marks_failed(make_daemon):
    d = make_daemon(extra=["--heartbeat-timeout", "0.5", "--recovery", "manual"])
    out = d.run_py(f"""
        import runtime
        ctx = runtime.new_context(0)
        ctx.synchronize(timeout=5)
        open("{d.debug(0, 'fw_hang')}", "w").write("1")
        fence = ctx.submit_noop()
        try:
            fence.wait(timeout=30)
        except runtime.DeviceLostError as exc:
            print("lost:", exc)
    """)
    assert "lost:" in out.stdout and "stopped heart-beating" in out.stdout, out.stderr
    assert d.attr(0, "state") == "failed" and d.attr(0, "failure_code") == "ENODEV"
    (d.root / "sys/class/accel/accel0/reset").write_text("1")
    d.wait_state(0, "operational")
