"""Temperature, clocks and thermal faults of one package: a device, with its partitions.

A first-order model, read lazily (no timer runs): the die sits at ``AMBIENT_C`` plus a
load term that follows the work it runs -- the firmware's packet rate or its compute
engines' utilization (kmod_emul/activity.py), whichever is the larger share of full load
-- plus heat that an injection adds; both settle with time constant ``TAU_S``. Sustained
full load settles at ``AMBIENT_C + LOAD_C`` (92 C), over ``SLOWDOWN_C``: after about four
seconds of it the clocks throttle, as a real part's do under sustained load, and stop
throttling soon after the load stops. Over ``SLOWDOWN_C`` the clocks throttle to half
(NVML's ``clocks_event_reasons.sw_thermal_slowdown``); over
``SHUTDOWN_C`` the device shuts down: it fails, its firmware stops, every context is lost
(record 141), and with ``recovery`` auto the driver resets it once it has cooled below
the slowdown threshold.

A split device's partitions share its model (kmod_emul/partition.py): one package, one
thermal budget. Its load term follows the packet rate of all of them together, every
partition reads the package's temperature, clock and throttle reasons, and an injection
on any one of them heats the package: a throttle is recorded on each, and a shutdown
fails each (every context lost); then the package's recovery resets the device, and its
package reset the partitions (``Resets.request``).

Injection (``ras_ctrl``): ``inject thermal ce <C> [<S>]`` heats the die to C degrees
(default: 2 over the slowdown threshold) and holds it there S seconds (default
``HOLD_S``) before it cools -- throttling, visible in ``temperature``, ``clock`` and
``throttle_reasons``, record 140. Without the hold the die fell back under the threshold
in under 0.25 s, which no 1 s monitor (``accel-smi -l 1``, a scrape) ever saw;
``inject thermal ue <C>`` heats it to C (default: 5 over the shutdown threshold) -- a
thermal shutdown. C is at most ``MAX_INJECT_C`` (EINVAL past it).
"""

from __future__ import annotations

import errno
import math
import time
from typing import TYPE_CHECKING

from abi import faults

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice

AMBIENT_C = 35.0
SLOWDOWN_C = 85.0
SHUTDOWN_C = 95.0
#: Degrees the die gains at sustained full load (``FULL_LOAD_PPS`` packets a second, or
#: the compute engines always busy): between the slowdown and the shutdown thresholds.
LOAD_C = 57.0
FULL_LOAD_PPS = 20_000.0
#: Injected heat decays with this time constant (the device cools).
TAU_S = 2.0
#: The hottest an injection heats the die to (``inject thermal ue|ce C``): past any
#: shutdown threshold, and a bound that keeps the model's floats finite.
MAX_INJECT_C = 200
#: How long ``inject thermal ce`` holds its heat by default: long enough for a monitor that
#: samples once a second to see the throttle at least twice.
HOLD_S = 3.0
#: The longest hold an injection may ask for (an hour): a bound, not a policy.
MAX_HOLD_S = 3600.0
BASE_CLOCK_MHZ = 1500
THROTTLED_CLOCK_MHZ = 750


class Thermal:
    def __init__(self, dev: AccelDevice) -> None:
        self.dev = dev
        self._heat = 0.0  # injected degrees over the load-driven temperature, at _heat_t
        self._heat_t = time.monotonic()
        self._hold_until = 0.0  # the injected heat does not decay before this (monotonic)
        self._load = 0.0  # smoothed load term, degrees
        #: (when, packets by device index) of the last load sample
        self._sample: tuple[float, dict[int, int]] = (time.monotonic(), {})

    def members(self) -> list[AccelDevice]:
        """The devices this model heats: the device and the partitions it is split into."""
        return [self.dev, *self.dev.partitions]

    def _heat_now(self, now: float) -> float:
        """Injected heat: held until ``_hold_until``, then decaying."""
        since = max(self._heat_t, self._hold_until)
        return self._heat * math.exp(-max(0.0, now - since) / TAU_S)

    def temperature(self) -> float:
        """Degrees Celsius now."""
        now = time.monotonic()
        packets = {d.index: d.fw_stats().get("packets", 0) for d in self.members()}
        then, before = self._sample
        if now - then >= 0.2:  # a rate needs a span; the load term smooths over samples
            # per device: a restarted firmware counts from 0 again, a new partition from 0
            done = sum(max(0, n - before.get(i, 0)) for i, n in packets.items())
            rate = done / (now - then)
            busy = max(d.activity.utilization("compute") for d in self.members()) / 100
            target = LOAD_C * max(min(1.0, rate / FULL_LOAD_PPS), busy)
            self._load += (target - self._load) * (1 - math.exp(-(now - then) / TAU_S))
            self._sample = (now, packets)
        return AMBIENT_C + self._load + self._heat_now(now)

    def throttle_reasons(self) -> str:
        t = self.temperature()
        if t >= SHUTDOWN_C or any(d.failure and "thermal" in d.failure[1]
                                  for d in self.members()):
            return "hw_thermal_shutdown"
        return "sw_thermal_slowdown" if t >= SLOWDOWN_C else "none"

    def clock_mhz(self) -> int:
        return THROTTLED_CLOCK_MHZ if self.temperature() >= SLOWDOWN_C else BASE_CLOCK_MHZ

    def cooled(self) -> bool:
        return self.temperature() < SLOWDOWN_C

    def heat_to(self, celsius: float, hold_s: float = 0.0) -> float:
        """Add the heat that brings the die to ``celsius`` now and hold it ``hold_s``
        seconds; the temperature reached."""
        now = time.monotonic()
        current = self.temperature()
        self._heat = self._heat_now(now) + max(0.0, celsius - current)
        self._heat_t = now
        self._hold_until = now + hold_s
        return self.temperature()

    def correctable(self, address: int, hold_s: float = HOLD_S) -> None:
        """Throttle the package for ``hold_s`` seconds at least: recorded on each device
        it heats, as each one slows."""
        reached = self.heat_to(address or SLOWDOWN_C + 2, hold_s)
        for dev in self.members():
            dev.report(faults.BY_NAME["THERMAL_THROTTLE"].code, address=address,
                       message=f"{reached:.0f} C, over the {SLOWDOWN_C:.0f} C slowdown "
                               f"threshold: clocks throttled to {THROTTLED_CLOCK_MHZ} MHz "
                               f"for {hold_s:g} s at least")

    def uncorrectable(self, address: int) -> None:
        """Shut the package down: each device it heats fails; the device (the package)
        is reset once cooled, and its reset reaches the partitions."""
        reached = self.heat_to(address or SHUTDOWN_C + 5)
        message = (f"thermal shutdown at {reached:.0f} C (over {SHUTDOWN_C:.0f} C)"
                   + ("; it is reset once cooled" if self.dev.recovery == "auto" else
                      "; reset it once cooled"))
        code = faults.BY_NAME["THERMAL_SHUTDOWN"].code
        for dev in self.members():
            dev.resets.shut_down(errno.ENODEV, message, code,
                          recover_when=self.cooled if dev is self.dev else None)
