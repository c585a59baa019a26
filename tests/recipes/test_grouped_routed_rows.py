"""A routing's tokens read where they lie on every grouped route (``GroupedProjection.project(x,
..., routes)``): FP8 blocks, MXFP8 and high precision (``grouped_mm``), NVFP4, and FP8 current
off the quantize-once path (per group, which gathers inside the op). Outputs and gradients equal
those of the layer given the gathered copy, bitwise, eager and compiled; the layer keeps the
tokens for backward, not a gathered ``[T * k, K]`` copy. (The quantize-once FP8 path:
tests/recipes/test_grouped_fp8.py.)"""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from moe_routing import in_place_and_on_a_copy, plain_and_checkpointed, qwen3_moe_experts
from quant_recipes.moe import fp8_block_gemm, nvfp4_gemm
from quant_recipes.moe import gemm as grouped_gemm
from quant_recipes.moe.linear import GroupedProjection
from quant_recipes.moe.routes import route

E, K, N = 4, 256, 128
TOKENS, TOP_K = 45, 2

#: recipe name -> (recipe, the paths its three GEMMs take on the CPU here)
RECIPES = {
    "high_precision": (None, {"grouped_mm"}),
    "fp8_current": (qr.Float8CurrentScaling(), {"per_group"}),
    "fp8_block": (qr.Float8BlockScaling(), {"fp8_block_grouped_gemm"}),
    "mxfp8": (qr.MXFP8BlockScaling(), {"grouped_mm"}),
    "nvfp4": (qr.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                   disable_2d_quantization=True), {"nvfp4_grouped_gemm"}),
}


@pytest.fixture
def on_cpu(monkeypatch):
    """The grouped routes on the CPU (the reference backend)."""
    monkeypatch.setattr(fp8_block_gemm, "DEVICES", {"cpu"})
    monkeypatch.setattr(nvfp4_gemm, "DEVICES", {"cpu"})
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")


def _routing(tokens: int):
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:TOP_K] for _ in range(tokens)]
                      ) if tokens else torch.zeros(0, TOP_K, dtype=torch.int64)
    sorted_ids, routes = route(ids)  # expert E - 1 gets no rows
    return torch.searchsorted(sorted_ids, torch.arange(E), right=True), routes


def _backend(saved: list):
    """aot_eager that lists the backward graph's saved inputs (shape, dtype) in ``saved``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def backward(gm, _):
        for node in gm.graph.find_nodes(op="placeholder"):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and not node.name.startswith("tangents"):
                saved.append((tuple(val.shape), val.dtype))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                        bw_compiler=backward)


def _run(proj, fn, x, w, gy, compiled):
    """Outputs and gradients, the paths taken, and what backward keeps (shape, dtype);
    ``compiled``: None (eager), "static" or "dynamic" shapes."""
    saved = []
    if compiled:
        fn = torch.compile(fn, fullgraph=True, backend=_backend(saved),
                           dynamic=compiled == "dynamic")
    xi = x.clone().requires_grad_()
    w.grad = None
    qr.reset_grouped_gemm_paths()

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(xi, w)
    y.backward(gy)
    return (y.detach(), xi.grad, w.grad), qr.grouped_gemm_paths(), saved


@pytest.mark.parametrize("tokens", [TOKENS, 0])
@pytest.mark.parametrize("compiled", [None, "static", "dynamic"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_routed_tokens_are_read_where_they_lie(on_cpu, name, compiled, tokens):
    recipe, paths = RECIPES[name]
    if compiled:
        quant_dynamo = pytest.importorskip("quant_dynamo")
        if not (quant_dynamo.compile_supported() and quant_dynamo.DERIVES_IN_GRAPH):
            pytest.skip("this torch cannot read a baked quantizer's value key (grouped ops "
                        "need it)")
        torch._dynamo.reset()
    offs, routes = _routing(tokens)
    torch.manual_seed(0)
    proj = GroupedProjection(E, K, N)
    w = torch.randn(E, N, K, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(tokens, K, dtype=torch.bfloat16)
    gy = torch.randn(tokens * TOP_K, N, dtype=torch.bfloat16)

    in_place, on_a_copy = in_place_and_on_a_copy(proj, offs, routes, recipe)
    got, got_paths, got_saved = _run(proj, in_place, x, w, gy, compiled)
    want, want_paths, want_saved = _run(proj, on_a_copy, x, w, gy, compiled)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert set(got_paths) == set(want_paths)
    if not tokens:  # no rows: no GEMM reads a byte
        return
    assert set(got_paths) == paths
    # what backward keeps: the tokens, where the layer given the copy keeps the gathered rows
    # (compiled, the partitioner may choose to gather again in backward instead)
    routed = ((tokens * TOP_K, K), torch.bfloat16)
    assert routed not in got_saved and ((tokens, K), torch.bfloat16) in got_saved
    assert compiled or routed in want_saved


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "outside"])
@pytest.mark.parametrize("name", ["high_precision", "fp8_block", "mxfp8"])
def test_a_checkpointed_experts_block_recomputes_its_routed_reads(on_cpu, name, inside):
    """A converted experts block recomputed by activation checkpointing (backward inside
    autocast, or outside it under the forward's frame), its routes reading the tokens in place:
    the same output, gradients and routes as without checkpointing."""
    recipe, paths = RECIPES[name]
    experts = qwen3_moe_experts(recipe, hidden=256, expert_width=128)
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(30, 256, generator=gen).bfloat16()
    ids = torch.rand(30, 7, generator=gen).argsort(dim=1)[:, :2]  # expert 7: no rows
    w = torch.rand(30, 2, generator=gen).softmax(-1).bfloat16()
    (plain, got_paths), (again, again_paths) = plain_and_checkpointed(experts, h, ids, w,
                                                                      recipe, inside)
    assert got_paths == again_paths == paths
    for a, b in zip(plain, again, strict=True):
        assert torch.equal(a, b)
