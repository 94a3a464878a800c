"""Stable physical identity: UUID and serial persisted per physical device.

A framework index (``device:1``) names a device inside one process; correlating a retired
page, a rank and an incident across reboots needs an identity that survives daemon
restarts. The physical key is the device's slot (its PCI-style bus id); the first daemon to
see a slot mints its UUID and serial and stores them in ``STATE_DIR/identity.json``.
"""

from __future__ import annotations

import json
import os
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Identity:
    uuid: str
    serial: str


def pci_bus_id(index: int, function: int = 0) -> str:
    """The emulated slot of physical device ``index`` (domain:bus:device.function); a
    compute partition of it answers at a function of its own (kmod_emul/partition.py)."""
    return f"0000:{0x41 + index:02x}:00.{function}"


class IdentityStore:
    """Reads and extends the persisted slot -> identity map (written atomically)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "identity.json"

    def _load(self) -> dict[str, dict[str, str]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise RuntimeError(f"identity store {self.path} is unreadable: {exc}") from None
        return data if isinstance(data, dict) else {}

    def identities(self, slots: list[str]) -> dict[str, Identity]:
        data = self._load()
        minted = False
        for slot in slots:
            if slot not in data:
                data[slot] = {
                    "uuid": f"ACCEL-{uuid.uuid4()}",
                    "serial": "".join(str(secrets.randbelow(10)) for _ in range(13)),
                }
                minted = True
        if minted:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp.{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
            os.replace(tmp, self.path)
        return {slot: Identity(**data[slot]) for slot in slots}
