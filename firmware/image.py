"""Firmware image format: a manifest and a payload, checked by a SHA-256.

An image is one file, ``MAGIC | u32 manifest length | manifest JSON | payload``. The
manifest names the version, the ISA it implements, the range of host-firmware mailbox ABIs
it speaks and the payload's checksum; the payload is the device configuration the firmware
boots with (engines, limits, capabilities). The driver verifies an image before it loads
it into a device (as ``request_firmware`` plus a signature check would), and the firmware's
boot ROM verifies the copy it was handed again.

``python -m firmware.image`` rebuilds the shipped image from ``DEFAULT_PAYLOAD``.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

MAGIC = b"AEMUFW01"
_LEN = struct.Struct("<I")

#: Where the shipped images live; the daemon's ``--firmware-dir`` overrides it.
IMAGE_DIR = Path(__file__).resolve().parent / "images"
#: The image every emulated device of this model loads.
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

DEFAULT_MANIFEST: dict[str, Any] = {
    "name": "accel-emu-a1",
    "version": "1.0.0",
    "isa_version": "1.0",
    "isa_stepping": "A1",
    "abi_min": 2,
    "abi_max": 2,
}

DEFAULT_PAYLOAD: dict[str, Any] = {
    "compute_engines": 2,
    "copy_engines": 2,
    "max_threads_per_block": 1024,
    "max_shared_mem_per_block": 48 * 1024,
    "max_contexts": 64,
    "max_queues": 4096,
    "max_host_allocations": 8192,
    "heartbeat_interval_ms": 50,
    "capabilities": [
        "noop",
        "copy",
        "compute",
        "fp64",
        "atomics",
        "shared_mem",
        "timestamps",
        "exclusive_mode",
        "multi_context",
        "matrix",
    ],
}


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
    return FirmwareImage(manifest, payload, raw)


def default_image() -> bytes:
    return build(DEFAULT_MANIFEST, json.dumps(DEFAULT_PAYLOAD, sort_keys=True).encode())


def main() -> None:
    """Rebuild the shipped image (run after changing DEFAULT_MANIFEST/PAYLOAD)."""
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else IMAGE_DIR / IMAGE_NAME
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(default_image())
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
