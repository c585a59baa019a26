"""GPU conformance tests: the Triton kernels, the reference and compiled code on CUDA, compared
bitwise. Every test here is marked ``cuda`` and skipped without a CUDA device, or under Triton's
interpreter (``TRITON_INTERPRET=1``: these tests check the compiled kernels, and take minutes on
a GPU). ``bash bench/device.sh check`` runs them on the GPU machine."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent


def _why_skipped() -> str | None:
    if not torch.cuda.is_available():
        return "GPU conformance tests need a CUDA device"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "GPU conformance tests check compiled kernels, not Triton's interpreter"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    why = _why_skipped()
    for item in items:
        if HERE in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.cuda)
            if why:
                item.add_marker(pytest.mark.skip(reason=why))
