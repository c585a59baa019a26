"""A compiled Linear that keeps no quantized copy (``save_input_copy=False``,
``save_weight_copy=False``) quantizes its operands again in backward, and backward is where that
quantization runs: the partitioner neither moves it into forward to save its bytes, nor saves the
bf16 input it reads when the input's producer (a norm, a SwiGLU product) can be recomputed. The
saved set is then the one the reference ops give, whichever form the quantization is lowered to
(quant_dynamo.capture: opaque ops and recorded kernels, which the partitioner cannot recompute,
and ``QUANT_LOWERING=mixed``); and the bits are eager's.
"""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from _inductor_saved import compiled_recording_saved

quant_dynamo = pytest.importorskip("quant_dynamo", reason="compile tests need quant-dynamo")
if not (quant_dynamo.compile_supported() and quant_dynamo.capture.supported()):
    pytest.skip(f"no opaque-object API or wrap_triton on torch {torch.__version__}",
                allow_module_level=True)

from functorch.compile import make_boxed_func, min_cut_rematerialization_partition  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

HIDDEN, INNER, TOKENS = 64, 96, 32
RECIPE = qr.Float8CurrentScaling()


class Block(torch.nn.Module):
    """A norm feeding two projections whose SwiGLU product feeds a third: the inputs backward
    quantizes again are computed in the graph, and cheap to recompute."""

    def __init__(self, keep: bool | None = False):
        super().__init__()
        torch.manual_seed(0)
        lean = {"dtype": torch.bfloat16, "bias": False, "save_weight_copy": keep,
                "save_input_copy": keep}
        self.norm = torch.nn.Parameter(torch.rand(HIDDEN, dtype=torch.bfloat16) + 0.5)
        self.gate = qr.Linear(HIDDEN, INNER, **lean)
        self.up = qr.Linear(HIDDEN, INNER, **lean)
        self.down = qr.Linear(INNER, HIDDEN, **lean)

    def forward(self, h):
        rstd = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        x = (h.float() * rstd).to(torch.bfloat16) * self.norm
        with qr.autocast(recipe=RECIPE):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _saved_by_inductor(block, h) -> list[tuple[str, torch.Size, torch.dtype]]:
    """What Inductor's compiled forward keeps for backward: its joint-graph passes and
    partitioner decide it."""
    with compiled_recording_saved(block) as (fn, saved):
        fn(h).float().sum().backward()
    return saved


@pytest.mark.skipif(not quant_dynamo.DERIVES_IN_GRAPH,
                    reason="this torch cannot derive the columnwise-only quantizer in a graph: "
                           "compiled layers quantize both usages in forward (torch 2.10)")
@pytest.mark.parametrize("keep", [False, None], ids=["no_copies", "default"])
@pytest.mark.parametrize("lowering", ["0", "mixed", "ops"])
def test_backward_quantizes_from_recomputed_inputs(cpu_ops_device, monkeypatch, lowering, keep):
    """Opaque (``0``; ``mixed``'s columnwise quantizations on the CPU) or traced as ops, the
    saved set holds no FP8 bytes and no bf16 tensor of the projections' inputs: only the block's
    input and weights, the norm's statistics and the projections' outputs. The default flags
    (``None``) do this for FP8 current scaling in a compiled graph."""
    monkeypatch.setenv("QUANT_LOWERING", lowering)
    block = Block(keep)
    h = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved_by_inductor(block, h)
    assert saved
    assert not [s for s in saved if s[2] in (torch.uint8, torch.float8_e4m3fn) and s[1].numel()]
    kept = [s[1].numel() for s in saved if not s[0].startswith("primals") and s[1].numel()]
    assert TOKENS * HIDDEN not in kept, saved  # the norm's output
    # gate's and up's outputs, which the SwiGLU's backward reads; not their product
    assert kept.count(TOKENS * INNER) <= 2, saved


@pytest.mark.parametrize("keep", [False, None], ids=["no_copies", "default"])
@pytest.mark.parametrize("lowering", ["0", "mixed"])
def test_recomputed_in_backward_gives_eager_bits(cpu_ops_device, monkeypatch, lowering, keep):
    """Partitioned as Inductor partitions (the quantization and the norm recomputed in
    backward), run eagerly op by op: the output and every gradient are eager's bits (eagerly
    the default keeps the copies: the same bits)."""
    monkeypatch.setenv("QUANT_LOWERING", lowering)
    block = Block(keep)
    h = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm),
                           bw_compiler=lambda gm, ex: make_boxed_func(gm),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    results = []
    for fn in (block, torch.compile(block, backend=backend, fullgraph=True)):
        t = h.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        y = fn(t)
        (y.float() * torch.linspace(-1, 2, HIDDEN)).sum().backward()
        results.append([y.detach(), t.grad, block.norm.grad,
                        *(m.weight.grad for m in (block.gate, block.up, block.down))])
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)


def test_the_mark_does_not_outlive_the_call():
    """The recompute mark is set on the tracer's current metadata for the call alone."""
    from torch.fx import traceback as fx_traceback
    from torch.utils.checkpoint import CheckpointPolicy

    with fx_traceback.preserve_node_meta():
        meta = fx_traceback.get_current_meta()
        meta["recompute"] = "outer"
        with quant_dynamo.capture.recomputed_in_backward():
            assert meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
        assert meta["recompute"] == "outer"
        del meta["recompute"]
        with quant_dynamo.capture.recomputed_in_backward():
            assert "recompute" in meta
        assert "recompute" not in meta


def test_the_default_keeps_the_copies_eagerly_and_for_other_recipes():
    """``None`` quantizes again in backward only in a compiled graph whose backward takes
    forward's amax: FP8 current scaling without an amax group. Eager code keeps the copies (the
    layer would otherwise hold the bf16 input), and so do FP8 blocks and an amax group (its
    backward would reduce the amax over the ranks again)."""
    from quant_core import Float8BlockQuantizer, Float8CurrentScalingQuantizer
    from quant_recipes.operands import keeps_copy

    current, blocks = Float8CurrentScalingQuantizer(), Float8BlockQuantizer()
    assert keeps_copy(None, current, None)  # eager
    assert not keeps_copy(False, current, None) and keeps_copy(True, current, None)
    seen = {}

    def probe():
        seen["current"] = keeps_copy(None, current, None)
        seen["blocks"] = keeps_copy(None, blocks, None)
        seen["group"] = keeps_copy(None, current, "a group")

    torch._dynamo.reset()
    torch.compile(probe, fullgraph=True)()
    assert seen == {"current": False, "blocks": True, "group": True}
