"""Fixtures: real accel-emud daemons on temporary roots, always stopped and reaped.

``daemon`` is one 2-device daemon shared by the session (most tests only read or make
their own contexts). ``make_daemon`` starts private daemons for tests that break, reset or
misconfigure a device; each is stopped at the test's end, pass or fail. ``run_py`` runs a
snippet in a fresh interpreter (the runtime's state is per process, as the fork rules
need) against a given root. ``other_user`` runs snippets as uid 65534 in an interpreter
that never was root (testkit/tenants.py, ``OtherUser``).

Every daemon these fixtures start keeps its compiled kernels in one JIT cache for the
whole session (``jit_cache_dir``, passed as ``accel-emud --jit-cache``): a kernel compiled
in one test's daemon is a cache hit in the next one's (a first compile of a kernel with
loops costs seconds). The cache is built to be shared (firmware/jit.py: entries keyed on
every compatibility input -- a different image's ISA or stepping is another key -- built
under a lock and renamed into place). A test that asserts the cache's own behaviour
(compile counts, misses, the files in it) asks ``make_daemon(jit_cache="private")``: its
daemon keeps STATE_DIR/jit-cache, empty at its start.

The tests live by layer (README.md, "Tests"): unit/ (no mount), driver/ (raw transactions
on a mount), runtime/, tools/, contain/. This file's fixtures serve them all; a layer's
own conftest.py holds only what that layer alone uses. The shared helpers sit next to
this file (rawdev.py, refusals.py, scenario.py) and every layer imports them by bare
name: tests/ is put on ``sys.path`` below (pytest's default "prepend" import mode does it
for this conftest's directory too; saying so keeps it true whatever the mode). Test file
names are unique across the tree, as that mode needs.

With ``--durations`` (``make test`` asks for the 30 slowest tests) the summary also lists
the slowest files, setup and teardown included.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from abi.fwimage import IMAGE_NAME
from firmware.image import IMAGE_DIR
from testkit import orphans
from testkit.daemon import Daemon
from testkit.tenants import OtherUser, user_environment

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


#: files in the summary of the slowest that ``--durations`` adds (``make test`` asks for it)
SLOWEST_FILES = 15
#: seconds each test file took, setup and teardown included (its daemons, its fixtures)
_file_seconds: Counter[str] = Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _file_seconds[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config
                            ) -> None:
    """With ``--durations``' slowest tests, the slowest files: where a run's time goes
    includes what no one test shows (a daemon per test, a process per snippet)."""
    if config.getoption("durations", None) is None or not _file_seconds:
        return
    terminalreporter.write_sep("=", f"slowest {SLOWEST_FILES} files (setup, call, teardown)")
    total = sum(_file_seconds.values())
    for path, seconds in _file_seconds.most_common(SLOWEST_FILES):
        terminalreporter.write_line(f"{seconds:8.2f}s {path}")
    terminalreporter.write_line(f"{total:8.2f}s in all {len(_file_seconds)} files")


def _new_daemon(tmp: Path, devices: int, firmware_dir: Path | None, extra: list[str],
                jit_cache: Path | None) -> Daemon:
    tmp.mkdir(parents=True, exist_ok=True)
    return Daemon(tmp / "root", tmp / "state", firmware_dir or IMAGE_DIR, devices, extra,
                  jit_cache)


@pytest.fixture(scope="session", autouse=True)
def _no_orphan_daemons(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Claim this run's temporary directory and stop the daemons a killed earlier run left
    mounted under the user's pytest temporaries (testkit/orphans.py says why they stay)."""
    base = tmp_path_factory.getbasetemp()
    orphans.claim(base)
    top = next((p for p in base.parents if p.name.startswith("pytest-of-")), None)
    if top is not None and (stopped := orphans.sweep(top)):
        warnings.warn(f"stopped {len(stopped)} accel-emud daemon(s) a killed test run left "
                      f"mounted: {', '.join(map(str, stopped))}", stacklevel=1)


@pytest.fixture(scope="session")
def jit_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's kernel cache, shared by every daemon of ``daemon`` and
    ``make_daemon`` (but those asked for ``jit_cache="private"``). Under pytest-xdist the
    workers of one run share it too (their base directories sit side by side in the
    run's): the cache is built for concurrent use, and a kernel compiles once a run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "jit-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("jit-cache")


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory, jit_cache_dir: Path) -> Iterator[Daemon]:
    d = _new_daemon(tmp_path_factory.mktemp("shared"), 2, None, [], jit_cache_dir)
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="session")
def other_user() -> Iterator[OtherUser]:
    """Another user's fresh interpreter, importing a world-readable copy of the runtime
    made once for the session (under /tmp: pytest's temporary directories are 0700) and
    removed at its end, with the tests' raw-transaction helper (rawdev.py). Fails, not
    skips, where no interpreter other users can run fits this one: the isolation tests
    must run as a real second user (``user_interpreter``: the system's python3 of this
    minor version, or the venv's base interpreter where others may run it)."""
    dest = Path(tempfile.mkdtemp(prefix="accel-user-env-", dir="/tmp"))
    try:
        user = user_environment(dest, modules=[TESTS_DIR / "rawdev.py"])
        if user is None:
            pytest.fail("no interpreter of this Python version that other users can run")
        yield user
    finally:
        shutil.rmtree(dest, ignore_errors=True)


@pytest.fixture
def make_daemon(tmp_path: Path, jit_cache_dir: Path) -> Iterator:
    """Private daemons; ``tenants=True`` roots one where other users can reach it (pytest's
    temporary directories are 0700), for tests that attack as another uid.
    ``jit_cache="private"`` gives one its own, empty kernel cache (STATE_DIR/jit-cache) for
    tests that count compiles or look at the cache's files; a directory gives it that one
    (a cache kept apart from the session's but shared by a few tests); by default
    ("shared") it uses the session's."""
    started: list[Daemon] = []
    shared: list[str] = []

    def make(devices: int = 1, firmware_dir: Path | None = None, extra: list[str] | None = None,
             start: bool = True, name: str = "d", tenants: bool = False,
             jit_cache: str | Path = "shared") -> Daemon:
        if not isinstance(jit_cache, Path) and jit_cache not in ("shared", "private"):
            raise ValueError(f"jit_cache={jit_cache!r}: 'shared', 'private' or a directory")
        base = tmp_path
        if tenants:
            shared.append(tempfile.mkdtemp(prefix="accel-tenants-", dir="/tmp"))
            os.chmod(shared[-1], 0o755)
            base = Path(shared[-1])
        d = _new_daemon(base / f"{name}{len(started)}", devices, firmware_dir, extra or [],
                        jit_cache_dir if jit_cache == "shared" else
                        jit_cache if isinstance(jit_cache, Path) else None)
        if tenants:
            os.chmod(d.root.parent, 0o755)
        started.append(d)
        if start:
            d.start()
        return d

    try:
        yield make
    finally:
        for d in started:
            d.stop()
        for path in shared:
            shutil.rmtree(path, ignore_errors=True)


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
