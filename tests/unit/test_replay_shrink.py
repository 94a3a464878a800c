"""accel-replay's shrink (tools/accel_replay.py) over a stand-in for the runs: which subset
it keeps when a failure needs ranks, and when it needs only a delay or a fault. The real
runs are tests/tools/test_accel_replay.py's."""

from __future__ import annotations

import pytest

from tools.accel_replay import shrink

pytestmark = pytest.mark.timeout(30)

RANK_A = ("accel0", (0, 0, "rank", 65052))
RANK_B = ("accel0", (1, 0, "rank", 15994))
ORDER_1 = ("accel0", (1, 1, "order", 0))
ORDER_0 = ("accel0", (0, 1, "order", 1))
DELAY = ("accel0", (0, 1, "delay", 20000))
FAULT = ("accel0", (0, 2, "fault", "memory ue 0x1000"))


class Runs:
    """Fails a subset that holds every decision of one of ``needs`` (any of them)."""

    def __init__(self, *needs: set) -> None:
        self.needs = needs
        self.subsets: list[list] = []

    def fails(self, items) -> bool:
        self.subsets.append(list(items))
        return any(need <= set(items) for need in self.needs)


def test_a_failure_of_ranks_is_shrunk_again_keeping_the_start_order() -> None:
    """Two ranks fail every run of the stand-in, as they did 15 runs in a row for real
    before a replay passed: a subset with a rank is redone with every ``order`` kept."""
    runs = Runs({RANK_A, RANK_B}, {ORDER_1, ORDER_0})
    got = shrink([RANK_A, RANK_B, ORDER_1, ORDER_0, DELAY], runs)
    assert got[:2] == [ORDER_1, ORDER_0], got
    assert RANK_A not in got and RANK_B not in got, got


def test_a_delay_or_a_fault_alone_is_kept_alone() -> None:
    for needed in (DELAY, FAULT):
        runs = Runs({needed})
        assert shrink([RANK_A, ORDER_1, needed, ORDER_0], runs) == [needed]
