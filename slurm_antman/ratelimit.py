"""Rate-limited logging, so a peer sending garbage in a loop cannot flood the node's log."""

from __future__ import annotations

import logging
import time
from typing import Callable


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self._log = logger
        self._interval = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, fmt: str, *args: object) -> bool:
        """Log at most one line per ``key`` per interval; returns whether it logged."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        n = self._suppressed.pop(key, 0)
        self._last[key] = now
        if len(self._last) > 1024:  # keys are per error code and peer kind, but stay bounded anyway
            self._last = {key: now}
        self._log.warning(fmt + (f" ({n} similar suppressed)" if n else ""), *args)
        return True
