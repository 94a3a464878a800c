"""``python -m bench`` itself: a bench that cannot list or select its rows is found here, not
at the end of a half-hour run (the figures themselves are never asserted: docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.suite import BENCHMARKS
from stress.harness import REPO


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


@pytest.mark.timeout(90)
def test_list_names_every_benchmark_with_its_summary():
    out = _bench("--list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.partition(":")[0] for ln in lines] == [name for name, _ in BENCHMARKS]
    assert all(ln.partition(": ")[2].strip() for ln in lines), lines


@pytest.mark.timeout(90)
def test_only_matching_nothing_is_an_error_that_starts_no_server():
    out = _bench("--only", "no-such-benchmark")
    assert out.returncode == 1
    assert out.stderr.strip() == "bench: nothing matches ['no-such-benchmark']"
    assert out.stdout == ""


@pytest.mark.timeout(90)
def test_compare_refuses_what_is_not_a_commit_before_making_a_worktree():
    before = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True,
                            cwd=REPO, check=True).stdout
    out = subprocess.run([sys.executable, "-m", "bench.compare", "no-such-commit"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 1
    assert out.stderr.strip() == "bench.compare: 'no-such-commit' is not a commit"
    assert subprocess.run(["git", "worktree", "list"], capture_output=True, text=True,
                          cwd=REPO, check=True).stdout == before
def test_profile_driver_in_process_times_every_piece():
    """``python -m bench.profile_driver`` builds its device with kmod_emul.offline, as the
    driver's unit tests do: when the device's construction changes, this fails here (it
    once went stale unnoticed: a constructor argument was added)."""
    from bench import profile_driver

    rows = profile_driver.in_process(number=3, repeat=1)
    assert len(rows) == 11 and rows[0][0].startswith("drv.execute + drv.take_reply")
    assert all(us > 0 for _, us in rows), rows
