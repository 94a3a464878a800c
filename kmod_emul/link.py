"""The link between packages, and its faults: the package/link reset scope.

Every device of a daemon sits on one fabric (``fabric_endpoint`` ``fabric0:portN``), and
a process's peer copies between its devices cross it. A link error is the one fault whose
reach goes past a device: the package (here one device) resets, and every device that
could reach it over the link -- its link domain, the daemon's other devices -- must stop
reaching it first (NVIDIA's NVLink errors, and the "drain peers and reset" rung of the
NVML recovery ladder).

* a correctable error (``inject link ce``): the transfer was replayed; counted and
  recorded (code 125), nothing else.
* an uncorrectable one (``inject link ue``): record 74 (scope package, action
  drain-and-reset) naming the endpoint and the contexts it loses; every peer's firmware is
  told the device is out of reach, and the device's own firmware that its peers are, so a
  copy across the link fails with ENOLINK (record 76, the copy's stream only) while each
  side's local work goes on; the device resets once every peer answered (the drain,
  bounded by ``DRAIN_TIMEOUT_S``); when it serves again the peers are told it is back.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING

import trio

from abi import faults, mailbox

if TYPE_CHECKING:
    from kmod_emul.device import AccelDevice

log = logging.getLogger(__name__)

#: How long a package reset waits for its peers to stop reaching it.
DRAIN_TIMEOUT_S = 2.0


def fabric_endpoint(index: int) -> str:
    return f"fabric0:port{index}"


def domain(dev: AccelDevice) -> list[AccelDevice]:
    """The devices that reach ``dev`` over the link: every other device of the daemon."""
    return [d for d in dev.all_devices if d is not dev]


class Link:
    """One device's port on the fabric: up, or down until its package reset is done."""

    def __init__(self, dev: AccelDevice) -> None:
        self.dev = dev
        self.up = True
        #: peers that have not yet confirmed they stopped reaching this device
        self.draining: set[int] = set()
        self._drained = trio.Event()

    @property
    def state(self) -> str:
        """sysfs ``link_state``."""
        return "up" if self.up else "down"

    def correctable(self, address: int) -> None:
        self.dev.report(faults.BY_NAME["LINK_CE"].code, link=fabric_endpoint(self.dev.index),
                        address=address)

    def uncorrectable(self, address: int) -> None:
        """Take the port down, drain the peers, reset the package (see the module doc)."""
        dev = self.dev
        endpoint = fabric_endpoint(dev.index)
        self.up = False
        self.draining = {p.index for p in domain(dev) if p.fw is not None}
        self._drained = trio.Event()
        if not self.draining:
            self._drained.set()
        for peer in domain(dev):
            peer.fw_send(0, mailbox.fw_link(device=dev.index, up=0))
            dev.fw_send(0, mailbox.fw_link(device=peer.index, up=0))
        lost = dev.tenants.lose_contexts(f"{dev.name} lost its link ({endpoint}): package reset")
        dev.report(faults.BY_NAME["LINK_ERROR"].code, link=endpoint, address=address,
                   contexts=lost, errno=errno.errorcode[errno.ENOLINK],
                   message=f"uncorrectable link error on {endpoint}: peers drained, "
                           "package reset")
        dev.resets.request(f"link error on {endpoint}: package reset")

    def peer_confirmed(self, peer_index: int) -> None:
        """A peer's firmware stopped reaching this device (its LINK answer)."""
        self.draining.discard(peer_index)
        if not self.draining:
            self._drained.set()

    async def drain(self) -> None:
        """Before the package reset: wait for the peers (bounded: a peer that is itself
        down answers never, and must not hold this device's recovery)."""
        if self.up:
            return
        with trio.move_on_after(DRAIN_TIMEOUT_S):
            await self._drained.wait()
        if self.draining:
            log.warning("%s: peers %s did not confirm the drain in %.1f s", self.dev.name,
                        sorted(self.draining), DRAIN_TIMEOUT_S)

    def restored(self) -> None:
        """The package serves again: its peers may reach it (a fresh firmware of its own
        starts with every link up)."""
        if self.up:
            return
        self.up = True
        for peer in domain(self.dev):
            peer.fw_send(0, mailbox.fw_link(device=self.dev.index, up=1))

    def on_answer(self, msg: mailbox.fw_link) -> None:
        """This device's firmware applied a LINK message: when it stopped reaching device
        ``msg.device``, that device's drain has one peer less."""
        if not msg.up:
            target = next((d for d in self.dev.all_devices if d.index == msg.device), None)
            if target is not None and target is not self.dev:
                target.link.peer_confirmed(self.dev.index)
