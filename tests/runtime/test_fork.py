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


def test_fork_after_init_child_gets_use_after_fork(daemon):
    out = daemon.run_py("""
        import os, runtime
        runtime.init()
        ctx = runtime.new_context(1)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            lines = [f"count {runtime.device_count()} {runtime.is_available()}"]
            for call in (runtime.synchronize, lambda: runtime.get_device_properties(0),
                         ctx.submit_noop, runtime.init, lambda: runtime.new_context(0)):
                try:
                    call()
                    lines.append("no error")
                except runtime.UseAfterForkError as exc:
                    msg = str(exc)
                    lines.append(f"fork-error {str(parent) in msg} {'spawn' in msg} "
                                 f"{'forkserver' in msg}")
            print("\\n".join(lines), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        runtime.synchronize()       # the parent is unaffected
        ctx.synchronize(timeout=5)
        print("parent ok")
    """)
    assert out.stdout.splitlines() == ["count 2 True"] + ["fork-error True True True"] * 5 + [
        "parent ok"], out.stderr


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
