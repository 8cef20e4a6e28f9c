"""At most so many log lines of one kind a second: a client sending bad requests in a loop, or a
broken worker failing every request, must not fill the disk. What is left out is counted, and the
next line written says how many."""

from __future__ import annotations

import time
from collections.abc import Callable


class LogCap:
    def __init__(self, per_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s, self.clock = per_s, clock
        self.window, self.written, self.skipped = 0, 0, 0  # (lines in the current second)

    def admit(self) -> str | None:
        """None: leave this line out (counted); else what to end it with: what was left out before it, if any."""
        now = int(self.clock())
        if now != self.window:
            self.window, self.written = now, 0
        if self.written >= self.per_s:
            self.skipped += 1
            return None
        self.written += 1
        note, self.skipped = f" [{self.skipped} more not logged before this]" if self.skipped else "", 0
        return note
