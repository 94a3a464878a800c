"""The daemon's loop is never frozen by a read that blocks (kmod_emul/daemon.py,
``interrupted_reads``).

pyfuse3 reads /dev/fuse with a blocking read(2) holding the interpreter's lock once poll
said it was readable, and a request withdrawn in between (its process killed) left the read
blocked, the whole daemon with it, until another request came. Here the loop blocks the
same way -- a read of an empty pipe through ``ctypes.PyDLL``, which keeps the interpreter's
lock -- and the timer must end it with EINTR within INTERRUPT_EVERY_S; once the block is
left, no timer runs. In a child process: it installs a SIGALRM handler and a timer. "Within"
is measured against the same run: the loop's own sleep of four timer periods before the
read, which a loaded machine stretches as much as it delays the timer's signal.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testkit import REPO

pytestmark = pytest.mark.timeout(60)

CHILD = """
import ctypes, errno, json, os, signal, time, trio
from kmod_emul.daemon import INTERRUPT_EVERY_S, interrupted_reads

async def main():
    with interrupted_reads():
        t0 = time.monotonic()
        await trio.sleep(4 * INTERRUPT_EVERY_S)  # the loop's own waits go on through the signals
        slept = time.monotonic() - t0
        r, _w = os.pipe()
        libc = ctypes.PyDLL(None, use_errno=True)  # the lock held, as pyfuse3's read holds it
        buf = ctypes.create_string_buffer(1)
        t0 = time.monotonic()
        got = libc.read(r, buf, 1)
        took = time.monotonic() - t0
    print(json.dumps([got, errno.errorcode.get(ctypes.get_errno()), took, slept,
                      signal.getitimer(signal.ITIMER_REAL)]))

trio.run(main)
"""


def test_a_read_that_blocks_the_loop_is_interrupted_and_the_timer_stops_after():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, timeout=30,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got, err, took, slept, timer = json.loads(out.stdout)
    assert (got, err, timer) == (-1, "EINTR", [0.0, 0.0])
    # the first tick ended it: well within the four periods the same run's sleep took
    assert took < slept, (took, slept)
