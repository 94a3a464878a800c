"""``wait_until``: the one way the tests wait for something asynchronous to happen.

Teardown, throttling, a firmware's log line -- much of what a test checks arrives a
little after the action that causes it. A fixed sleep guesses how long that takes and
breaks on a loaded machine; a poll with a generous limit waits only as long as needed.
When the limit does run out, the error names what was awaited and the last value seen,
so a failure on a busy CI runner says where it stuck rather than just "timed out".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: How often to look again: short next to any wait worth polling, long enough that the
#: poll itself does not load the machine it waits on
INTERVAL = 0.02


class WaitTimeout(AssertionError):
    """A wait ran out: an AssertionError, so that a test reports it as a failure (and
    callers that expect an AssertionError of a check keep working)."""


def wait_until(probe: Callable[[], T], timeout: float, what: str, *,
               ok: Callable[[T], object] = bool, interval: float = INTERVAL) -> T:
    """Call ``probe`` until ``ok`` holds for what it returns (by default: until that is
    true), and return that value. Past ``timeout`` seconds raise ``WaitTimeout`` naming
    ``what`` and the last value. ``probe`` is called once more after the deadline before
    giving up, so a slow sleep on a loaded machine cannot turn a met condition into a
    failure."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}; "
                              f"last seen: {value!r}")
        time.sleep(interval)


__all__ = ["INTERVAL", "WaitTimeout", "wait_until"]
