"""The backend contract (``quant_core.backend_contract.Backend``) matches the reference, the
definition every backend mirrors: same functions, same parameters, kinds and defaults."""

from __future__ import annotations

import inspect

import pytest
from quant_core import backends, reference
from quant_core.backend_contract import FUNCTIONS, Backend


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name != "self"]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_contract_method_matches_the_reference(name):
    assert _params(getattr(Backend, name)) == _params(getattr(reference, name))
    assert getattr(Backend, name).__doc__, f"Backend.{name} has no docstring"


def test_registry_uses_the_contract():
    assert backends.FUNCTIONS == FUNCTIONS
    assert isinstance(backends.get("reference"), Backend)
    assert len(FUNCTIONS) == 27
