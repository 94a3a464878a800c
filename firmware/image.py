"""The shipped firmware image of the A1 model: its manifest and device configuration.

The format (and its checks) is the contract's, :mod:`abi.fwimage`; this is what the
firmware team builds into it. ``python -m firmware.image [DEST]`` rebuilds
``firmware/images/accel-emu-a1.fw`` after a change here (``make firmware``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from abi import fwimage, kernel_lang, mailbox

#: Where the shipped images live; the daemon's ``--firmware-dir`` overrides it.
IMAGE_DIR = Path(__file__).resolve().parent / "images"

DEFAULT_MANIFEST: dict[str, Any] = {
    "name": "accel-emu-a1",
    "version": "1.0.0",
    "isa_version": kernel_lang.ISA_VERSION,
    "isa_stepping": "A1",
    # the mailbox ABI this firmware's code speaks (firmware/main.py)
    "abi_min": mailbox.MAILBOX_ABI,
    "abi_max": mailbox.MAILBOX_ABI,
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



def default_image(**payload: Any) -> bytes:
    """The shipped image; with keyword arguments, a variant whose payload differs in
    those fields (a shorter watchdog, fewer capabilities) for tests and benchmarks."""
    body = dict(DEFAULT_PAYLOAD, **payload)
    return fwimage.build(DEFAULT_MANIFEST, json.dumps(body, sort_keys=True).encode())


def build_into(directory: Path, **payload: Any) -> Path:
    """Write ``default_image(**payload)`` into ``directory`` (made if missing) under the
    name the driver looks for; return the directory, for ``--firmware-dir``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / fwimage.IMAGE_NAME).write_bytes(default_image(**payload))
    return directory


def main() -> None:
    """Rebuild the shipped image (run after changing DEFAULT_MANIFEST/PAYLOAD)."""
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else IMAGE_DIR / fwimage.IMAGE_NAME
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(default_image())
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
