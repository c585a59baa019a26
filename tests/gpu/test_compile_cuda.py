"""On CUDA with the Triton backend: fullgraph-compiled (Inductor) ``quant_dynamo.quantize`` and
``quant_dynamo.qdq`` equal eager bitwise for every quantizer, and a compiled quantized ``Linear``
per recipe equals its eager forward and backward bitwise."""

from __future__ import annotations

import formats
import pytest
import torch

pytest.importorskip("triton")

import quant_dynamo  # noqa: E402
import quant_recipes as qr  # noqa: E402
from quant_core import backends  # noqa: E402

#: Quantizers (tests/formats.py): every format, NVFP4 with the RHT and with 2D blocks instead of
#: its default; every built-in recipe, by qualified id.
QUANTIZERS = {name: make for name, make in formats.quantizers(
    "block1d", "nvfp4_rht", "nvfp4_2d", defaults=True).items() if name != "nvfp4"}
RECIPES = formats.default_recipes(qualified=True)


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


#: NVFP4's 4over6 (1x16 MAE, 16x16 MSE) and row-scaled variants: their Triton kernels lowered.
VARIANTS = {
    "nvfp4_4over6": lambda: _nvfp4(columnwise_usage=True, nvfp4_use_4over6=True,
                                                   nvfp4_e4m3_max=256),
    "nvfp4_4over6_2d_mse": lambda: _nvfp4(
        columnwise_usage=True, with_2d_quantization=True, nvfp4_use_4over6=True,
        nvfp4_e4m3_max=256, nvfp4_4over6_err_mode="MSE"),
    "nvfp4_row_scaled": lambda: _nvfp4(columnwise_usage=False,
                                                       row_scaled_nvfp4=True),
}


def _nvfp4(**fields):
    from quant_core import NVFP4Quantizer

    return NVFP4Quantizer(with_rht=False, **fields)


@pytest.mark.parametrize("op", ["quantize", "qdq"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiled_variant_equals_eager(name, op, monkeypatch):
    """Ragged rows (1000) too: the kernels mask the last block of rows."""
    monkeypatch.setenv("QUANT_BACKEND", "triton")
    x = torch.randn(1000, 2048, device="cuda", dtype=torch.bfloat16)
    q = VARIANTS[name]()
    assert q.lowerings() == ("kernels",)
    torch._dynamo.reset()
    fn = torch.compile(lambda t: getattr(quant_dynamo, op)(t, q), fullgraph=True)
    fn(x)
    got = fn(x)
    torch.cuda.synchronize()
    want = getattr(quant_dynamo, op)(x, q)
    if op == "quantize":
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


@pytest.mark.parametrize("lowering", ["1", "mixed", "ops"])
@pytest.mark.parametrize("copies", [True, False], ids=["copies", "lean"])
def test_compiled_linears_and_their_producers_equal_eager(lowering, copies, monkeypatch):
    """A scaling feeding FP8 current-scaling Linears whose product feeds another, under each
    lowering form, with and without the quantized copies kept for backward: Inductor's forward
    and backward (the quantizations and their inputs recomputed there in the lean form) equal
    eager bitwise. Inductor rounds its fused pointwise chains as eager does
    (``emulate_precision_casts``: the input gradient's sum and scaling are two bf16 ops)."""
    monkeypatch.setenv("QUANT_LOWERING", lowering)
    torch.manual_seed(0)
    flags = {"save_weight_copy": copies, "save_input_copy": copies}
    gate, up = (qr.Linear(1024, 2048, bias=False, device="cuda", dtype=torch.bfloat16, **flags)
                for _ in range(2))
    down = qr.Linear(2048, 1024, bias=False, device="cuda", dtype=torch.bfloat16, **flags)
    # no gradient for the scale: its sum over tokens is torch's reduction, in Inductor's order
    norm = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5
    params = [gate.weight, up.weight, down.weight]

    def block(h):
        x = h * norm
        with qr.autocast(recipe=qr.Float8CurrentScaling()):
            return down(gate(x) * up(x))

    h = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        t = h.clone().requires_grad_()
        for p in params:
            p.grad = None
        with torch._inductor.config.patch(emulate_precision_casts=True):
            y = fn(t)
            y.float().pow(2).sum().backward()
        results.append([y.detach(), t.grad, *(p.grad for p in params)])
    torch.cuda.synchronize()
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)
