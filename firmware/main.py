"""The firmware's boot ROM and its scheduler loop.

Boot: the driver has copied an image into the mailbox; the boot ROM verifies it (magic,
checksum, mailbox ABI range), publishes its versions, sets READY and raises an interrupt.
Run: consume the command ring, execute, post completions with device timestamps, raise an
interrupt, and heart-beat. After activity the loop spins briefly before it sleeps on the
doorbell (the machine has two cores: an idle firmware must not burn one).
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import select
import signal
import time

from firmware import abi, image

#: Keep polling this long after the last message before sleeping on the doorbell.
SPIN_AFTER_ACTIVITY_S = 200e-6


class Firmware:
    """One device's firmware state: the contexts it knows and the work it runs."""

    def __init__(self, mbx: abi.Mailbox, doorbell_fd: int, irq_fd: int) -> None:
        self.mbx = mbx
        self.doorbell_fd = doorbell_fd
        self.irq_fd = irq_fd
        self.contexts: set[int] = set()
        self.hung = False
        self.heartbeat_s = 0.05
        self._backlog: list[tuple[int, int, int, int, int]] = []

    # boot -------------------------------------------------------------------------
    def boot(self) -> bool:
        self.mbx.set_fw_state(abi.FwState.BOOTING)
        try:
            img = image.parse(self.mbx.image())
            if not img.manifest["abi_min"] <= abi.MAILBOX_ABI <= img.manifest["abi_max"]:
                raise image.ImageError(
                    f"image speaks mailbox ABI {img.manifest['abi_min']}..{img.manifest['abi_max']}, "
                    f"boot ROM {abi.MAILBOX_ABI}"
                )
            if self.mbx.boot_flags & abi.BootFlag.FAIL_BOOT:
                raise image.ImageError("injected boot failure (debugfs fw_boot_fail)")
        except image.ImageError as exc:
            self.mbx.set_fw_state(abi.FwState.BOOT_FAILED, errno.EIO, f"boot ROM: {exc}")
            self.interrupt()
            return False
        config = img.config
        self.heartbeat_s = config.get("heartbeat_interval_ms", 50) / 1000
        self.mbx.set_versions(img.version, str(img.manifest["isa_version"]))
        self.mbx.beat(time.monotonic_ns())
        self.mbx.set_fw_state(abi.FwState.READY)
        self.interrupt()
        return True

    # run ----------------------------------------------------------------------------
    def interrupt(self) -> None:
        try:
            os.write(self.irq_fd, b"\1")
        except BlockingIOError:
            pass  # the driver has not drained earlier interrupts; it will see the ring

    def execute(self, op: int, ctx_id: int, seqno: int, arg: int) -> int | None:
        """Run one message; return a completion status, or None for no completion."""
        if op == abi.Op.CTX_CREATE:
            self.contexts.add(ctx_id)
            return None
        if op == abi.Op.CTX_DESTROY:
            self.contexts.discard(ctx_id)
            return None
        if op == abi.Op.HANG:
            self.hung = True
            return None
        if ctx_id not in self.contexts:
            return errno.ENOENT
        if op == abi.Op.NOOP:
            return 0
        return errno.EINVAL

    def drain(self) -> int:
        """Run every queued message; return how many there were."""
        done = 0
        while not self.hung and (msg := self.mbx.cmd.pop()) is not None:
            op, _status, ctx_id, seqno, arg = msg
            status = self.execute(op, ctx_id, seqno, arg)
            if status is not None:
                self._backlog.append((op, ctx_id, seqno, time.monotonic_ns(), status))
            done += 1
        posted = 0
        while self._backlog:
            op, ctx_id, seqno, ts, status = self._backlog[0]
            if not self.mbx.cpl.push(op, ctx_id, seqno, ts, status):
                break  # completion ring full: the driver drains it on this interrupt
            self._backlog.pop(0)
            posted += 1
        if posted:
            self.interrupt()
        return done

    def run(self) -> int:
        last_beat = time.monotonic()
        last_work = 0.0
        while True:
            if self.drain():
                last_work = time.monotonic()
            now = time.monotonic()
            if not self.hung and now - last_beat >= self.heartbeat_s:
                self.mbx.beat(time.monotonic_ns())
                last_beat = now
            spinning = now - last_work < SPIN_AFTER_ACTIVITY_S and not self.hung
            if spinning:
                os.sched_yield()  # on a shared core, let the driver answer its caller first
            timeout = 0 if spinning else max(0.0, self.heartbeat_s - (now - last_beat))
            ready, _, _ = select.select([self.doorbell_fd], [], [], timeout)
            if ready and os.read(self.doorbell_fd, 4096) == b"":
                self.mbx.set_fw_state(abi.FwState.HALTED)
                return 0  # the driver closed the doorbell: it is gone or resetting us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firmware", description=__doc__)
    parser.add_argument("--mailbox-fd", type=int, required=True)
    parser.add_argument("--doorbell-fd", type=int, required=True)
    parser.add_argument("--irq-fd", type=int, required=True)
    args = parser.parse_args(argv)
    # The driver stops us by closing the doorbell or with SIGTERM/SIGKILL; a Ctrl-C meant
    # for the daemon's terminal must not crash the device.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.set_blocking(args.irq_fd, False)
    buf = mmap.mmap(args.mailbox_fd, abi.MAILBOX_SIZE)
    fw = Firmware(abi.Mailbox(memoryview(buf)), args.doorbell_fd, args.irq_fd)
    if not fw.boot():
        return 1
    return fw.run()
