"""One attribute file of the tree (sysfs, debugfs), on its own so that every module that
contributes attributes (kmod_emul/sysfs.py, kmod_emul/ras.py) can declare them without
importing the others: the device imports its RAS state, which must not import the
device's attribute tables in turn.

What a write may carry is decided here, once for every attribute (``Attr.store``), as
sysfs hands every ``store`` a page at most: a value is printable ASCII text (and
whitespace) of at most ``ATTR_SIZE`` bytes, else EINVAL before any attribute sees it. A
number in a value is read by ``parse_number`` alone. Both exist because the attributes
once parsed their own: ``str.isdigit`` is true of ``'²'``, which ``int`` refuses; ``int``
refuses more than 4,300 digits; and a 400-digit degree overflowed the thermal model's
float. Each raised something other than a ``DriverError``, which the daemon answers as a
driver bug (EIO, with a traceback in its log). EIO is for device I/O errors; malformed
input is EINVAL.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kmod_emul.errors import DriverError

#: An attribute file's size, and the most one write to it may carry: a page, as sysfs's.
ATTR_SIZE = 4096
#: What a written value may hold: printable ASCII, spaces, tabs and line ends.
_TEXT = re.compile(r"[\x20-\x7e\t\n\r]*")
#: A number: decimal, or hexadecimal after 0x (ASCII digits only: ``re`` would match
#: other scripts' digits for ``\d``).
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|[0-9]+")
_DECIMAL = re.compile(r"[0-9]+")


def value_text(buf: bytes) -> str:
    """The text of one write to an attribute; EINVAL for more than a page or for anything
    but printable ASCII and whitespace (no attribute takes anything else)."""
    if len(buf) > ATTR_SIZE:
        raise DriverError(errno.EINVAL, f"an attribute takes at most {ATTR_SIZE} bytes, "
                                        f"not {len(buf)}")
    text = buf.decode("ascii", errors="replace")
    if not _TEXT.fullmatch(text):
        raise DriverError(errno.EINVAL, f"an attribute takes printable ASCII text, not "
                                        f"{_shown(text)}")
    return text


def parse_number(text: str, what: str, below: int, decimal: bool = False) -> int:
    """``text`` as a number from 0 to ``below - 1``, decimal or 0x-hexadecimal (only
    decimal with ``decimal``: a count or a mode, as sysfs reads them); EINVAL for anything
    else. Every numeric value of every attribute is read here, so none can reach a model
    out of its range."""
    if not (_DECIMAL if decimal else _NUMBER).fullmatch(text):
        raise DriverError(errno.EINVAL, f"{what} {_shown(text)} is not "
                                        f"{'decimal' if decimal else 'hex (0x...) or decimal'}")
    base = 16 if text[:2].lower() == "0x" else 10
    digits = (text[2:] if base == 16 else text).lstrip("0") or "0"
    # more digits than the bound has is out of range: int() is never asked for a page of
    # them (past 4,300 decimal digits it refuses with ValueError)
    if len(digits) > len(f"{below:x}" if base == 16 else str(below)) \
            or int(digits, base) >= below:
        bound = f"{below:#x}" if base == 16 else str(below)
        raise DriverError(errno.EINVAL, f"{what} {_shown(text)} is not below {bound}")
    return int(digits, base)


def _shown(text: str) -> str:
    """A value as a message quotes it: at most 40 characters (a page of digits is not a
    log line)."""
    return repr(text) if len(text) <= 40 else f"{text[:37]!r}... ({len(text)} characters)"


@dataclass(frozen=True)
class Writer:
    """Who wrote an attribute: the process that opened it (FUSE names the caller at
    open, not at write), for the records an operator action leaves (``reset_reason``)."""

    pid: int
    uid: int

    def describe(self) -> str:
        """``pid 1234 (accel-smi), uid 0``: the command name while the process lives."""
        try:
            with open(f"/proc/{self.pid}/comm", encoding="utf-8") as f:
                comm = f" ({f.read().strip()})"
        except OSError:
            comm = ""
        return f"pid {self.pid}{comm}, uid {self.uid}"


@dataclass(frozen=True)
class Attr:
    """One attribute file; ``read`` renders it, ``write`` parses and applies one value.
    ``per_viewer``: ``read`` takes the reading user's uid and shows them what is theirs
    (root sees everything). A ``write`` that must wait (a partition mode change boots
    firmware) returns what to await; the writer's ``write(2)`` returns once it is done.
    ``with_writer``: ``write`` also takes the ``Writer``."""

    read: Callable[..., str] | None = None
    write: Callable[[str], Awaitable[None] | None] | None = None
    per_viewer: bool = False
    with_writer: bool = False

    def render(self, uid: int) -> str:
        assert self.read is not None
        return self.read(uid) if self.per_viewer else self.read()

    def store(self, buf: bytes, writer: Writer) -> Awaitable[None] | None:
        """Apply one ``write(2)``: its bytes checked as every value is (``value_text``)."""
        assert self.write is not None
        if self.with_writer:
            return self.write(value_text(buf), writer)  # type: ignore[call-arg]
        return self.write(value_text(buf))
