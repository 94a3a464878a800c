"""One attribute file of the tree (sysfs, debugfs), on its own so that every module that
contributes attributes (kmod_emul/sysfs.py, kmod_emul/ras.py) can declare them without
importing the others: the device imports its RAS state, which must not import the
device's attribute tables in turn."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Attr:
    """One attribute file; ``read`` renders it, ``write`` parses and applies one value.
    ``per_viewer``: ``read`` takes the reading user's uid and shows them what is theirs
    (root sees everything). A ``write`` that must wait (a partition mode change boots
    firmware) returns what to await; the writer's ``write(2)`` returns once it is done."""

    read: Callable[..., str] | None = None
    write: Callable[[str], Awaitable[None] | None] | None = None
    per_viewer: bool = False

    def render(self, uid: int) -> str:
        assert self.read is not None
        return self.read(uid) if self.per_viewer else self.read()
