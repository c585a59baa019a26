"""The one-launch grouped routes of the block-scaled recipes (FP8 blocks' block-scaled kernel,
MXFP8's ``torch._grouped_mm`` after one decode, NVFP4's grouped kernel) under the two ways a
training step runs a layer's forward again or with other shapes: activation checkpointing (the
recompute inside ``autocast`` and outside it, under the forward's frame) and a ``dynamic=True``
compile over changing token counts. Each gives the plain eager step's bytes.

The routes are forced onto the CPU's reference backend (the kernels are held to it in
tests/kernels); FP8 current scaling's routes have the same tests in test_grouped_fp8.py."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from quant_core import backends
from quant_recipes.moe import fp8_block_gemm, nvfp4_gemm
from quant_recipes.moe import gemm as grouped_gemm
from torch.utils.checkpoint import checkpoint

K, N = 128, 256
COUNTS = [0, 37, 1, 90]  # an empty group, a group of one row, groups past one 32-row block
OTHER_COUNTS = ([3, 0, 0, 20, 1, 0, 9], [40, 2, 7, 0, 0, 1, 30])

#: recipe id -> (recipe, the route's module attribute that lists its devices, its path name)
ROUTES = {
    "fp8_block": (qr.Float8BlockScaling, (fp8_block_gemm, "DEVICES"),
                  "fp8_block_grouped_gemm"),
    "mxfp8": (qr.MXFP8BlockScaling, (grouped_gemm, "GROUPED_MM_DEVICES"), "grouped_mm"),
    "nvfp4": (lambda: qr.NVFP4BlockScaling(disable_stochastic_rounding=True),
              (nvfp4_gemm, "DEVICES"), "nvfp4_grouped_gemm"),
}


@pytest.fixture(params=list(ROUTES))
def route(request, monkeypatch):
    """``(recipe, path)`` of one route, forced onto the CPU's reference backend."""
    make, (module, attr), path = ROUTES[request.param]
    monkeypatch.setattr(module, attr, {"cpu"})
    if request.param == "mxfp8" and not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    with backends.using("reference"):
        yield make(), path


def _layer(experts: int):
    torch.manual_seed(0)
    return qr.GroupedLinear(experts, K, N, dtype=torch.bfloat16, name="experts")


def _inputs(counts, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), K, generator=gen).to(torch.bfloat16)
    return x, torch.randn(sum(counts), N, generator=gen).to(torch.bfloat16)


def _under(m, recipe):
    """``m``'s forward inside ``autocast(recipe)``, as ``forward(x, counts)``."""

    def forward(x, counts):
        with qr.autocast(recipe=recipe):
            return m(x, counts=counts)

    return forward


def _step(forward, m, x, gy, counts):
    """``(y, dx, dw)`` of one step of ``forward(x, counts)`` over ``m``'s parameters."""
    xi = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    y = forward(xi, torch.tensor(counts))
    y.backward(gy)
    return y.detach(), xi.grad, m.weight.grad


def _assert_equal(got, want):
    for name, a, b in zip(("y", "dx", "dw"), got, want, strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("inside", [True, False], ids=["backward_inside", "backward_outside"])
def test_activation_checkpointing_equals_the_plain_step(route, inside):
    recipe, path = route
    m = _layer(len(COUNTS))
    x, gy = _inputs(COUNTS)
    qr.reset_grouped_gemm_paths()
    want = _step(_under(m, recipe), m, x, gy, COUNTS)
    assert qr.grouped_gemm_paths() == {path: 3}
    xi = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    with qr.autocast(recipe=recipe):
        y = checkpoint(m, xi, counts=torch.tensor(COUNTS), use_reentrant=False)
        if inside:
            y.backward(gy)
    if not inside:  # the recompute runs outside the region, under the forward's frame
        y.backward(gy)
    _assert_equal((y.detach(), xi.grad, m.weight.grad), want)


def test_dynamic_compile_over_token_counts_equals_eager(route):
    """Other token counts run the same compiled code (the first call may trace its frame twice:
    Dynamo restarts once to turn a Python float into a tensor), bitwise the eager step."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not (quant_dynamo.compile_supported() and quant_dynamo.DERIVES_IN_GRAPH):
        pytest.skip("this torch cannot read a baked quantizer's value key (grouped ops need it)")
    from torch._dynamo.testing import CompileCounterWithBackend

    recipe, path = route
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    m = _layer(len(OTHER_COUNTS[0]))
    forward = _under(m, recipe)
    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for seed, counts in enumerate(OTHER_COUNTS + ([12, 0, 33, 0, 5, 64, 0],)):
        x, gy = _inputs(counts, seed)
        got = _step(compiled, m, x, gy, counts)
        qr.reset_grouped_gemm_paths()
        want = _step(forward, m, x, gy, counts)
        assert qr.grouped_gemm_paths() == {path: 3}  # the eager step's route
        _assert_equal(got, want)
        frames.append(counter.frame_count)
    assert frames[0] <= 2 and frames[1:] == [frames[0]] * 2
