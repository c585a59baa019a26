"""Fixtures shared by every test folder.

``quant_dynamo.capture.KERNEL_DEVICES`` and ``OPS_DEVICES`` name the device types whose quant ops
a compiled graph lowers (CUDA). The tests that check lowering on the CPU add it through the
fixtures below, the one place tests change those sets: ``monkeypatch`` replaces the set for one
test and restores the package's afterwards.
"""

from __future__ import annotations

import os

import pytest


def _with_cpu(monkeypatch, name: str) -> None:
    capture = pytest.importorskip("quant_dynamo.capture", reason="lowering needs quant-dynamo")
    monkeypatch.setattr(capture, name, getattr(capture, name) | {"cpu"})


@pytest.fixture
def cpu_kernel_device(monkeypatch) -> None:
    """The CPU among ``KERNEL_DEVICES`` for one test: quant ops on CPU tensors are lowered to the
    (capturable) backend's kernels."""
    _with_cpu(monkeypatch, "KERNEL_DEVICES")


@pytest.fixture
def cpu_ops_device(monkeypatch) -> None:
    """The CPU among ``OPS_DEVICES`` for one test: quantizers on CPU tensors may be lowered to
    reference ops."""
    _with_cpu(monkeypatch, "OPS_DEVICES")


@pytest.fixture(params=["reference", "triton"])
def impl(request):
    """Each test once on the reference backend and once on the Triton kernels, which run on the
    CPU only through ``TRITON_INTERPRET=1``; yields the backend's name."""
    from installed import require_triton_backend
    from quant_core import backends

    if request.param == "triton":
        require_triton_backend()
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels run on the CPU only through TRITON_INTERPRET=1")
    with backends.using(request.param):
        yield request.param
