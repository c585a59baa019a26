"""``torch.library.opcheck`` of every ``quant`` custom op and every format.

``quant::quantize`` is not differentiable: its autograd registration marks every output
non-differentiable, and the storages' buffers carry no autograd history either
(``quant_core.inputs.as_2d`` detaches). ``qdq`` has a straight-through gradient. Both are checked
on inputs with and without ``requires_grad``, at M = 32 and M = 0 (where empty outputs used to
share a storage, which custom-op outputs may not).
"""

from __future__ import annotations

import formats
import pytest
import torch
from _dynamo_helpers import requires_api

#: Every format's default quantizer and variants from tests/formats.py.
QUANTIZERS = {name: make() for name, make in formats.quantizers(
    "block1d", "nvfp4_rht", defaults=True).items()}


def _op(name, q):
    return getattr(getattr(torch.ops.quant, name), q._quant_op_overload)


@requires_api
@pytest.mark.parametrize("m", [32, 0])
@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
def test_opcheck_quantize_and_qdq(fmt, m):
    q = QUANTIZERS[fmt]
    for requires_grad in (False, True):
        x = torch.randn(m, 64, dtype=torch.bfloat16, requires_grad=requires_grad)
        torch.library.opcheck(_op("quantize", q), (x, q))
        torch.library.opcheck(_op("qdq", q), (x, q))


@requires_api
@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
def test_quantize_outputs_do_not_require_grad(fmt):
    q = QUANTIZERS[fmt]
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    for t in _op("quantize", q)(x, q):
        assert not t.requires_grad and t.grad_fn is None


@requires_api
@pytest.mark.parametrize("m", [32, 0])
@pytest.mark.parametrize("fmt", formats.select(QUANTIZERS, reduces_amax=True))
def test_opcheck_amax_and_quantize_with_amax(fmt, m):
    """The split around the amax reduction: ``amax`` then ``quantize_with_amax`` gives
    ``quantize``'s buffers, and both ops pass opcheck."""
    q = QUANTIZERS[fmt]
    x = torch.randn(m, 64, dtype=torch.bfloat16)
    amax = _op("amax", q)(x, q)
    torch.library.opcheck(_op("amax", q), (x, q))
    torch.library.opcheck(_op("quantize_with_amax", q), (x, amax, q))
    split = _op("quantize_with_amax", q)(x, amax, q)
    whole = _op("quantize", q)(x, q)
    assert all(torch.equal(a, b) for a, b in zip(split, whole, strict=True))


@requires_api
def test_amax_of_a_format_without_one_is_a_clear_error():
    q = QUANTIZERS["mxfp8"]
    with pytest.raises(TypeError, match="MXFP8Quantizer has no amax to reduce"):
        _op("amax", q)(torch.randn(32, 64), q)
