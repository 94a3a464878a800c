"""The memory and pipes a process brings to the driver (docs/containment.md).

The driver creates no file a process can write: rings, pinned and managed memory, the
doorbell page and module images are memfds of this process, *sealed* so that nobody --
this process included -- can shrink or grow them while the device maps them (module images
are sealed against writing as well: what the driver checked is what the firmware runs). A
command names such a descriptor; the driver imports it, and this process may close its own
descriptor afterwards (a mapping keeps the memory).
"""

from __future__ import annotations

import fcntl
import mmap
import os

from abi import uapi


def sealed_memfd(name: str, size: int, data: bytes | None = None) -> int:
    """A memfd of ``size`` bytes sealed with ``ACCEL_SEALS_PINNED``, or with ``data``
    written into it and sealed with ``ACCEL_SEALS_IMMUTABLE``; the caller owns it."""
    fd = os.memfd_create(f"accel-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if data is not None:
            os.pwrite(fd, data, 0)
        fcntl.fcntl(fd, uapi.F_ADD_SEALS,
                    uapi.ACCEL_SEALS_PINNED if data is None else uapi.ACCEL_SEALS_IMMUTABLE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_memfd(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of a memfd shared (a zero-size mapping is not possible: one byte
    then stands in, as the driver rounds sizes to pages anyway)."""
    return mmap.mmap(fd, max(size, 1))
