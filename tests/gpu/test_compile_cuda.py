"""On CUDA with the Triton backend: fullgraph-compiled (Inductor) ``quant_dynamo.quantize`` and
``quant_dynamo.qdq`` equal eager bitwise for every quantizer, and a compiled quantized ``Linear``
per recipe equals its eager forward and backward bitwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import quant_dynamo  # noqa: E402
import quant_recipes as qr  # noqa: E402
from quant_core import (  # noqa: E402
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    backends,
)

QUANTIZERS = {
    "current": lambda: Float8CurrentScalingQuantizer(),
    "mxfp8": lambda: MXFP8Quantizer(),
    "block2d": lambda: Float8BlockQuantizer(),
    "block1d": lambda: Float8BlockQuantizer(block_scaling_dim=1),
    "nvfp4_rht": lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
}
RECIPES = {
    "fp8_current": qr.Float8CurrentScaling,
    "fp8_block": qr.Float8BlockScaling,
    "mxfp8": qr.MXFP8BlockScaling,
    "nvfp4": qr.NVFP4BlockScaling,
}


@pytest.fixture(autouse=True, scope="module")
def triton_backend():
    """The Triton backend registered (source trees lack the entry point that does it)."""
    if "triton" not in backends.available():
        from quant_kernels.backend import BACKEND

        backends.register(BACKEND)


@pytest.mark.parametrize("op", ["quantize", "qdq"])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_compiled_op_equals_eager(name, op, monkeypatch):
    monkeypatch.setenv("QUANT_BACKEND", "triton")  # tests/dynamo compile the reference on CPU
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    q = QUANTIZERS[name]().with_usage(columnwise=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda t: getattr(quant_dynamo, op)(t, q), fullgraph=True)
    fn(x)  # compile
    got = fn(x)
    torch.cuda.synchronize()
    want = getattr(quant_dynamo, op)(x, q)
    if op == "quantize":
        assert len(got) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_linear_equals_eager(name):
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    layer = qr.Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(inp):
        with qr.autocast(recipe=recipe):
            return layer(inp)

    eager = step(x)
    eager.float().sum().backward()
    g_eager = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = layer.weight.grad = None
    torch._dynamo.reset()
    fn = torch.compile(step, fullgraph=True)
    fn(x).float().sum().backward()  # compile forward and backward
    x.grad = layer.weight.grad = None
    compiled = fn(x)
    compiled.float().sum().backward()
    torch.cuda.synchronize()
    assert torch.equal(eager, compiled)
    assert torch.equal(g_eager[0], x.grad)
    assert torch.equal(g_eager[1], layer.weight.grad)
