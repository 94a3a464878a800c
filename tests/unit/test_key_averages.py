"""``key_averages().table()`` takes torch.profiler's sort keys as well as its own."""

from __future__ import annotations

import pytest

from runtime._key_averages import TORCH_SORT_KEYS, KeyAverage, KeyAverages

ROWS = KeyAverages([KeyAverage("Kernel.launch", True, 3, 30_000, 9_000),
                    KeyAverage("fill", False, 3, 0, 9_000),
                    KeyAverage("DeviceArray.copy_to_host", True, 1, 80_000, 2_000)])


@pytest.mark.timeout(10)
@pytest.mark.parametrize("torch_key", sorted(TORCH_SORT_KEYS))
def test_a_torch_sort_key_sorts_as_ours(torch_key):
    assert ROWS.table(sort_by=torch_key) == ROWS.table(sort_by=TORCH_SORT_KEYS[torch_key])


@pytest.mark.timeout(10)
def test_an_unknown_sort_key_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="one of name, calls"):
        ROWS.table(sort_by="flops")
