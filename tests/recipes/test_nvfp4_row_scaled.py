"""Row-scaled NVFP4 activations (``NVFP4BlockScaling(row_scaled_activation=True)``,
numerics.md §7.9) in a Linear: the recipe's slots, forward and backward against the operands
decoded independently, rows that split with their amaxes, and the compiled graph equal to eager.
"""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from quant_core import NVFP4Quantizer, reference
from quant_core.formats.nvfp4 import NVFP4TensorStorage


def row_scaled_recipe(**kw) -> qr.NVFP4BlockScaling:
    """TransformerEngine's compile-test configuration of the variant."""
    return qr.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True,
        row_scaled_activation=True, backward_override="dequantized",
        fp4_quant_fwd_inp=qr.QParams(), fp4_quant_fwd_weight=qr.QParams(),
        fp4_quant_bwd_grad=qr.QParams(), **kw)


def _layer_and_input(seed: int = 0):
    torch.manual_seed(seed)
    m = qr.Linear(64, 32, bias=True, dtype=torch.bfloat16)
    # rows of very different magnitudes: one amax per row keeps the small rows' precision
    x = torch.randn(24, 64) * torch.logspace(-3, 3, 24)[:, None]
    return m, x.bfloat16().requires_grad_()


def test_forward_non_weight_slots_are_row_scaled():
    state = qr.RecipeState.create(row_scaled_recipe(), mode="forward", num_quantizers=3)
    inp, weight, out = state.make_quantizers()
    assert inp.row_scaled_nvfp4 and not inp.columnwise_usage
    assert out.row_scaled_nvfp4
    assert not weight.row_scaled_nvfp4 and weight.columnwise_usage
    bwd = qr.RecipeState.create(row_scaled_recipe(), mode="backward", num_quantizers=2)
    assert not any(q.row_scaled_nvfp4 for q in bwd.make_quantizers())


def test_linear_equals_the_reference_gemms():
    """Forward: the reference NVFP4 GEMM of the row-scaled input and the weight (one factor per
    output row), plus the bias; backward ("dequantized" override): dgrad from the decoded
    weight, wgrad from the decoded input, the gradient itself unquantized."""
    m, x = _layer_and_input()
    with qr.autocast(recipe=row_scaled_recipe()):
        y = m(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    xq = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False).quantize(x.detach())
    wq = NVFP4Quantizer(columnwise_usage=False).quantize(m.weight.detach())
    assert xq._amax_rowwise.shape == (24,)
    xd, wd = xq.dequantize(torch.float32), wq.dequantize(torch.float32)
    ra, rb = xq.gemm_operand(False), wq.gemm_operand(False)
    want = reference.nvfp4_gemm(ra.data, ra.scale, ra.amax, rb.data, rb.scale, rb.amax,
                                a_swizzled=False, b_swizzled=False, bias=m.bias,
                                out_dtype=torch.bfloat16)
    assert torch.equal(y, want)
    assert torch.equal(x.grad, (gy.float() @ wd).bfloat16())
    assert torch.equal(m.weight.grad, (gy.float().t() @ xd).bfloat16())


def test_row_scaling_keeps_small_rows_that_one_amax_flushes():
    m, x = _layer_and_input()
    rows = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False).quantize(x.detach())
    tensor = NVFP4Quantizer(columnwise_usage=False).quantize(x.detach())
    small = x.detach()[0].float()
    err_rows = (rows.dequantize(torch.float32)[0] - small).abs().max()
    err_tensor = (tensor.dequantize(torch.float32)[0] - small).abs().max()
    top = small.abs().max()
    # E2M1 keeps a block within a quarter of its amax; one tensor-wide amax flushes this row
    assert err_rows <= top / 4 and err_tensor > top / 2


def test_rows_split_and_concatenate_with_their_amaxes():
    x = torch.randn(48, 32) * torch.logspace(-2, 2, 48)[:, None]
    q = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False, internal=False)
    t = q.quantize(x)
    top, bottom = t[:32], t[32:]
    assert torch.equal(top._amax_rowwise, t._amax_rowwise[:32])
    assert torch.equal(bottom.dequantize(), t.dequantize()[32:])
    assert torch.equal(torch.cat([top, bottom]).dequantize(), t.dequantize())
    assert torch.equal(t.view(4, 12, 32).dequantize().reshape(48, 32), t.dequantize())


def test_the_gemm_operand_carries_one_factor_per_row():
    """Rowwise, the operand's amax is one per row (each output row's factor); there is no
    transposed operand (no columnwise form)."""
    s = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False).quantize(
        torch.randn(32, 32))
    assert isinstance(s, NVFP4TensorStorage) and s._row_scaled_nvfp4
    op = s.gemm_operand(False)
    assert op.rows == 32 and torch.equal(op.amax, s._amax_rowwise)
    assert s.gemm_operand(True) is None


def test_amax_reduction_and_columnwise_use_are_refused():
    q = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False)
    with pytest.raises(ValueError, match="takes no with_amax_reduction=True"):
        q.replace(with_amax_reduction=True)
    with pytest.raises(ValueError, match="takes no amax reduction"):
        q.amax_numel()
    with pytest.raises(ValueError, match="takes no columnwise_usage=True"):
        q.replace(columnwise_usage=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_linear_equals_eager(backend):
    dynamo = pytest.importorskip("quant_dynamo")
    if not dynamo.compile_supported():
        pytest.skip("this torch bakes no quantizer into a graph")
    m, x = _layer_and_input()
    recipe = row_scaled_recipe()

    def step(inp):
        with qr.autocast(recipe=recipe):
            return m(inp)

    y = step(x)
    y.float().sum().backward()
    eager = (y.detach(), x.grad.clone(), m.weight.grad.clone())
    x.grad = None
    m.weight.grad = None
    torch._dynamo.reset()
    yc = torch.compile(step, fullgraph=True, backend=backend)(x)
    yc.float().sum().backward()
    for a, b in zip(eager, (yc.detach(), x.grad, m.weight.grad), strict=True):
        assert torch.equal(a, b)
