"""Where a DEVICE_QUERY spends its time inside the driver.

``python -m bench.profile_driver`` times the driver's pieces in this process, on a device
set up as after a boot (firmware image loaded) that runs no firmware and mounts nothing
(``kmod_emul.offline``, which the driver's unit tests use too): the daemon's handlers of a
command's write and its reply's read (``AccelFS.write``/``read``, their turns included), their
pieces (``Turns.start_now``, ``drv.execute`` + ``drv.read``, the struct's checks and copy,
``AccelDevice.describe``), and a sysfs attribute's render.

``python -m bench.profile_driver --daemon [N]`` also runs a real daemon under cProfile
(``python -m cProfile -o`` on ``accel-emud --foreground``), sends N device queries and
prints the daemon's top functions: the FUSE dispatch and trio scheduling around the
handlers, which the in-process timings cannot see. The daemon is always stopped.
"""

from __future__ import annotations

import argparse
import ctypes
import io
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from bench.procs import REPO, lazy_unmount, mounts_under

def _us(fn: Callable[[], object], number: int = 20000, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def in_process(number: int = 20000, repeat: int = 5) -> list[tuple[str, float]]:
    """Each piece's cost per call (best of ``repeat`` runs of ``number`` calls), in us."""
    from abi import uapi
    from firmware.image import IMAGE_DIR
    from kmod_emul import drv
    from kmod_emul.fs import AccelFS, Tree
    from kmod_emul.offline import OfflineDriver
    from kmod_emul.sysfs import device_attrs

    def us(fn: Callable[[], object], n: int = number) -> float:
        return _us(fn, number=n, repeat=repeat)

    def done(coro: Coroutine[Any, Any, object]) -> None:
        """Run a handler that does not suspend (a command's) without an event loop."""
        try:
            coro.send(None)
        except StopIteration:
            return
        raise RuntimeError("the handler suspended")

    with OfflineDriver(IMAGE_DIR) as driver:  # a booted device, no firmware, no mount
        dev, info = driver.devices[0], driver.info
        f = driver.open(0)
        fs = AccelFS(Tree(), info)
        fs._handles[1] = f  # an open file of this process, as AccelFS.open leaves it
        fs.turns.opened(f.pid)
        cmd = uapi.ACCEL_CMD_DEVICE_QUERY
        raw = uapi.CMD_HDR.pack(cmd.code, 0, 1) + bytes(uapi.accel_device_info())
        size = ctypes.sizeof(uapi.accel_device_info)

        def handlers() -> None:
            done(fs.write(1, 0, raw))
            done(fs.read(1, 1, size))

        def execute_and_read() -> None:
            drv.execute(info, f, raw)
            drv.read(f, 1, size)

        state_attr = device_attrs(dev)["state"]
        uuid_attr = device_attrs(dev)["uuid"]
        attr_n = max(1, number // 10)
        return [
            ("AccelFS.write + AccelFS.read (whole DEVICE_QUERY)", us(handlers)),
            ("  Turns.start_now (one process alone: no poll)", us(lambda: fs.turns.start_now(1))),
            ("  drv.execute + drv.read", us(execute_and_read)),
            ("    accel_device_info.reserved_clear", us(
                lambda: uapi.accel_device_info.reserved_clear(raw, uapi.CMD_HDR.size))),
            ("    accel_device_info.from_buffer_copy", us(
                lambda: uapi.accel_device_info.from_buffer_copy(raw, uapi.CMD_HDR.size))),
            ("    AccelDevice.describe", us(dev.describe)),
            ("sysfs state attribute render (Attr.read)", us(state_attr.read, attr_n)),
            ("sysfs uuid attribute render (Attr.read)", us(uuid_attr.read, attr_n)),
        ]


def daemon_profile(queries: int) -> str:
    """Profile a real daemon answering ``queries`` DEVICE_QUERYs; return the top of it."""
    from abi import uapi

    work = Path(tempfile.mkdtemp(prefix="accel-bench-prof-"))
    root, state, prof = work / "root", work / "state", work / "daemon.prof"
    read_fd, write_fd = os.pipe()
    cmd = [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "tools.accel_emud",
           "start", "--root", str(root), "--devices", "1", "--memory", "256M",
           "--state-dir", str(state), "--foreground", "--ready-fd", str(write_fd)]
    with open(work / "daemon.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log, pass_fds=(write_fd,), start_new_session=True)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as ready:
            if ready.readline() != b"ready\n":
                raise RuntimeError((work / "daemon.log").read_text()[-2000:])
        fd = os.open(root / uapi.DEV_DIR / "accel0", os.O_RDWR)
        code = uapi.ACCEL_CMD_DEVICE_QUERY.code
        payload = bytes(uapi.accel_device_info())
        size = ctypes.sizeof(uapi.accel_device_info)
        t0 = time.perf_counter()
        for tag in range(1, queries + 1):
            os.pwrite(fd, uapi.CMD_HDR.pack(code, 0, tag) + payload, 0)
            os.pread(fd, size, tag)
        elapsed = time.perf_counter() - t0
        os.close(fd)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if mounts_under(root):
            lazy_unmount(root)
    out = io.StringIO()
    out.write(f"{queries} DEVICE_QUERYs in {elapsed:.2f} s under cProfile "
              f"({elapsed / queries * 1e6:.0f} us each, profiler overhead included)\n")
    stats = pstats.Stats(str(prof), stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_driver", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--daemon", type=int, nargs="?", const=5000, default=0, metavar="N",
                   help="also cProfile a real daemon answering N device queries")
    args = p.parse_args(argv)
    print("in-process driver cost of one DEVICE_QUERY (best of 5, per call):")
    for name, us in in_process():
        print(f"  {name:<55} {us:8.2f} us")
    if args.daemon:
        print()
        print(daemon_profile(args.daemon))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
