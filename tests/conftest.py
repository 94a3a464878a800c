"""Fixtures: real accel-emud daemons on temporary roots, always stopped and reaped.

``daemon`` is one 2-device daemon shared by the session (most tests only read or make
their own contexts). ``make_daemon`` starts private daemons for tests that break, reset or
misconfigure a device; each is stopped at the test's end, pass or fail. ``run_py`` runs a
snippet in a fresh interpreter (the runtime's state is per process, as the fork rules
need) against a given root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from firmware.image import IMAGE_DIR, IMAGE_NAME
from kmod_emul import daemon as kdaemon
from kmod_emul import uapi

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Daemon:
    root: Path
    state_dir: Path
    firmware_dir: Path
    devices: int
    extra: list[str] = field(default_factory=list)

    def start(self, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "tools.accel_emud", "--root", str(self.root),
               "--devices", str(self.devices), "--memory", "256M",
               "--state-dir", str(self.state_dir), "--firmware-dir", str(self.firmware_dir),
               *self.extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
        if check and proc.returncode != 0:
            raise RuntimeError(f"accel-emud failed to start:\n{proc.stdout}{proc.stderr}")
        return proc

    def stop(self) -> None:
        kdaemon.stop(self.root)

    @property
    def pid(self) -> int:
        mount = kdaemon.find_mount(self.root)
        assert mount is not None and mount.pid is not None
        return mount.pid

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, ACCEL_EMU_ROOT=str(self.root), PYTHONPATH=str(REPO))
        env.pop("ACCEL_VISIBLE_DEVICES", None)
        env.update(extra)
        return env

    def attr(self, dev: int, name: str) -> str:
        return (self.root / uapi.CLASS_DIR / f"accel{dev}" / name).read_text().strip()

    def debug(self, dev: int, name: str) -> Path:
        return self.root / uapi.DEBUG_DIR / f"accel{dev}" / name

    def node(self, dev: int) -> Path:
        return self.root / uapi.DEV_DIR / f"accel{dev}"

    def wait_state(self, dev: int, state: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.attr(dev, "state") != state:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"accel{dev} stayed {self.attr(dev, 'state')!r}, wanted {state!r} "
                    f"(failure: {self.attr(dev, 'failure')!r})")
            time.sleep(0.02)

    def wait_attrs(self, dev: int, expected: dict[str, str], timeout: float = 20.0) -> None:
        """Wait until sysfs shows ``expected`` (teardown is asynchronous: the firmware
        confirms it after the process is gone)."""
        deadline = time.monotonic() + timeout
        while (now := {k: self.attr(dev, k) for k in expected}) != expected:
            if time.monotonic() > deadline:
                raise AssertionError(f"accel{dev} shows {now}, wanted {expected}")
            time.sleep(0.02)

    def popen_py(self, code: str, *args: str) -> subprocess.Popen[str]:
        """Start a snippet in a fresh interpreter against this root, with text pipes on
        stdin, stdout and stderr (for processes a test holds open, signals or kills)."""
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                                env=self.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO)

    def run_py(self, code: str, *, timeout: float = 60, **env: str
               ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                              capture_output=True, text=True, env=self.env(**env),
                              timeout=timeout, cwd=REPO)


def _new_daemon(tmp: Path, devices: int, firmware_dir: Path | None, extra: list[str]) -> Daemon:
    tmp.mkdir(parents=True, exist_ok=True)
    return Daemon(tmp / "root", tmp / "state", firmware_dir or IMAGE_DIR, devices, extra)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = _new_daemon(tmp_path_factory.mktemp("shared"), 2, None, [])
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator:
    started: list[Daemon] = []

    def make(devices: int = 1, firmware_dir: Path | None = None, extra: list[str] | None = None,
             start: bool = True, name: str = "d") -> Daemon:
        d = _new_daemon(tmp_path / f"{name}{len(started)}", devices, firmware_dir, extra or [])
        started.append(d)
        if start:
            d.start()
        return d

    try:
        yield make
    finally:
        for d in started:
            d.stop()


@pytest.fixture
def firmware_copy(tmp_path: Path) -> Path:
    """A private firmware directory holding a copy of the shipped image, to break at will."""
    fw_dir = tmp_path / "firmware"
    fw_dir.mkdir()
    shutil.copy(IMAGE_DIR / IMAGE_NAME, fw_dir / IMAGE_NAME)
    return fw_dir


@pytest.fixture(autouse=True)
def _shared_daemon_idle(request: pytest.FixtureRequest) -> None:
    """Tests on the shared daemon start from an idle device: processes of earlier tests have
    exited, but the firmware confirms their teardown (and the memory comes back) a moment
    later, and tests that compare sysfs figures must not see that tail."""
    if "daemon" in request.fixturenames:
        d: Daemon = request.getfixturevalue("daemon")
        for dev in range(d.devices):
            d.wait_attrs(dev, {"contexts": "0", "memory_used": "0"})
