"""Short in CI, long on request: the repetition counts of tests whose proof is "the same
thing, many times" (children in turn, rounds of a race).

CI runs the suite under a time budget (`make test`, README.md "Tests"), so such a test
runs a count that still makes its point -- every path it names taken, every check made --
and its long form, the count that hunts for the rare interleaving, runs with
``ACCEL_TESTS_LONG=1``. Those tests carry the ``long_form`` marker: `make stress` runs
them long after the attackers of stress/ (``ACCEL_TESTS_LONG=1 pytest -m long_form``).
"""

from __future__ import annotations

import os

#: whether the tests run their long forms (``ACCEL_TESTS_LONG=1``)
LONG = os.environ.get("ACCEL_TESTS_LONG") == "1"


def count(short: int, long: int) -> int:
    """``long`` with ``ACCEL_TESTS_LONG=1``, else ``short``: a test's repetitions."""
    return long if LONG else short
