"""TransformerEngine's ``test_autocast_sanity`` (``tests/pytorch/test_torch_compile.py``) with
its recipe list: the four built-in block/current recipes and TE's two NVFP4 variant
configurations (``nvfp4_4over6`` and ``nvfp4_row_scaled``, built as TE builds them). A Linear
under each, compiled with ``fullgraph=True``, forward and backward; here also equal to eager
bitwise. TE's test runs a ``torch.nn.Linear``, which TE's autocast leaves in high precision, on 8
tokens; here the layer is quantized, so the input has 16 tokens (NVFP4's Hadamard transform
mixes 16 rows). The suite's other cases are mapped in behaviour.md §10.1."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch

quant_dynamo = pytest.importorskip("quant_dynamo", reason="compile tests need quant-dynamo")
if not quant_dynamo.compile_supported():
    pytest.skip(f"no opaque-object API on torch {torch.__version__}", allow_module_level=True)


def nvfp4_row_scaled() -> qr.NVFP4BlockScaling:
    return qr.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True,
        row_scaled_activation=True, backward_override="dequantized",
        fp4_quant_fwd_inp=qr.QParams(), fp4_quant_fwd_weight=qr.QParams(),
        fp4_quant_bwd_grad=qr.QParams())


def nvfp4_4over6() -> qr.NVFP4BlockScaling:
    return qr.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, nvfp4_4over6="all",
        fp4_quant_fwd_inp=qr.QParams(),
        fp4_quant_fwd_weight=qr.QParams(fp4_2d_quantization=True),
        fp4_quant_bwd_grad=qr.QParams())


TE_RECIPES = {
    "Float8CurrentScaling": qr.Float8CurrentScaling,
    "Float8BlockScaling": qr.Float8BlockScaling,
    "MXFP8BlockScaling": qr.MXFP8BlockScaling,
    "NVFP4BlockScaling": qr.NVFP4BlockScaling,
    "nvfp4_4over6": nvfp4_4over6,
    "nvfp4_row_scaled": nvfp4_row_scaled,
}


@pytest.mark.parametrize("name", list(TE_RECIPES))
def test_autocast_sanity(name):
    recipe = TE_RECIPES[name]()
    torch.manual_seed(0)
    model = qr.Linear(32, 32, dtype=torch.bfloat16)
    inp = torch.randn(16, 32, dtype=torch.bfloat16)

    def fn(x):
        with qr.autocast(recipe=recipe):
            return model(x)

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        torch._dynamo.reset()
        torch.manual_seed(1)  # the gradient's stochastic rounding, where the recipe has it
        x = inp.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        out = f(x)
        out.sum().backward()
        results.append((out.detach(), x.grad, model.weight.grad, model.bias.grad))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)
