"""Expert biases on the grouped routes (quant_recipes.moe.bias): a GroupedLinear with a bias
takes the same one-launch GEMMs as one without, adds each group's bias to the fp32 product
before the one rounding, and sums the bias gradient per group on the device.

Oracle: the per-group path (the dense Linear's quantize calls and GEMMs, bias included, on
each padded group: tested against the dense Linear in test_grouped_linear.py), equal up to the
order of the fp32 sums. On the CPU the routes run on the reference backend and, under
``TRITON_INTERPRET=1``, on the Triton kernels through the interpreter; that they read nothing
on the host: tests/recipes/test_grouped_host_reads.py."""

from __future__ import annotations

import contextlib

import pytest
import quant_recipes as qr
import torch
from quant_core import backends
from quant_recipes.moe import bias, fp8_block_gemm, nvfp4_gemm
from quant_recipes.moe import fp8_gemm as grouped_fp8_gemm
from quant_recipes.moe import gemm as grouped_gemm

COUNTS = [0, 37, 1, 90]  # an empty group, a group of one row, groups past one block
K, N = 128, 256


def _fp8_current(mp):
    mp.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", {"cpu", "cuda"})
    mp.setattr(grouped_fp8_gemm, "_runs", lambda device_type, dtype: False)


def _fp8_block(mp):
    mp.setattr(fp8_block_gemm, "DEVICES", {"cpu", "cuda"})


def _nvfp4(mp):
    mp.setattr(nvfp4_gemm, "DEVICES", {"cpu", "cuda"})


#: recipe, what puts its grouped route on the CPU, the paths of a step with a bias
ROUTES = {
    "fp8_current": (qr.Float8CurrentScaling(), _fp8_current, {"fp8_grouped_gemm": 3}),
    "fp8_block": (qr.Float8BlockScaling(), _fp8_block, {"fp8_block_grouped_gemm": 3}),
    "nvfp4": (qr.NVFP4BlockScaling(disable_stochastic_rounding=True), _nvfp4,
              {"nvfp4_grouped_gemm": 3}),
}


def _step(recipe, counts=COUNTS):
    """A step of a biased layer under ``recipe`` (outside autocast: None)."""
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(counts), K, N, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        m.bias.copy_(torch.randn(len(counts), N) * 4)
    x = torch.randn(sum(counts), K, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(sum(counts), N, dtype=torch.bfloat16)
    qr.reset_grouped_gemm_paths()
    with qr.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
        y = m(x, torch.tensor(counts).cumsum(0))
    y.backward(gy)
    return (y.detach(), x.grad, m.weight.grad, m.bias.grad), qr.grouped_gemm_paths()


def _per_group(recipe):
    with backends.using("reference"):
        want, paths = _step(recipe)
    assert paths == {"per_group": 3}
    return want


@pytest.mark.parametrize("name", list(ROUTES))
def test_a_bias_keeps_the_grouped_route(impl, monkeypatch, name):
    recipe, on_cpu, want_paths = ROUTES[name]
    want = _per_group(recipe)
    on_cpu(monkeypatch)
    got, paths = _step(recipe)
    assert paths == want_paths
    for what, a, b in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        # the same products and bias in fp32, summed in another order, one rounding
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-5, msg=what)


def test_the_bias_is_added_before_the_one_rounding():
    """A product that bf16 cannot hold next to its bias: rounding it first loses the bias."""
    y = torch.tensor([[1.0 + 2**-8 - 2**-12]])  # just under half a bf16 step above 1
    b = torch.tensor([[2**-9]], dtype=torch.bfloat16)
    got = bias.added(y, b, torch.tensor([0]), torch.bfloat16)
    assert got.item() == 1.0 + 2**-7 and (y.to(torch.bfloat16) + b).item() == 1.0


def test_group_sums_sum_each_group_in_fp32():
    gy = torch.tensor([[1.0], [2**-8], [2**-8], [3.0], [5.0]], dtype=torch.bfloat16)
    offs = torch.tensor([3, 3, 5], dtype=torch.int32)
    got = bias.group_sums(gy, offs, torch.bfloat16)
    # bf16 sums would drop both 2**-8 terms; fp32 keeps them to the one rounding
    assert got.flatten().tolist() == [1.0078125, 0.0, 8.0]


@pytest.mark.parametrize("recipe", [qr.MXFP8BlockScaling(), None], ids=["mxfp8", "outside"])
def test_the_grouped_mm_route_takes_a_bias(impl, monkeypatch, recipe):
    """``torch._grouped_mm`` gives no fp32 product: the forward with a bias multiplies the same
    decoded operands by the backend's ``grouped_rows_gemm``, the backward's GEMMs stay on
    ``torch._grouped_mm`` and the bias gradient is the group sums; MXFP8, and the
    high-precision layer outside autocast."""
    want = _per_group(recipe)
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    got, paths = _step(recipe)
    assert paths == {"decoded_grouped_gemm": 1, "grouped_mm": 2}
    for what, a, b in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-5, msg=what)


def test_compiled_fullgraph_with_a_bias_equals_eager(monkeypatch):
    """The quantize-once FP8 op with its bias argument, and the block routes' grouped ops,
    compiled with ``fullgraph=True``: bitwise the eager step, one frame for every routing."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not (quant_dynamo.compile_supported() and quant_dynamo.DERIVES_IN_GRAPH):
        pytest.skip("this torch cannot read a baked quantizer's value key (grouped ops need it)")
    from torch._dynamo.testing import CompileCounterWithBackend

    for name in ("fp8_current", "fp8_block"):
        recipe, on_cpu, want_paths = ROUTES[name]
        on_cpu(monkeypatch)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        torch.manual_seed(0)
        m = qr.GroupedLinear(len(COUNTS), K, N, bias=True, dtype=torch.bfloat16)

        def step(x, offs, m=m, recipe=recipe):
            with qr.autocast(recipe=recipe):
                return m(x, offs)

        compiled = torch.compile(step, fullgraph=True, backend=counter)
        x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16)
        gy = torch.randn(sum(COUNTS), N, dtype=torch.bfloat16)
        for counts in (COUNTS, [32, 32, 32, 32], [0, 0, 128, 0]):
            results = []
            for fn in (compiled, step):
                xi = x.clone().requires_grad_()
                m.zero_grad(set_to_none=True)
                qr.reset_grouped_gemm_paths()
                fn(xi, torch.tensor(counts).cumsum(0)).backward(gy)
                results.append((xi.grad, m.weight.grad, m.bias.grad))
                assert qr.grouped_gemm_paths() == want_paths
            for a, b in zip(*results, strict=True):
                assert torch.equal(a, b)
        assert counter.frame_count == 1
