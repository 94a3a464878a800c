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
        cached = cls.__dict__.get("_reserved_ranges")
        if cached is None:
            cached = tuple(
                (getattr(cls, name).offset, getattr(cls, name).offset + getattr(cls, name).size)
                for name, *_ in cls._fields_
                if name.startswith(("pad", "reserved"))
            )
            cls._reserved_ranges = cached
        return cached

    @classmethod
    def reserved_clear(cls, raw: bytes | memoryview, base: int = 0) -> bool:
        """True when every reserved byte of the struct at ``raw[base:]`` is zero."""
        return not any(any(raw[base + lo : base + hi]) for lo, hi in cls.reserved_ranges())
