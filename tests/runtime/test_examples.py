"""A user's first minute: every Python block of the README and every script in examples/
runs, against a real mount, and checks what it computes (each asserts its results)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from testkit import REPO

README_BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
EXAMPLES = sorted((REPO / "examples").glob("*.py"))


def test_the_readme_has_python_to_run():
    assert README_BLOCKS and EXAMPLES


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", range(len(README_BLOCKS)))
def test_readme_python_block_runs(daemon, block, tmp_path):
    """Saved as a script, as a user would (``@runtime.kernel`` reads its source)."""
    script = tmp_path / "readme.py"
    script.write_text(README_BLOCKS[block])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=daemon.env(), timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stderr + out.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(daemon, script):
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=daemon.env(), timeout=240, cwd=REPO)
    assert out.returncode == 0, out.stderr + out.stdout
    assert out.stdout.strip(), "an example says what it computed"
