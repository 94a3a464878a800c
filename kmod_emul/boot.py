"""A device's bring-up: the step table, and the firmware's attach to the driver.

``boot`` runs ``BRINGUP`` (kmod_emul/bringup.py runs any such table) for one device; a
failed step leaves the device failed with that step's error, and nothing it or the steps
before it made. The firmware's own steps are ``FirmwareProcess``'s (kmod_emul/fw.py);
the driver's are the two at the end: learn the device from the image (``config``), then
route messages to the firmware (``attach``). ``stop`` tears the last bring-up down with
the same undos a failed one runs (ivpu_dev_init and its goto labels, ivpu_dev_fini).
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from abi import fwimage, mailbox, uapi
from kmod_emul import bringup, limits
from kmod_emul.errors import DriverError
from kmod_emul.fw import FirmwareProcess

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Boot:
    """One bring-up of a device: the device, and the firmware its steps assemble."""

    dev: AccelDevice
    fw: FirmwareProcess


async def boot(dev: AccelDevice) -> None:
    """Run the bring-up table (``BRINGUP``) for ``dev``; on success it is operational."""
    dev.state = uapi.DeviceState.BOOTING
    dev.failure = None
    dev.sched_hold = False  # a fresh firmware schedules
    dev.ras.retire_pending()  # nothing from before the reset runs any more
    flags = mailbox.BootFlag.FAIL_BOOT if dev.fw_boot_fail else 0
    fw = FirmwareProcess(dev.firmware_dir, flags, dev.name, dev.memory_total,
                         dev.mem_config, dev.engine_share)
    try:
        dev.up = await bringup.bring_up(BRINGUP, Boot(dev, fw), dev.name,
                                        fail_at=dev.fail_step)
    except DriverError as exc:
        dev.resets.fail(exc.errno, exc.message)
        return
    except OSError as exc:  # out of descriptors, memory, processes: this device only
        dev.resets.fail(exc.errno or errno.EIO,
                        f"bring-up step {bringup.failed_step(exc)} failed: {exc.strerror or exc}")
        return
    if dev.resets.requested.is_set():
        return  # a reset arrived while booting; the supervisor skips serving by the state
    dev.state = uapi.DeviceState.OPERATIONAL
    dev.link.restored()
    assert fw.image is not None
    log.info("%s: firmware %s up (pid %d)", dev.name, fw.image.version, fw.pid)


async def stop(dev: AccelDevice) -> None:
    """Tear the last bring-up down: the same undos a failed one runs."""
    up, dev.up = dev.up, None
    if up is not None:
        await up.teardown()


def limits_of(dev: AccelDevice) -> limits.Limits:
    """What the configuration allows, cut to the daemon's descriptors, with the
    operator's values (``--limit``) once an image says what the tables are (the daemon
    checked them against the image at start: ``daemon.check_limits``)."""
    overrides = dict(dev.mem_config.limits) if dev.fw_image is not None else {}
    try:
        return limits.Limits.for_device(dev.config, dev.mem_config.devices,
                                        dev.mem_config.fd_limit, overrides)
    except limits.LimitError as exc:  # an image installed since allows less
        raise DriverError(errno.EINVAL, f"accel-emud --limit: {exc}") from None


# --- bring-up steps of the driver's own (the firmware's are FirmwareProcess's) -----------
def configure(dev: AccelDevice, img: fwimage.FirmwareImage | None) -> None:
    """Learn the device from the image that runs (engines, limits, capabilities and
    versions: the description and sysfs render them); None: back to knowing nothing, so
    versions report what runs, not what ran before."""
    dev.fw_image, dev.static_info = img, None
    dev.limits = limits_of(dev)


def attach(dev: AccelDevice, fw: FirmwareProcess) -> None:
    """Route the driver's messages to this firmware; first, the memory budget."""
    dev.fw = fw
    try:
        dev.send_budget()
    except BaseException:
        detach(dev)  # a step that fails releases its own half
        raise


def detach(dev: AccelDevice) -> None:
    """No more messages; what was never sent is dropped (its descriptors closed), and
    the confirmations the firmware owed (unmaps, context teardowns) will never come."""
    fw, dev.fw = dev.fw, None
    if fw is not None:
        fw.drop_backlog()
    dev.memory.firmware_gone()


#: A device's bring-up, in order: (name, do, undo). A failure at a step undoes the steps
#: before it, last first; a stop or reset undoes them all (kmod_emul/bringup.py). The
#: debugfs knob ``fail_step`` (``accel-emud --fail-step accelN:STEP`` at start) fails
#: the named one; docs/driver.md lists what each makes and releases.
BRINGUP: tuple[bringup.Step[Boot], ...] = (
    bringup.Step("image", lambda b: b.fw.load_image()),
    bringup.Step("mailbox", lambda b: b.fw.map_mailbox(), lambda b: b.fw.unmap_mailbox()),
    bringup.Step("interrupts", lambda b: b.fw.open_interrupts(),
                 lambda b: b.fw.close_interrupts()),
    bringup.Step("fd_channel", lambda b: b.fw.open_fd_channel(),
                 lambda b: b.fw.close_fd_channel()),
    bringup.Step("process", lambda b: b.fw.start_process(), lambda b: b.fw.halt_process()),
    bringup.Step("handshake", lambda b: b.fw.handshake()),
    bringup.Step("config", lambda b: configure(b.dev, b.fw.image),
                 lambda b: configure(b.dev, None)),
    bringup.Step("attach", lambda b: attach(b.dev, b.fw), lambda b: detach(b.dev)),
)
STEP_NAMES: tuple[str, ...] = tuple(s.name for s in BRINGUP)
