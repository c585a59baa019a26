"""The Triton backend is found through its entry point but never chosen automatically on the CPU,
where it only runs through the slow interpreter (tests name it explicitly)."""

from __future__ import annotations

import torch
from quant_core import backends
from quant_kernels.backend import BACKEND


def test_interpreter_is_supported_but_not_preferred(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert BACKEND.supports(torch.device("cpu"))
    assert not BACKEND.preferred(torch.device("cpu"))
    assert BACKEND.preferred(torch.device("cuda"))
    backends._choice_cache.clear()
    assert backends.get(None, "cpu").name == "reference"
    assert backends.get("triton", "cpu").name == "triton"
    assert backends.get(None, "cuda").name == "triton"
