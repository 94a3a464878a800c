"""Baselines for the submission path: what two Python processes cost with nothing else.

* ``PingPong``: a child process spins on a shared-memory word and answers; one round trip
  is the floor of a submit-to-completion (the child is the "firmware", spinning).
* ``PipeWake``: the child sleeps in select(2) on a pipe and answers in shared memory; one
  round trip is the floor of waking an idle firmware.
* ``bare_ring_rate``: writing 64-byte packets into a shared ring and publishing a write
  pointer, with a consumer process draining it: the floor of an asynchronous launch.
"""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time

_U64 = struct.Struct("<Q")

_CHILD = r"""
import mmap, os, select, struct, sys
U = struct.Struct("<Q")
fd = os.open(sys.argv[1], os.O_RDWR); m = mmap.mmap(fd, 4096)
mode = sys.argv[2]
pipe_r = int(sys.argv[3]) if mode == "pipe" else -1
seen = 0
while True:
    if mode == "spin":
        v = U.unpack_from(m, 0)[0]
        if v == seen:
            continue
    elif mode == "ring":
        v = U.unpack_from(m, 0)[0]
        if v != seen:
            U.pack_into(m, 64, v)        # consumed up to here
        seen = v
        if U.unpack_from(m, 128)[0]:
            break
        continue
    else:
        select.select([pipe_r], [], [])
        os.read(pipe_r, 64)
        v = U.unpack_from(m, 0)[0]
    if v == 2**64 - 1:
        break
    seen = v
    U.pack_into(m, 64, v)
"""


class _Child:
    def __init__(self, mode: str) -> None:
        self._file = tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="accel-bench-")
        self._file.truncate(4096)
        self.mem = mmap.mmap(self._file.fileno(), 4096)
        self.pipe_r, self.pipe_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, self._file.name, mode,
                                      str(self.pipe_r)], pass_fds=(self.pipe_r,))
        os.close(self.pipe_r)
        self.seq = 0

    def close(self) -> None:
        _U64.pack_into(self.mem, 0, 2**64 - 1)
        _U64.pack_into(self.mem, 128, 1)
        try:
            os.write(self.pipe_w, b"x")
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.pipe_w)
        self.mem.close()
        self._file.close()


class PingPong(_Child):
    def __init__(self) -> None:
        super().__init__("spin")

    def round_trip(self) -> None:
        self.seq += 1
        _U64.pack_into(self.mem, 0, self.seq)
        while _U64.unpack_from(self.mem, 64)[0] != self.seq:
            pass


class PipeWake(_Child):
    def __init__(self) -> None:
        super().__init__("pipe")

    def round_trip(self) -> None:
        self.seq += 1
        _U64.pack_into(self.mem, 0, self.seq)
        os.write(self.pipe_w, b"\1")
        while _U64.unpack_from(self.mem, 64)[0] != self.seq:
            pass


def bare_ring_rate(packets: int) -> float:
    """Seconds per packet written into a shared ring with a live consumer."""
    child = _Child("ring")
    ring = mmap.mmap(-1, 1024 * 64)
    pkt = bytes(64)
    try:
        time.sleep(0.05)
        t0 = time.perf_counter()
        for i in range(packets):
            while i - _U64.unpack_from(child.mem, 64)[0] >= 1024:
                pass
            off = (i % 1024) * 64
            ring[off : off + 64] = pkt
            _U64.pack_into(child.mem, 0, i + 1)
        elapsed = time.perf_counter() - t0
    finally:
        child.close()
    return elapsed / packets
