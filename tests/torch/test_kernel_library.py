"""The vendor kernel library on a real mount (firmware/jit.py ``KernelCache.library``,
built by bench/kernel_library.py, ``make kernels``): a daemon with an empty state
directory runs the MLP's and the CNN's first training step without compiling a kernel.

The library is the one ``make setup`` built into the checkout (``make test`` rebuilds it
first when the compiler or torch_accel's kernels changed), i.e. what a user's firmware
finds: building a second one here would only repeat that build (about 40 s of the suite)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from firmware.jit import LIBRARY_DIR
from testkit import REPO


@pytest.mark.timeout(300)
def test_first_steps_load_the_library_instead_of_compiling(
        make_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    assert any(LIBRARY_DIR.glob("??/*")), f"no kernel library in {LIBRARY_DIR}: run `make kernels`"
    monkeypatch.setenv("AEMU_KERNEL_LIBRARY", str(LIBRARY_DIR))  # the firmware inherits it
    d = make_daemon(jit_cache="private")
    assert not any(d.jit_cache_dir.iterdir())  # an empty state directory
    subprocess.run([sys.executable, "-m", "bench.kernel_library", "--workload"], check=True,
                   cwd=REPO, env=d.env(), timeout=240)
    compiles = int(d.attr(0, "jit_compiles"))
    assert compiles == 0, f"{compiles} kernels compiled: the library is stale, run `make kernels`"
    assert int(d.attr(0, "jit_hits")) > 0
