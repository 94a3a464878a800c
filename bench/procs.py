"""Servers the benchmarks start and always stop: accel-emud daemons and echo filesystems.

Each server lives under the run's temporary directory, so whatever happens, everything this
run mounted is below one path and ``leftovers`` can prove nothing stayed behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


def _unescape(field: str) -> str:
    """Undo the octal escapes of /proc/mounts."""
    return field.encode().decode("unicode_escape")


def mounts_under(prefix: Path) -> list[tuple[str, str]]:
    """(source, mountpoint) of every mount at or below ``prefix``."""
    top = os.path.realpath(prefix)
    found = []
    with open("/proc/mounts") as f:
        for line in f:
            source, mountpoint, *_ = line.split()
            mp = _unescape(mountpoint)
            if mp == top or mp.startswith(top + "/"):
                found.append((source, mp))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone once reaped; reap it if it is ours
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def lazy_unmount(mountpoint: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class AccelDaemon:
    """``accel-emud`` on ``base/root`` with its state (identity, log) in ``base/state``."""

    def __init__(self, base: Path, devices: int = 2, memory: str = "256M",
                 firmware_dir: Path | None = None) -> None:
        self.base = base
        self.firmware_dir = firmware_dir
        self.root = base / "root"
        self.state_dir = base / "state"
        self.devices = devices
        self.memory = memory
        self.pid: int | None = None
        self.started = False

    def start(self) -> float:
        """Start it; return the seconds the ``accel-emud`` command took to return (ready)."""
        self.base.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "tools.accel_emud", "--root", str(self.root),
               "--devices", str(self.devices), "--memory", self.memory,
               "--state-dir", str(self.state_dir)]
        if self.firmware_dir is not None:
            cmd += ["--firmware-dir", str(self.firmware_dir)]
        self.started = True  # from here on, stop() must run whatever happens
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              timeout=START_TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"accel-emud failed to start (exit {proc.returncode}):\n"
                               f"{proc.stdout}{proc.stderr}")
        from kmod_emul import daemon as kdaemon

        mount = kdaemon.find_mount(self.root)
        self.pid = mount.pid if mount else None
        return elapsed

    def node(self, dev: int = 0) -> Path:
        return self.root / "dev/accel" / f"accel{dev}"

    def attr(self, dev: int, name: str) -> Path:
        return self.root / "sys/class/accel" / f"accel{dev}" / name

    def _processes(self) -> list[int]:
        """Every accel-emud process (launcher or daemon) started for this root.

        The root is a fresh temporary path, so this finds exactly ours, including a daemon
        whose start was interrupted before it mounted (``kdaemon.stop`` finds those by
        their mount only)."""
        needle = [b"tools.accel_emud", os.fsencode(self.root)]
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if all(n in argv for n in needle):
                found.append(int(entry))
        return found

    def stop(self) -> None:
        if not self.started:
            return
        from kmod_emul import daemon as kdaemon

        kdaemon.stop(self.root)
        stragglers = self._processes()
        for pid in stragglers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while stragglers and time.monotonic() < deadline:
            stragglers = [p for p in stragglers if _alive(p)]
            time.sleep(0.02)
        for pid in stragglers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if mounts_under(self.root):
            lazy_unmount(self.root)
        self.started = False


class EchoServer:
    """``python -m bench.echo_fs`` on ``base/root``; its stderr goes to ``base/echo.log``."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.root = base / "root"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it; return the seconds from spawning the process to its mount being ready."""
        self.base.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(exist_ok=True)
        read_fd, write_fd = os.pipe()
        try:
            with open(self.base / "echo.log", "ab") as log:
                t0 = time.perf_counter()
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "bench.echo_fs", str(self.root),
                     "--ready-fd", str(write_fd)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(write_fd,),
                    cwd=REPO, start_new_session=True)
            os.close(write_fd)
            write_fd = -1
            with os.fdopen(read_fd, "rb") as ready:
                read_fd = -1
                line = ready.readline()
            elapsed = time.perf_counter() - t0
        finally:
            for fd in (read_fd, write_fd):
                if fd >= 0:
                    os.close(fd)
        if line != b"ready\n":
            code = self.proc.wait(timeout=STOP_TIMEOUT_S)
            tail = (self.base / "echo.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"echo fs failed to start (exit {code}):\n{tail}")
        return elapsed

    @property
    def file(self) -> Path:
        return self.root / "echo"

    @property
    def attr(self) -> Path:
        return self.root / "attr"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if mounts_under(self.root):
            lazy_unmount(self.root)
