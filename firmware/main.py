"""The firmware's boot ROM and its control loop.

Boot: the driver has copied an image into the mailbox; the boot ROM verifies it (magic,
checksum, mailbox ABI range), publishes its versions, sets READY and raises an interrupt.

Run: one loop consumes the mailbox (contexts, mappings, queues) and runs the queue
scheduler (:mod:`firmware.engines`) over the user-mode rings. After activity it keeps
polling for a while, yielding the CPU, so back-to-back work costs no wake-up; then it
marks every ring "sleeping" and sleeps in poll(2) on the driver's doorbell pipe, the
contexts' doorbell FIFOs and the engines' wake-up pipe (the machine has two cores: an idle
firmware must not burn one). A producer that sees "sleeping" writes one byte to its
context's FIFO.

Memory is released only when the device is done with it: an UNMAP is answered once every
packet written before it has completed, and a context's teardown once its queues stopped.
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import select
import signal
import sys
import threading
import time

import numpy as np

from firmware import abi, image, memory
from firmware.engines import FwContext, Ring, Scheduler
from kmod_emul import uapi

#: Keep polling this long after the last work before sleeping.
SPIN_AFTER_ACTIVITY_S = 500e-6
#: While a ring waits on another device's fence nothing here wakes us: poll this often.
CROSS_DEVICE_POLL_S = 0.001


class Firmware:
    def __init__(self, mbx: abi.Mailbox, doorbell_fd: int, irq_fd: int,
                 backings: memory.Backings, vram_size: int, shm_dir: str,
                 jit_cache_dir: str) -> None:
        self.mbx = mbx
        self.doorbell_fd = doorbell_fd
        self.irq_fd = irq_fd
        self.backings = backings
        self.vram_size = vram_size
        self.shm_dir = shm_dir
        self.jit_cache_dir = jit_cache_dir
        self.contexts: dict[int, FwContext] = {}
        self.heartbeat_s = 0.05
        self.stats = dict.fromkeys(abi.STAT_NAMES, 0)
        self._cpl_lock = threading.Lock()
        self._backlog: list[tuple[int, int, tuple[int, ...], int]] = []
        #: (ctx, va, {ring: wptr it must complete}) waiting for the device to finish
        self._deferred_unmaps: list[tuple[FwContext, int, dict[Ring, int]]] = []
        self._closing: list[Ring] = []
        self._teardowns: list[FwContext] = []
        self.sched: Scheduler | None = None
        self.hung = False

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
        self.sched = Scheduler(config, residency, self.stats, self._fence_irq, self.jit_cache_dir)
        if _has_entries(self.jit_cache_dir):
            self.sched.warm_up()  # kernels ran here before: have the JIT ready for them
        self.mbx.set_versions(img.version, str(img.manifest["isa_version"]))
        self.mbx.beat(time.monotonic_ns())
        self.mbx.set_fw_state(abi.FwState.READY)
        self.interrupt()
        return True

    # to the driver -------------------------------------------------------------------
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

    def _fence_irq(self, ring: Ring, value: int) -> None:
        self.post(abi.Op.FENCE, ring.ctx.id, (ring.id, value))

    # control messages ----------------------------------------------------------------
    def handle(self, msg: tuple[int, ...], payload: bytes) -> None:
        op, _status, ctx_id, *a = msg
        assert self.sched is not None
        if op == abi.Op.HANG:
            self.hung = self.sched.hung = True
        elif op == abi.Op.HOLD:
            self.sched.held = bool(a[0])
        elif op == abi.Op.SET_BUDGET:
            self.sched.residency.device_bytes = a[0]
        elif op == abi.Op.CTX_CREATE:
            ctx = self.contexts[ctx_id] = FwContext(ctx_id)
            path = os.path.join(self.shm_dir, uapi.doorbell_name(ctx_id, a[0]))
            ctx.doorbell = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            ctx._doorbell_keepalive = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        elif (ctx := self.contexts.get(ctx_id)) is None:
            return  # the driver never names a context it did not create; ignore a stray
        elif op == abi.Op.CTX_DESTROY:
            del self.contexts[ctx_id]
            for ring in ctx.queues.values():
                ring.faulted = True  # what is still queued completes as cancelled, unrun
            self._teardowns.append(ctx)
        elif op == abi.Op.MAP:
            va, size, kind, owner, where, token = a
            try:
                data = self.backings.view(kind, owner, size, where, token)
            except (OSError, memory.Fault):
                return  # the driver created the backing; unreachable means it is gone
            resident = None
            if kind == uapi.MemKind.MANAGED:
                resident = np.zeros(-(-size // memory.MANAGED_PAGE), bool)
            ctx.space.add(memory.Mapping(va, size, kind, owner, data, resident))
        elif op == abi.Op.UNMAP:
            targets = {r: r.wptr for r in ctx.queues.values() if not r.fence_only}
            self._deferred_unmaps.append((ctx, a[0], targets))
        elif op == abi.Op.QUEUE_CREATE:
            qid, priority, token = a[0], a[1], a[2]
            try:
                ring = Ring(ctx, qid, priority,
                            os.path.join(self.shm_dir, uapi.ring_name(qid, token)))
            except OSError:
                return  # destroyed before we got to it: the driver already removed the file
            ctx.queues[qid] = ring
            self.sched.add(ring)
        elif op == abi.Op.QUEUE_IMPORT:
            local, _peer_dev, peer_qid, token = a[0], a[1], a[2], a[3]
            try:
                ring = Ring(ctx, local, 0, os.path.join(self.shm_dir, uapi.ring_name(peer_qid, token)),
                            fence_only=True)
            except OSError:
                return  # the peer queue is gone; a WAIT_QUEUE naming it faults as unknown
            ctx.queues[local] = ring
        elif op == abi.Op.MODULE_LOAD:
            path = os.path.join(self.shm_dir, uapi.module_name(a[0], a[1]))
            try:
                with open(path, "rb") as f:
                    module = json.load(f)
            except (OSError, ValueError):
                return  # unloaded before we read it; launches naming it fault as unknown
            ctx.modules[a[0]] = list(module["kernels"].items())
            self.sched.warm_up()  # kernels are coming: load the JIT (numba) off the hot path
        elif op == abi.Op.MODULE_UNLOAD:
            ctx.modules.pop(a[0], None)
        elif op == abi.Op.QUEUE_DESTROY:
            ring = ctx.queues.get(a[0])
            if ring is not None:
                ring.closing = True
                self._closing.append(ring)

    def _housekeeping(self) -> None:
        """Unmaps, queue closes and context teardowns whose work has completed."""
        for ctx in [c for c in self._teardowns if not any(r.busy for r in c.queues.values())]:
            self._teardowns.remove(ctx)
            self._teardown(ctx)
        done = [d for d in self._deferred_unmaps
                if all(r.completed >= w for r, w in d[2].items())]
        for d in done:
            self._deferred_unmaps.remove(d)
            self._unmap(d[0], d[1])
            self.post(abi.Op.UNMAP, d[0].id, (d[1],))
        for ring in [r for r in self._closing if r.completed >= r.wptr and not r.busy]:
            self._closing.remove(ring)
            assert self.sched is not None
            self.sched.remove(ring)
            ring.ctx.queues.pop(ring.id, None)

    def _unmap(self, ctx: FwContext, va: int) -> None:
        m = ctx.space.remove(va)
        if m is not None and m.resident is not None:
            assert self.sched is not None
            self.sched.residency.drop(m)

    def _teardown(self, ctx: FwContext) -> None:
        """Forget a stopped context: its rings, mappings and doorbell; report it gone."""
        assert self.sched is not None
        for ring in ctx.queues.values():
            self.sched.remove(ring)
        self._deferred_unmaps = [d for d in self._deferred_unmaps if d[0] is not ctx]
        for m in ctx.space.mappings():
            self._unmap(ctx, m.va)
        for fd in (ctx.doorbell, ctx._doorbell_keepalive):
            if fd >= 0:
                os.close(fd)
        self.post(abi.Op.CTX_DESTROY, ctx.id, ())

    # run ----------------------------------------------------------------------------
    def drain_mailbox(self) -> int:
        done = 0
        while not self.hung and (item := self.mbx.cmd.pop()) is not None:
            self.handle(*item)
            done += 1
        if self._backlog:
            with self._cpl_lock:
                self._flush_locked()
        return done

    def _sleep(self, timeout: float) -> None:
        """Mark the rings sleeping, re-check, and sleep until a doorbell or the timeout."""
        assert self.sched is not None
        self.mbx.set_stats(self.stats)  # counters are current whenever the device idles
        rings = self.sched.rings
        for r in rings:
            r.set_sleeping(1)
        uapi.full_barrier()  # producers store wptr then load "sleeping"; we store then load
        if not self.sched.pending() and self.mbx.cmd.pending() == 0:
            if any(r.blocked and r.blocked[0].fence_only for r in rings):
                timeout = min(timeout, CROSS_DEVICE_POLL_S)
            fds = [self.doorbell_fd, self.sched.wake_fd] + [
                c.doorbell for c in self.contexts.values() if c.doorbell >= 0]
            ready, _, _ = select.select(fds, [], [], timeout)
            for fd in ready:
                self._drain_fd(fd)
        for r in rings:
            r.set_sleeping(0)

    def _drain_fd(self, fd: int) -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        if fd == self.doorbell_fd and data == b"":
            self.mbx.set_fw_state(abi.FwState.HALTED)
            sys.exit(0)  # the driver closed the doorbell: it is gone or resetting us
        if self.sched is not None and fd == self.sched.wake_fd:
            self.sched.drain_wakeups()

    def run(self) -> int:
        assert self.sched is not None
        last_beat = time.monotonic()
        last_work = 0.0
        while True:
            self.sched.publish()  # before the mailbox is drained: see publish()
            work = self.drain_mailbox() + self.sched.poll()
            if self._deferred_unmaps or self._closing or self._teardowns:
                self._housekeeping()
            now = time.monotonic()
            if work:
                last_work = now
            if not self.hung and now - last_beat >= self.heartbeat_s:
                self.mbx.beat(time.monotonic_ns())
                self.mbx.set_stats(self.stats)
                last_beat = now
            if now - last_work < SPIN_AFTER_ACTIVITY_S and not self.hung:
                os.sched_yield()  # on a shared core, let others run, but stay awake
                self._poll_doorbell()
                continue
            self._sleep(max(0.0, self.heartbeat_s - (now - last_beat)))

    def _poll_doorbell(self) -> None:
        """While spinning, still notice the driver closing the doorbell (it went away)."""
        ready, _, _ = select.select([self.doorbell_fd], [], [], 0)
        if ready:
            self._drain_fd(self.doorbell_fd)


def _has_entries(cache_dir: str) -> bool:
    """Whether the persistent kernel cache holds anything (its entries live in
    two-character shard directories). Then the JIT warms up at boot, off the hot path:
    a firmware on a machine that never ran a kernel does not pay for numba."""
    try:
        with os.scandir(cache_dir) as it:
            return any(e.is_dir() and len(e.name) == 2 for e in it)
    except OSError:
        return False


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
    parser.add_argument("--jit-cache", required=True, help="the persistent kernel cache")
    args = parser.parse_args(argv)
    # The driver stops us by closing the doorbell or with SIGTERM/SIGKILL; a Ctrl-C meant
    # for the daemon's terminal must not crash the device.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.setswitchinterval(0.0002)  # engine threads get the GIL back quickly from the loop
    os.set_blocking(args.irq_fd, False)
    os.set_blocking(args.doorbell_fd, False)
    buf = mmap.mmap(args.mailbox_fd, abi.MAILBOX_SIZE)
    backings = memory.Backings.open(args.shm_dir, args.vram_fds, args.vram_size)
    fw = Firmware(abi.Mailbox(memoryview(buf)), args.doorbell_fd, args.irq_fd, backings,
                  args.vram_size, args.shm_dir, args.jit_cache)
    if not fw.boot():
        return 1
    return fw.run()
