"""Fixtures of the containment tests alone."""

from __future__ import annotations

import pytest

from testkit.bystander import Bystander
from testkit.contained import assert_contained, snapshot


@pytest.fixture
def contained(make_daemon):
    """A 2-device daemon other users can reach, a bystander of root's on each device, and
    a snapshot taken once they run; at the test's end the bystanders' data and the
    daemon's books, processes and descriptors are checked against it."""
    d = make_daemon(devices=2, tenants=True)
    with Bystander(d, 0) as b0, Bystander(d, 1) as b1:
        before = snapshot(d)
        yield d
        b0.check()
        b1.check()
        assert_contained(d, before)
