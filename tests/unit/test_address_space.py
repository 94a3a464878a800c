"""A context's address space in the firmware (firmware/memory.py ``AddressSpace``):
resolving an address range gives the one mapping holding all of it, or a Fault at the
first byte outside; the last mapping found is kept for the next resolve (a stream's
argument blocks all lie in one arena), which must never answer for a mapping that was
removed or replaced since."""

from __future__ import annotations

import numpy as np
import pytest

from abi import uapi
from firmware import memory

KiB = 1 << 10


def _mapping(va: int, size: int) -> memory.Mapping:
    return memory.Mapping(va, size, uapi.MemKind.HOST_PINNED, 0, np.zeros(size, np.uint8))


def _fault_at(space: memory.AddressSpace, va: int, size: int) -> int:
    with pytest.raises(memory.Fault) as ei:
        space.resolve(va, size)
    return ei.value.addr


@pytest.mark.timeout(30)
def test_a_range_resolves_to_its_mapping_or_faults_at_the_first_byte_outside():
    space = memory.AddressSpace()
    a, b = _mapping(0x10000, 64 * KiB), _mapping(0x40000, 4 * KiB)
    space.add(a)
    space.add(b)
    end = 0x10000 + 64 * KiB
    for bad, where in (((end - 4, 8), end), ((end, 0), end), ((0xFFFF, 1), 0xFFFF),
                       ((0x30000, 8), 0x30000), ((0x40000 - 8, 16), 0x40000 - 8)):
        # each after a resolve of ``a``, which the next one tries first
        assert space.resolve(0x10000, 64 * KiB) == (a, 0)
        assert space.resolve(0x10000 + 100, 8) == (a, 100)
        assert _fault_at(space, *bad) == where, bad
        assert space.resolve(0x40010, 16) == (b, 0x10)


@pytest.mark.timeout(30)
def test_a_removed_or_replaced_mapping_is_never_the_answer():
    space = memory.AddressSpace()
    old = _mapping(0x10000, 64 * KiB)
    space.add(old)
    assert space.resolve(0x10100, 64) == (old, 0x100)  # kept for the next resolve
    space.remove(0x10000)
    assert _fault_at(space, 0x10100, 64) == 0x10100
    new = _mapping(0x10000, 8 * KiB)  # the same address again, smaller
    space.add(new)
    assert space.resolve(0x10100, 64) == (new, 0x100)
    assert _fault_at(space, 0x10000 + 8 * KiB, 64) == 0x10000 + 8 * KiB
