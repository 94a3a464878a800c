"""The test kit's own reporting: a descriptor leak names what
leaked, not only how many."""

from __future__ import annotations

import os

import pytest

from testkit.contained import fd_change, fd_targets

pytestmark = pytest.mark.timeout(30)


def test_a_leaked_descriptor_is_named_by_what_it_is() -> None:
    before = fd_targets(os.getpid())
    memfd = os.memfd_create("accel-leak-probe")
    r, w = os.pipe()
    try:
        after = fd_targets(os.getpid())
    finally:
        for fd in (memfd, r, w):
            os.close(fd)
    assert fd_change(before, after) == \
        "gained ['/memfd:accel-leak-probe (deleted)', 'pipe', 'pipe']"
    assert fd_change(after, before) == "lost ['/memfd:accel-leak-probe (deleted)', 'pipe', 'pipe']"
    assert fd_change(before, fd_targets(os.getpid())) == ""  # closed again: no change
