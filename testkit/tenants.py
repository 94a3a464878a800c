"""The other tenant, in two shapes. ``as_user`` turns a snippet into one that imports as
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
import shutil
import stat
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from testkit import REPO
from testkit.daemon import Daemon

#: uid and gid of the other tenant
NOBODY = 65534


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


__all__ = ["NOBODY", "OtherUser", "SYSTEM_PYTHON", "TENANT_IMPORTS", "as_user", "tenant_code",
           "user_environment", "user_interpreter", "world_reachable"]
