"""The backend registry (architecture.md contract 3).

A backend is an object with ``name: str``, ``priority: int``, ``supports(device) -> bool`` and the
functions of :mod:`quant_core.reference` with the same signatures. An optional
``preferred(device) -> bool`` (default: ``supports``) says whether automatic choice may pick it
there: Triton supports the CPU through its slow interpreter, but is never picked for it. An
optional ``capturable = True`` says its launches can be recorded into a compiled graph
(:mod:`quant_core.kernel_capture`). The pure-torch reference is always present (priority 0,
every device). Kernel packages join through the entry-point group ``quant_core.backends``:
installing them is enough.

Choice: an explicit ``name``, else the backend of an enclosing :func:`using` on this thread,
else the ``QUANT_BACKEND`` environment variable, else the highest-priority backend that supports
the device.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import threading
import types
import warnings
from collections.abc import Iterator

import torch

from . import backend_contract, reference

ENTRY_POINT_GROUP = "quant_core.backends"
#: The functions every backend provides, with the reference's signatures (the contract, one
#: documented method each: :class:`quant_core.backend_contract.Backend`).
FUNCTIONS = backend_contract.FUNCTIONS


def _reference_backend() -> types.SimpleNamespace:
    fns = {name: getattr(reference, name) for name in FUNCTIONS}
    return types.SimpleNamespace(name="reference", priority=0, supports=lambda device: True, **fns)


_registry: dict[str, object] | None = None
_choice_cache: dict[tuple[str | None, str, str | None], object] = {}


def _load() -> dict[str, object]:
    global _registry
    if _registry is None:
        found: dict[str, object] = {"reference": _reference_backend()}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                backend = ep.load()
            except Exception as exc:  # a broken optional backend must not break quant-core
                warnings.warn(f"quant backend {ep.name!r} failed to load: {exc}", stacklevel=2)
                continue
            found[backend.name] = backend
        _registry = found
    return _registry


def register(backend) -> None:
    """Register a backend object by hand (tests, out-of-tree experiments). It must have a str
    ``name``, an int ``priority``, a callable ``supports`` and every function of FUNCTIONS."""
    missing = [f for f in ("supports", *FUNCTIONS) if not callable(getattr(backend, f, None))]
    name, priority = getattr(backend, "name", None), getattr(backend, "priority", None)
    if not isinstance(name, str) or not name:
        missing.insert(0, "name (a non-empty str)")
    if isinstance(priority, bool) or not isinstance(priority, int):
        missing.insert(0, "priority (an int)")
    if missing:
        raise TypeError(f"backends.register: {backend!r} lacks {', '.join(missing)}")
    _load()[backend.name] = backend
    _choice_cache.clear()


def unregister(name: str) -> None:
    """Remove a backend registered by hand (``KeyError`` for an unknown name; the reference
    cannot be removed)."""
    if name == "reference":
        raise ValueError("the reference backend cannot be unregistered")
    del _load()[name]
    _choice_cache.clear()


def available() -> list[str]:
    """Names of the registered backends, highest priority first."""
    return [b.name for b in sorted(_load().values(), key=lambda b: -b.priority)]


_selected = threading.local()


@contextlib.contextmanager
def using(name: str) -> Iterator[None]:
    """Make ``name`` the backend of every call on this thread that names none (re-entrant; the
    innermost wins). Compiled graphs trace the reference this way (``using("reference")``), so
    that a quantize and the dequantize or GEMM of its storage all become torch ops."""
    previous = getattr(_selected, "name", None)
    _selected.name = name
    try:
        yield
    finally:
        _selected.name = previous


def preload(device_types: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """Load the registry and choose the backend of each device type now (where
    ``$QUANT_BACKEND`` allows it), so that code ``torch.compile`` traces only looks them up:
    loading entry points and choosing do not trace. quant-dynamo calls it at import."""
    for device_type in device_types:
        if environment_problem(device_type) is None:
            get(None, device_type)


def environment_problem(device: torch.device | str) -> str | None:
    """One line saying why ``$QUANT_BACKEND`` cannot serve ``device`` (an unknown name, or a
    backend that does not support the device), naming the variable and the allowed values;
    ``None`` when it is unset or usable."""
    requested = os.environ.get("QUANT_BACKEND") or None
    if requested is None:
        return None
    dev = torch.device(device)
    registry = _load()
    usable = [n for n in available() if registry[n].supports(dev)]
    if requested in usable:
        return None
    why = "is not a registered backend" if requested not in registry else (
        f"does not support {dev.type}"
        + (" (Triton runs on the CPU only with TRITON_INTERPRET=1)"
           if requested == "triton" and dev.type == "cpu" else ""))
    return (f"QUANT_BACKEND={requested!r} {why}; allowed on {dev.type}: {', '.join(usable)} "
            "(or unset it: the fastest backend for the device)")


def get(name: str | None = None, device: torch.device | str | None = None):
    """The backend to use for ``device``: ``name``, else :func:`using`'s, else
    ``$QUANT_BACKEND``, else the fastest.

    Raises ``ValueError`` for an unknown name or a backend that does not support the device.
    """
    requested = (name or getattr(_selected, "name", None) or os.environ.get("QUANT_BACKEND")
                 or None)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    key = (requested, dev.type, os.environ.get("TRITON_INTERPRET"))
    cached = _choice_cache.get(key)
    if cached is not None:
        return cached
    registry = _load()
    if requested is not None:
        if requested not in registry:
            raise ValueError(
                f"unknown quant backend {requested!r}; available: {available()}"
            )
        backend = registry[requested]
        if not backend.supports(dev):
            raise ValueError(f"quant backend {requested!r} does not support device {dev}")
    else:
        backend = max(
            (b for b in registry.values() if getattr(b, "preferred", b.supports)(dev)),
            key=lambda b: b.priority,
        )
    _choice_cache[key] = backend
    return backend
