"""The firmware's boot ROM and its control loop.

Boot: the driver has copied an image into the mailbox; the boot ROM verifies it (magic,
checksum, mailbox ABI range), publishes its versions, sets READY and raises an interrupt.
Run: the control loop consumes the mailbox (contexts, mappings, queues, submissions),
hands packets to queue workers (:mod:`firmware.engines`), heart-beats, and publishes its
counters. After activity it spins briefly, yielding the CPU, before it sleeps on the
doorbell (the machine has two cores: an idle firmware must not burn one).

Memory is released only when the device is done with it: an UNMAP is answered once every
packet queued before it has completed, and a context's teardown once its queues stopped.
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import select
import signal
import threading
import time

import numpy as np

from firmware import abi, image, memory
from firmware.engines import Engines, FwContext, QueueWorker

#: Keep polling this long after the last message before sleeping on the doorbell.
SPIN_AFTER_ACTIVITY_S = 200e-6


class Firmware:
    def __init__(self, mbx: abi.Mailbox, doorbell_fd: int, irq_fd: int,
                 backings: memory.Backings, vram_size: int) -> None:
        self.mbx = mbx
        self.doorbell_fd = doorbell_fd
        self.irq_fd = irq_fd
        self.backings = backings
        self.vram_size = vram_size
        self.contexts: dict[int, FwContext] = {}
        self.heartbeat_s = 0.05
        self.stats = dict.fromkeys(abi.STAT_NAMES, 0)
        self._cpl_lock = threading.Lock()
        self._backlog: list[tuple[int, int, tuple[int, ...], int]] = []
        #: (ctx, va, {queue: seqno it must reach}) waiting for the device to finish
        self._deferred_unmaps: list[tuple[FwContext, int, dict[QueueWorker, int]]] = []
        self.engines: Engines | None = None

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
        residency = memory.Residency(self.stats, self.vram_size)
        self.engines = Engines(config["copy_engines"], residency, self.stats, self.complete)
        self.mbx.set_versions(img.version, str(img.manifest["isa_version"]))
        self.mbx.beat(time.monotonic_ns())
        self.mbx.set_fw_state(abi.FwState.READY)
        self.interrupt()
        return True

    # completions -------------------------------------------------------------------
    def interrupt(self) -> None:
        try:
            os.write(self.irq_fd, b"\1")
        except BlockingIOError:
            pass  # the driver has not drained earlier interrupts; it will see the ring

    def post(self, op: int, ctx_id: int, args: tuple[int, ...], status: int = 0) -> None:
        """Queue a completion for the driver (any thread) and raise an interrupt."""
        with self._cpl_lock:
            self._backlog.append((op, ctx_id, args, status))
            self._flush_locked()

    def _flush_locked(self) -> None:
        posted = 0
        while self._backlog:
            op, ctx_id, args, status = self._backlog[0]
            if not self.mbx.cpl.push(op, ctx_id, args, status):
                break  # ring full: the driver drains it on this interrupt; retried later
            self._backlog.pop(0)
            posted += 1
        if posted:
            self.mbx.set_stats(self.stats)
            self.interrupt()

    def complete(self, ctx_id: int, qid: int, seqno: int, status: int, addr: int,
                 opcode: int) -> None:
        self.post(abi.Op.SUBMIT, ctx_id, (qid, seqno, time.monotonic_ns(), addr, opcode), status)
        if self._deferred_unmaps:
            self._run_deferred_unmaps()

    # control messages ----------------------------------------------------------------
    def handle(self, msg: tuple[int, ...], payload: bytes) -> None:
        op, _status, ctx_id, *a = msg
        assert self.engines is not None
        if op == abi.Op.HANG:
            self.engines.hung = True
            return
        if op == abi.Op.SET_BUDGET:
            self.engines.residency.device_bytes = a[0]
            return
        if op == abi.Op.CTX_CREATE:
            self.contexts[ctx_id] = FwContext(ctx_id)
            return
        ctx = self.contexts.get(ctx_id)
        if ctx is None:
            return  # the driver never names a context it did not create; ignore a stray
        if op == abi.Op.CTX_DESTROY:
            del self.contexts[ctx_id]
            threading.Thread(target=self._teardown, args=(ctx,), daemon=True).start()
        elif op == abi.Op.MAP:
            va, size, kind, owner, where, token = a
            try:
                data = self.backings.view(kind, owner, size, where, token)
            except (OSError, memory.Fault):
                return  # the driver created the backing; unreachable means it is gone
            resident = None
            if kind == memory.MANAGED:
                pages = -(-size // memory.MANAGED_PAGE)
                resident = np.zeros(pages, bool)
            ctx.space.add(memory.Mapping(va, size, kind, owner, data, resident))
        elif op == abi.Op.UNMAP:
            targets = {q: q.submitted for q in ctx.queues.values()}
            self._deferred_unmaps.append((ctx, a[0], targets))
            self._run_deferred_unmaps()
        elif op == abi.Op.QUEUE_CREATE:
            worker = QueueWorker(self.engines, ctx, a[0], a[1])
            ctx.queues[a[0]] = worker
            worker.start()
        elif op == abi.Op.QUEUE_DESTROY:
            worker = ctx.queues.get(a[0])
            if worker is not None:
                worker.stop(drain=True)
        elif op == abi.Op.SUBMIT:
            worker = ctx.queues.get(a[0])
            if worker is not None:
                worker.submit(a[1], payload)

    def _run_deferred_unmaps(self) -> None:
        with self._cpl_lock:
            ready = [d for d in self._deferred_unmaps
                     if all(q.completed >= s or not q.is_alive() for q, s in d[2].items())]
            for d in ready:
                self._deferred_unmaps.remove(d)
        for ctx, va, _ in ready:
            self._unmap(ctx, va)
            self.post(abi.Op.UNMAP, ctx.id, (va,))

    def _unmap(self, ctx: FwContext, va: int) -> None:
        m = ctx.space.remove(va)
        if m is not None and m.resident is not None:
            assert self.engines is not None
            self.engines.residency.drop(m)

    def _teardown(self, ctx: FwContext) -> None:
        """Stop a context's queues (dropping queued work), release its mappings, report."""
        for worker in ctx.queues.values():
            worker.stop(drain=False)
        for worker in ctx.queues.values():
            worker.join()
        with self._cpl_lock:
            self._deferred_unmaps = [d for d in self._deferred_unmaps if d[0] is not ctx]
        for m in ctx.space.mappings():
            self._unmap(ctx, m.va)
        self.post(abi.Op.CTX_DESTROY, ctx.id, ())

    # run ----------------------------------------------------------------------------
    def drain(self) -> int:
        """Handle every queued control message; return how many there were."""
        done = 0
        assert self.engines is not None
        while not self.engines.hung and (item := self.mbx.cmd.pop()) is not None:
            self.handle(*item)
            done += 1
        if self._backlog:
            with self._cpl_lock:
                self._flush_locked()
        return done

    def run(self) -> int:
        assert self.engines is not None
        last_beat = time.monotonic()
        last_work = 0.0
        while True:
            if self.drain():
                last_work = time.monotonic()
            now = time.monotonic()
            if not self.engines.hung and now - last_beat >= self.heartbeat_s:
                self.mbx.beat(time.monotonic_ns())
                self.mbx.set_stats(self.stats)
                last_beat = now
            spinning = now - last_work < SPIN_AFTER_ACTIVITY_S and not self.engines.hung
            if spinning:
                os.sched_yield()  # on a shared core, let the driver answer its caller first
            timeout = 0 if spinning else max(0.0, self.heartbeat_s - (now - last_beat))
            ready, _, _ = select.select([self.doorbell_fd], [], [], timeout)
            if ready and os.read(self.doorbell_fd, 4096) == b"":
                self.mbx.set_fw_state(abi.FwState.HALTED)
                return 0  # the driver closed the doorbell: it is gone or resetting us


def _vram_fds(text: str) -> dict[int, int]:
    """'0:5,1:6' -> {device 0: fd 5, device 1: fd 6}."""
    pairs = (item.split(":") for item in text.split(",") if item)
    return {int(dev): int(fd) for dev, fd in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firmware", description=__doc__)
    parser.add_argument("--mailbox-fd", type=int, required=True)
    parser.add_argument("--doorbell-fd", type=int, required=True)
    parser.add_argument("--irq-fd", type=int, required=True)
    parser.add_argument("--vram-fds", type=_vram_fds, required=True,
                        help="DEV:FD,... every device's VRAM memfd (peers included)")
    parser.add_argument("--vram-size", type=int, required=True)
    parser.add_argument("--shm-dir", required=True, help="where host-visible backings live")
    args = parser.parse_args(argv)
    # The driver stops us by closing the doorbell or with SIGTERM/SIGKILL; a Ctrl-C meant
    # for the daemon's terminal must not crash the device.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.set_blocking(args.irq_fd, False)
    buf = mmap.mmap(args.mailbox_fd, abi.MAILBOX_SIZE)
    backings = memory.Backings.open(args.shm_dir, args.vram_fds, args.vram_size)
    fw = Firmware(abi.Mailbox(memoryview(buf)), args.doorbell_fd, args.irq_fd, backings,
                  args.vram_size)
    if not fw.boot():
        return 1
    return fw.run()
