"""The driver's internal error: an errno plus a message for the daemon's log."""

from __future__ import annotations

import errno as _errno


class DriverError(Exception):
    """Raised by driver code; the FUSE layer answers the request with ``errno``."""

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(f"{_errno.errorcode.get(errno, errno)}: {message}")
        self.errno = errno
        self.message = message
