"""The struct base every layout of the contracts is built on (uAPI, user queues, mailbox)."""

from __future__ import annotations

import ctypes


class Struct(ctypes.LittleEndianStructure):
    """Base of every struct of the contracts: packed, little-endian, explicit padding only;
    fields named ``pad*``/``reserved*`` must be zero (a receiver checks them with
    :meth:`reserved_clear`, so they can gain a meaning later)."""

    _pack_ = 1

    @classmethod
    def reserved_ranges(cls) -> tuple[tuple[int, int], ...]:
        """(start, end) byte ranges of the ``pad*``/``reserved*`` fields, computed once."""
        return tuple((lo, hi) for lo, hi, _zeros in _reserved(cls))

    @classmethod
    def reserved_clear(cls, raw: bytes | memoryview, base: int = 0) -> bool:
        """True when every reserved byte of the struct at ``raw[base:]`` is zero (on every
        command the driver takes: a slice compared with zeros, 2x faster than any())."""
        for lo, hi, zeros in _RESERVED.get(cls) or _reserved(cls):
            if raw[base + lo : base + hi] != zeros:
                return False
        return True


#: each struct's reserved ranges with their zeros, by class (a plain dict: a lookup in a
#: ctypes class's own __dict__ cost 0.8 us, a tenth of a DEVICE_QUERY's decode)
_RESERVED: dict[type, tuple[tuple[int, int, bytes], ...]] = {}


def _reserved(cls: type[Struct]) -> tuple[tuple[int, int, bytes], ...]:
    ranges = _RESERVED.get(cls)
    if ranges is None:
        ranges = _RESERVED[cls] = tuple(
            (field.offset, field.offset + field.size, bytes(field.size))
            for name, *_ in cls._fields_ if name.startswith(("pad", "reserved"))
            for field in (getattr(cls, name),))
    return ranges
