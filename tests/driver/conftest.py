"""Fixtures of the raw driver tests: open files of device 0 of the shared daemon.

``dev`` is the test's own open file; ``bystander`` another one holding a context, which
bad input elsewhere must not disturb; ``env`` both, for the per-command bad-input cases
(tests/refusals.py), closing what the cases open.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rawdev import RawDev
from refusals import Env


@pytest.fixture
def dev(daemon) -> Iterator[RawDev]:
    with RawDev(daemon.node(0)) as d:
        yield d


@pytest.fixture
def bystander(daemon) -> Iterator[tuple[RawDev, int]]:
    """Another context on the same device, which bad input elsewhere must not disturb."""
    with RawDev(daemon.node(0)) as d:
        yield d, d.ctx_create()


@pytest.fixture
def env(daemon, dev, bystander) -> Iterator[Env]:
    e = Env(daemon, dev, bystander)
    try:
        yield e
    finally:
        e.close()
