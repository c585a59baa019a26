"""Spies for tests of what backward keeps alive: weak references to chosen tensors, and a log of
which of them are alive whenever a later function is called."""

from __future__ import annotations

import weakref


def tracking_first_output(fn, refs: list, when=None):
    """``fn``, appending a weak reference to its first output to ``refs`` on each call (each
    call whose arguments ``when(*args, **kw)`` accepts, where given)."""
    def spy(*args, **kw):
        out = fn(*args, **kw)
        if when is None or when(*args, **kw):
            refs.append(weakref.ref(out[0]))
        return out
    return spy


def logging_alive(fn, refs: list, log: list):
    """``fn``, appending to ``log`` at each call which of the weak references ``refs`` are
    alive."""
    def spy(*args, **kw):
        log.append([ref() is not None for ref in refs])
        return fn(*args, **kw)
    return spy


def track_first_output(monkeypatch, owner, name: str, refs: list, when=None) -> None:
    """``owner.<name>`` made :func:`tracking_first_output`."""
    monkeypatch.setattr(owner, name, tracking_first_output(getattr(owner, name), refs, when))


def log_alive_at(monkeypatch, owner, name: str, refs: list) -> list:
    """``owner.<name>`` made :func:`logging_alive`; returns the log (one list of booleans per
    call)."""
    log: list = []
    monkeypatch.setattr(owner, name, logging_alive(getattr(owner, name), refs, log))
    return log
