"""Kernel capture: backends launch their kernels directly, or into a graph being traced.

When quant-dynamo lowers a ``quant`` op for a compiled graph (AOTAutograd functionalization, then
Inductor), it runs the op's Python body inside :func:`capture`. A backend whose kernels can be
recorded (``capturable = True``, e.g. Triton through ``torch.library.wrap_triton``) then records
each launch as a graph node instead of launching it, so the compiled code launches the same
kernels (same source, same constants: the same bytes) without a Python custom op around them.
A launch that cannot be recorded raises :class:`NotCapturable`; the caller then keeps the opaque
op. Eager code never enters :func:`capture` and pays nothing for this.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


class NotCapturable(RuntimeError):
    """A kernel launch that cannot be recorded into a traced graph (the op stays opaque)."""


def capturing() -> bool:
    """True inside :func:`capture` on this thread: kernel launches are recorded, not run."""
    return getattr(_state, "active", False)


@contextlib.contextmanager
def capture() -> Iterator[None]:
    """Record the kernel launches of capturable backends on this thread (re-entrant)."""
    previous = capturing()
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous
