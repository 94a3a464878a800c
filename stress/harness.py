"""A real daemon and the checks made after every attack, shared by the tests and the
stress runs.

``Daemon`` is one ``accel-emud`` on a root of its own (started and stopped by the caller,
always stopped: tests use the fixtures in tests/conftest.py). After every attack the
containment checks ask (docs/containment.md): are the daemon and every firmware the same
live processes, is every device operational, are a bystander tenant's data and work intact
(``Bystander``), and did nothing leak -- the driver's books in sysfs, the daemon's and the
firmwares' descriptors, /dev/shm (``snapshot`` then ``assert_contained``). Two ways to be the other tenant: ``as_user`` turns a snippet into one that imports as
root and then drops to another uid in the same interpreter (quick, and able to import what
only root can read: the test helpers, the firmware; but the process began as root, so it
holds what root opened before the drop, and its imports saw root's view of the files).
``OtherUser`` starts a fresh interpreter as that uid from the first instruction, importing
the runtime from a world-readable copy (``user_environment``): what a real second user
does, for the isolation tests that must not be passed by root's leftovers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import textwrap
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from abi import faults, uapi
from firmware.main import has_cache_entries
from kmod_emul import daemon as kdaemon

REPO = Path(__file__).resolve().parent.parent


def _sigint_by_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interruptible() -> dict[str, Any]:
    """``subprocess.Popen`` keywords for a child that will be sent SIGINT: where this process
    ignores SIGINT (a runner started in the background by a shell without job control,
    ``make test &``, inherits SIGINT ignored), the child would inherit that and Python would
    keep it ignored -- no KeyboardInterrupt, ever. The child gets the default disposition
    back, as when run from a terminal (Python then installs its KeyboardInterrupt handler)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return {"preexec_fn": _sigint_by_default}
    return {}


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
        env = dict(os.environ, ACCEL_EMU_ROOT=str(self.root), PYTHONPATH=str(REPO))
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


#: sysfs counters that must come back to what they were once an attacker is gone
BOOKS = ("contexts", "open_files", "clients", "memory_used", "pinned_bytes",
         "host_allocations", "queues", "exclusive_owner")
#: uid and gid of the other tenant
NOBODY = 65534


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> Counter[str]:
    """What a process's descriptors are (``/memfd:accel-ring (deleted)``, ``pipe``,
    ``socket``...; inode numbers dropped), so that a leak names what leaked: the count
    alone said only "firmware 24 -> 25" when ring_fuzz caught one (docs/containment.md)."""
    out: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd") if pid > 0 else ():
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        out[re.sub(r":\[\d+\]$", "", target)] += 1
    return out


def _fd_change(before: Counter[str], now: Counter[str]) -> str:
    gained, lost = now - before, before - now
    return ", ".join([*([f"gained {sorted(gained.elements())}"] if gained else []),
                      *([f"lost {sorted(lost.elements())}"] if lost else [])])


def firmware_children(d) -> int:
    """How many firmware processes daemon ``d`` runs (its only children): one per device
    and partition, and none of a partition that is gone."""
    children = 0
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children += fields[0] not in ("Z", "X") and int(fields[1]) == d.pid
    return children


def world_reachable(path: Path) -> bool:
    """Whether another user can reach ``path``: every directory on the way is o+x."""
    p = Path(path).resolve()
    for part in [p, *p.parents]:
        try:
            if not os.stat(part).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@dataclass
class Snapshot:
    daemon_pid: int
    fw_pids: list[int]
    daemon_fds: int
    fw_fds: list[int]
    books: list[dict[str, str]]
    shm: set[str]
    #: the firmware processes' descriptors by what they are (fd_targets; fw_fds counts them)
    fw_targets: list[Counter[str]]


def _fw_pid(d, dev: int) -> int:
    """The device's firmware process, or -1 when none runs (the device failed)."""
    text = d.debug(dev, "fw_pid").read_text().strip()
    return int(text) if text.isdigit() else -1


def settle(d, timeout: float = 60.0) -> None:
    """Wait out a boot-time JIT warm-up (``jit_ready`` turns 1 when it ends): while numba
    loads, the firmware's descriptor count flickers by one (measured: 11/12 for ~0.7 s on
    an idle machine, seconds under load), and a baseline taken then is off by one. A device
    whose warm-up never shows (one that failed) is left to the checks that follow."""
    if not d.warms_at_boot:
        return
    deadline = time.monotonic() + timeout
    for i in range(d.devices):
        while time.monotonic() < deadline and d.attr(i, "state") == "operational" and (
                d.attr(i, "jit_ready") != "1"):
            time.sleep(0.02)


def snapshot(d) -> Snapshot:
    """A baseline: the processes, descriptors, books and /dev/shm once the firmware has
    settled (see settle)."""
    settle(d)
    return _now(d)


def _now(d) -> Snapshot:
    fw = [_fw_pid(d, i) for i in range(d.devices)]
    targets = [fd_targets(p) for p in fw]
    return Snapshot(d.pid, fw, fd_count(d.pid), [t.total() for t in targets],
                    [{k: d.attr(i, k) for k in BOOKS} for i in range(d.devices)],
                    set(os.listdir("/dev/shm")), targets)


def assert_contained(d, before: Snapshot, timeout: float = 30.0,
                     reset: tuple[int, ...] = ()) -> None:
    """The same daemon and firmwares live, every device is operational, and the books,
    descriptors and /dev/shm are back to ``before`` (teardown is asynchronous: the
    firmware confirms it after the attacker is gone, so this waits for it). Devices in
    ``reset`` were reset on purpose: a new firmware runs there, whose descriptors are its
    own."""
    kept = [i for i in range(d.devices) if i not in reset]
    deadline = time.monotonic() + timeout
    while True:
        now = _now(d)  # polled: the baseline settled already
        states = [d.attr(i, "state") for i in range(d.devices)]
        problems = []
        if (now.daemon_pid, [now.fw_pids[i] for i in kept]) != (
                before.daemon_pid, [before.fw_pids[i] for i in kept]):
            problems.append(f"processes {before.daemon_pid}/{before.fw_pids} -> "
                            f"{now.daemon_pid}/{now.fw_pids}")
        if not all(alive(p) for p in [now.daemon_pid, *now.fw_pids]):
            problems.append("a daemon or firmware process died")
        if states != ["operational"] * d.devices:
            problems.append(f"states {states}")
        if now.books != before.books:
            problems.append(f"books {before.books} -> {now.books}")
        if now.daemon_fds != before.daemon_fds or [now.fw_fds[i] for i in kept] != [
                before.fw_fds[i] for i in kept]:
            changed = [f"firmware {i} {_fd_change(before.fw_targets[i], now.fw_targets[i])}"
                       for i in kept if before.fw_fds[i] != now.fw_fds[i]]
            problems.append(f"descriptors daemon {before.daemon_fds} -> {now.daemon_fds}, "
                            f"firmware {before.fw_fds} -> {now.fw_fds}"
                            + "".join(f"; {c}" for c in changed))
        if now.shm - before.shm:  # what others remove from the shared /dev/shm is theirs
            problems.append(f"/dev/shm gained {sorted(now.shm - before.shm)}")
        if not problems:
            return
        if time.monotonic() > deadline or "processes" in problems[0]:
            raise AssertionError("not contained: " + "; ".join(problems))
        time.sleep(0.05)


_BYSTANDER = """
import sys, numpy as np, runtime
dev = int(sys.argv[1])
rng = np.random.default_rng(dev + 7)
pattern = rng.integers(0, 255, 4 << 20, dtype=np.uint8)
s = runtime.Stream(dev)
keep = runtime.to_device(pattern, device=dev, stream=s)
pin = runtime.pinned_empty(pattern.shape, np.uint8, device=dev)
s.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    try:
        keep.copy_to_host(pin, stream=s)
        scratch = runtime.empty(pattern.shape, np.uint8, device=dev, stream=s)
        scratch.copy_(keep, stream=s)
        back = scratch.copy_to_host(stream=s)
        s.synchronize(timeout=30)
        ok = np.array_equal(pin, pattern) and np.array_equal(back, pattern)
        print("ok" if ok else "corrupt", flush=True)
    except Exception as exc:
        print(f"error {exc!r}", flush=True)
"""


def close_child(proc: subprocess.Popen[str]) -> None:
    """End a tenant driven through its stdin: EOF, then a kill past 30 s."""
    if proc.poll() is None:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Bystander:
    """Another tenant on device ``dev``: its data must stay intact and its work must run
    through whatever an attacker does. It holds nothing on the other devices (the runtime
    opens only the devices a process uses), so another process may hold those
    exclusively; ``alone``: it does not even see them (``ACCEL_VISIBLE_DEVICES``)."""

    def __init__(self, d, dev: int = 0, alone: bool = False) -> None:
        self.proc = (d.popen_py(_BYSTANDER, "0", ACCEL_VISIBLE_DEVICES=str(dev)) if alone
                     else d.popen_py(_BYSTANDER, str(dev)))
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise AssertionError(f"bystander did not start: {line!r} {self.proc.stderr.read()}")
        # one round before anyone takes a snapshot: what its checks create lazily (staging
        # buffers, the firmware's copies of their descriptors) is then part of the baseline
        # (without it, a snapshot under load could miss one descriptor that came later)
        self.check()

    def check(self) -> None:
        assert self.proc.poll() is None, "the bystander died"
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert answer == "ok", f"bystander: {answer!r}"

    def close(self) -> None:
        close_child(self.proc)

    def __enter__(self) -> Bystander:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tenant_code(code: str, imports: str = "") -> str:
    """``code`` after the imports a tenant's snippet may rely on: os, sys, errno, json,
    numpy as np, the runtime with its kernel front end, and abi's kernel_lang, uapi and
    userq, then ``imports`` (extra import lines)."""
    return (f"import os, sys, errno, json, numpy as np, runtime, runtime.kernels\n"
            f"from abi import kernel_lang, uapi, userq\n{imports}\n" + textwrap.dedent(code))


def as_user(code: str, uid: int = NOBODY, imports: str = "") -> str:
    """``code`` run as ``uid`` after importing what it needs as root (``tenant_code``).
    For the stress tools' many quick tenant processes, where a fresh interpreter per
    process would cost more than the storm; every isolation test runs as ``OtherUser``,
    which never was root (root's head start, files opened and imports read as root, could
    pass a check a real second user fails)."""
    drop = (f"os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); "
            f"os.setresuid({uid}, {uid}, {uid})\n")
    return tenant_code(drop + textwrap.dedent(code), imports)


#: What a tenant's program imports; ``user_environment`` copies the packages this pulls in.
TENANT_IMPORTS = "import runtime, runtime.kernels, runtime.kernel_lib, abi.kernel_lang"
#: The interpreter another user runs: Debian's, outside /root (where pyenv and the venv's
#: base may live, 0700 to others).
SYSTEM_PYTHON = "/usr/bin/python3"


def _tenant_packages() -> list[Path]:
    """The files and package folders of every non-stdlib top-level module that
    ``TENANT_IMPORTS`` loads, asked of a fresh interpreter (what is already imported here
    says nothing about what the runtime needs), with the ``NAME.libs`` folders of vendored
    shared libraries (numpy's) next to them."""
    probe = ("import sys, json; before = set(sys.modules)\n" + TENANT_IMPORTS + "\n"
             "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
             "print(json.dumps([getattr(sys.modules[m], '__file__', None) for m in new]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    found: list[Path] = []
    for name in json.loads(out.stdout):
        if name is None or Path(name).resolve().is_relative_to(stdlib):
            continue  # built in, or the standard library the other interpreter has
        path = Path(name)
        top = path.parent if path.name == "__init__.py" else path
        found.append(top)
        if (libs := top.with_name(top.name + ".libs")).is_dir():
            found.append(libs)
    return found


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the file is already world-readable (the copy is then free, and a
    mode change could not reach the original), else a copy. Compiled bytecode is kept:
    the other user cannot write any, and would compile numpy on every start."""
    if os.stat(src).st_mode & stat.S_IROTH:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass  # another file system
    shutil.copy2(src, dst)  # keeps the mtime, which the bytecode's validity is checked by
    os.chmod(dst, 0o644)


def user_interpreter() -> str | None:
    """An interpreter another user can run that reads this one's bytecode and extension
    modules: ``SYSTEM_PYTHON`` if it is this minor version, else the venv's base
    interpreter if it is world-executable, else None."""
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    if os.access(SYSTEM_PYTHON, os.X_OK):
        got = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print('%d.%d' % "
                              "sys.version_info[:2])"], capture_output=True, text=True)
        if got.stdout.strip() == want:
            return SYSTEM_PYTHON
    base = getattr(sys, "_base_executable", sys.executable)
    return base if os.stat(base).st_mode & stat.S_IXOTH else None


@dataclass(frozen=True)
class OtherUser:
    """Another user's fresh interpreter: ``python`` run as ``uid`` (and its gid, no
    supplementary groups) from its first instruction, importing the runtime from
    ``path``, a world-readable copy. Unlike ``as_user`` it never was root: it holds
    nothing root opened and can read only what the other user can."""

    python: str
    path: Path
    uid: int = NOBODY

    def _argv_env(self, d: Daemon, code: str, args: tuple[str, ...],
                  env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        return ([self.python, "-s", "-c", textwrap.dedent(code), *args],
                {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": str(self.path),
                 "PYTHONDONTWRITEBYTECODE": "1", "ACCEL_EMU_ROOT": str(d.root), **env})

    def _ids(self) -> dict[str, object]:
        return {"user": self.uid, "group": self.uid, "extra_groups": [], "cwd": "/"}

    def run(self, d: Daemon, code: str, *args: str, timeout: float = 60, **env: str
            ) -> subprocess.CompletedProcess[str]:
        argv, full_env = self._argv_env(d, code, args, env)
        return subprocess.run(argv, capture_output=True, text=True, env=full_env,
                              timeout=timeout, **self._ids())

    def popen(self, d: Daemon, code: str, *args: str, **env: str) -> subprocess.Popen[str]:
        """As ``Daemon.popen_py``: text pipes on stdin, stdout and stderr."""
        argv, full_env = self._argv_env(d, code, args, env)
        return subprocess.Popen(argv, env=full_env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **self._ids())


def user_environment(dest: Path, uid: int = NOBODY,
                     modules: Sequence[Path] = ()) -> OtherUser | None:
    """Fill ``dest`` (a new directory other users can enter) with a world-readable copy of
    what the runtime imports, the project's packages and its third-party ones (folders
    0755, files 0644), and of ``modules`` (single-file helpers such as tests/rawdev.py),
    for ``OtherUser``. None when no interpreter fits (``user_interpreter``). Run once per
    session: it costs a fresh interpreter and links."""
    python = user_interpreter()
    if python is None:
        return None
    os.chmod(dest, 0o755)
    for src in [*_tenant_packages(), *modules]:
        target = dest / src.name
        if src.is_dir():
            shutil.copytree(src, target, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(src), str(target))
    for folder, dirs, _files in os.walk(dest):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o755)
    return OtherUser(python, dest, uid)


__all__ = ["BOOKS", "Bystander", "Daemon", "NOBODY", "OtherUser", "REPO", "Snapshot", "alive",
           "as_user", "assert_contained", "close_child", "fd_count", "firmware_children",
           "interruptible", "snapshot", "tenant_code", "user_environment", "world_reachable"]
