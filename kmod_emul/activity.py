"""How busy a device is: engine utilization over the last second, power, per-client time.

The firmware counts the nanoseconds its engines (and its control loop, standing in for
an engine when it runs a small packet inline) spend on packets, per engine kind and per
context (``abi.mailbox``: ``compute_busy_ns``/``copy_busy_ns`` and the context table).
The driver samples the totals ``SAMPLE_S`` apart while the device serves and keeps the
last ``WINDOW_S``: ``utilization`` is the busy time in that window over the time the
kind's engines had, as NVML's ``utilization.gpu`` is the share of a sample period a
kernel ran. A firmware that restarted counts from 0 again; the window starts afresh.

Power follows utilization (a dynamic term over an idle floor) and halves its dynamic term
while the clocks are throttled (kmod_emul/thermal.py): no figure here is fixed, each moves
with the work the device runs.

``fdinfo`` is DRM's per-client accounting (Documentation/gpu/drm-usage-stats.rst): one
block per open context, ``drm-engine-<kind>: N ns`` and ``drm-total-vram``/
``drm-memory-vram`` in KiB, shown to whom may see the process (root: everyone), as
``/proc/PID/fdinfo`` is shown to whom may ptrace it.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

import trio

from abi import mailbox, uapi

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice

SAMPLE_S = 0.1
WINDOW_S = 1.0
#: Watts: the floor of an idle device, and what its engines add at full use, by kind.
IDLE_W = 60.0
DYNAMIC_W = {"compute": 200.0, "copy": 40.0}
POWER_LIMIT_W = 300.0


class Activity:
    """One device's engine-time samples and what is derived from them."""

    def __init__(self, dev: AccelDevice) -> None:
        self.dev = dev
        #: (monotonic seconds, busy ns by kind), oldest first, at most a window's worth
        self._samples: collections.deque[tuple[float, tuple[int, ...]]] = collections.deque(
            maxlen=round(WINDOW_S / SAMPLE_S) + 1)

    def sample(self) -> None:
        stats = self.dev.fw_stats()
        busy = tuple(stats.get(f"{k}_busy_ns", 0) for k in mailbox.ENGINE_KINDS)
        if self._samples and any(b < a for a, b in zip(self._samples[-1][1], busy)):
            self._samples.clear()  # a new firmware counts from 0
        self._samples.append((time.monotonic(), busy))

    def forget(self) -> None:
        """The device stopped serving: nothing runs, and the next window starts afresh."""
        self._samples.clear()

    async def run(self, scope: trio.CancelScope) -> None:
        """Sample while the device serves (one of its watchers, ``AccelDevice.serve``)."""
        try:
            while True:
                self.sample()
                await trio.sleep(SAMPLE_S)
        finally:
            self.forget()

    def utilization(self, kind: str = "compute") -> int:
        """Percent of the window the ``kind`` engines were busy, 0-100 (0 before two
        samples, and while the device does not serve)."""
        if len(self._samples) < 2 or self.dev.state != uapi.DeviceState.OPERATIONAL:
            return 0
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        i = mailbox.ENGINE_KINDS.index(kind)
        engines = max(1, int(self.dev.config.get(f"{kind}_engines", 1)))
        share = (last[i] - first[i]) / ((t1 - t0) * 1e9 * engines)
        return round(100 * min(1.0, max(0.0, share)))

    def power(self) -> float:
        """Watts drawn now: the idle floor plus each kind's dynamic power at its
        utilization, halved while the clocks are throttled."""
        if self.dev.state != uapi.DeviceState.OPERATIONAL:
            return 0.0
        dynamic = sum(w * self.utilization(k) / 100 for k, w in DYNAMIC_W.items())
        if self.dev.thermal.throttle_reasons() != "none":
            dynamic /= 2
        return IDLE_W + dynamic


def fdinfo(dev: AccelDevice, uid: int) -> str:
    """DRM fdinfo blocks of every open context ``uid`` may see, blank-line separated."""
    times = dev.fw.mbx.ctx_stats() if dev.fw is not None else {}
    blocks = []
    for ctx in sorted(dev.tenants.live_contexts(), key=lambda c: c.id):
        if uid != 0 and ctx.file.uid != uid:
            continue
        ns = times.get(ctx.id, dict.fromkeys(mailbox.ENGINE_KINDS, 0))
        vram_kib = sum(a.backing.size for a in ctx.allocations.values()
                       if a.backing.kind == uapi.MemKind.DEVICE) // 1024
        blocks.append("\n".join([
            f"pid: {ctx.file.pid}",
            "drm-driver: accel-emu",
            f"drm-pdev: {dev.pci_bus_id}",
            f"drm-client-id: {ctx.id}",
            *(f"drm-engine-{k}: {ns[k]} ns" for k in mailbox.ENGINE_KINDS),
            f"drm-total-vram: {vram_kib} KiB",
            f"drm-memory-vram: {vram_kib} KiB",
            # the file's last refused command, as its process reads it (ACCEL_LAST_ERROR_OFFSET)
            *([f"accel-last-error: {ctx.file.last_error.strip()}"] if ctx.file.last_error
              else []),
        ]))
    return "\n\n".join(blocks)
