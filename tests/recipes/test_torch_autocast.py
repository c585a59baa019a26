"""Quantized layers under ``torch.autocast`` (behaviour.md §7): an fp32 layer's GEMMs give the
autocast dtype, as ``F.linear`` does there and as TransformerEngine's modules do (their activation
dtype), each the fp32 layer's result rounded once to it; the operands are quantized from their
own dtypes, the bias is added in fp32 before that rounding, and each gradient takes its
operand's dtype (the bias gradient an fp32 sum rounded once to the bias's dtype)."""

from __future__ import annotations

import copy

import pytest
import quant_recipes as qr
import torch

RECIPES = {"fp8_current": qr.Float8CurrentScaling(), "mxfp8": qr.MXFP8BlockScaling(),
           "fp8_block": qr.Float8BlockScaling(),
           # the Hadamard transform takes bf16 inputs only; stochastic rounding differs run to run
           "nvfp4": qr.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)}


def _layer(bias: bool) -> qr.Linear:
    torch.manual_seed(0)
    return qr.Linear(128, 64, bias=bias)


def _needs_compile():
    dynamo = pytest.importorskip("quant_dynamo", reason="compile tests need quant-dynamo")
    if not dynamo.compile_supported():
        pytest.skip(f"no opaque-object API on torch {torch.__version__}")


def _step(lin, x, gy, recipe, amp: bool, compiled: bool = False):
    lin.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    fn = torch.compile(lin, backend="inductor", fullgraph=True) if compiled else lin
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), qr.autocast(recipe=recipe):
        y = fn(x)
    y.backward(gy.to(y.dtype))
    grads = [x.grad] + [p.grad for p in lin.parameters()]
    return y, grads


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", list(RECIPES))
def test_an_fp32_linear_gives_the_autocast_dtype_rounded_once(name, bias):
    recipe = RECIPES[name]
    lin = _layer(bias)
    x = torch.randn(32, 128)
    gy = torch.randn(32, 64).bfloat16().float()  # what the autocast run's backward receives
    y32, g32 = _step(lin, x, gy, recipe, amp=False)
    y, g = _step(lin, x, gy, recipe, amp=True)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y32.bfloat16())
    (dx, dw, *db), (dx32, dw32, *db32) = g, g32
    for got, want in ((dx, dx32), (dw, dw32)):  # each GEMM in bf16, then its operand's dtype
        assert got.dtype == torch.float32 and torch.equal(got, want.bfloat16().float())
    for got, want in zip(db, db32, strict=True):  # the fp32 sum of the same gradient values
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_compiled_equals_eager_under_torch_autocast():
    _needs_compile()
    recipe = RECIPES["fp8_current"]
    lin = _layer(bias=True)
    x, gy = torch.randn(32, 128), torch.randn(32, 64)
    eager = _step(lin, x, gy, recipe, amp=True)
    compiled = _step(copy.deepcopy(lin), x, gy, recipe, amp=True, compiled=True)
    assert eager[0].dtype == compiled[0].dtype == torch.bfloat16
    assert torch.equal(eager[0], compiled[0])
    for a, b in zip(eager[1], compiled[1], strict=True):
        assert torch.equal(a, b)


def test_a_bf16_linear_is_unchanged_by_torch_autocast():
    recipe = RECIPES["fp8_current"]
    lin = _layer(bias=True).bfloat16()
    x, gy = torch.randn(32, 128).bfloat16(), torch.randn(32, 64).bfloat16()
    plain, amp = _step(lin, x, gy, recipe, amp=False), _step(lin, x, gy, recipe, amp=True)
    assert torch.equal(plain[0], amp[0])
    for a, b in zip(plain[1], amp[1], strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8"])
def test_an_fp32_grouped_linear_rounds_its_output_once_to_the_autocast_dtype(name):
    """Grouped layers compute in their operands' dtypes and round the output once to the
    autocast dtype; their gradients are those of the fp32 layer for the same gradient values."""
    torch.manual_seed(0)
    m = qr.GroupedLinear(4, 128, 64)
    x, counts = torch.randn(96, 128), torch.tensor([32, 0, 48, 16])
    gy = torch.randn(96, 64).bfloat16().float()
    runs = []
    for amp in (False, True):
        m.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), \
                qr.autocast(recipe=RECIPES[name]):
            y = m(xx, counts=counts)
        y.backward(gy.to(y.dtype))
        runs.append((y, xx.grad, m.weight.grad))
    (y32, dx32, dw32), (y, dx, dw) = runs
    assert y.dtype == torch.bfloat16 and torch.equal(y, y32.bfloat16())
    assert dx.dtype == dw.dtype == torch.float32
    assert torch.equal(dx, dx32) and torch.equal(dw, dw32)
