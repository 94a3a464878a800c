"""The FUSE filesystem: a tree of device nodes and attribute files.

``dev/accel/accelN`` opens a device (one open = one ``OpenFile``); a write runs one command
transaction and a read at offset ``tag`` fetches its reply (see :mod:`abi.uapi`).
Attribute files render their value when opened and are served with ``direct_io`` so that
readers never see a stale page-cache copy of a changing value.

The tree changes shape only when a device is split into compute partitions or made whole
again (:mod:`kmod_emul.partition`): a partition's nodes are added to the node table and
removed from it, and the kernel is told to drop the names it cached of removed ones
(``invalidate_entry_async``), since names are cached for ``CACHE_TIMEOUT_S``. A name that
was never there is not cached (a lookup that answers ENOENT leaves no lasting negative
entry), so an added node is found at once.

Handlers never wait for the device (:mod:`kmod_emul.drv`), and each process reaches a
device node through an inode of its own. The kernel serialises the writes to one inode (FUSE
takes the inode's lock for every direct-I/O write unless the file system opts into parallel
writes, which libfuse 3.14 cannot ask for): with one inode per device, one tenant's threads
looping on commands queued every other tenant's commands behind theirs (bench
``bystander_under_floods`` measures a bystander's DEVICE_QUERY under such a flood). So a lookup of
``dev/accel/accelN`` answers with an inode of the calling process (``Tree.instance``), never
cached (``entry_timeout`` 0), so that every open walks to its own process's inode; a process's
threads still share theirs, so a flood queues only behind itself. The kernel's lookup count of
each such inode is kept, and the inode goes when the kernel forgets it (``forget``). The kernel
still hands the daemon every process's requests in one queue, in arrival order, so the
device-node writes and reads it has read start in turns by process (:mod:`kmod_emul.turns`;
debugfs ``accel/turns`` lists the last starts).

Permissions are the driver's own checks (the mount has no ``default_permissions``): writing
an attribute needs root, as does anything under ``sys/kernel/debug`` and a device's
``devcoredump/`` (see :mod:`kmod_emul.sysfs`, :mod:`kmod_emul.coredump`). The kernel's
mode-bit checks are off so that every refusal reaches the driver, which counts and logs
it (:mod:`kmod_emul.isolation`); ``access`` answers by the same rules.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pyfuse3

from abi import uapi
from kmod_emul import drv
from kmod_emul.attr import ATTR_SIZE, Attr, Writer
from kmod_emul.context import OpenFile, tgid_of
from kmod_emul.coredump import devcoredump_attrs
from kmod_emul.device import AccelDevice
from kmod_emul.errors import DriverError
from kmod_emul.faultlog import FaultLog, Watcher
from kmod_emul.isolation import isolation_attrs
from kmod_emul.partition import Partitions, partition_attrs, partition_debug_attrs
from kmod_emul.ras import ras_attrs
from kmod_emul.sysfs import debug_attrs, device_attrs, limit_attrs, module_attrs, reset_mask_attrs
from kmod_emul.turns import Turns

log = logging.getLogger(__name__)

#: The tree changes shape only on a partition mode change, which invalidates what it
#: removes, so the kernel may cache names and attributes for long.
CACHE_TIMEOUT_S = 300.0


@dataclass(eq=False)
class Node:
    inode: int
    mode: int
    children: dict[bytes, Node] = field(default_factory=dict)
    attr: Attr | None = None
    device: AccelDevice | None = None
    events: FaultLog | None = None  # the device's event node: each open is a watcher
    root_only: bool = False  # debugfs, devcoredump: neither listed nor opened but by root
    #: the device an attribute or directory describes (where a refused user is counted)
    of: AccelDevice | None = None
    #: a device node's per-process inode: (the device node's inode, the process's tgid)
    instance_of: tuple[int, int] | None = None


class Tree:
    """Builds the node table; inodes are allocated in creation order from ROOT_INODE."""

    def __init__(self) -> None:
        self._inodes = itertools.count(pyfuse3.ROOT_INODE)
        self.nodes: dict[int, Node] = {}
        self.root = self._new(stat.S_IFDIR | 0o755)
        #: (device node inode, tgid) -> that process's inode of the device node
        self._instances: dict[tuple[int, int], Node] = {}
        #: the kernel's lookup count of each per-process inode (FUSE's nlookup)
        self._lookups: dict[int, int] = {}

    def _new(self, mode: int, **kw: object) -> Node:
        node = Node(next(self._inodes), mode, **kw)  # type: ignore[arg-type]
        self.nodes[node.inode] = node
        return node

    def mkdir(self, path: str, root_only: bool = False, of: AccelDevice | None = None) -> Node:
        """The directory at ``path``, made with its parents if missing; ``of`` is the
        device the last component describes (the parents describe no one device)."""
        node = self.root
        parts = path.split("/")
        for i, part in enumerate(parts):
            key = part.encode()
            if key not in node.children:
                node.children[key] = self._new(stat.S_IFDIR | (0o700 if root_only else 0o755),
                                               root_only=root_only,
                                               of=of if i == len(parts) - 1 else None)
            node = node.children[key]
        return node

    def add_attrs(self, path: str, attrs: dict[str, Attr], root_only: bool = False,
                  of: AccelDevice | None = None) -> None:
        parent = self.mkdir(path, root_only, of)
        for name, attr in attrs.items():
            perm = ((0o400 if root_only else 0o444) if attr.read else 0) | (0o200 if attr.write else 0)
            parent.children[name.encode()] = self._new(stat.S_IFREG | perm, attr=attr,
                                                       root_only=root_only, of=of)

    def add_events(self, path: str, name: str, flog: FaultLog) -> None:
        """A blocking, pollable event stream. 0666: anyone may watch (and set the filter
        of their own watcher); what each sees is filtered by who they are."""
        self.mkdir(path).children[name.encode()] = self._new(stat.S_IFREG | 0o666,
                                                             events=flog)

    def add_device(self, dev: AccelDevice) -> None:
        """Every node of one device: its device node, event node, sysfs and debugfs."""
        parent = self.mkdir("dev/accel")
        parent.children[dev.name.encode()] = self._new(stat.S_IFREG | 0o666, device=dev)
        cls = f"{uapi.CLASS_DIR}/{dev.name}"
        self.add_attrs(cls, device_attrs(dev), of=dev)
        self.add_attrs(cls, reset_mask_attrs(), of=dev)
        self.add_events(uapi.EVENTS_DIR, dev.name, dev.faults)
        self.add_attrs(f"{cls}/limits", limit_attrs(dev), of=dev)
        self.add_attrs(f"{cls}/ras", ras_attrs(dev), of=dev)
        self.add_attrs(f"{cls}/isolation", isolation_attrs(dev.isolation), of=dev)
        self.add_attrs(f"{cls}/devcoredump", devcoredump_attrs(dev), root_only=True, of=dev)
        self.add_attrs(f"sys/kernel/debug/accel/{dev.name}", debug_attrs(dev), root_only=True,
                       of=dev)

    def instance(self, node: Node, tgid: int) -> Node:
        """Process ``tgid``'s inode of device node ``node``, counted as looked up once more
        (made at its first lookup, dropped once the kernel forgets it: ``forget``)."""
        key = (node.inode, tgid)
        inst = self._instances.get(key)
        if inst is None:
            inst = self._instances[key] = self._new(node.mode, device=node.device, of=node.of,
                                                    instance_of=key)
        self._lookups[inst.inode] = self._lookups.get(inst.inode, 0) + 1
        return inst

    def forget(self, inode: int, count: int) -> None:
        """The kernel dropped ``count`` lookups of ``inode``; a per-process inode goes with
        its last (nothing has it open then: an open file holds its inode)."""
        left = self._lookups.get(inode)
        if left is None:
            return
        if left > count:
            self._lookups[inode] = left - count
            return
        del self._lookups[inode]
        node = self.nodes.pop(inode, None)
        if node is not None and node.instance_of is not None:
            self._instances.pop(node.instance_of, None)

    def remove_device(self, dev: AccelDevice) -> list[tuple[int, bytes]]:
        """Drop every node ``add_device`` made; the (parent inode, name) of each name
        removed, for the kernel to forget. Inodes are never reused, so a stale cached one
        answers ENOENT rather than reaching another device's node."""
        removed = []
        for path in ("dev/accel", uapi.CLASS_DIR, uapi.EVENTS_DIR, "sys/kernel/debug/accel"):
            parent = self.mkdir(path)
            node = parent.children.pop(dev.name.encode(), None)
            if node is not None:
                removed.append((parent.inode, dev.name.encode()))
                for gone in _subtree(node):
                    del self.nodes[gone.inode]
        for key, inst in list(self._instances.items()):  # processes' inodes of its node
            if inst.device is dev:
                del self._instances[key]
                self.nodes.pop(inst.inode, None)
        return removed


def _privileged(node: Node, ctx: pyfuse3.RequestContext, how: str) -> pyfuse3.FUSEError:
    """EACCES for a user who is not root, counted on the device the node describes."""
    if node.of is not None:
        node.of.isolation.refuse("privileged", tgid_of(ctx.pid), ctx.uid,
                                 f"{how} a root-only attribute", errno.EACCES)
    return pyfuse3.FUSEError(errno.EACCES)


def _subtree(node: Node) -> Iterator[Node]:
    yield node
    for child in node.children.values():
        yield from _subtree(child)


def build_tree(info: drv.DriverInfo, devices: list[AccelDevice], partitions: Partitions) -> Tree:
    """The physical devices (each with its partition attributes), then the partitions
    that are enabled."""
    tree = Tree()
    tree.mkdir("dev/accel")
    tree.mkdir(uapi.CLASS_DIR)
    tree.mkdir("sys/kernel/debug", root_only=True)
    for dev in devices:
        tree.add_device(dev)
        tree.add_attrs(f"{uapi.CLASS_DIR}/{dev.name}", partition_attrs(partitions, dev),
                       of=dev)
        tree.add_attrs(f"sys/kernel/debug/accel/{dev.name}",
                       partition_debug_attrs(partitions, dev), root_only=True, of=dev)
    for dev in partitions.enabled():
        tree.add_device(dev)
    tree.add_attrs("sys/module/accel_emu", module_attrs(info, devices))
    return tree


@dataclass(eq=False)
class AttrHandle:
    node: Node
    content: bytes
    writer: Writer


def _fuse_error(exc: Exception) -> pyfuse3.FUSEError:
    """The errno a request fails with. A driver bug answers EIO to its caller and is
    logged, instead of taking every tenant's device down with the daemon."""
    if isinstance(exc, DriverError):
        log.debug("answering %s", exc)
        return pyfuse3.FUSEError(exc.errno)
    log.error("driver bug answering a request", exc_info=exc)
    return pyfuse3.FUSEError(errno.EIO)


class AccelFS(pyfuse3.Operations):
    def __init__(self, tree: Tree, info: drv.DriverInfo) -> None:
        super().__init__()
        self.tree = tree
        self.info = info
        self._handles: dict[int, OpenFile | AttrHandle | Watcher] = {}
        self._fh = itertools.count(1)
        self._mtime_ns = time.time_ns()
        #: device-node writes and reads start in turns by process (kmod_emul/turns.py)
        self.turns = Turns()
        tree.add_attrs("sys/kernel/debug/accel", {"turns": Attr(read=self.turns.render)},
                       root_only=True)

    def add_device(self, dev: AccelDevice) -> None:
        """A partition enabled: its nodes appear (nothing cached stands in their way)."""
        self.tree.add_device(dev)

    def remove_device(self, dev: AccelDevice) -> None:
        """A partition disabled: its nodes go, and the kernel forgets their names."""
        for parent_inode, name in self.tree.remove_device(dev):
            pyfuse3.invalidate_entry_async(parent_inode, name, ignore_enoent=True)

    def _node(self, inode: int) -> Node:
        try:
            return self.tree.nodes[inode]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        node = self._node(inode)
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = inode
        entry.st_mode = node.mode
        entry.st_nlink = 2 + sum(stat.S_ISDIR(c.mode) for c in node.children.values()) \
            if stat.S_ISDIR(node.mode) else 1
        entry.st_size = ATTR_SIZE if node.attr else 0
        entry.st_uid = entry.st_gid = 0
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = self._mtime_ns
        entry.entry_timeout = entry.attr_timeout = CACHE_TIMEOUT_S
        if node.device is not None:  # looked up again by every path walk: lookup
            entry.entry_timeout = 0
        return entry

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        parent = self._node(parent_inode)
        if parent.root_only and ctx.uid != 0:  # as a 0700 directory's names are
            raise _privileged(parent, ctx, "look up in")
        child = parent.children.get(name)
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if child.device is not None:  # the calling process's own inode (module docstring)
            child = self.tree.instance(child, tgid_of(ctx.pid))
        return await self.getattr(child.inode)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for inode, count in inode_list:
            self.tree.forget(inode, count)

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        """access(2) by the rules ``open`` and ``opendir`` enforce (the mount leaves
        permission checks to us): root may do anything; others may not enter root-only
        nodes, nor write attributes, nor execute files."""
        node = self._node(inode)
        if ctx.uid == 0:
            return True
        if node.root_only:
            return False
        if node.attr is not None:
            return not mode & (os.W_OK | os.X_OK) and (not mode & os.R_OK or bool(node.attr.read))
        return stat.S_ISDIR(node.mode) or not mode & os.X_OK

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        # `echo 1 > attr` truncates first; attribute files have no length to change.
        return await self.getattr(inode)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        node = self._node(inode)
        if not stat.S_ISDIR(node.mode):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if node.root_only and ctx.uid != 0:
            raise _privileged(node, ctx, "list")
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = sorted(self._node(fh).children.items())
        for i, (name, child) in enumerate(entries[start_id:], start_id):
            if not pyfuse3.readdir_reply(token, name, await self.getattr(child.inode), i + 1):
                break

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if node.device is not None:
            try:
                opened = node.device.tenants.open(ctx.pid, ctx.uid, ctx.gid)
            except Exception as exc:  # noqa: BLE001 - see _fuse_error
                raise _fuse_error(exc) from None
            self.turns.opened(opened.pid)
            handle: OpenFile | AttrHandle | Watcher = opened
        elif node.events is not None:
            try:
                handle = node.events.watch(ctx.uid, tgid_of(ctx.pid), bool(flags & os.O_NONBLOCK))
            except Exception as exc:  # noqa: BLE001 - see _fuse_error
                raise _fuse_error(exc) from None
        elif node.attr is not None:
            writing = flags & os.O_ACCMODE != os.O_RDONLY
            reading = flags & os.O_ACCMODE != os.O_WRONLY
            if (writing and node.attr.write is None) or (reading and node.attr.read is None):
                raise pyfuse3.FUSEError(errno.EACCES)
            if (writing or node.root_only) and ctx.uid != 0:
                raise _privileged(node, ctx, "write" if writing else "read")
            try:
                text = node.attr.render(ctx.uid) if reading else ""
            except Exception as exc:  # noqa: BLE001 - see _fuse_error
                raise _fuse_error(exc) from None
            handle = AttrHandle(node, (text + "\n").encode() if reading else b"",
                                Writer(tgid_of(ctx.pid), ctx.uid))
        else:
            raise pyfuse3.FUSEError(errno.EISDIR)
        fh = next(self._fh)
        self._handles[fh] = handle
        # an event node is a stream, as a pipe is: the kernel answers pread(2) ESPIPE
        # itself, and serialises read(2) on the open file's position lock (it does not
        # serialise preads: 400 threads in pread took every request task; see
        # kmod_emul/faultlog.py, WaitingReads)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False,
                                nonseekable=isinstance(handle, Watcher))

    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handles[fh]
        try:
            if isinstance(handle, OpenFile):  # a command's reply: the hot path, tested first
                if not self.turns.start_now(handle.pid):
                    await self.turns.take(handle.pid)
                return drv.read(handle, off, size)
            if isinstance(handle, AttrHandle):
                return handle.content[off : off + size]
            return await handle.read(size)  # a Watcher's event
        except Exception as exc:  # noqa: BLE001 - see _fuse_error
            raise _fuse_error(exc) from None

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handles[fh]
        try:
            if isinstance(handle, OpenFile):  # a command: the hot path, tested first
                if not self.turns.start_now(handle.pid):
                    await self.turns.take(handle.pid)
                pending = drv.execute(self.info, handle, buf)
                if pending is not None:  # MODULE_LOAD: its checks run in a thread
                    await pending
            elif isinstance(handle, AttrHandle):
                assert handle.node.attr is not None
                pending = handle.node.attr.store(buf, handle.writer)
                if pending is not None:  # a change that takes a while (a partition mode)
                    await pending
            else:
                handle.configure(buf.decode(errors="replace"))  # a Watcher's
        except Exception as exc:  # noqa: BLE001 - see _fuse_error
            raise _fuse_error(exc) from None
        return len(buf)

    async def poll(self, inode: int, fh: int, poll_handle: pyfuse3.PollHandle | None,
                   ctx: pyfuse3.RequestContext) -> int:
        """An event node is readable once it has an event; everything else always is."""
        handle = self._handles.get(fh)
        if not isinstance(handle, Watcher):
            return select.POLLIN | select.POLLOUT
        if handle.ready():
            return select.POLLIN
        handle.poll_handle = poll_handle  # Watcher.offer notifies it
        return 0

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if isinstance(handle, Watcher):
            handle.close()
        if isinstance(handle, OpenFile):
            self.turns.closed(handle.pid)
            try:
                handle.device.tenants.release(handle)
            except Exception as exc:  # noqa: BLE001 - see _fuse_error
                _fuse_error(exc)
