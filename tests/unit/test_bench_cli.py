"""``python -m bench`` itself: a bench that cannot list or select its rows is found here, not
at the end of a half-hour run (the figures themselves are never asserted: docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.suite import BENCHMARKS
from testkit import REPO


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
    assert len(rows) == 8 and rows[0][0].startswith("AccelFS.write + AccelFS.read")
    assert all(us > 0 for _, us in rows), rows


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _recorded() -> tuple[dict, dict]:
    """Results as a run records them: two groups, goals met, missed and absent."""
    from bench.core import Row

    meta = {"time": "2026-12-01T12:00:00+0000", "host": "bench-host", "cpus": 2,
            "loadavg": (0.5, 0.4, 0.3), "commit": "0123456789abcdef", "dirty": False,
            "quick": True}
    groups = {
        "command_round_trips": [
            Row("device-query round trip", 120.0, "echo-fs pwrite+pread", 100.0, goal=1.3),
            Row("no-op | submit+wait", 450.0, "echo-fs pwrite+pread", 100.0)],
        "kernels": [Row("SIMT saxpy", 2.0, "numba CUDA simulator", 50000.0, goal=1e-4),
                    Row("GEMM 256x256", 9.0, "numpy matmul", 1.0, "ms", goal=2.0)],
    }
    return meta, groups


@pytest.mark.timeout(60)
def test_report_has_every_row_and_one_valid_png_per_group(tmp_path):
    from bench.core import Failure
    from bench.report import write_report

    meta, groups = _recorded()
    (tmp_path / "stale.png").write_bytes(PNG_MAGIC)  # a plot of an earlier run
    written = write_report(tmp_path, meta, groups, [Failure("floods", "Trace\nRuntimeError: x")])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "command_round_trips.png", "kernels.png", "report.md", "results.json"]
    assert set(written) == set(tmp_path.iterdir())
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 2000
    md = (tmp_path / "report.md").read_text()
    assert "- date: 2026-12-01T12:00:00+0000" in md and "- host: bench-host" in md
    assert "- commit: 0123456789ab" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert table[0] == ("| group | benchmark | figure | baseline | baseline value | ratio | "
                        "goal | met |")
    assert table[1:] == [
        "| command_round_trips | device-query round trip | 120.0 us | echo-fs pwrite+pread | "
        "100.0 us | 1.2x | <= 1.3x | yes |",
        "| command_round_trips | no-op \\| submit+wait | 450.0 us | echo-fs pwrite+pread | "
        "100.0 us | 4.5x | - | - |",
        "| kernels | SIMT saxpy | 2.0 us | numba CUDA simulator | 50,000.0 us | 4e-05x | "
        "<= 0.0001x | yes |",
        "| kernels | GEMM 256x256 | 9.0 ms | numpy matmul | 1.0 ms | 9x | <= 2x | NO |"]
    assert "**floods failed:** `RuntimeError: x`" in md
    assert "![kernels](kernels.png)" in md


@pytest.mark.timeout(120)
def test_a_quick_run_writes_its_report_where_told(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench", "--quick", "--only", "sysfs_read",
                          "--report", str(tmp_path / "rep")], capture_output=True, text=True,
                         timeout=110, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    md = (tmp_path / "rep" / "report.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| sysfs_read |")]
    assert len(rows) == 1 and "sysfs attribute read (accel0/state)" in rows[0]
    assert (tmp_path / "rep" / "sysfs_read.png").read_bytes().startswith(PNG_MAGIC)
    assert f"report written to {tmp_path / 'rep' / 'report.md'}" in out.stdout
