"""The backend is discoverable and mirrors the reference's contract."""

from __future__ import annotations

import importlib.metadata
import inspect

import torch
from quant_core import backends, reference

NAMES = backends.FUNCTIONS


def _backend():
    eps = importlib.metadata.entry_points(group="quant_core.backends")
    (ep,) = [e for e in eps if e.name == "triton"]
    return ep.load()


def test_entry_point_loads_backend():
    from quant_kernels.backend import BACKEND

    b = _backend()
    assert b is BACKEND
    assert b.name == "triton" and b.priority == 10


def test_signatures_mirror_reference():
    b = _backend()
    for name in NAMES:
        assert inspect.signature(getattr(b, name)) == inspect.signature(
            getattr(reference, name)
        ), name


def test_supports(monkeypatch):
    b = _backend()
    assert b.supports(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert b.supports(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not b.supports(torch.device("cpu"))
    assert not b.supports(torch.device("meta"))
