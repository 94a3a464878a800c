"""The driver's rate-limited log lines, as ``dev_warn_ratelimited``: what a tenant can make
happen in a loop -- a refused reach for another's handle (kmod_emul/isolation.py), a fault
(kmod_emul/faultlog.py) -- must not fill the daemon's log.

At most ``LOG_BURST`` lines per ``LOG_INTERVAL_S`` per device and kind, then one line
saying how many were not logged (when the next window opens, as Linux's ``___ratelimit``
prints its "callbacks suppressed"). What is counted or recorded is never limited: only the
lines.
"""

from __future__ import annotations

import logging
import time
from typing import Any

LOG_BURST = 10
LOG_INTERVAL_S = 5.0


class RateLimitedLog:
    """The lines of one device about one kind of event (``what``, plural: "refusals")."""

    def __init__(self, logger: logging.Logger, name: str, what: str) -> None:
        self.logger = logger
        self.name = name
        self.what = what
        self._window_start = 0.0
        self._logged = 0
        self._suppressed = 0

    def log(self, level: int, msg: str, *args: Any) -> None:
        """Log ``msg % args`` at ``level`` unless this window's burst is spent."""
        now = time.monotonic()
        if now - self._window_start >= LOG_INTERVAL_S:
            if self._suppressed:
                self.logger.warning("%s: %d more %s not logged", self.name, self._suppressed,
                                    self.what)
            self._window_start, self._logged, self._suppressed = now, 0, 0
        if self._logged < LOG_BURST:
            self._logged += 1
            self.logger.log(level, msg, *args)
        else:
            self._suppressed += 1
