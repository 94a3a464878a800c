"""Firmware loading and boot: the driver's side of the mailbox.

``load_image`` is ``request_firmware`` plus verification: it tells a missing image
(ENOPKG) from a corrupt or incompatible one (ENOEXEC). ``FirmwareProcess`` holds the rest of
a boot as bring-up steps with their undos (run by the driver's table, kmod_emul/boot.py):
it copies the verified image into a fresh mailbox (a memfd), starts the device's firmware
process with only the mailbox, doorbell, interrupt and descriptor-channel fds (and every
device's VRAM), and waits for the READY handshake; a firmware that exits or reports
failure during boot is a boot failure (EIO).

The firmware's log is its stderr, which the firmware writes only when something went
wrong. It reaches the daemon's log through the driver, which keeps its last lines
(``FirmwareProcess.log_tail``) for the dump of a device-scope fault (kmod_emul/coredump.py).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import signal
import socket
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from abi import fwimage, mailbox
from abi._struct import Struct
from kmod_emul.errors import DriverError

if TYPE_CHECKING:
    from kmod_emul.device import MemoryConfig

log = logging.getLogger(__name__)

BOOT_TIMEOUT_S = 30.0
STOP_GRACE_S = 1.0
#: Lines of the firmware's log the driver keeps (the tail a coredump shows).
LOG_TAIL_LINES = 64
#: Longer lines are kept cut to this many bytes (the log itself gets them whole).
LOG_LINE_MAX = 1024


class LiveTable:
    """The driver's side of the mailbox's live table (``mailbox.LIVE_OFF``): an entry per
    live context holding its id, cleared the moment the context is lost, so the firmware
    starts nothing more of it however far behind the loss's message is queued. One per
    boot: a reset's new mailbox starts with every entry free; entries of the old one are
    cleared into nothing (``closed``)."""

    def __init__(self, words: memoryview) -> None:
        self._words = words
        self._free = list(range(len(words) - 1, -1, -1))
        self.closed = False

    def claim(self, ctx_id: int) -> LiveEntry:
        """An entry holding ``ctx_id``. The driver bounds ``max_contexts`` by the table's
        size (kmod_emul/limits.py), and a context gives its entry back when it is lost, so
        a free one always exists for a context the limits let in."""
        if not self._free:
            raise DriverError(errno.ENOSPC, "the firmware's live-context table is full")
        slot = self._free.pop()
        self._words[slot] = ctx_id
        return LiveEntry(self, slot, ctx_id)

    def release(self, slot: int, ctx_id: int) -> None:
        if self.closed:
            return
        if self._words[slot] == ctx_id:
            self._words[slot] = 0
            self._free.append(slot)


@dataclass
class LiveEntry:
    """One context's entry in a :class:`LiveTable`."""

    table: LiveTable
    slot: int
    ctx_id: int

    def clear(self) -> None:
        """The context is lost: from here on the firmware starts none of its packets.
        Idempotent."""
        self.table.release(self.slot, self.ctx_id)


def load_image(firmware_dir: Path, name: str = fwimage.IMAGE_NAME) -> fwimage.FirmwareImage:
    """Read and verify ``firmware_dir/name`` or raise DriverError with a distinct errno."""
    path = firmware_dir / name
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DriverError(
            errno.ENOPKG,
            f"firmware image {name} not found in {firmware_dir}; install it (the package ships "
            f"firmware/images/{name}) or point accel-emud --firmware-dir at it, then reset the device",
        ) from None
    except OSError as exc:
        raise DriverError(errno.ENOPKG, f"firmware image {path} unreadable: {exc.strerror}") from None
    try:
        img = fwimage.parse(raw)
    except fwimage.ImageError as exc:
        raise DriverError(
            errno.ENOEXEC,
            f"firmware image {path} is corrupt: {exc}; reinstall the image, then reset the device",
        ) from None
    lo, hi = img.manifest["abi_min"], img.manifest["abi_max"]
    if not lo <= mailbox.MAILBOX_ABI <= hi:
        raise DriverError(
            errno.ENOEXEC,
            f"firmware image {path} speaks mailbox ABI {lo}..{hi} but this driver speaks "
            f"{mailbox.MAILBOX_ABI}; install a matching firmware, then reset the device",
        )
    return img


@dataclass(eq=False)
class _Message:
    """A message on its way to the firmware, with the descriptors it carries (owned here
    until sent: the channel closes them once they are in flight)."""

    op: mailbox.Op
    ctx_id: int
    payload: Struct
    fds: list[int] = field(default_factory=list)
    fds_sent: bool = False


class FirmwareProcess:
    """A device's firmware: its image, mailbox, wake-up pipes, descriptor channel and process.

    It starts empty; the bring-up steps below fill it, each undo releasing what its step
    made (the driver's table in kmod_emul/boot.py runs them, in this order):

    ``load_image``; ``map_mailbox``/``unmap_mailbox``; ``open_interrupts``/``close_interrupts``;
    ``open_fd_channel``/``close_fd_channel``; ``start_process``/``halt_process``; ``handshake``.

    Once up, the driver talks to it with ``send``, ``flush``, ``wait_irq`` and
    ``ring_doorbell``. Descriptors not held read -1, objects not held None.
    """

    def __init__(self, firmware_dir: Path, boot_flags: int, label: str, vram_size: int,
                 memcfg: MemoryConfig, engine_share: int = 1) -> None:
        self.firmware_dir = firmware_dir
        #: a compute partition's firmware schedules on its share of the engines
        self.engine_share = engine_share
        self.boot_flags = boot_flags
        self.label = label
        self.vram_size = vram_size
        self.memcfg = memcfg
        self.image: fwimage.FirmwareImage | None = None
        self._memfd = -1
        self._mem: mmap.mmap | None = None
        self.mbx: mailbox.Mailbox | None = None
        self.live: LiveTable | None = None
        self.irq_r = self._irq_w = -1
        self._fdchan: mailbox.FdChannel | None = None
        self._fw_sock: socket.socket | None = None  # the channel's far end, until handed over
        self._doorbell_w = -1
        self.proc: trio.Process | None = None
        self._cookies = iter(range(1, 1 << 63))
        #: messages that found the command ring (or the channel) full, sent in order
        self._backlog: deque[_Message] = deque()
        #: the last lines the firmware wrote to its log, oldest first
        self.log_tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    # --- bring-up steps, in order; each undo releases what its step made ------------------
    def load_image(self) -> None:
        """Read and verify the image (nothing to undo: it is bytes, copied by the mailbox)."""
        self.image = load_image(self.firmware_dir)

    def map_mailbox(self) -> None:
        """A fresh memfd, mapped, stamped and holding a copy of the image."""
        assert self.image is not None
        self._memfd = os.memfd_create(f"accel-emu-{self.label}-mailbox", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._memfd, mailbox.MAILBOX_SIZE)
            self._mem = mmap.mmap(self._memfd, mailbox.MAILBOX_SIZE)
            self.mbx = mailbox.Mailbox(memoryview(self._mem))
            self.mbx.host_init(self.image.raw, self.boot_flags)
            self.live = LiveTable(self.mbx.live)
        except BaseException:
            self.unmap_mailbox()  # releases the part made: the chain will not undo this step
            raise

    def unmap_mailbox(self) -> None:
        if self.live is not None:
            self.live.closed = True
            self.live = None
        if self.mbx is not None:
            self.mbx.release()
            self.mbx = None
        if self._mem is not None:
            mem, self._mem = self._mem, None
            mem.close()
        self._memfd = _close(self._memfd)

    def open_interrupts(self) -> None:
        """The interrupt pipe: the firmware writes, the driver's read end never blocks."""
        self.irq_r, self._irq_w = os.pipe()
        os.set_blocking(self.irq_r, False)

    def close_interrupts(self) -> None:
        if self.irq_r >= 0:
            trio.lowlevel.notify_closing(self.irq_r)
        self.irq_r = _close(self.irq_r)
        self._irq_w = _close(self._irq_w)

    def open_fd_channel(self) -> None:
        """The socket pair that carries clients' descriptors to the firmware."""
        self._fdchan, self._fw_sock = mailbox.FdChannel.pair()

    def close_fd_channel(self) -> None:
        if self._fdchan is not None:
            self._fdchan.close()
            self._fdchan = None
        if self._fw_sock is not None:
            self._fw_sock.close()
            self._fw_sock = None

    async def start_process(self) -> None:
        """Start ``python -m firmware`` with the mailbox, the interrupt pipe's write end, the
        channel's far end, every device's VRAM (so peer access needs no fd passing later)
        and the read end of a new doorbell pipe, and nothing else of the daemon's. The
        ends it got are handed over (closed here: the child has them now). The doorbell
        pipe is this step's, not the interrupts': its EOF is how the driver asks the
        firmware to halt, which the undo must do before it waits for the process. Its
        stderr is a pipe to the driver (``_pass_log``), which ends with the process."""
        assert self._fw_sock is not None
        doorbell_r, doorbell_w = os.pipe()
        os.set_blocking(doorbell_w, False)  # a full pipe means "already rung", never a stall
        log_r, log_w = os.pipe()
        memcfg = self.memcfg
        vram_fds = {dev: vram.fileno() for dev, vram in memcfg.vram.items()}
        vram = ",".join(f"{dev}:{fd}" for dev, fd in vram_fds.items())
        theirs = self._fw_sock.fileno()
        try:
            self.proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "firmware", "--mailbox-fd", str(self._memfd),
                 "--doorbell-fd", str(doorbell_r), "--irq-fd", str(self._irq_w),
                 "--vram-fds", vram, "--vram-size", str(self.vram_size),
                 "--fd-channel", str(theirs), "--jit-cache", memcfg.jit_cache,
                 "--engine-share", str(self.engine_share)],
                pass_fds=(self._memfd, doorbell_r, self._irq_w, theirs,
                          *vram_fds.values()),
                stderr=log_w,
                start_new_session=True,  # a Ctrl-C on the daemon's terminal is not a device crash
            )
        except BaseException:
            os.close(doorbell_w)
            os.close(log_r)
            raise
        finally:
            os.close(doorbell_r)
            os.close(log_w)
        threading.Thread(target=_pass_log, args=(log_r, self.log_tail),
                         name=f"{self.label}-firmware-log", daemon=True).start()
        self._doorbell_w = doorbell_w
        self._memfd = _close(self._memfd)  # the mapping stays; the child has the file
        self._irq_w = _close(self._irq_w)
        self._fw_sock.close()
        self._fw_sock = None

    async def halt_process(self) -> None:
        """Close the doorbell (the firmware halts on its EOF), SIGKILL if it lingers; reap it."""
        self._doorbell_w = _close(self._doorbell_w)
        proc = self.proc
        if proc is None:
            return
        with trio.CancelScope(shield=True):
            with trio.move_on_after(STOP_GRACE_S):
                await proc.wait()
            if proc.returncode is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()
        log.debug("firmware pid %d stopped (status %s)", proc.pid, proc.returncode)

    def kill(self) -> None:
        """Stop the firmware at once, as a fatal error inside it does (an uncorrectable
        firmware error, kmod_emul/ras.py): the driver's exit watcher then runs the path of
        any firmware death (fail, record, recover)."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def handshake(self) -> None:
        """Wait for READY; a firmware that reports failure, exits or takes too long is a
        boot failure (EIO). Holds nothing: the process step's undo halts the firmware."""
        assert self.mbx is not None and self.proc is not None
        with trio.move_on_after(BOOT_TIMEOUT_S):
            while True:
                state = self.mbx.fw_state
                if state == mailbox.FwState.READY:
                    return
                if state == mailbox.FwState.BOOT_FAILED:
                    raise DriverError(errno.EIO, f"firmware failed to boot: {self.mbx.boot_message}")
                if self.proc.poll() is not None:
                    raise DriverError(
                        errno.EIO,
                        f"firmware process exited during boot with status {self.proc.returncode}",
                    )
                await self.wait_irq(0.05)
        raise DriverError(errno.EIO, f"firmware did not finish booting in {BOOT_TIMEOUT_S:.0f} s")

    def drop_backlog(self) -> None:
        """Forget the messages never sent (the firmware is going): close their descriptors."""
        for msg in self._backlog:  # never sent: their descriptors are still ours
            if not msg.fds_sent:
                for fd in msg.fds:
                    os.close(fd)
        self._backlog.clear()

    async def wait_irq(self, timeout: float | None = None) -> bool:
        """Sleep until the firmware raises an interrupt; consume it. False on timeout."""
        with trio.move_on_after(timeout if timeout is not None else float("inf")):
            await trio.lowlevel.wait_readable(self.irq_r)
            try:
                os.read(self.irq_r, 4096)
            except BlockingIOError:
                pass
            return True
        return False

    def send(self, ctx_id: int, payload: Struct, fds: list[int] | None = None) -> None:
        """Queue the message whose payload is ``payload`` (its op is the struct's, from
        ``mailbox.OP_OF``) and ring the doorbell. Never drops one: a message that finds the
        ring full waits in the backlog, which drains (in order) on the next interrupt.
        ``fds`` (owned by the call from here on) travel on the descriptor channel under
        the cookie this sets in the payload."""
        if fds:
            payload.cookie = next(self._cookies)
        self._backlog.append(_Message(mailbox.OP_OF[type(payload)], ctx_id, payload,
                                      list(fds or ())))
        self.flush()

    def untaken(self) -> int:
        """Control messages sent that the firmware has not taken yet (in the ring or the
        backlog). It handles each as it takes it, before it next takes any packet."""
        return self.mbx.cmd.pending() + len(self._backlog)

    def flush(self) -> None:
        sent = False
        while self._backlog:
            msg = self._backlog[0]
            if msg.fds and not msg.fds_sent:
                if not self._fdchan.send(msg.payload.cookie, msg.fds):
                    break  # the channel is full: the firmware drains it as it goes
                msg.fds_sent = True
            if not self.mbx.cmd.push(msg.op, msg.ctx_id, msg.payload):
                break
            self._backlog.popleft()
            sent = True
        if sent:
            self.ring_doorbell()

    def ring_doorbell(self) -> None:
        if self._doorbell_w >= 0:
            try:
                os.write(self._doorbell_w, b"\1")
            except (BlockingIOError, BrokenPipeError):
                pass  # already rung / firmware gone (the watchdog reports the latter)


def _pass_log(fd: int, tail: deque[str]) -> None:
    """Copy the firmware's log (the pipe ``fd``) to the daemon's stderr as it comes, and
    keep its last lines in ``tail``; close ``fd`` once every writer is gone (the firmware
    exited). A thread of its own: its blocking reads never hold the event loop, and the
    pipe never fills up and stalls a firmware that writes a lot (a traceback storm)."""
    partial = b""
    try:
        while chunk := os.read(fd, 65536):
            *lines, partial = (partial + chunk).split(b"\n")
            tail.extend(line[:LOG_LINE_MAX].decode(errors="replace") for line in lines)
            partial = partial[:LOG_LINE_MAX]
            out = memoryview(chunk)  # after the tail: a line in the log is in the tail too
            try:
                while out:
                    out = out[os.write(2, out):]
            except OSError:
                pass  # the daemon's log is unwritable (a full disk): the tail is still kept
    finally:
        if partial:
            tail.append(partial.decode(errors="replace"))
        os.close(fd)


def _close(fd: int) -> int:
    """Close ``fd`` if held; -1, for the field that held it."""
    if fd >= 0:
        os.close(fd)
    return -1
