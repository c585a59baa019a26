"""A top-k routing's rows (``quant_recipes.moe.routes``): the tokens gathered into expert order
and each token's k rows weighted and summed back. Values against per-token loops, gradients
against autograd of the index forms they replace, and the compiled forms (no scatter in
backward, eager's bits under Inductor)."""

from __future__ import annotations

import pytest
import torch
from quant_recipes.moe.routes import combine_routes, gather_tokens, route


def _ids(tokens: int, k: int, experts: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if not tokens:
        return torch.zeros(0, k, dtype=torch.int64)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])


def _case(tokens=24, k=4, hidden=40, dtype=torch.bfloat16, seed=0):
    ids = _ids(tokens, k, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    y = torch.randn(tokens * k, hidden, generator=g)
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    return y.to(dtype), weights.to(dtype), route(ids)[1], ids


def test_route_sorts_the_pairs_by_expert_stably():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    sorted_ids, routes = route(ids)
    assert sorted_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert routes.perm.tolist() == [1, 2, 3, 5, 0, 4]  # pair t * k + j, token order per expert
    assert routes.rows.tolist() == [0, 1, 1, 2, 0, 2]
    assert routes.copies.tolist() == [[4, 0], [1, 2], [5, 3]]


def _row_of(ids) -> dict[int, int]:
    """Each (token, route) pair ``t * k + j``'s row, in plain Python: the pairs sorted by
    expert, then by pair."""
    pairs = sorted(range(ids.numel()), key=lambda p: (int(ids.reshape(-1)[p]), p))
    return {pair: r for r, pair in enumerate(pairs)}


def _combine_loop(y, weights, ids):
    """Per token and route, in plain Python: the row of (t, j) from :func:`_row_of`; fp32
    products, fp32 sum in route order, one rounding."""
    tokens, k = weights.shape
    row_of = _row_of(ids)
    out = torch.empty(tokens, y.shape[1], dtype=y.dtype)
    for t in range(tokens):
        acc = torch.zeros(y.shape[1], dtype=torch.float32)
        for j in range(k):
            acc = acc + y[row_of[t * k + j]].float() * weights[t, j].float()
        out[t] = acc.to(y.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,k", [(24, 4), (7, 1), (5, 8), (0, 2)])
def test_each_token_sums_its_weighted_routes_in_route_order(tokens, k, dtype):
    y, weights, routes, ids = _case(tokens, k, dtype=dtype)
    got = combine_routes(y, weights, routes)
    assert got.dtype == dtype and got.shape == (tokens, y.shape[1])
    if dtype == torch.float32:  # products rounded, maybe fused with the add
        torch.testing.assert_close(got, _combine_loop(y, weights, ids), rtol=1e-6, atol=1e-7)
    else:  # exact products: one order of additions, one result
        assert torch.equal(got, _combine_loop(y, weights, ids))


def _gather_and_sum(y, weights, routes):
    """The combine through an autograd-visible index (autograd scatters its gradient)."""
    rows = y[routes.copies]
    acc = rows[:, 0].float() * weights[:, 0, None].float()
    for j in range(1, weights.shape[1]):
        acc = acc + rows[:, j].float() * weights[:, j, None].float()
    return acc.to(y.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_gradients_equal_autograd_of_the_index(dtype):
    y, weights, routes, _ = _case(dtype=dtype)
    dout = torch.randn(weights.shape[0], y.shape[1], generator=torch.Generator().manual_seed(9))
    grads = []
    for fn in (combine_routes, _gather_and_sum):
        yy, ww = y.clone().requires_grad_(), weights.clone().requires_grad_()
        fn(yy, ww, routes).backward(dout.to(dtype))
        grads.append((yy.grad, ww.grad))
    (dy, dw), (dy_ref, dw_ref) = grads
    assert torch.equal(dy, dy_ref)  # each row receives exactly one term: no sum to reorder
    torch.testing.assert_close(dw, dw_ref, rtol=1e-6, atol=0)  # a sum over the width


def test_only_the_inputs_that_need_it_get_a_gradient():
    y, weights, routes, _ = _case()
    yy = y.clone().requires_grad_()
    combine_routes(yy, weights, routes).sum().backward()
    assert yy.grad is not None and weights.grad is None
    ww = weights.clone().requires_grad_()
    combine_routes(y, ww, routes).sum().backward()
    assert ww.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,k", [(24, 4), (7, 1), (0, 2)])
def test_a_gathered_token_gets_the_sum_of_its_rows_gradients(tokens, k, dtype):
    """``gather_tokens`` is ``x[rows]``; each token's gradient adds its k rows' gradients in
    fp32 in route order and rounds once (autograd's scatter of the index, by contrast, adds
    them one rounding at a time in the input's dtype)."""
    _, _, routes, ids = _case(tokens, k)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, 16, generator=g).to(dtype).requires_grad_()
    got = gather_tokens(x, routes)
    assert torch.equal(got, x[routes.rows])
    d = torch.randn(tokens * k, 16, generator=g).to(dtype)
    got.backward(d)
    row_of = _row_of(ids)
    want = torch.zeros(tokens, 16, dtype=torch.float32)
    for t in range(tokens):
        for j in range(k):
            want[t] += d[row_of[t * k + j]].float()
    assert torch.equal(x.grad, want.to(dtype))


def _graphs(fn, *args):
    """The forward and backward ATen graphs AOTAutograd makes of ``fn``."""
    from functorch.compile import aot_function, make_boxed_func

    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    compiled = aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    compiled(*args).sum().backward()
    return graphs


def _scatters(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and ("index_put" in str(n.target) or "scatter" in str(n.target))}


def test_backward_gathers_instead_of_scattering():
    """The gradients of the routed rows and of the gathered tokens are gathers; autograd of the
    index forms scatters into zeros (an atomic add per element on a GPU)."""
    y, weights, routes, _ = _case()
    x = torch.randn(weights.shape[0], 8).bfloat16().requires_grad_()
    y, weights = y.requires_grad_(), weights.requires_grad_()
    assert _scatters(_graphs(_gather_and_sum, y, weights, routes)["backward"])  # replaced form
    assert _scatters(_graphs(lambda x, rows: x[rows], x, routes.rows)["backward"])
    assert not _scatters(_graphs(combine_routes, y, weights, routes)["backward"])
    assert not _scatters(_graphs(gather_tokens, x, routes)["backward"])


@pytest.mark.parametrize("dynamic", [False, True])
def test_inductor_gives_eager_bits(dynamic):
    """Compiled by Inductor (the CPU's C++ code here): the same fp32 products and the same
    order of additions, so the same combined output, routed rows' gradient and tokens'
    gradient as eager."""
    def step(x, y, weights, routes):
        return combine_routes(y, weights, routes), gather_tokens(x, routes)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="inductor", dynamic=dynamic, fullgraph=True)
    for tokens in (24, 9):
        y, weights, routes, _ = _case(tokens, 4, seed=tokens)
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, 40, generator=g).bfloat16()
        grads = (torch.randn(tokens, 40, generator=g).bfloat16(),
                 torch.randn(tokens * 4, 40, generator=g).bfloat16())
        out = {}
        for what, fn in (("eager", step), ("compiled", compiled)):
            xx, yy, ww = (t.clone().requires_grad_() for t in (x, y, weights))
            results = fn(xx, yy, ww, routes)
            torch.autograd.backward(results, grads)
            out[what] = (*results, yy.grad, xx.grad)
        for a, b in zip(out["eager"], out["compiled"], strict=True):
            assert torch.equal(a, b)


def test_fp64_operands_keep_their_precision_and_pass_gradcheck():
    """fp64 rows are summed in fp64 (not rounded through fp32); the gradients, and the
    gradients of the gradients, are those of the sums (finite differences)."""
    y, weights, routes, ids = _case(7, 3, hidden=5, dtype=torch.float64)
    x = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = combine_routes(y, weights, routes)
    row_of = _row_of(ids)
    want = torch.stack([sum(y[row_of[t * 3 + j]] * weights[t, j] for j in range(3))
                        for t in range(7)])
    torch.testing.assert_close(got, want, rtol=1e-15, atol=1e-15)
    args = (y.requires_grad_(), weights.requires_grad_())
    assert torch.autograd.gradcheck(lambda y, w: combine_routes(y, w, routes), args)
    assert torch.autograd.gradgradcheck(lambda y, w: combine_routes(y, w, routes), args)
    xx = x.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: gather_tokens(x, routes), (xx,))
    assert torch.autograd.gradgradcheck(lambda x: gather_tokens(x, routes), (xx,))


def test_the_documented_top_k_block_equals_a_loop_over_tokens_and_experts():
    """behaviour.md's top-k recipe for a hand-written MoE block (route, gather_tokens,
    GroupedLinear, combine_routes), in fp32 high precision: each token's output is the
    router-weighted sum of its chosen experts' MLPs, computed token by token; so are the
    gradients of the tokens, the weights and the routing weights."""
    import quant_recipes as qr

    experts, d, h, tokens, k = 5, 16, 24, 13, 2
    torch.manual_seed(0)
    up, down = qr.GroupedLinear(experts, d, h), qr.GroupedLinear(experts, h, d)
    x = torch.randn(tokens, d, requires_grad=True)
    top_k_index = _ids(tokens, k, experts=experts)
    top_k_weights = torch.rand(tokens, k).softmax(-1).requires_grad_()
    act = torch.nn.functional.silu

    sorted_ids, routes = route(top_k_index)
    counts = torch.bincount(sorted_ids, minlength=experts)
    y = down(act(up(gather_tokens(x, routes), counts=counts)), counts=counts)
    out = combine_routes(y, top_k_weights.to(y.dtype), routes)
    got = (out, *torch.autograd.grad(out.sum(), (x, up.weight, down.weight, top_k_weights)))

    want_out = torch.stack([
        sum(top_k_weights[t, j] * torch.nn.functional.linear(
            act(torch.nn.functional.linear(x[t], up.weight[e])), down.weight[e])
            for j, e in enumerate(top_k_index[t].tolist()))
        for t in range(tokens)])
    want = (want_out, *torch.autograd.grad(want_out.sum(),
                                           (x, up.weight, down.weight, top_k_weights)))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
