"""The daemon's loop is never frozen by a read that blocks (kmod_emul/daemon.py, LoopWatch).

pyfuse3 reads /dev/fuse with a blocking read(2) holding the interpreter's lock once poll
said it was readable, and a request withdrawn in between (its process killed) left the read
blocked, the whole daemon with it, until another request came. Here the loop blocks the
same way -- a read of an empty pipe through ``ctypes.PyDLL``, which keeps the interpreter's
lock -- and the watchdog must get it out with EINTR within a fraction of a second, and be
gone once stopped. In a child process: the watch installs a SIGUSR1 handler.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kmod_emul.daemon import LOOP_STUCK_S
from stress.harness import REPO

pytestmark = pytest.mark.timeout(60)

CHILD = """
import ctypes, errno, json, os, time, trio
from kmod_emul.daemon import LoopWatch

async def main():
    watch = LoopWatch()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.tick)
        await trio.sleep(1.0)  # ticking: the watchdog leaves the loop alone
        r, _w = os.pipe()
        libc = ctypes.PyDLL(None, use_errno=True)  # the lock held, as pyfuse3's read holds it
        buf = ctypes.create_string_buffer(1)
        t0 = time.monotonic()
        got = libc.read(r, buf, 1)
        took = time.monotonic() - t0
        watch.stop()
        nursery.cancel_scope.cancel()
    print(json.dumps([got, errno.errorcode.get(ctypes.get_errno()), took,
                      watch._watchdog.returncode]))

trio.run(main)
"""


def test_a_read_that_blocks_the_loop_is_interrupted_and_the_watchdog_stops():
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, timeout=30,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got, err, took, watchdog = json.loads(out.stdout)
    assert (got, err, watchdog) == (-1, "EINTR", 0)
    assert LOOP_STUCK_S / 2 <= took < 4 * LOOP_STUCK_S, took
