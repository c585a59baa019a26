"""On CUDA: mixture-of-experts layers run every grouped GEMM as one launch and read nothing on
the host (FP8 current scaling's weight gradient on the backend's grouped kernel,
``OWN_KERNEL_MIN_EXPERTS`` 0; ``torch.cuda.set_sync_debug_mode("error")`` fails on any synchronizing
call), eagerly, compiled, and captured in a CUDA graph that is replayed with other group sizes;
their results lie within the accumulation bound of the per-group path's (each group quantized
and multiplied alone, the definition)."""

from __future__ import annotations

import contextlib

import pytest
import quant_recipes as qr
import torch
from quant_recipes.moe import fp8_block_gemm as grouped_fp8_block_gemm
from quant_recipes.moe import fp8_gemm as grouped_fp8_gemm
from quant_recipes.moe import gemm as grouped_gemm
from quant_recipes.moe import nvfp4_gemm as grouped_nvfp4_gemm
from quant_recipes.recipe import fast_accumulation

DEV = "cuda"
E, K, N = 8, 256, 384
COUNTS = [0, 1, 37, 200, 16, 0, 5, 61]
OTHER = [64, 0, 0, 3, 190, 40, 22, 1]  # the same total, other groups
RECIPES = {
    "fp8_current": (lambda: qr.Float8CurrentScaling(), None),
    "fp8_current_e4m3": (lambda: qr.Float8CurrentScaling(fp8_format=qr.Format.E4M3), None),
    "mxfp8": (lambda: qr.MXFP8BlockScaling(), {"grouped_mm": 3}),
    "fp8_block": (lambda: qr.Float8BlockScaling(), {"fp8_block_grouped_gemm": 3}),
    # round to nearest: a replayed graph and an eager step draw other random bytes
    "nvfp4": (lambda: qr.NVFP4BlockScaling(disable_stochastic_rounding=True),
              {"nvfp4_grouped_gemm": 3}),
}


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _data(counts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-2, 2, sum(counts))[:, None]
    x = (torch.randn(sum(counts), K, generator=gen) * rows).to(DEV, torch.bfloat16)
    gy = torch.randn(sum(counts), N, generator=gen).to(DEV, torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0).to(DEV, torch.int32)
    return x, gy, offs


def _layer(seed=0, bias=False):
    torch.manual_seed(seed)
    return qr.GroupedLinear(E, K, N, bias=bias, dtype=torch.bfloat16, device=DEV,
                            name="experts")


def _step(m, fwd, recipe, x, gy, offs):
    xi = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    with qr.autocast(recipe=recipe):
        y = fwd(xi, offs)
    y.backward(gy)
    return y.detach(), xi.grad, m.weight.grad


def _want_paths(name):
    """The paths with ``OWN_KERNEL_MIN_EXPERTS`` 0 (what reads nothing on the host): every FP8
    GEMM on the grouped kernels."""
    want = RECIPES[name][1]
    return {"fp8_grouped_gemm": 3} if want is None else want


@pytest.fixture(autouse=True)
def own_tokens_kernel(monkeypatch):
    monkeypatch.setattr(grouped_fp8_gemm, "OWN_KERNEL_MIN_EXPERTS", 0)


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    """Each test compiles its own graphs: the layers of every test share one ``forward``, whose
    recompiles per recipe would otherwise reach Dynamo's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _assert_within_bound(got, want, x, w, gy, counts, recipe=None):
    """``|got - want| <= 2^-7 |want| + 2^-11 (|A| |B|)`` for y, dx and dw, plus for each GEMM
    the recipe lets accumulate fast (``fast_accumulation``: both sides do, numerics.md §8)
    ``2 K 2^-14 (|A| |B|)``."""
    per_tensor = recipe is not None and recipe.float8_per_tensor_scaling()
    fast = fast_accumulation(recipe) if per_tensor else (False,) * 3
    ks = (x.shape[1], gy.shape[1], x.shape[0])
    ax, aw, ag = x.float().abs(), w.detach().float().abs(), gy.float().abs()
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()[:-1]]
    spans = list(zip(starts, counts, strict=True))
    mags = [torch.cat([ax[s:s + c] @ aw[g].t() for g, (s, c) in enumerate(spans)]),
            torch.cat([ag[s:s + c] @ aw[g] for g, (s, c) in enumerate(spans)]),
            torch.stack([ag[s:s + c].t() @ ax[s:s + c] for s, c in spans])]
    for name, a, b, s, f, k in zip(("y", "dx", "dw"), got, want, mags, fast, ks, strict=True):
        err = (a.float() - b.float()).abs()
        rel = 2.0**-11 + (2 * k * 2.0**-14 if f else 0.0)
        assert (err <= 2.0**-7 * b.float().abs() + rel * s).all(), name


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_step_reads_nothing_on_the_host(monkeypatch, name, compiled):
    recipe = RECIPES[name][0]()
    m = _layer()
    fwd = torch.compile(m, fullgraph=True, dynamic=False) if compiled else m
    x, gy, offs = _data(COUNTS)
    _step(m, fwd, recipe, x, gy, offs)  # compiles, probes the kernels once
    qr.reset_grouped_gemm_paths()
    with no_host_sync():
        got = _step(m, fwd, recipe, x, gy, offs)
    assert qr.grouped_gemm_paths() == _want_paths(name)
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", set())
    monkeypatch.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", set())
    monkeypatch.setattr(grouped_fp8_block_gemm, "DEVICES", set())
    monkeypatch.setattr(grouped_nvfp4_gemm, "DEVICES", set())
    qr.reset_grouped_gemm_paths()
    want = _step(m, m, recipe, x, gy, offs)
    assert qr.grouped_gemm_paths() == {"per_group": 3}
    _assert_within_bound(got, want, x, m.weight, gy, COUNTS, recipe)


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "fp8_block", "nvfp4"])
def test_a_captured_step_replays_with_other_group_sizes(name):
    """One CUDA graph of forward + backward, replayed after the group sizes changed in place:
    the results of an eager step with those sizes."""
    recipe = RECIPES[name][0]()
    m = _layer()
    x, gy, offs = _data(COUNTS)
    xs = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            xs.grad = None
            m.zero_grad(set_to_none=True)
            with qr.autocast(recipe=recipe):
                m(xs, offs).backward(gy)
    torch.cuda.current_stream().wait_stream(side)
    xs.grad = None
    m.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with qr.autocast(recipe=recipe):
            ys = m(xs, offs)
        ys.backward(gy)
    x2, gy2, offs2 = _data(OTHER, seed=1)
    with torch.no_grad():
        xs.copy_(x2)
        offs.copy_(offs2)
        gy.copy_(gy2)
    graph.replay()
    got = (ys.detach().clone(), xs.grad.clone(), m.weight.grad.clone())
    want = _step(m, m, recipe, x2, gy2, offs2)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_block", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("compiled", [False, True])
def test_a_biased_step_reads_nothing_on_the_host(monkeypatch, name, compiled):
    """Expert biases (GPT-OSS): the same grouped routes, each bias added to the fp32 product and
    its gradient summed per group on the device (MXFP8's forward GEMM on the backend's grouped
    rows GEMM, which gives the fp32 product ``torch._grouped_mm`` does not)."""
    recipe = RECIPES[name][0]()
    m = _layer(bias=True)
    fwd = torch.compile(m, fullgraph=True, dynamic=False) if compiled else m
    x, gy, offs = _data(COUNTS)
    _step(m, fwd, recipe, x, gy, offs)
    qr.reset_grouped_gemm_paths()
    with no_host_sync():
        got = _step(m, fwd, recipe, x, gy, offs)
        db = m.bias.grad.clone()
    want_paths = ({"decoded_grouped_gemm": 1, "grouped_mm": 2} if name == "mxfp8"
                  else _want_paths(name))
    assert qr.grouped_gemm_paths() == want_paths
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", set())
    monkeypatch.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", set())
    monkeypatch.setattr(grouped_fp8_block_gemm, "DEVICES", set())
    monkeypatch.setattr(grouped_nvfp4_gemm, "DEVICES", set())
    want = _step(m, m, recipe, x, gy, offs)
    _assert_within_bound(got, want, x, m.weight, gy, COUNTS, recipe)
    torch.testing.assert_close(db, m.bias.grad, rtol=2**-7, atol=1e-3)


def _hf_experts(recipe):
    """A converted Qwen3-MoE experts block (16 experts, top-4) and a routed batch."""
    from moe_routing import qwen3_moe_experts

    experts = qwen3_moe_experts(recipe, hidden=256, expert_width=128, experts=16, top_k=4,
                                device=DEV)
    tokens = 300
    h = torch.randn(tokens, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.randint(0, 16, (tokens, 4), device=DEV)
    weights = torch.rand(tokens, 4, device=DEV, dtype=torch.bfloat16)
    return experts, (h, idx, weights)


def test_hf_experts_read_nothing_on_the_host():
    """A converted Qwen3-MoE experts block: routing, grouped GEMMs and the combine, forward and
    backward, with no synchronizing call."""
    recipe = qr.Float8CurrentScaling()
    experts, args = _hf_experts(recipe)
    for guard in (contextlib.nullcontext(), no_host_sync()):
        with guard, qr.autocast(recipe=recipe):
            experts(*args).sum().backward()


@pytest.mark.parametrize("compiled", [False, True])
def test_hf_experts_quantize_the_routed_rows_where_they_lie(monkeypatch, compiled):
    """The experts block's grouped quantize reads each routed row in the hidden states (and,
    compiled, takes the amaxes Inductor computes next to it): output and every gradient equal,
    bitwise, those of the block that gathers the routed rows into a copy first (the input
    gradient of both each token's routed rows summed in route order: no atomics)."""
    from quant_recipes.moe.linear import GroupedProjection
    from quant_recipes.moe.routes import gather_tokens

    recipe = qr.Float8CurrentScaling()
    experts, (h, idx, weights) = _hf_experts(recipe)
    project = GroupedProjection.project

    def gathering_first(self, x, offs, w, b, layouts=None, routes=None, param=None):
        return project(self, x if routes is None else gather_tokens(x, routes), offs, w, b,
                       layouts, param=param)

    results = []
    for gather in (False, True):
        if gather:
            monkeypatch.setattr(GroupedProjection, "project", gathering_first)
        torch._dynamo.reset()
        fn = torch.compile(experts, fullgraph=True) if compiled else experts
        experts.zero_grad(set_to_none=True)
        x = h.detach().clone().requires_grad_()
        with qr.autocast(recipe=recipe):
            y = fn(x, idx, weights)
        y.float().pow(2).sum().backward()
        results.append((y, experts.gate_up_proj.grad, experts.down_proj.grad, x.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_routes_compiled_give_eager_bits():
    """The experts' combine and the tokens' gather under Inductor (Triton, which may fuse each
    multiply and add): bf16 products are exact in fp32 and the routes are added in the same
    order, so the combine's output, the routed rows' gradient and the tokens' gradient equal
    eager's bitwise; the routing weights' gradient is a sum over the width, within its
    rounding."""
    from quant_recipes.moe.routes import combine_routes, gather_tokens, route

    tokens, k, hidden = 4099, 8, 2048
    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.rand(tokens, 128, device=DEV, generator=g).topk(k, dim=-1).indices
    _, routes = route(ids)
    x = torch.randn(tokens, hidden, device=DEV, generator=g).bfloat16()
    y = torch.randn(tokens * k, hidden, device=DEV, generator=g).bfloat16()
    w = torch.rand(tokens, k, device=DEV, generator=g).softmax(-1).bfloat16()
    dout = torch.randn(tokens, hidden, device=DEV, generator=g).bfloat16()
    dy = torch.randn(tokens * k, hidden, device=DEV, generator=g).bfloat16()

    def step(x, y, w):
        return combine_routes(y, w, routes), gather_tokens(x, routes)

    torch._dynamo.reset()
    out = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        xx, yy, ww = (t.clone().requires_grad_() for t in (x, y, w))
        combined, gathered = fn(xx, yy, ww)
        torch.autograd.backward((combined, gathered), (dout, dy))
        out.append((combined, gathered, yy.grad, xx.grad, ww.grad))
    for a, b in zip(out[0][:4], out[1][:4], strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(out[1][4], out[0][4], rtol=2**-7, atol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", [None, qr.Float8BlockScaling(), qr.MXFP8BlockScaling(),
                                    qr.NVFP4BlockScaling(disable_stochastic_rounding=True)],
                         ids=["high_precision", "fp8_block", "mxfp8", "nvfp4"])
def test_every_grouped_route_reads_routed_tokens_where_they_lie(recipe, compiled):
    """A routing's tokens given to a projection with its routes (the kernels read each row
    through the index, backward keeps the tokens): output and gradients equal, bitwise, those
    of the projection given the gathered copy (NVFP4 without stochastic rounding, whose two
    runs would draw different numbers)."""
    from moe_routing import in_place_and_on_a_copy
    from quant_recipes.moe.linear import GroupedProjection
    from quant_recipes.moe.routes import route

    experts, k_in, n, tokens, top_k = 16, 512, 256, 700, 4
    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.rand(tokens, experts - 1, device=DEV, generator=g).topk(top_k, dim=-1).indices
    sorted_ids, routes = route(ids)
    offs = torch.searchsorted(sorted_ids, torch.arange(experts, device=DEV), right=True)
    proj = GroupedProjection(experts, k_in, n)
    w = torch.randn(experts, n, k_in, device=DEV, generator=g).bfloat16().requires_grad_()
    x = torch.randn(tokens, k_in, device=DEV, generator=g).bfloat16()
    gy = torch.randn(tokens * top_k, n, device=DEV, generator=g).bfloat16()

    results = []
    for fn in in_place_and_on_a_copy(proj, offs, routes, recipe):
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True) if compiled else fn
        xi = x.clone().requires_grad_()
        w.grad = None
        y = fn(xi, w)
        y.backward(gy)
        results.append((y, xi.grad, w.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
