"""Spies for tests of what backward keeps alive: weak references to the first output of chosen
calls, and a log of which of them are alive whenever a later function is called."""

from __future__ import annotations

import weakref


def track_first_output(monkeypatch, owner, name: str, refs: list, when=None) -> None:
    """``owner.<name>`` appends a weak reference to its first output to ``refs`` on each call
    (each call whose arguments ``when(*args, **kw)`` accepts, where given)."""
    real = getattr(owner, name)

    def spy(*args, **kw):
        out = real(*args, **kw)
        if when is None or when(*args, **kw):
            refs.append(weakref.ref(out[0]))
        return out

    monkeypatch.setattr(owner, name, spy)


def log_alive_at(monkeypatch, owner, name: str, refs: list) -> list:
    """``owner.<name>`` logs, at each call, which of the weak references ``refs`` are alive;
    returns the log (one list of booleans per call)."""
    real, log = getattr(owner, name), []

    def spy(*args, **kw):
        log.append([ref() is not None for ref in refs])
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, spy)
    return log
