"""torch_accel's shim build (torch_accel/_build.py): a build killed midway leaves torch's
baton file behind, and the next import must not wait on it forever."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testkit import REPO


@pytest.mark.timeout(300)
def test_a_leftover_build_baton_does_not_hang_the_next_import():
    from torch_accel import _build  # noqa: PLC0415 - torch only for this test

    where = _build.build_dir()
    where.mkdir(parents=True, exist_ok=True)
    (where / "lock").write_text("")  # what a killed torch.utils.cpp_extension build leaves
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    out = subprocess.run([sys.executable, "-c", "import torch_accel; print(torch_accel._C.__name__)"],
                         capture_output=True, text=True, env=env, timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch_accel_C"]
    assert not (where / "lock").exists()


@pytest.mark.timeout(300)
def test_a_finished_build_is_loaded_without_asking_ninja():
    """A finished build directory's library is imported as it is: ninja rebuilt it
    whenever the compiler's command line differed, as it does for the same torch reached
    through a symlinked virtualenv (two checkouts sharing one rebuilt each other's shim).
    A build file ninja cannot read shows that nothing asked it."""
    from torch_accel import _build  # noqa: PLC0415 - torch only for this test

    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    load = [sys.executable, "-c", "import torch_accel; print(torch_accel._C.__name__)"]
    subprocess.run(load, check=True, capture_output=True, env=env, timeout=240, cwd=REPO)
    where = _build.build_dir()
    assert (where / _build.DONE).exists()
    ninja = where / "build.ninja"
    kept = ninja.read_bytes()
    try:
        ninja.write_text("this is not a ninja file\n")
        out = subprocess.run(load, capture_output=True, text=True, env=env, timeout=240,
                             cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["torch_accel_C"]
        assert ninja.read_text() == "this is not a ninja file\n"
    finally:
        ninja.write_bytes(kept)
