"""The daemon's log file is bounded (tools/accel_emud.py, ``DaemonLog``): cut past its
size, the last cuts kept and no more, with the daemon's stdout and stderr following it to
each new file. Run in a child process: the handler takes over that process's stdout and
stderr, as the daemon's does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testkit import REPO
from tools.accel_emud import LOG_BACKUPS

pytestmark = pytest.mark.timeout(60)

SMALL = 4096

CHILD = f"""
import logging, os, sys
from pathlib import Path
from tools import accel_emud
accel_emud.LOG_MAX_BYTES = {SMALL}
logging.basicConfig(level=logging.INFO, format=accel_emud.LOG_FORMAT,
                    handlers=[accel_emud.DaemonLog(Path(sys.argv[1]))])
log = logging.getLogger("flood")
for i in range(400):
    log.info("line %d %s", i, "x" * 100)
    if i % 100 == 99:
        os.write(2, b"stderr after line %d\\n" % i)
log.info("the last line")
print("stdout at the end", flush=True)
os.write(2, b"stderr at the end\\n")
"""


def test_the_daemon_log_is_cut_and_stdout_and_stderr_follow_it(tmp_path: Path):
    path = tmp_path / "accel-emud.log"
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], cwd=REPO, timeout=30,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == out.stderr == ""  # both went to the log
    files = sorted(tmp_path.iterdir())
    assert files == [path, *(path.with_name(f"{path.name}.{i}")
                             for i in range(1, LOG_BACKUPS + 1))]
    # a cut is made before the line that would pass the size; stderr's bytes count too
    assert all(f.stat().st_size <= SMALL + 200 for f in files), [
        f.stat().st_size for f in files]
    # what is written to stdout and stderr lands in the current file, after the last cut
    assert path.read_text().splitlines()[-2:] == ["stdout at the end", "stderr at the end"]
