"""A dependency-free progress bar for long command-line work."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Redraws one line on a terminal; elsewhere prints a line every 10% of the work."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def update(self, label: str, step: int, loss: float) -> None:
        """Count one unit of work done; ``label``, ``step`` and ``loss`` describe it."""
        self.done += 1
        frac = self.done / self.total
        elapsed = time.perf_counter() - self.start
        filled = int(self.width * frac)
        bar = "#" * filled + "-" * (self.width - filled)
        text = (
            f"[{bar}] {100 * frac:5.1f}% {label:13s} step {step:4d} loss {loss:.4f} "
            f"{elapsed:6.1f}s"
        )
        if self.tty:
            self.stream.write("\r" + text)
            self.stream.flush()
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(text + "\n")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()
