"""A dependency-free progress bar for long command-line work."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


def terminal_columns() -> int:
    """The terminal's width (``$COLUMNS`` first, as ``shutil`` does; 80 when unknown)."""
    return shutil.get_terminal_size((80, 24)).columns


def fit(line: str, columns: int) -> str:
    """``line`` cut to ``columns - 1`` characters (a full-width line wraps on some terminals),
    ending in ``…`` when cut."""
    limit = max(columns - 1, 1)
    return line if len(line) <= limit else line[: limit - 1] + "…"


class Progress:
    """Redraws one line on a terminal; elsewhere prints a line every 10% of the work. Lines fit
    the terminal's width (the bar shrinks first, then the text is cut), so a redrawn line never
    wraps into a new one."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30,
                 columns: int | None = None) -> None:
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.columns = columns or terminal_columns()
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
        tail = f" {100 * frac:5.1f}% {label:13s} step {step:4d} loss {loss:.4f} {elapsed:6.1f}s"
        width = max(min(self.width, self.columns - 1 - len(tail) - 2), 10)
        filled = int(width * frac)
        text = fit(f"[{'#' * filled + '-' * (width - filled)}]{tail}", self.columns)
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
