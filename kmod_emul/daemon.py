"""The daemon's body: boot the devices, mount, serve until told to stop, clean up.

Structure (trio): one nursery owns a supervisor task per device, the FUSE request loop
and a signal watcher. SIGTERM, SIGINT or SIGHUP cancels the nursery; the ``finally``
unmounts and every device supervisor halts its firmware, so nothing outlives the daemon.
Should the daemon be SIGKILLed, its firmware processes read EOF on their doorbells and
halt, and the next start lazily unmounts the dead mount it finds.

The mount's ``fsname`` is ``accel-emud@PID``: ``/proc/mounts`` then says who serves a root
without touching the mount (which would hang if the daemon were stopped).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyfuse3
import trio

from kmod_emul import drv
from kmod_emul.device import AccelDevice, MemoryConfig
from kmod_emul.fs import AccelFS, build_tree
from kmod_emul.identity import IdentityStore, pci_bus_id
from kmod_emul.errors import DriverError
from kmod_emul.fw import load_image
from kmod_emul.limits import Limits, raise_fd_limit
from kmod_emul.memory import VramFile
from kmod_emul.partition import Partitions

log = logging.getLogger(__name__)

FSNAME_PREFIX = "accel-emud@"
#: FUSE requests served at once. A request that waits holds one (a blocking read of an
#: event node: kmod_emul/faultlog.py bounds those to a quarter of them), and once all are
#: held every other request waits in the kernel.
MAX_TASKS = 256
#: While pyfuse3 serves, a timer signal interrupts the loop's thread this often
#: (``interrupted_reads``).
INTERRUPT_EVERY_S = 0.25


@contextmanager
def interrupted_reads() -> Iterator[None]:
    """A read of /dev/fuse that would block the daemon ends within INTERRUPT_EVERY_S.

    pyfuse3 waits until /dev/fuse is readable, then reads it with a blocking read(2), the
    interpreter's lock held. A request can leave the device between the two: the kernel
    withdraws a request whose process was killed before the daemon read it, and an
    interrupt once its request is answered. The read then blocks the whole daemon until
    another request comes: no timer runs (a waiting read's slice, the firmware's
    heartbeat watch), no firmware message is handled. 400 threads of one process killed
    in read(2) of an event node froze it so in 2 of 12 tries, for as long as nobody else
    sent a request (their process unkillable meanwhile: its threads were queued behind
    reads the frozen loop could not end).

    No thread of the daemon can help while the read holds the interpreter's lock, but the
    kernel's interval timer can: SIGALRM every INTERRUPT_EVERY_S, whose handler does
    nothing. The kernel gives a process's signal to its main thread, the loop's, when that
    thread can take it; a blocked read answers EINTR, which pyfuse3 takes as "poll again",
    and any other wait of the loop is retried (PEP 475; trio's own). The timer runs only
    while pyfuse3 serves: libfuse's mount and unmount do not retry a call a signal
    interrupts. The handler stays: a signal generated as the timer stops may still come."""
    signal.signal(signal.SIGALRM, lambda signum, frame: None)
    signal.setitimer(signal.ITIMER_REAL, INTERRUPT_EVERY_S, INTERRUPT_EVERY_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


@dataclass(frozen=True)
class DaemonConfig:
    root: Path
    devices: int
    memory: int
    state_dir: Path
    firmware_dir: Path
    heartbeat_timeout_s: float = 2.0
    #: what a device does when its running firmware dies or hangs: "auto" or "manual"
    recovery: str = "auto"
    driver: drv.DriverInfo = drv.DriverInfo()
    #: device-local bytes one process may hold per device; 0 for no limit
    process_memory_limit: int = 0
    #: the operator's limits (``--limit``), by name: kmod_emul/limits.py
    limits: Mapping[str, int] = field(default_factory=dict)
    #: where the firmware keeps compiled kernels (default: STATE_DIR/jit-cache)
    jit_cache: Path | None = None
    #: device index -> bring-up step to fail (fault injection: seeds debugfs ``fail_step``
    #: before the first boot, when debugfs is not mounted yet)
    fail_steps: Mapping[int, str] = field(default_factory=dict)


class AlreadyServed(Exception):
    pass


@dataclass(frozen=True)
class MountInfo:
    root: Path
    pid: int | None

    @property
    def alive(self) -> bool:
        return self.pid is not None and pid_alive(self.pid)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie counts as dead: a daemon started in the background
    is reparented, and where no init reaps it, a killed one lingers as a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _unescape(field: str) -> str:
    """Undo the octal escapes of /proc/mounts (space, tab, newline, backslash)."""
    return field.encode().decode("unicode_escape")


def _fuse_mounts() -> Iterator[tuple[str, Path]]:
    """(source, mountpoint) of every FUSE mount in /proc/mounts."""
    with open("/proc/mounts") as f:
        for line in f:
            source, mountpoint, fstype, *_ = line.split()
            if fstype.startswith("fuse"):
                yield source, Path(_unescape(mountpoint))


def _mount_info(source: str, mountpoint: Path) -> MountInfo:
    pid_text = source[len(FSNAME_PREFIX):] if source.startswith(FSNAME_PREFIX) else ""
    return MountInfo(mountpoint, int(pid_text) if pid_text.isdigit() else None)


def find_mount(root: Path) -> MountInfo | None:
    """The accel-emud mount at ``root`` according to /proc/mounts, if any."""
    target = Path(os.path.realpath(root))
    for source, mountpoint in _fuse_mounts():
        if mountpoint == target:
            return _mount_info(source, mountpoint)
    return None


def accel_mounts() -> list[MountInfo]:
    """Every mount an accel-emud made (its source names the daemon), wherever it is."""
    return [_mount_info(source, mountpoint) for source, mountpoint in _fuse_mounts()
            if source.startswith(FSNAME_PREFIX)]


def unmount_stale(root: Path) -> None:
    """Lazily detach a mount whose daemon is gone (``fusermount3 -u -z``)."""
    subprocess.run(["fusermount3", "-u", "-z", str(root)], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def prepare_root(root: Path) -> None:
    """Refuse a served root, clear a dead mount, make sure the directory exists."""
    mount = find_mount(root)
    if mount is not None:
        if mount.alive:
            raise AlreadyServed(
                f"{root} is already served by accel-emud (pid {mount.pid}); "
                f"stop it first with: accel-emud stop --root {root}"
            )
        log.warning("clearing the stale mount at %s left by a dead daemon", root)
        unmount_stale(root)
    root.mkdir(parents=True, exist_ok=True)


def check_limits(config: DaemonConfig, fd_limit: int) -> None:
    """Refuse the operator's limits (LimitError) before anything is mounted, against the
    image the devices will boot. A missing or broken image is the devices' own failure,
    reported when they boot; their limits are checked again then."""
    if not config.limits:
        return
    try:
        image = load_image(config.firmware_dir)
    except DriverError:
        return
    Limits.for_device(image.config, config.devices, fd_limit, config.limits)


def make_devices(config: DaemonConfig) -> list[AccelDevice]:
    fd_limit = raise_fd_limit()
    check_limits(config, fd_limit)
    slots = [pci_bus_id(i) for i in range(config.devices)]
    identities = IdentityStore(config.state_dir).identities(slots)
    vram = {i: VramFile(f"accel{i}-vram", config.memory) for i in range(config.devices)}
    jit_cache = config.jit_cache or config.state_dir / "jit-cache"
    jit_cache.mkdir(parents=True, exist_ok=True)
    mem = MemoryConfig(vram, config.process_memory_limit, str(jit_cache), config.devices,
                       fd_limit, str(config.state_dir),
                       tuple(sorted(config.limits.items())))
    devices = [
        AccelDevice(i, identities[slot], config.memory, config.firmware_dir,
                    config.heartbeat_timeout_s, mem)
        for i, slot in enumerate(slots)
    ]
    for dev in devices:
        dev.all_devices = devices
        dev.fail_step = config.fail_steps.get(dev.index, "")
        dev.recovery = config.recovery
    return devices


async def serve(config: DaemonConfig, on_ready: Callable[[], None]) -> None:
    """Boot every device and enabled partition, mount the tree, call ``on_ready``, serve
    until signalled."""
    prepare_root(config.root)
    devices = make_devices(config)
    partitions = Partitions(devices, config.state_dir)
    partitions.restore()
    fs = AccelFS(build_tree(config.driver, devices, partitions), config.driver)
    partitions.nodes = fs
    # no default_permissions: the kernel would refuse other users by the mode bits before
    # the driver heard of it, and the driver counts and logs each refusal itself
    options = set(pyfuse3.default_options) - {"default_permissions"} | {
        f"fsname={FSNAME_PREFIX}{os.getpid()}",
        "subtype=accel-emu",
    }
    if os.geteuid() == 0:
        options.add("allow_other")  # other users' processes are tenants too
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, nursery.cancel_scope, devices)
        async with trio.open_nursery() as booting:  # boot the devices side by side
            for dev in devices:
                booting.start_soon(nursery.start, dev.run)
            booting.start_soon(partitions.start, nursery)
        pyfuse3.init(fs, str(config.root), options)
        fs.turns.watch(_fuse_fd())
        try:
            on_ready()
            log.info("serving %d device(s) at %s", len(devices), config.root)
            with interrupted_reads():
                await pyfuse3.main(min_tasks=4, max_tasks=MAX_TASKS)
        finally:
            pyfuse3.close(unmount=True)
            nursery.cancel_scope.cancel()


def _fuse_fd() -> int:
    """The descriptor of /dev/fuse that pyfuse3 reads requests from (it does not say which:
    the daemon opens /dev/fuse only through it, so it is the one there is)."""
    fds = [int(fd) for fd in os.listdir("/proc/self/fd")
           if _link(f"/proc/self/fd/{fd}") == "/dev/fuse"]
    if len(fds) != 1:
        raise RuntimeError(f"expected one descriptor of /dev/fuse, found {fds}")
    return fds[0]


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # the listing's own descriptor, closed by now
        return ""


#: What a context lost to a stop says (``accel-emud stop --force``, or a signal).
STOPPED = "the daemon was stopped by the operator"
#: How long a stop that lost contexts serves on, for their processes to read why.
STOP_GRACE_S = 0.5


async def _stop_on_signal(scope: trio.CancelScope, devices: list[AccelDevice]) -> None:
    """Stop on a signal; first every device fails with ``STOPPED`` (its contexts lost), so
    a client hears it was a stop, not a crash ("the daemon died")."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            log.info("received %s, shutting down", name)
            lost = [part.resets.fail(errno.ENODEV, f"{STOPPED} ({name})")
                    for dev in devices for part in [dev, *dev.partitions]]
            if any(lost):  # their runtimes read state and failure to say why: let them
                await trio.sleep(STOP_GRACE_S)
            scope.cancel()
            return


def stop(root: Path, timeout_s: float = 10.0) -> str:
    """Stop whatever serves ``root``: SIGTERM, then SIGKILL; always leave no mount."""
    mount = find_mount(root)
    if mount is None:
        return f"{root}: not served"
    if mount.alive and mount.pid is not None:
        _signal(mount.pid, signal.SIGTERM)
        if not _wait_gone(root, mount.pid, timeout_s):
            log.warning("accel-emud pid %d ignored SIGTERM; killing it", mount.pid)
            _signal(mount.pid, signal.SIGKILL)
            _wait_gone(root, mount.pid, timeout_s, mount_too=False)
    if find_mount(root) is not None:
        unmount_stale(root)
    return f"{root}: stopped"


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _wait_gone(root: Path, pid: int, timeout_s: float, mount_too: bool = True) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid) and (not mount_too or find_mount(root) is None):
            return True
        time.sleep(0.02)
    return False


def status(root: Path) -> tuple[int, str]:
    """(exit code, sentence) like ``systemctl status``: 0 serving, 3 not, 1 stale."""
    mount = find_mount(root)
    if mount is None:
        return 3, f"{root}: not served"
    if not mount.alive:
        return 1, f"{root}: stale mount (daemon pid {mount.pid} is gone); run accel-emud stop"
    try:
        devices = (root / "sys/module/accel_emu/devices").read_text().strip()
    except OSError as exc:
        return 1, f"{root}: mounted by pid {mount.pid} but unreadable ({errno.errorcode.get(exc.errno)})"
    return 0, f"{root}: served by accel-emud pid {mount.pid}, {devices} device(s)"
