"""Whether quant-kernels is installed as a distribution, whose entry point registers the Triton
backend. A source checkout on ``PYTHONPATH`` imports ``quant_kernels`` but registers nothing:
there the backend tests say so instead of failing on an empty registry."""

from __future__ import annotations

import importlib.metadata

from quant_core.backends import ENTRY_POINT_GROUP

NOT_INSTALLED = ("quant-kernels is importable but not installed (pip install -e "
                 "packages/quant-kernels): the Triton backend registers through its entry point")


def triton_entry_point():
    """quant-kernels' entry point of the Triton backend, or ``None`` where it is not installed."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return next((e for e in eps if e.name == "triton"), None)


#: The Triton backend is registered (quant-kernels installed).
TRITON_BACKEND = triton_entry_point() is not None
