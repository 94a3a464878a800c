"""Build (once) and load the C++ shim, ``torch_accel._C``.

The shim is compiled with torch's own extension builder against the installed torch, into
``torch_accel/_build/`` (kept between runs: the first build takes about a minute on two
cores, a later import only loads the library). ``make setup`` builds it; an import finds it
built, or builds it then. The build directory is keyed by torch's version and the source's
hash, so a changed shim or another torch rebuilds instead of loading a stale library
(and the stale builds are removed).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "csrc" / "shim.cpp"]
#: the file a build writes once its library loaded: the build directory is complete
DONE = "built"


def build_dir() -> Path:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    return HERE / "_build" / f"torch-{torch.__version__}-{digest}"


def load(verbose: bool = False) -> ModuleType:
    """The built shim (building it first when this source and torch have none yet)."""
    where = build_dir()
    where.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    # One builder at a time under a lock the kernel drops when its holder dies: torch's
    # own baton is a plain file, which a build killed midway (a test's timeout) leaves
    # behind, and every later import would wait on it forever. Holding ours, any baton
    # there is such a leftover.
    with open(where.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not where.exists():  # a new source or torch: the older builds are stale
            for old in where.parent.glob("torch-*"):
                shutil.rmtree(old, ignore_errors=True)
        where.mkdir(exist_ok=True)
        (where / "lock").unlink(missing_ok=True)
        if (where / DONE).exists():
            return _import(where / "torch_accel_C.so")
        module = cpp_extension.load(name="torch_accel_C", sources=[str(p) for p in SOURCES],
                                    build_directory=str(where), extra_cflags=["-O2"],
                                    verbose=verbose)
        (where / DONE).touch()
        return module


def _import(library: Path) -> ModuleType:
    """The shim a finished build left, imported as it is: the build directory's key (this
    source, this torch) is all it depends on. Going through ``cpp_extension.load`` would
    ask ninja, which rebuilds whenever the compiler's command line differs, and it does
    when the same torch is reached through another path (a virtualenv behind a symlink:
    two checkouts sharing one venv rebuilt each other's shim for a minute at every turn)."""
    spec = importlib.util.spec_from_file_location("torch_accel_C", library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

