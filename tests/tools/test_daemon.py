"""accel-emud's lifecycle: start, refuse, stop, SIGTERM, SIGKILL and restart, concurrency."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from rawdev import RawDev, errname
from scenario import SPINNING

from abi import uapi
from kmod_emul import daemon as kdaemon
from kmod_emul.daemon import pid_alive
from testkit import REPO, orphans
from testkit.waiting import wait_until


def firmware_pids(d, devices: int) -> list[int]:
    return [int(d.debug(i, "fw_pid").read_text()) for i in range(devices)]


def emud(*args: str, env=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.accel_emud", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, env=env)


def test_start_status_stop_leaves_nothing(make_daemon):
    d = make_daemon(devices=2)
    assert sorted(os.listdir(d.root / uapi.DEV_DIR)) == ["accel0", "accel1"]
    st = emud("status", "--root", str(d.root))
    assert st.returncode == 0 and "2 device(s)" in st.stdout
    fw = firmware_pids(d, 2)
    assert all(pid_alive(p) for p in fw)
    out = emud("stop", "--root", str(d.root))
    assert out.returncode == 0 and "stopped" in out.stdout
    assert kdaemon.find_mount(d.root) is None
    wait_until(lambda: [p for p in fw if pid_alive(p)], 10, "the firmwares to halt",
               ok=lambda running: not running)
    st = emud("status", "--root", str(d.root))
    assert st.returncode == 3 and "not served" in st.stdout


def test_refuses_a_root_already_served(daemon):
    out = emud("--root", str(daemon.root), "--devices", "1", "--state-dir",
               str(daemon.state_dir))
    assert out.returncode == 1
    assert f"already served by accel-emud (pid {daemon.pid})" in out.stderr
    assert "accel-emud stop --root" in out.stderr
    assert daemon.attr(0, "state") == "operational"  # the serving daemon is untouched


def test_sigterm_unmounts_and_halts_firmware(make_daemon):
    d = make_daemon(devices=2)
    pid, fw = d.pid, firmware_pids(d, 2)
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: kdaemon.find_mount(d.root), 10, "the mount to go",
               ok=lambda mount: mount is None)
    wait_until(lambda: [p for p in [pid, *fw] if pid_alive(p)], 10,
               "the daemon and its firmwares to exit", ok=lambda running: not running)


def test_sigkill_then_next_start_recovers(make_daemon):
    d = make_daemon(devices=1)
    uuid = d.attr(0, "uuid")
    pid, fw = d.pid, firmware_pids(d, 1)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10, "the killed daemon to be gone")
    # The firmware notices its driver is gone (EOF on its doorbell) and halts by itself.
    wait_until(lambda: [p for p in fw if pid_alive(p)], 10, "the firmware to halt by itself",
               ok=lambda running: not running)
    st = emud("status", "--root", str(d.root))
    assert st.returncode == 1 and "stale mount" in st.stdout
    d.start()  # clears the dead mount and serves again
    assert d.pid != pid
    assert d.attr(0, "state") == "operational"
    assert d.attr(0, "uuid") == uuid


def test_stop_after_sigkill_clears_the_stale_mount(make_daemon):
    d = make_daemon()
    pid = d.pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10, "the killed daemon to be gone")
    assert emud("stop", "--root", str(d.root)).returncode == 0
    assert kdaemon.find_mount(d.root) is None


@pytest.mark.parametrize("args, message", [
    (["--devices", "0"], "--devices must be at least 1"),
    (["--memory", "lots"], "not a size"),
    (["--driver-abi", "x"], "not an ABI version"),
])
def test_bad_arguments(tmp_path, args, message):
    out = emud("--root", str(tmp_path / "r"), *args)
    assert out.returncode == 2 and message in out.stderr
    assert kdaemon.find_mount(tmp_path / "r") is None


@pytest.mark.parametrize("mode", ["background", "foreground"])
@pytest.mark.parametrize("value, message", [
    ("max_queue_depth=0", "not a size"),
    ("max_queue_depth=\u0661\u0666", "not a size"),  # Arabic-Indic 16: ASCII digits only
    ("max_queue_depth=2048", "max_queue_depth 2048 is more than this device can hold (1024)"),
    ("max_contexts_per_process=999", "max_contexts_per_process 999 exceeds max_contexts"),
    # was accepted: the 1,024th queue of a context then met StopIteration (EIO)
    ("max_queues_per_context=1024",
     "max_queues_per_context 1024 is more than a context's doorbell slots (1023)"),
    ("nonsense=1", "not NAME=VALUE with a limit's name"),
    ("max_queues_per_process", "not NAME=VALUE with a limit's name"),
])
def test_a_refused_limit_exits_2_before_anything_starts(tmp_path, mode, value, message):
    """Every --limit that cannot be exits 2 with a message naming it, in the foreground
    and in the background alike (a background start said exit 1 for a limit past its
    table, docs/containment.md said 2), and nothing is mounted."""
    out = emud("start", "--root", str(tmp_path / "root"), "--state-dir", str(tmp_path / "state"),
               *(["--foreground"] if mode == "foreground" else []), "--limit", value)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr, out.stderr
    assert not (tmp_path / "root" / "dev").exists()  # nothing was mounted
    assert kdaemon.find_mount(tmp_path / "root") is None


def test_wait_on_a_hung_device_never_blocks_in_the_driver(make_daemon):
    """WAIT answers at once, even on a hung device: a request that slept would hold the
    device node for every tenant (the waiter sleeps on its own event pipe instead)."""
    heartbeat_s = 60  # the hang lasts until the heartbeat watch ends it
    d = make_daemon(devices=2, extra=["--heartbeat-timeout", str(heartbeat_s)])
    with RawDev(d.node(1)) as hung:
        ctx = hung.ctx_create()
        d.debug(1, "fw_hang").write_text("1")
        seqno = hung.noop(ctx)
        start = time.monotonic()
        outcome = {errname(lambda: hung.wait(ctx, seqno)) for _ in range(30)}
        elapsed = time.monotonic() - start
        out = d.run_py("""
            import runtime
            ctx = runtime.new_context(0)
            for _ in range(50):
                assert runtime.get_device_properties(0).state == "operational"
                ctx.submit_noop().wait(timeout=5)
            print("done")
        """)
        assert out.stdout.strip() == "done", out.stderr
    assert outcome == {"ETIME"}
    # a WAIT that slept in the driver would sleep until the hang ends; all thirty answered
    # long before the first heartbeat deadline, however loaded the machine
    assert elapsed < heartbeat_s / 2, f"30 WAITs on a hung device took {elapsed:.1f} s"


WAITS_ON_A_SPIN = SPINNING + """
try:
    s.synchronize()
except runtime.DeviceLostError as exc:
    print("lost:", exc, flush=True)
"""


@pytest.mark.timeout(120)
def test_stop_refuses_while_in_use_and_force_tells_clients_it_was_a_stop(make_daemon):
    """As rmmod refuses a module in use: ``accel-emud stop`` with a process holding a
    context exits 1 naming its pid, and the daemon serves on; ``--force`` stops it, and
    the client's DeviceLostError says the operator stopped the daemon (not that it died)."""
    d = make_daemon(devices=1)
    client = d.popen_py(WAITS_ON_A_SPIN)
    try:
        assert client.stdout.readline().strip() == "waiting"
        out = emud("stop", "--root", str(d.root), env=d.env())
        assert out.returncode == 1 and out.stdout == "", out
        assert f"in use by pid {client.pid} (holding contexts)" in out.stderr
        assert "--force" in out.stderr
        assert kdaemon.find_mount(d.root) is not None and pid_alive(d.pid)
        out = emud("stop", "--root", str(d.root), "--force", env=d.env())
        assert out.returncode == 0 and "stopped" in out.stdout, out
        lost = client.stdout.readline()
        assert lost.startswith("lost:") and "stopped by the operator (SIGTERM)" in lost, lost
        assert client.wait(timeout=30) == 0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert kdaemon.find_mount(d.root) is None


@pytest.mark.timeout(60)
def test_a_killed_runs_daemon_is_stopped_by_the_next_runs_sweep(make_daemon, tmp_path):
    """A runner killed before its teardown leaves its daemons mounted (they run in their own
    session); the next run stops those whose claiming process is gone, and only those."""
    orphaned, owned = tmp_path / "killed-run", tmp_path / "live-run"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for base, pid in ((orphaned, gone.pid), (owned, os.getpid())):
        base.mkdir()
        orphans.claim(base, pid)
    victim = make_daemon(name="killed-run/d")
    keeper = make_daemon(name="live-run/d")
    unclaimed = make_daemon(name="d")  # directly under tmp_path: no claim below the top

    assert orphans.sweep(tmp_path) == [victim.root]
    assert kdaemon.find_mount(victim.root) is None
    for d in (keeper, unclaimed):
        assert kdaemon.find_mount(d.root).alive
        assert (d.node(0)).exists()
