"""The floor of the command path: a minimal pyfuse3 + trio filesystem in its own process.

``python -m bench.echo_fs MOUNTPOINT [--ready-fd FD]`` mounts two files and serves them
until SIGTERM/SIGINT/SIGHUP, then unmounts:

* ``echo`` (mode 0666, ``direct_io``): a write stores its buffer under the write's offset
  for this open file; a read at that offset returns the buffer (truncated to the read size)
  and forgets it. ``pwrite(fd, buf, tag)`` + ``pread(fd, n, tag)`` is therefore exactly the
  syscall pattern of an accel command transaction (``pwrite`` of header+struct, then
  ``pread`` of the reply at the tag), with no work behind it: the baseline of every
  driver-mediated command.
* ``attr`` (mode 0444, ``direct_io``): a fixed small text, rendered at open like a sysfs
  attribute; the baseline of an attribute read (open + read + close).

It mirrors what the driver's filesystem does where the kernel can tell the difference
(``default_permissions``, ``direct_io`` without ``keep_cache``, 300 s entry and attribute
timeouts, no ``flush`` handler, ``pyfuse3.main(min_tasks=4, max_tasks=256)``), and nothing
else, so that "measured / echo" is the driver's own cost per FUSE round trip.

``--ready-fd`` receives ``ready\\n`` once the mount is live (as accel-emud's does), so the
benchmark can time "process start to mount ready" the same way for both.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

FSNAME_PREFIX = "bench-echo@"
CACHE_TIMEOUT_S = 300.0
ATTR_TEXT = b"operational\n"
_ROOT = pyfuse3.ROOT_INODE
_ECHO = _ROOT + 1
_ATTR = _ROOT + 2
_NAMES = {b"echo": _ECHO, b"attr": _ATTR}
_MODES = {
    _ROOT: stat.S_IFDIR | 0o755,
    _ECHO: stat.S_IFREG | 0o666,
    _ATTR: stat.S_IFREG | 0o444,
}


class EchoFS(pyfuse3.Operations):
    def __init__(self) -> None:
        super().__init__()
        self._mtime_ns = time.time_ns()
        self._next_fh = 1
        #: fh -> (inode, {offset: buffer}); per open file, like the driver's OpenFile.replies
        self._open: dict[int, tuple[int, dict[int, bytes]]] = {}

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        try:
            mode = _MODES[inode]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = inode
        entry.st_mode = mode
        entry.st_nlink = 2 if inode == _ROOT else 1
        entry.st_size = 4096 if inode == _ATTR else 0
        entry.st_uid = entry.st_gid = 0
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = self._mtime_ns
        entry.entry_timeout = entry.attr_timeout = CACHE_TIMEOUT_S
        return entry

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        inode = _NAMES.get(name) if parent_inode == _ROOT else None
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(inode)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode != _ROOT:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = sorted(_NAMES.items())
        for i, (name, inode) in enumerate(entries[start_id:], start_id):
            if not pyfuse3.readdir_reply(token, name, await self.getattr(inode), i + 1):
                break

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode not in (_ECHO, _ATTR):
            raise pyfuse3.FUSEError(errno.EISDIR if inode == _ROOT else errno.ENOENT)
        fh = self._next_fh
        self._next_fh += 1
        self._open[fh] = (inode, {})
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        inode, stored = self._open[fh]
        if inode == _ATTR:
            return ATTR_TEXT[off : off + size]
        buf = stored.pop(off, None)
        if buf is None:
            raise pyfuse3.FUSEError(errno.ENOMSG)
        return buf[:size]

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        inode, stored = self._open[fh]
        if inode != _ECHO:
            raise pyfuse3.FUSEError(errno.EBADF)
        stored[off] = buf
        return len(buf)

    async def release(self, fh: int) -> None:
        self._open.pop(fh, None)


async def _serve(mountpoint: str, ready_fd: int | None) -> None:
    options = set(pyfuse3.default_options) | {
        f"fsname={FSNAME_PREFIX}{os.getpid()}", "subtype=bench-echo"}
    pyfuse3.init(EchoFS(), mountpoint, options)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            if ready_fd is not None:
                os.write(ready_fd, b"ready\n")
                os.close(ready_fd)
            await pyfuse3.main(min_tasks=4, max_tasks=256)
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for _ in signals:
            scope.cancel()
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.echo_fs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mountpoint")
    p.add_argument("--ready-fd", type=int, default=None)
    args = p.parse_args(argv)
    os.makedirs(args.mountpoint, exist_ok=True)
    try:
        trio.run(_serve, args.mountpoint, args.ready_fd)
    except RuntimeError as exc:  # pyfuse3.init failures (no /dev/fuse, busy mountpoint)
        print(f"bench.echo_fs: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
