"""NVFP4 backward with M % 16 != 0 (no RHT), 1-D input, mixed dtypes, and a
mixed-format wgrad (NVFP4 gradient x MXFP8 input) run and give the quantized gradient."""

from __future__ import annotations

import formats
import pytest
import quant_recipes as qr
import torch
from quant_core import DType, MXFP8Quantizer, NVFP4Quantizer


def _nvfp4_grad_mxfp8_rest(role):
    if role is not None and role.tensor_type == "grad_output":
        return NVFP4Quantizer()
    return MXFP8Quantizer(DType.E4M3)


RECIPES = {
    "custom_nvfp4": lambda: qr.CustomRecipe(qfactory=lambda role: NVFP4Quantizer()),
    "nvfp4_no_rht": formats.recipes("nvfp4_no_rht")["nvfp4_no_rht"],
    "mixed_wgrad": lambda: qr.CustomRecipe(qfactory=_nvfp4_grad_mxfp8_rest),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("shape, x_dtype, w_dtype", [
    ((4, 32), torch.float32, torch.float32),
    ((32,), torch.float32, torch.float32),
    ((4, 32), torch.float32, torch.bfloat16),
    ((20, 32), torch.bfloat16, torch.bfloat16),
])
def test_ragged_nvfp4_backward(recipe, shape, x_dtype, w_dtype):
    torch.manual_seed(0)
    m = qr.Linear(32, 16, dtype=w_dtype)
    x = torch.randn(*shape, dtype=x_dtype, requires_grad=True)
    with qr.autocast(recipe=RECIPES[recipe]()):
        y = m(x)
    g = torch.randn_like(y)
    y.backward(g)
    assert x.grad.shape == x.shape and m.weight.grad.shape == m.weight.shape
    # 4-bit gradients: compare with the unquantized gradient loosely (the bits are pinned by the
    # GEMM and quantizer tests); a crash or a garbage result fails here
    dx = (g.float() @ m.weight.float()).to(x.grad.dtype)
    rel = (x.grad.float() - dx.float()).norm() / dx.float().norm()
    assert torch.isfinite(x.grad).all() and rel < 0.5
