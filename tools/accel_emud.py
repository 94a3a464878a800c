"""``accel-emud``: mount and serve an emulated accelerator; ``stop`` and ``status`` it.

Without ``--foreground`` the command starts the daemon in its own session and returns once
the mount is ready (exit 0), or prints why it could not start (exit 1). The daemon tells
its starter it is ready through a pipe, so "returned" always means "mounted and booted".

Arguments that cannot be exit 2 in either mode, before anything starts: argparse's
errors, and a ``--limit`` the devices' image cannot hold (checked here, so that a
background start says so as a foreground one does).

The daemon's log file (``--log-file``; in the background STATE_DIR/accel-emud.log) is cut
at ``LOG_MAX_BYTES``, keeping ``LOG_BACKUPS`` earlier cuts, as logrotate would: what a
tenant can make the driver log is rate-limited (kmod_emul/ratelimit.py), but the file must
not grow without end whatever the daemon's life brings.
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from abi import uapi
from tools.sysfs_tree import fdinfo
from firmware.image import IMAGE_DIR

if TYPE_CHECKING:
    from kmod_emul.daemon import DaemonConfig

START_TIMEOUT_S = 120.0
#: The daemon's log file is cut past this size; the last LOG_BACKUPS cuts are kept
#: (accel-emud.log.1, .2): at most (1 + LOG_BACKUPS) * LOG_MAX_BYTES on disk.
LOG_MAX_BYTES = 8 << 20
LOG_BACKUPS = 2
LOG_FORMAT = "%(asctime)s accel-emud[%(process)d] %(levelname)s %(name)s: %(message)s"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'1G', '512M', '2GiB', '4096' -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE | re.ASCII)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1G or 512M)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _positive_size(text: str) -> int:
    size = parse_size(text)
    if size == 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1G or 512M)")
    return size


def parse_limit(text: str) -> tuple[str, int]:
    """'max_queues_per_process=8', 'max_pinned_bytes_per_process=1G' -> (name, value): one
    of the driver's limits (kmod_emul/limits.py), a positive count or size."""
    from kmod_emul.limits import LIMIT_NAMES

    name, sep, value = text.partition("=")
    if not sep or name not in LIMIT_NAMES:
        raise argparse.ArgumentTypeError(f"not NAME=VALUE with a limit's name: {text!r}; the "
                                         f"limits are {' '.join(LIMIT_NAMES)}")
    return name, _positive_size(value)


def parse_abi(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not an ABI version: {text!r} (try 1.0)")
    return int(m.group(1)), int(m.group(2))


def parse_fail_step(text: str) -> tuple[int, str]:
    """'accel1:mailbox' (or '1:mailbox') -> (1, 'mailbox')."""
    m = re.fullmatch(r"(?:accel)?(\d+):(\w+)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not DEVICE:STEP: {text!r} (try accel1:mailbox)")
    return int(m.group(1)), m.group(2)


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/accel-emu")
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "accel-emu"


def _parser() -> argparse.ArgumentParser:
    root_help = "mount root (default: $ACCEL_EMU_ROOT or the per-user default)"
    p = argparse.ArgumentParser(prog="accel-emud", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action")
    start = sub.add_parser("start", help="mount and serve (the default action)")
    start.add_argument("--root", type=Path, default=Path(uapi.default_root()), help=root_help)
    start.add_argument("--devices", type=int, default=1, help="number of devices (default 1)")
    start.add_argument("--memory", type=_positive_size, default=parse_size("1G"),
                       help="memory per device, e.g. 1G, 512M (default 1G)")
    start.add_argument("--foreground", action="store_true", help="serve in this process")
    start.add_argument("--state-dir", type=Path, default=default_state_dir(),
                       help="where stable device identities and the log live")
    start.add_argument("--firmware-dir", type=Path, default=IMAGE_DIR,
                       help=f"where firmware images are looked up (default {IMAGE_DIR})")
    start.add_argument("--heartbeat-timeout", type=float, default=2.0, metavar="SECONDS",
                       help="declare a device failed after this long without a heartbeat")
    start.add_argument("--recovery", choices=("auto", "manual"), default="auto",
                       help="when a running firmware dies or stops heart-beating: reset the "
                            "device at once (auto, the default) or leave it failed (manual)")
    start.add_argument("--process-memory-limit", type=parse_size, default=0, metavar="SIZE",
                       help="device-local memory one process may hold per device (default: none)")
    start.add_argument("--limit", type=parse_limit, action="append", default=[],
                       metavar="NAME=VALUE",
                       help="set one of the driver's limits on every device, e.g. "
                            "max_queues_per_process=8 or max_queue_depth=64 (repeatable; "
                            "sys/class/accel/accelN/limits/ shows them all)")
    start.add_argument("--jit-cache", type=Path, default=None, metavar="DIR",
                       help="persistent kernel cache (default STATE_DIR/jit-cache)")
    start.add_argument("--driver-abi", type=parse_abi, default=None, metavar="MAJOR.MINOR",
                       help="emulate a driver of another uAPI version (version-skew testing)")
    start.add_argument("--fail-step", type=parse_fail_step, action="append", default=[],
                       metavar="accelN:STEP",
                       help="fault injection: fail device N's bring-ups at STEP (sets its "
                            "debugfs fail_step; docs/driver.md lists the steps)")
    start.add_argument("--log-file", type=Path, default=None,
                       help="the daemon's log, stdout and stderr, cut past "
                            f"{LOG_MAX_BYTES >> 20} MiB keeping {LOG_BACKUPS} earlier cuts "
                            "(default: STATE_DIR/accel-emud.log in the background, stderr "
                            "in the foreground)")
    start.add_argument("-v", "--verbose", action="store_true", help="log every refused command")
    start.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    for name, text in (("stop", "unmount cleanly and stop the daemon"),
                       ("status", "say whether the root is served (exit 0 yes, 3 no, 1 stale)")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--root", type=Path, default=Path(uapi.default_root()), help=root_help)
        if name == "stop":
            sp.add_argument("--force", action="store_true",
                            help="stop even while processes hold contexts (they are told "
                                 "the daemon was stopped by the operator)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    if not argv or argv[0] not in ("start", "stop", "status", "-h", "--help"):
        argv = ["start", *argv]
    args = _parser().parse_args(argv)
    if args.action == "start" and args.devices < 1:
        _parser().error("--devices must be at least 1")
    if args.action == "start" and args.fail_step:
        from kmod_emul.boot import STEP_NAMES

        for dev, step in args.fail_step:
            if dev >= args.devices:
                _parser().error(f"--fail-step: no device accel{dev} (--devices {args.devices})")
            if step not in STEP_NAMES:
                _parser().error(f"--fail-step: no bring-up step {step!r}; the steps are "
                                f"{' '.join(STEP_NAMES)}")
    return args


class DaemonLog(logging.handlers.RotatingFileHandler):
    """The daemon's log file, cut past ``LOG_MAX_BYTES``. The daemon's stdout and stderr
    are the same file (what does not go through logging: a traceback the interpreter
    prints, the firmware's log passed on by kmod_emul/fw.py), so they follow it to each new
    file; their bytes count towards the cut, made at the next logged line."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS)
        self._redirect()

    def doRollover(self) -> None:
        super().doRollover()
        self._redirect()

    def _redirect(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(self.stream.fileno(), fd)


def _config(args: argparse.Namespace) -> DaemonConfig:
    from kmod_emul import daemon, drv

    driver = drv.DriverInfo()
    if args.driver_abi:
        driver = drv.DriverInfo(abi_major=args.driver_abi[0], abi_minor=args.driver_abi[1])
    return daemon.DaemonConfig(
        root=args.root.resolve(), devices=args.devices, memory=args.memory,
        state_dir=args.state_dir.resolve(), firmware_dir=args.firmware_dir.resolve(),
        heartbeat_timeout_s=args.heartbeat_timeout, recovery=args.recovery, driver=driver,
        process_memory_limit=args.process_memory_limit, limits=dict(args.limit),
        jit_cache=args.jit_cache.resolve() if args.jit_cache else None,
        fail_steps=dict(args.fail_step),
    )


def _limits_fit(config: DaemonConfig) -> bool:
    """Whether the operator's limits fit the image the devices will boot, checked against
    the descriptor limit the daemon raises itself to (its hard limit); if not, say why."""
    from kmod_emul import daemon
    from kmod_emul.limits import LimitError

    try:
        daemon.check_limits(config, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    except LimitError as exc:
        _refuse_limit(exc)
        return False
    return True


def _refuse_limit(exc: Exception) -> int:
    print(f"accel-emud: --limit: {exc}", file=sys.stderr)
    return 2


def _serve(config: DaemonConfig, args: argparse.Namespace) -> int:
    import trio

    from kmod_emul import daemon
    from kmod_emul.limits import LimitError

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format=LOG_FORMAT,
        handlers=[DaemonLog(args.log_file)] if args.log_file else None,
    )

    def ready() -> None:
        if args.ready_fd is not None:
            os.write(args.ready_fd, b"ready\n")
            os.close(args.ready_fd)

    try:
        trio.run(daemon.serve, config, ready)
    except daemon.AlreadyServed as exc:
        print(f"accel-emud: {exc}", file=sys.stderr)
        return 1
    except LimitError as exc:  # the image changed since main() checked them
        return _refuse_limit(exc)
    return 0


def _start_background(args: argparse.Namespace, argv: list[str]) -> int:
    from kmod_emul import daemon

    mount = daemon.find_mount(args.root)
    if mount is not None and mount.alive:
        print(f"accel-emud: {args.root} is already served by accel-emud (pid {mount.pid}); "
              f"stop it first with: accel-emud stop --root {args.root}", file=sys.stderr)
        return 1
    log_file = args.log_file or args.state_dir / "accel-emud.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    child_argv = [a for a in argv if a != "start"]
    with open(log_file, "ab") as log:  # until the daemon takes it over (DaemonLog)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.accel_emud", "start", *child_argv, "--foreground",
             "--log-file", str(log_file.resolve()), "--ready-fd", str(write_fd)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(write_fd,),
            start_new_session=True,
        )
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        line = ready.readline()  # EOF if the daemon dies before it is ready
    if line == b"ready\n":
        print(f"accel-emud: serving {args.devices} device(s) at {args.root.resolve()} "
              f"(pid {proc.pid}, log {log_file})")
        return 0
    code = proc.wait(timeout=START_TIMEOUT_S)
    tail = log_file.read_text(errors="replace").splitlines()[-15:]
    print(f"accel-emud: failed to start (exit {code}); log {log_file}:", file=sys.stderr)
    print("\n".join(tail), file=sys.stderr)
    return 2 if code == 2 else 1  # 2: a refused --limit, as in the foreground


def holders(root: Path) -> list[int]:
    """The processes holding contexts on any device ``root`` serves (the ``fdinfo``
    blocks this user may see: root sees every tenant's), for ``stop`` to refuse."""
    pids: set[int] = set()
    try:
        infos = sorted((root / uapi.CLASS_DIR).glob("accel*/fdinfo"))
    except OSError:  # a stale mount (its daemon is gone): nobody holds anything there
        return []
    for info in infos:
        try:
            text = info.read_text()
        except OSError:  # a device gone meanwhile
            continue
        pids.update(int(b["pid"]) for b in fdinfo(text) if isinstance(b.get("pid"), int))
    return sorted(pids)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from kmod_emul import daemon

    if args.action == "stop":
        users = [] if args.force else holders(args.root)
        if users:  # as rmmod refuses a module in use
            print(f"accel-emud: {args.root}: in use by pid {', '.join(map(str, users))} "
                  "(holding contexts); stop them first, or accel-emud stop --force",
                  file=sys.stderr)
            return 1
        print(f"accel-emud: {daemon.stop(args.root)}")
        return 0
    if args.action == "status":
        code, text = daemon.status(args.root)
        print(f"accel-emud: {text}")
        return code
    config = _config(args)
    if not _limits_fit(config):
        return 2
    if args.foreground:
        return _serve(config, args)
    return _start_background(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
