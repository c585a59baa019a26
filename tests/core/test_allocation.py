"""The one allocation path (behaviour.md §1.2, TE's allocation-primitive tests): what
``inner_tensor_specs`` / ``make_empty`` / ``alloc_tensors`` describe is exactly what ``quantize``
produces, for every format, usage combination and leading shape, also under FakeTensorMode."""

from __future__ import annotations

import formats
import pytest
import torch
from quant_core import (
    Float8Quantizer,
    MXFP8Quantizer,
)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

#: Every format's default quantizer and variants from tests/formats.py; delayed scaling (stateful)
#: stays local.
QUANTIZERS = {
    **{name: make() for name, make in formats.quantizers(
        "mxfp8_swizzled", "block1d", "nvfp4_rht", defaults=True).items()},
    "delayed": Float8Quantizer(torch.ones(1), torch.zeros(1)),
}
USAGES = [(True, True), (True, False), (False, True)]
SHAPES = [(64, 128), (3, 48, 96), (0, 64)]


def _with_usage(q, rowwise, columnwise):
    if isinstance(q, Float8Quantizer):  # stateful: a new object over the same tensors
        return Float8Quantizer(q.scale, q.amax, q.dtype, rowwise_usage=rowwise,
                               columnwise_usage=columnwise)
    return q.with_usage(rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("usage", USAGES, ids=["both", "row", "col"])
@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_make_empty_matches_quantize(name, usage, shape):
    q = _with_usage(QUANTIZERS[name], *usage)
    x = torch.randn(shape).to(torch.bfloat16)
    real = q.quantize(x)
    empty = q.make_empty(shape, dtype=torch.bfloat16)
    assert type(empty) is type(real) and empty.shape == real.shape and empty.dtype == real.dtype
    assert empty.quantizer is q
    for buf_name, t in real.buffers().items():
        e = getattr(empty, buf_name)
        assert (t is None) == (e is None), buf_name
        if t is not None:
            assert (e.shape, e.dtype, e.device) == (t.shape, t.dtype, t.device), buf_name
            assert not e.any(), "make_empty zero-fills every byte, padding included"
    specs = q.inner_tensor_specs(torch.Size(shape))
    present = [n for n, t in real.buffers().items() if t is not None]
    assert list(specs) == present  # declaration order


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_alloc_tensors_under_fake_mode(name):
    q = QUANTIZERS[name]
    specs = q.inner_tensor_specs(torch.Size((32, 64)))
    with FakeTensorMode():
        tensors = q.alloc_tensors((32, 64))
    assert list(tensors) == list(specs)
    for buf_name, t in tensors.items():
        assert isinstance(t, FakeTensor)
        assert (tuple(t.shape), t.dtype) == (tuple(specs[buf_name][0]), specs[buf_name][1])


def test_make_empty_dequantizes_to_zeros():
    out = MXFP8Quantizer().make_empty((32, 64), dtype=torch.float32).dequantize()
    # E8M0 byte 0 is 2^-127 and the data bytes are +0: every element dequantizes to +0.
    assert torch.equal(out, torch.zeros(32, 64))


@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
def test_symbolic_shapes_build_storages_without_the_spec_cache(name):
    """Traced code (dynamic shapes) builds storages over SymInt shapes: the per-shape spec cache
    of value quantizers cannot hash them and must step aside, not fail."""
    from quant_core import quantizer as quantizer_module
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    x = mode.from_tensor(torch.zeros(64, 128), symbolic_context=context,
                         source=ConstantSource("x"))
    q = QUANTIZERS[name]
    cached = len(quantizer_module._SPECS)
    with mode:
        storage = q.make_empty(x.shape, dtype=torch.bfloat16)
    assert storage.shape == x.shape
    assert len(quantizer_module._SPECS) == cached
    want = q.make_empty((64, 128), dtype=torch.bfloat16).buffers()
    for buf_name, buf in storage.buffers().items():
        assert (buf is None) == (want[buf_name] is None), buf_name
