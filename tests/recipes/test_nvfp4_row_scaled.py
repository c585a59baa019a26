"""Row-scaled NVFP4 activations (``NVFP4BlockScaling(row_scaled_activation=True)``,
numerics.md §7.9) in a Linear: the recipe's slots, forward and backward against the operands
decoded independently, rows that split with their amaxes, the compiled graph equal to eager, and
autocast's amax reduction group (2 gloo ranks) leaving the per-row amaxes alone.
"""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
import torch.distributed as dist
from _dist_helpers import init, spawn
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


def test_amax_reduction_flag_and_columnwise_use_are_refused():
    """The quantizer cannot tell whether a group's ranks hold other rows (nothing to share) or
    other columns of its rows: ``with_amax_reduction`` is refused, its amax count is a row
    count."""
    q = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False)
    with pytest.raises(ValueError, match="takes no with_amax_reduction=True"):
        q.replace(with_amax_reduction=True)
    with pytest.raises(ValueError, match="amax_numel needs the input's rows"):
        q.amax_numel()
    assert q.amax_numel(rows=24) == 24
    with pytest.raises(ValueError, match="takes no columnwise_usage=True"):
        q.replace(columnwise_usage=True)


def test_per_row_amaxes_pass_through_local_amax_and_quantize_with_amax():
    """The split around a reduction keeps one amax per row, and amaxes combined elementwise
    (the max of two column halves' row amaxes) give the whole rows' quantization."""
    _, x = _layer_and_input()
    x = x.detach()
    q = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False)
    amax = q.local_amax(x)
    assert amax.shape == (24,)
    want = q.quantize(x)
    got = q.quantize_with_amax(x, amax)
    halves = torch.maximum(q.local_amax(x[:, :32]), q.local_amax(x[:, 32:]))
    left = q.quantize_with_amax(x[:, :32].contiguous(), halves)
    for name in want.buffer_names:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert torch.equal(left.dequantize(torch.float32), want.dequantize(torch.float32)[:, :32])


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


def _reduction_group_worker(rank, port, compiled, out):
    """Each rank its own rows and, to make the weight's reduction visible, its own weight
    (rank r's is r + 1 times the base weight)."""
    init(rank, port, 2)
    try:
        m, x = _layer_and_input(seed=0)
        base = m.weight.detach().clone()
        with torch.no_grad():
            m.weight.mul_(rank + 1)
        x = (x.detach() * (rank + 1)).flip(0).requires_grad_()  # other rows on each rank
        recipe = row_scaled_recipe()

        def step(t):
            with qr.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                return m(t)

        fn = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
        y = fn(x)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
        y.backward(gy)
        # the input: its own rows' amaxes, not reduced; the weight: the amax of both ranks'
        # weights (rank 1's, twice the base's)
        xq = NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False).quantize(x.detach())
        wq_ = NVFP4Quantizer(columnwise_usage=False)
        wq = wq_.quantize_with_amax(m.weight.detach(), wq_.local_amax(2 * base))
        ra, rb = xq.gemm_operand(False), wq.gemm_operand(False)
        want = reference.nvfp4_gemm(ra.data, ra.scale, ra.amax, rb.data, rb.scale, rb.amax,
                                    a_swizzled=False, b_swizzled=False, bias=m.bias,
                                    out_dtype=torch.bfloat16)
        xd, wd = xq.dequantize(torch.float32), wq.dequantize(torch.float32)
        out[rank] = {"y": torch.equal(y, want),
                     "x.grad": torch.equal(x.grad, (gy.float() @ wd).bfloat16()),
                     "weight.grad": torch.equal(m.weight.grad, (gy.float().t() @ xd).bfloat16())}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compiled", [False, True])
def test_autocast_reduction_group_reduces_the_weight_and_leaves_the_rows(compiled):
    """Under ``autocast(amax_reduction_group=g)`` (data parallel: the ranks hold other rows) the
    per-tensor weight amax is all-reduced, the row-scaled input's per-row amaxes are the rank's
    own rows' (there is nothing to share)."""
    if compiled:
        dynamo = pytest.importorskip("quant_dynamo")
        if not dynamo.compile_supported():
            pytest.skip("this torch bakes no quantizer into a graph")
    out = spawn(_reduction_group_worker, compiled)
    for rank in range(2):
        assert all(out[rank].values()), (rank, out[rank])
