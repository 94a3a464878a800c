"""Kernels on managed memory: the page maps a launch's code marks, and their migration.

A buffer argument in managed memory gets the argument type ``<type>@managed``
(:data:`MANAGED_SUFFIX`), which compiles to a variant of the kernel whose accesses of that
buffer set ``marks[page] = 1`` for each 64 KiB page they touch (firmware/lower/render.py: per access on the checked path, once per block for the
index box of an access whose range the block checked). After each slice of blocks the engine
that ran it migrates the pages marked since the previous slice (:func:`migrate`): faults,
bytes to the device, LRU evictions under oversubscription, all in the device's counters
(firmware/memory.py, ``Residency``). The emulator's data is host memory either way, so
the order -- bytes first, accounting after the slice -- changes nothing a kernel reads; the
migration still costs a real copy per page, on the engine's thread, never on the control
loop for more than :data:`INLINE_PAGES` pages (a launch that could touch more does not run
inline).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from firmware.memory import MANAGED_PAGE, Mapping, Residency

#: Suffix of a buffer's argument type when its memory is managed (``"float32[1d]@managed"``;
#: firmware/kernel_check.py parses it): a different variant, so the JIT keys it apart.
#: Here, not in kernel_check, because launches need it and kernel_check imports numba.
MANAGED_SUFFIX = "@managed"
#: A small launch runs inline on the control loop only if its managed buffers span at most
#: this many pages (1 MiB): the most a migration after it may copy there.
INLINE_PAGES = 16


@dataclass(eq=False)
class PageMap:
    """One managed buffer argument of a launch: the pages its bytes span, as marked."""

    mapping: Mapping
    first: int  # the mapping's page holding the buffer's first byte
    offset: int  # that byte's offset in its page (the generated code's ``_po_x``)
    marks: np.ndarray  # uint8, one per page spanned (``_pm_x``): 1 = touched


def bind(pages: list[PageMap] | None, m: Mapping, off: int, nbytes: int,
         type_name: str) -> tuple[list[PageMap], str]:
    """Add the buffer of bytes [off, off + nbytes) of managed mapping ``m`` to a launch's
    page maps (created on its first managed buffer, so that a launch without any pays
    nothing); returns them and the buffer's argument type."""
    first = off // MANAGED_PAGE
    count = (off + nbytes - 1) // MANAGED_PAGE - first + 1 if nbytes else 0
    pm = PageMap(m, first, off - first * MANAGED_PAGE, np.zeros(count, np.uint8))
    return [*(pages or ()), pm], type_name + MANAGED_SUFFIX


def arguments(pages: list[PageMap]) -> list:
    """The trailing kernel arguments of the page maps, in parameter order (the order of
    ``ArgType.extra_numba_types``)."""
    return [x for p in pages for x in (p.marks, p.offset)]


def inline_ok(pages: list[PageMap]) -> bool:
    """Whether migrating whatever a launch on these managed buffers may touch is small
    enough for the control loop."""
    return sum(len(p.marks) for p in pages) <= INLINE_PAGES


def migrate(residency: Residency, pages: list[PageMap]) -> None:
    """Migrate the pages marked since the last call and clear their marks. Engines running
    other blocks of the launch may mark concurrently: the marks are read from a snapshot
    (numpy's nonzero refuses an array that changes under it) and only those read are
    cleared, after the read, so a mark is never lost (at worst a page is seen again next
    time, resident then)."""
    for p in pages:
        touched = np.flatnonzero(p.marks.copy())
        if len(touched):
            p.marks[touched] = 0
            residency.touch_pages(p.mapping, (touched + p.first).tolist())
