"""Firmware image format: a manifest and a payload, checked by a SHA-256.

An image is one file, ``MAGIC | u32 manifest length | manifest JSON | payload``. The
manifest names the version, the ISA it implements, the range of host-firmware mailbox ABIs
it speaks and the payload's checksum; the payload is the device configuration the firmware
boots with (engines, limits, capabilities: ``CONFIG_FIELDS``), which the driver reports
(DEVICE_QUERY, sysfs) and enforces. The driver verifies an image before it loads it into a
device (as ``request_firmware`` plus a signature check would), and the firmware's boot ROM
verifies the copy it was handed again.

The shipped image is built by ``python -m firmware.image`` (firmware/image.py).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from abi import mailbox, uapi

MAGIC = b"AEMUFW01"
_LEN = struct.Struct("<I")

#: The image every emulated device of this model loads (``request_firmware``'s name).
IMAGE_NAME = "accel-emu-a1.fw"

REQUIRED_MANIFEST_KEYS = (
    "name",
    "version",
    "isa_version",
    "isa_stepping",
    "abi_min",
    "abi_max",
    "payload_sha256",
)
#: The device configuration a payload must carry (optional ones have their consumer's
#: default: ``max_queues``, ``max_host_allocations``, ``heartbeat_interval_ms``,
#: ``watchdog_ms``); ``capabilities`` names bits of ``uapi.Cap``.
CONFIG_FIELDS: dict[str, type] = {
    "compute_engines": int,
    "copy_engines": int,
    "max_threads_per_block": int,
    "max_shared_mem_per_block": int,
    "max_contexts": int,
    "capabilities": list,
}
#: What the driver reports of a device no image has booted on: it knows nothing yet.
UNBOOTED_CONFIG: dict[str, Any] = {
    **{k: 0 for k, t in CONFIG_FIELDS.items() if t is int}, "capabilities": []}
#: The engines a compute partition gets its share of (docs/partitions.md).
PARTITIONED_ENGINES = ("compute_engines", "copy_engines")


def partition_config(config: dict[str, Any], share: int) -> dict[str, Any]:
    """The configuration one of ``share`` partitions of a device runs with: its engines
    divided among them (at least one each). The driver reports it and the partition's
    firmware schedules on it, so both derive it here from the same image."""
    if share == 1:
        return config
    return {**config, **{k: max(1, config[k] // share) for k in PARTITIONED_ENGINES}}

class ImageError(Exception):
    """The image cannot be used; the message says why."""


@dataclass(frozen=True)
class FirmwareImage:
    manifest: dict[str, Any]
    payload: bytes
    raw: bytes

    @cached_property
    def config(self) -> dict[str, Any]:
        return json.loads(self.payload)

    @property
    def version(self) -> str:
        return str(self.manifest["version"])


def build(manifest: dict[str, Any], payload: bytes) -> bytes:
    """Serialise an image, filling in the payload checksum."""
    full = dict(manifest, payload_sha256=hashlib.sha256(payload).hexdigest())
    head = json.dumps(full, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(head)) + head + payload


def parse(raw: bytes) -> FirmwareImage:
    """Verify and split an image; raises ImageError naming the defect."""
    if not raw.startswith(MAGIC):
        raise ImageError("bad magic (not an accel-emu firmware image)")
    off = len(MAGIC)
    if len(raw) < off + _LEN.size:
        raise ImageError("truncated header")
    (head_len,) = _LEN.unpack_from(raw, off)
    off += _LEN.size
    if len(raw) < off + head_len:
        raise ImageError("truncated manifest")
    try:
        manifest = json.loads(raw[off : off + head_len])
    except ValueError as exc:
        raise ImageError(f"unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict):
        raise ImageError("manifest is not an object")
    missing = [k for k in REQUIRED_MANIFEST_KEYS if k not in manifest]
    if missing:
        raise ImageError(f"manifest lacks {', '.join(missing)}")
    if not all(type(manifest[k]) is int for k in ("abi_min", "abi_max")):
        raise ImageError("manifest abi_min/abi_max are not integers")
    payload = raw[off + head_len :]
    digest = hashlib.sha256(payload).hexdigest()
    if digest != manifest["payload_sha256"]:
        raise ImageError(
            f"payload checksum mismatch (manifest {manifest['payload_sha256'][:12]}…, "
            f"payload {digest[:12]}…)"
        )
    try:
        config = json.loads(payload)
    except ValueError as exc:
        raise ImageError(f"unreadable payload ({exc})") from None
    if not isinstance(config, dict):
        raise ImageError("payload is not an object")
    for key, kind in CONFIG_FIELDS.items():
        value = config.get(key)
        if type(value) is not kind or (kind is int and value < 0):
            want = "a non-negative integer" if kind is int else "a list"
            raise ImageError(f"payload field {key} is {value!r}, not {want}")
    if config["max_contexts"] > mailbox.LIVE_SLOTS:
        raise ImageError(f"payload max_contexts {config['max_contexts']} exceeds the mailbox's "
                         f"live-context table ({mailbox.LIVE_SLOTS})")
    caps = config["capabilities"]
    if not all(isinstance(c, str) for c in caps):
        raise ImageError("payload capabilities are not all names")
    unknown = set(caps) - set(uapi.caps_to_names(~0))
    if unknown:
        raise ImageError(f"payload names unknown capabilities {sorted(map(str, unknown))}")
    return FirmwareImage(manifest, payload, raw)
