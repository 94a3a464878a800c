"""The vendor kernel library on a real mount (firmware/jit.py ``KernelCache.library``,
built by bench/kernel_library.py, ``make kernels``): a daemon with an empty state
directory runs the MLP's and the CNN's first training step without compiling a kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testkit import REPO


@pytest.mark.timeout(600)
def test_first_steps_load_the_library_instead_of_compiling(
        make_daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    library = tmp_path / "library"
    subprocess.run([sys.executable, "-m", "bench.kernel_library", "--dest", str(library)],
                   check=True, cwd=REPO, timeout=300)
    assert any(library.glob("??/*"))
    monkeypatch.setenv("AEMU_KERNEL_LIBRARY", str(library))  # the firmware inherits it
    d = make_daemon(jit_cache="private")
    assert not any(d.jit_cache_dir.iterdir())  # an empty state directory
    subprocess.run([sys.executable, "-m", "bench.kernel_library", "--workload"], check=True,
                   cwd=REPO, env=d.env(), timeout=300)
    assert int(d.attr(0, "jit_compiles")) == 0
    assert int(d.attr(0, "jit_hits")) > 0
