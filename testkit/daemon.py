"""``Daemon``: one ``accel-emud`` on a root of its own, for a test or a stress run to
attack. The caller starts it and always stops it (tests use the fixtures in
tests/conftest.py); it runs snippets in fresh interpreters against that root and reads
its sysfs, debugfs and log."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from abi import faults, uapi
from firmware.main import has_cache_entries
from kmod_emul import daemon as kdaemon
from testkit import REPO
from testkit.procs import interruptible
from testkit.waiting import WaitTimeout, wait_until


@dataclass
class Daemon:
    root: Path
    state_dir: Path
    firmware_dir: Path
    devices: int
    extra: list[str] = field(default_factory=list)
    #: the firmware's persistent kernel cache (``--jit-cache``); None: the daemon's own,
    #: STATE_DIR/jit-cache (tests/conftest.py points test daemons at one for the session)
    jit_cache: Path | None = None
    #: whether the kernel cache held entries when this daemon started: its firmwares then
    #: load numba on a side thread at boot (firmware/main.py), opening and closing files
    warms_at_boot: bool = field(default=False, init=False)

    def start(self, check: bool = True) -> subprocess.CompletedProcess[str]:
        self.warms_at_boot = has_cache_entries(self.jit_cache_dir)
        cmd = [sys.executable, "-m", "tools.accel_emud", "--root", str(self.root),
               "--devices", str(self.devices), "--memory", "256M",
               "--state-dir", str(self.state_dir), "--firmware-dir", str(self.firmware_dir),
               *(["--jit-cache", str(self.jit_cache)] if self.jit_cache else []),
               *self.extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
        if check and proc.returncode != 0:
            raise RuntimeError(f"accel-emud failed to start:\n{proc.stdout}{proc.stderr}")
        return proc

    def stop(self) -> None:
        kdaemon.stop(self.root)

    @property
    def jit_cache_dir(self) -> Path:
        """Where this daemon's firmware keeps compiled kernels."""
        return self.jit_cache or self.state_dir / "jit-cache"

    @property
    def pid(self) -> int:
        mount = kdaemon.find_mount(self.root)
        assert mount is not None and mount.pid is not None
        return mount.pid

    def env(self, **extra: str) -> dict[str, str]:
        """A client's environment: this daemon's root, the repository on the path, and
        the log directory of any torchrun it starts (``PET_LOG_DIR``, torchrun's
        ``--log-dir``) in this daemon's state directory, which the test's temporary
        directory holds: else each torchrun leaves a ``/tmp/torchelastic_*`` behind."""
        env = dict(os.environ, ACCEL_EMU_ROOT=str(self.root), PYTHONPATH=str(REPO),
                   PET_LOG_DIR=str(self.state_dir / "torchelastic"))
        env.pop("ACCEL_VISIBLE_DEVICES", None)
        env.update(extra)
        return env

    def attr(self, dev: int, name: str) -> str:
        return (self.root / uapi.CLASS_DIR / f"accel{dev}" / name).read_text().strip()

    def log_text(self) -> str:
        """What the daemon has logged so far (its default log file)."""
        return (self.state_dir / "accel-emud.log").read_text()

    def fault_log(self, dev: int = 0) -> list[dict[str, Any]]:
        """The device's fault records as root sees them, oldest first (sysfs fault_log)."""
        return faults.from_lines(self.attr(dev, "fault_log"))

    def debug(self, dev: int, name: str) -> Path:
        return self.root / uapi.DEBUG_DIR / f"accel{dev}" / name

    def node(self, dev: int) -> Path:
        return self.root / uapi.DEV_DIR / f"accel{dev}"

    def wait_state(self, dev: int, state: str, timeout: float = 20.0) -> None:
        """Wait until accel``dev`` is in ``state``; a timeout also names why it failed, if
        it did (its ``failure`` attribute)."""
        try:
            wait_until(lambda: self.attr(dev, "state"), timeout, f"accel{dev} to be {state!r}",
                       ok=lambda now: now == state)
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc} (failure: {self.attr(dev, 'failure')!r})") from None

    def wait_attrs(self, dev: int, expected: dict[str, str], timeout: float = 20.0) -> None:
        """Wait until sysfs shows ``expected`` (teardown is asynchronous: the firmware
        confirms it after the process is gone)."""
        wait_until(lambda: {k: self.attr(dev, k) for k in expected}, timeout,
                   f"accel{dev} to show {expected}", ok=lambda now: now == expected)

    def popen_py(self, code: str, *args: str, **env: str) -> subprocess.Popen[str]:
        """Start a snippet in a fresh interpreter against this root, with text pipes on
        stdin, stdout and stderr (for processes a test holds open, signals or kills; SIGINT
        raises KeyboardInterrupt in them even where this process ignores it)."""
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                                env=self.env(**env), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=REPO, **interruptible())

    def run_py(self, code: str, *, timeout: float = 60, **env: str
               ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                              capture_output=True, text=True, env=self.env(**env),
                              timeout=timeout, cwd=REPO)


__all__ = ["Daemon"]
