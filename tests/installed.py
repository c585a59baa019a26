"""Whether quant-kernels is installed as a distribution, whose entry point registers the Triton
backend. A source checkout on ``PYTHONPATH`` imports ``quant_kernels`` but registers nothing:
there the tests that run on the Triton backend skip, saying so, and
``tests/kernels/test_backend.py`` fails, saying so (it guards the installation CI makes)."""

from __future__ import annotations

import importlib.metadata

import pytest
from quant_core.backends import ENTRY_POINT_GROUP

NOT_INSTALLED = ("quant-kernels is importable but not installed (pip install -e "
                 "packages/quant-kernels): the Triton backend registers through its entry point")


def triton_entry_point():
    """quant-kernels' entry point of the Triton backend, or ``None`` where it is not installed."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return next((e for e in eps if e.name == "triton"), None)


#: The Triton backend is registered (quant-kernels installed).
TRITON_BACKEND = triton_entry_point() is not None


def require_triton_backend() -> None:
    """Skip the calling test unless the Triton backend is registered."""
    if not TRITON_BACKEND:
        pytest.skip(NOT_INSTALLED)
