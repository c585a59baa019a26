"""CUDA graphs: quantize and the quantized Linear under manual ``torch.cuda.graph``
capture and under ``torch.compile(mode="reduce-overhead")``, bitwise equal to uncaptured runs
across replays with new inputs; stochastic-rounding seeds advance per replay. CUDA only."""

from __future__ import annotations

import formats
import pytest
import quant_recipes as qr
import torch
from quant_core import backends

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")

if torch.cuda.is_available() and "triton" not in backends.available():
    from quant_kernels.backend import BACKEND  # source trees: no entry point registered it

    backends.register(BACKEND)

#: One quantizer per format (tests/formats.py), NVFP4 with the RHT; the built-in recipes.
QUANTIZERS = {name: make() for name, make in formats.default_quantizers().items()
              if name != "nvfp4"}
QUANTIZERS["nvfp4_rht"] = formats.quantizer("nvfp4_rht")
RECIPES = formats.default_recipes()


def _buffers(storage) -> list[torch.Tensor]:
    return [t for t in storage.buffers().values() if t is not None]


def _inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(256, 512, device="cuda", generator=g, dtype=torch.bfloat16) * (i + 1)
            for i in range(n)]


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_quantize_under_manual_capture(name):
    q = QUANTIZERS[name]
    static_x = torch.zeros(256, 512, device="cuda", dtype=torch.bfloat16)
    q.quantize(static_x)  # warm-up: compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _buffers(q.quantize(static_x))
    for x in _inputs(3, seed=1):
        static_x.copy_(x)
        graph.replay()
        want = _buffers(q.quantize(x))
        for a, b in zip(captured, want, strict=True):
            assert torch.equal(a, b)


def test_stochastic_rounding_seeds_advance_per_replay():
    """The seed is drawn on the device inside the graph (philox offsets advance per replay): two
    replays on one input differ, and each equals the reference for the seed it drew."""
    from quant_core import reference as ref
    from quant_kernels.backend import BACKEND as B

    x = _inputs(1, seed=2)[0]
    amax = torch.tensor([x.abs().max().float().item()], device="cuda")
    kw = dict(rowwise=True, columnwise=False, with_rht=False, rht_sign_mask=0,
              with_2d_quantization=False, stochastic_rounding=True, swizzle=False)

    def run():
        seed = torch.randint(0, 2**31 - 1, (1,), device="cuda", dtype=torch.int64)
        return seed, B.nvfp4_quantize(x, amax, None, rng_seed=seed, **kw)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seed, out = run()
    seen = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        want = ref.nvfp4_quantize(x.cpu(), amax.cpu(), None, rng_seed=seed.cpu(), **kw)
        assert torch.equal(out[0].cpu(), want[0]) and torch.equal(out[1].cpu(), want[1])
        seen.append((seed.item(), out[0].clone()))
    assert seen[0][0] != seen[1][0] and not torch.equal(seen[0][1], seen[1][1])


def _linear(recipe_name: str):
    """``(layer, forward under autocast, the recipe)``: a bf16 Linear 512 -> 256 on CUDA."""
    torch.manual_seed(0)
    lin = qr.Linear(512, 256, dtype=torch.bfloat16, device="cuda")
    # NVFP4's gradients round stochastically: a replay draws new seeds (the point of the seed
    # test above), so here the comparison with an uncaptured run uses round-to-nearest
    kw = {"disable_stochastic_rounding": True} if recipe_name == "nvfp4" else {}
    recipe = RECIPES[recipe_name](**kw)

    def fwd(x):
        with qr.autocast(recipe=recipe):
            return lin(x)

    return lin, fwd, recipe


def _step(lin, fwd, x, g):
    x = x.detach().requires_grad_()
    lin.weight.grad = lin.bias.grad = None
    y = fwd(x)
    y.backward(g)
    return [y.detach().clone(), x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()]


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_under_manual_capture(name):
    lin, fwd, _ = _linear(name)
    static_x = torch.zeros(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_g = torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch's docs require
        for _ in range(2):
            _step(lin, fwd, static_x, static_g)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    lin.weight.grad = lin.bias.grad = None
    static_x.grad = None
    qr.reset_gemm_paths()
    with torch.cuda.graph(graph):
        static_y = fwd(static_x)
        static_y.backward(static_g)
    captured_paths = qr.gemm_paths()
    assert sum(captured_paths.values()) == 3  # recorded once per GEMM, at capture
    captured = [static_y, static_x.grad, lin.weight.grad, lin.bias.grad]  # the graph's memory
    xs, gs = _inputs(3, seed=3), [t[:, :256].contiguous() for t in _inputs(3, seed=4)]
    for x, g in zip(xs, gs, strict=True):
        static_x.data.copy_(x)
        static_g.copy_(g)
        graph.replay()
        got = [t.clone() for t in captured]
        want = _step(lin, fwd, x, g)
        for what, a, b in zip(("y", "x.grad", "weight.grad", "bias.grad"), got, want, strict=True):
            assert torch.equal(a, b), f"{what}: max |diff| {(a.float() - b.float()).abs().max()}"
        qr.reset_gemm_paths()
        graph.replay()
        assert qr.gemm_paths() == {}  # a replay runs no Python: nothing is counted


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_compiled_reduce_overhead(name):
    lin, fwd, _ = _linear(name)
    compiled = torch.compile(fwd, mode="reduce-overhead", fullgraph=True)
    xs, gs = _inputs(4, seed=5), [t[:, :256].contiguous() for t in _inputs(4, seed=6)]
    for x, g in zip(xs, gs, strict=True):
        torch.compiler.cudagraph_mark_step_begin()
        got = _step(lin, compiled, x, g)
        want = _step(lin, fwd, x, g)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def _trained(kept: bool, compiled: bool, steps: int = 3):
    """``steps`` SGD steps of an FP8 current-scaling Linear (compiled with
    ``mode="reduce-overhead"`` or eager; its weight kept per optimizer step or quantized in
    forward): each step's output and input gradient, then the final weight."""
    lin, fwd, recipe = _linear("current")
    handle = qr.quantize_weights_per_step(lin, recipe) if kept else None
    run = torch.compile(fwd, mode="reduce-overhead", fullgraph=True) if compiled else fwd
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    out = []
    for x, g in zip(_inputs(steps, seed=7), _inputs(steps, seed=8), strict=True):
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        x = x.detach().requires_grad_()
        y = run(x)
        y.backward(g[:, :256].contiguous())
        out += [y.detach().clone(), x.grad.clone()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    if handle is not None:
        handle.remove()
    return out + [lin.weight.detach().clone()]


def test_kept_weights_replayed_as_cuda_graphs_follow_the_optimizer():
    """Weights quantized once per optimizer step, read by a layer replayed as a CUDA graph: the
    graphs read the refreshed bytes (written into the buffers they recorded), every step
    bitwise equal to eager training that quantizes in forward."""
    want = _trained(kept=False, compiled=False)
    got = _trained(kept=True, compiled=True)
    assert len(got) == len(want) == 7
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"tensor {i}: max |diff| {(a.float() - b.float()).abs().max()}"
