"""New lines of a child's log that hold a marker, read as they are written: ``serve`` prints its
brokers' activity lines (``broker/activity.py``) where the operator watches, as vLLM's server
prints its throughput, while everything else stays in the log files."""

from __future__ import annotations

from pathlib import Path

ACTIVITY_MARKER = "activity: "  # what begins a broker's activity line in its log (``broker/activity.py``)


class LogRelay:
    def __init__(self, path: Path, marker: str) -> None:
        """Relay what ``path`` gets from now on (not what it held already)."""
        self.path, self.marker = path, marker
        self.offset = path.stat().st_size if path.exists() else 0

    def lines(self) -> list[str]:
        """The whole lines written since the last call that hold the marker, each from the marker on."""
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self.offset:  # (the file was replaced or cut: from its start)
                    self.offset = 0
                f.seek(self.offset)
                data = f.read(1 << 20)  # (bounded: a flood of log lines is skipped over, not held)
        except OSError:
            return []
        whole = data[:data.rfind(b"\n") + 1] if len(data) < 1 << 20 else data
        self.offset += len(whole)
        text = whole.decode(errors="replace")
        return [line[line.index(self.marker) + len(self.marker):] for line in text.splitlines() if self.marker in line]
