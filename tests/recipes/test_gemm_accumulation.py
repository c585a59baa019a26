"""Which GEMMs may use the FP8 tensor cores' fast accumulation: the recipe's ``MMParams`` per GEMM
(``fp8_gemm_fprop`` / ``_dgrad`` / ``_wgrad``), TransformerEngine's module default where a recipe
has none (fprop fast, dgrad and wgrad split), carried by every layer to cuBLAS's
``use_fast_accum``. On the CPU ``torch._scaled_mm`` is replaced by an emulation that records
the flag."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from _scaled_mm import recorded_scaled_mm
from quant_recipes.recipe import fast_accumulation

M, K, N = 32, 64, 48


@pytest.mark.parametrize("recipe, want", [
    (qr.Float8CurrentScaling(), (True, False, False)),
    (qr.Float8CurrentScaling(fp8_gemm_fprop=qr.MMParams(True)), (False, False, False)),
    (qr.Float8CurrentScaling(fp8_gemm_dgrad=qr.MMParams(False),
                             fp8_gemm_wgrad=qr.MMParams(False)), (True, True, True)),
    (qr.Float8BlockScaling(), (False, False, False)),
    (qr.DelayedScaling(), (True, False, False)),
    (qr.MXFP8BlockScaling(), (True, False, False)),
])
def test_fast_accumulation_per_gemm(recipe, want):
    assert fast_accumulation(recipe) == want


@pytest.fixture
def recorded():
    """Each ``torch._scaled_mm`` call's ``use_fast_accum`` (:func:`recorded_scaled_mm`)."""
    with recorded_scaled_mm() as calls:
        yield calls


def _compiled(fn):
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not quant_dynamo.compile_supported():
        pytest.skip("no torch.compile support for quant on this torch")
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("fprop_split, want", [(None, [True, False, False]),
                                               (True, [False, False, False])])
@pytest.mark.parametrize("compiled", [False, True])
def test_linear_passes_each_gemms_flag_to_cublas(recorded, fprop_split, want, compiled):
    """fprop, then dgrad and wgrad: the default Float8CurrentScaling multiplies forward with
    fast accumulation and backward without; ``fp8_gemm_fprop=MMParams(True)`` splits it too."""
    fields = {} if fprop_split is None else {"fp8_gemm_fprop": qr.MMParams(fprop_split)}
    recipe = qr.Float8CurrentScaling(**fields)
    torch.manual_seed(0)
    layer = qr.Linear(K, N, bias=False, dtype=torch.bfloat16)

    def step(x):
        with qr.autocast(recipe=recipe):
            return layer(x)

    fn = _compiled(step) if compiled else step
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    fn(x).backward(torch.randn(M, N, dtype=torch.bfloat16))
    assert recorded == want
    assert x.grad is not None and layer.weight.grad is not None


def test_accumulation_changes_no_cpu_result():
    """Off the FP8 tensor cores every GEMM sums in fp32: the two settings give the same bits."""
    torch.manual_seed(0)
    layer = qr.Linear(K, N, bias=False, dtype=torch.bfloat16)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    outs = []
    for split in (False, True):
        with qr.autocast(recipe=qr.Float8CurrentScaling(fp8_gemm_fprop=qr.MMParams(split))):
            outs.append(layer(x))
    assert torch.equal(*outs)


def test_equal_recipes_share_the_compiled_graph():
    """The flags are read as plain booleans: a recipe whose ``MMParams`` fields are distinct but
    equal objects (from a dict, or spelled out) runs the graph of the default one, no recompile."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not quant_dynamo.compile_supported():
        pytest.skip("no torch.compile support for quant on this torch")
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = qr.Linear(K, N, bias=False, dtype=torch.bfloat16)
    counter = CompileCounter()

    def step(x, recipe):
        with qr.autocast(recipe=recipe):
            return layer(x)

    fn = torch.compile(step, backend=counter, fullgraph=True)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    for recipe in (qr.Float8CurrentScaling(),
                   qr.Float8CurrentScaling(fp8_gemm_dgrad=qr.MMParams(True)),
                   qr.recipe("fp8_current", fp8_gemm_wgrad={"use_split_accumulator": True})):
        fn(x, recipe).sum().backward()
    assert counter.frame_count == 1


def test_a_recipe_built_in_compiled_code_keeps_its_flags(recorded):
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not quant_dynamo.compile_supported():
        pytest.skip("no torch.compile support for quant on this torch")
    torch.manual_seed(0)
    layer = qr.Linear(K, N, bias=False, dtype=torch.bfloat16)

    def step(x):
        with qr.autocast(recipe=qr.Float8CurrentScaling(fp8_gemm_wgrad=qr.MMParams(False))):
            return layer(x)

    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    _compiled(step)(x).backward(torch.randn(M, N, dtype=torch.bfloat16))
    assert recorded == [True, False, True]
