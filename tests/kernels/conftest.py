"""Kernel tests run on CUDA, or on the CPU through Triton's interpreter (TRITON_INTERPRET=1).

Every comparison is bitwise against ``quant_core.reference``; FP8 NaN bytes compare by NaN-ness.
"""

from __future__ import annotations

import os

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA or INTERPRET:
        return
    skip = pytest.mark.skip(
        reason="quant-kernels tests need a CUDA device or TRITON_INTERPRET=1 (set by nox)"
    )
    for item in items:
        if "tests/kernels" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
