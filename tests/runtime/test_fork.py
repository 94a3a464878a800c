"""Fork, spawn and crash: the first rules.

* After init, a forked child that touches the device gets UseAfterForkError naming the
  pre-fork initialisation and recommending spawn or forkserver; discovery still works and
  the parent carries on.
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

from rawdev import RawDev, errname


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
    out = daemon.run_py(textwrap.dedent("""
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
            print(f"count {runtime.device_count()} {runtime.is_available()}")
            for name, call in calls.items():
                try:
                    call()
                    print(name, "returned")
                except runtime.UseAfterForkError as exc:
                    msg = str(exc)
                    print(name, str(parent) in msg and "initialised" in msg and "spawn" in msg
                          and "forkserver" in msg)
                except Exception as exc:
                    print(name, repr(exc))
            print(flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        lib.fill[1, 16](a, 7.0, stream=s)   # the parent carries on, on the same objects
        a.copy_to_host(pin, stream=s)
        s.synchronize()
        ctx.synchronize(timeout=5)
        print("parent", bool((pin == 7).all()), runtime.is_initialized())
    """))
    lines = out.stdout.splitlines()
    assert lines[0] == "count 2 True", out.stderr
    refused = [l for l in lines[1:-2] if not l.endswith(" True")]
    calls = sum(line.startswith('    "') for line in CHILD_CALLS.splitlines())
    assert not refused and len(lines) == calls + 3, (refused, lines, out.stderr)
    assert lines[-1] == "parent True True", out.stderr


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
        assert int(daemon.attr(0, "contexts")) == int(baseline[0]["contexts"]) + 4
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
