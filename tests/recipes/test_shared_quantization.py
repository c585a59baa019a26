"""One quantization per (tensor, quantizer value), and what a compiled block keeps for backward.

Layers that read one activation under equal quantizers (q, k and v; gate and up) share its
quantization: eagerly inside ``shared_activations()`` (by default each layer quantizes its own
input, so a write the version counter misses is seen), compiled through the graph's
common-subexpression elimination over the quantization's traced ops ("ops" lowering; the CPU is
added to ``OPS_DEVICES`` here). A compiled block then keeps for backward one FP8 copy of the shared
input and, with ``save_weight_copy=False``, no copy of a weight; its results equal eager mode's
bit for bit.
"""

from __future__ import annotations

import importlib.util

import pytest
import quant_recipes as qr
import torch
from _counting import count_quantizations
from _inductor_saved import compiled_recording_saved
from quant_core import Float8CurrentScalingQuantizer
from quant_recipes import reuse

RECIPE = qr.Float8CurrentScaling()


class Block(torch.nn.Module):
    """Three projections of one input (as q, k, v), then a gated pair (as gate, up) and down."""

    def __init__(self, save_weight_copy: bool = True, save_input_copy: bool = True):
        super().__init__()
        kw = {"bias": False, "dtype": torch.bfloat16, "save_weight_copy": save_weight_copy,
              "save_input_copy": save_input_copy}
        self.q, self.k, self.v = (qr.Linear(64, n, **kw) for n in (64, 32, 32))
        self.gate, self.up = qr.Linear(128, 96, **kw), qr.Linear(128, 96, **kw)
        self.down = qr.Linear(96, 48, **kw)

    def forward(self, x):
        h = torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)
        return self.down(self.gate(h) * self.up(h))  # one rounding, compiled or not


def _run(fn, block, x):
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with qr.autocast(recipe=RECIPE):
        y = fn(x)
    y.float().pow(2).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in block.parameters()]


def _x():
    torch.manual_seed(1)
    return torch.randn(40, 64, dtype=torch.bfloat16)


@pytest.fixture
def quantized_shapes(monkeypatch):
    """The shapes current scaling quantizes, in order."""
    calls = count_quantizations(monkeypatch, Float8CurrentScalingQuantizer)
    reuse.forget()
    return calls


def test_eager_readers_of_one_tensor_share_its_quantization(quantized_shapes):
    torch.manual_seed(0)
    block = Block()
    with qr.shared_activations(), qr.autocast(recipe=RECIPE):
        block(_x())
    # x once for q, k, v; h once for gate and up; the product once; six weights
    assert sorted(quantized_shapes) == sorted([(40, 64), (40, 128), (40, 96)] + [
        tuple(p.shape) for p in block.parameters()])


def test_by_default_each_reader_quantizes_its_input(quantized_shapes):
    torch.manual_seed(0)
    block = Block()
    with qr.autocast(recipe=RECIPE):
        block(_x())
    assert sorted(quantized_shapes) == sorted([(40, 64)] * 3 + [(40, 128)] * 2 + [(40, 96)] + [
        tuple(p.shape) for p in block.parameters()])


def test_by_default_a_write_past_the_version_counter_is_seen():
    """``.data`` and NumPy writes leave the version as it was."""
    torch.manual_seed(0)
    a, b = qr.Linear(64, 32, bias=False), qr.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    writes = [lambda t: t.data.mul_(3)]
    if importlib.util.find_spec("numpy") is not None:  # the compat sessions' torch has none
        writes.append(lambda t: t.numpy().__imul__(3))
    for write in writes:
        with qr.autocast(recipe=RECIPE):
            a(x)
            version = x._version
            write(x)
            assert x._version == version
            assert torch.equal(b(x), b(x.clone()))


def test_an_in_place_change_is_quantized_again(quantized_shapes):
    torch.manual_seed(0)
    a, b = qr.Linear(64, 32, bias=False), qr.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    with qr.shared_activations(), qr.autocast(recipe=RECIPE):
        a(x)
        x.mul_(2)  # the same object at a new version: the remembered quantization is stale
        b(x)
    assert quantized_shapes.count((8, 64)) == 2


def test_an_inference_tensor_is_never_shared(quantized_shapes):
    """It has no version counter to tell an in-place change by."""
    torch.manual_seed(0)
    a, b = qr.Linear(64, 32, bias=False), qr.Linear(64, 32, bias=False)
    with qr.shared_activations(), torch.inference_mode(), qr.autocast(recipe=RECIPE):
        x = torch.randn(8, 64)
        a(x)
        x.mul_(2)
        got = b(x)
        assert torch.equal(got, b(x.clone()))
    assert quantized_shapes.count((8, 64)) == 3


def test_a_dead_tensor_releases_its_quantization():
    layer = qr.Linear(64, 32, bias=False)
    with qr.shared_activations(), qr.autocast(recipe=RECIPE):
        layer(torch.randn(8, 64))  # the input dies with this statement
        assert getattr(reuse._last, "entry", None) is None


def test_leaving_the_context_forgets_the_last_quantization(quantized_shapes):
    layer = qr.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    with qr.shared_activations():
        with qr.shared_activations(), qr.autocast(recipe=RECIPE):
            layer(x)
        assert reuse._last.entry is not None  # the outer context still shares
    assert reuse._last.entry is None
    with qr.autocast(recipe=RECIPE):
        layer(x)
    assert quantized_shapes.count((8, 64)) == 2


def test_sharing_changes_no_bit():
    torch.manual_seed(0)
    block = Block()

    def shared(x):
        with qr.shared_activations():
            return block(x)

    def unshared(x):  # each reader gets its own copy of the input: nothing to share
        h = torch.cat([block.q(x.clone()), block.k(x.clone()), block.v(x.clone())], dim=-1)
        return block.down(block.gate(h.clone()) * block.up(h))

    for a, b in zip(_run(shared, block, _x()), _run(unshared, block, _x()), strict=True):
        assert torch.equal(a, b)


dynamo = pytest.importorskip("quant_dynamo", reason="compile tests need quant-dynamo")
compiled_tests = pytest.mark.skipif(
    not (dynamo.compile_supported() and dynamo.capture.supported() and dynamo.DERIVES_IN_GRAPH),
    reason=f"torch {torch.__version__}: no opaque-object API, register_torch_dispatch or "
           "quantizer derivation in graphs")


@pytest.fixture
def ops_on_cpu(cpu_ops_device):
    """The CPU among the devices whose quantizers are lowered to reference ops."""


def _saved_by_inductor(block, x):
    """The (shape, dtype) of every tensor the Inductor-compiled block's backward graph takes
    besides gradients (what its partitioner, which merges equal expressions first, chose to
    keep), and the block's results."""
    with compiled_recording_saved(block) as (fn, saved):
        got = _run(fn, block, x)
    return [(tuple(shape), dtype) for _, shape, dtype in saved], got


@compiled_tests
@pytest.mark.parametrize("save_weight_copy", [True, False])
def test_a_compiled_block_keeps_one_copy_of_a_shared_input(ops_on_cpu, save_weight_copy):
    torch.manual_seed(0)
    block = Block(save_weight_copy)
    x = _x()
    saved, got = _saved_by_inductor(block, x)
    want = _run(block, block, x)
    # x.grad sums three bf16 input gradients, which Inductor adds in fp32 and rounds once
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert i == 1 or torch.equal(a, b), i
    fp8 = [s for s, dtype in saved if dtype == torch.uint8 and len(s) == 2 and 0 not in s]
    # the input of q/k/v, once (transposed), and the input of gate/up once: never one per reader
    assert fp8.count((64, 40)) == 1 and fp8.count((128, 40)) == 1, saved
    weights = [tuple(p.shape[::-1]) for p in block.parameters()]
    kept = [s for s in fp8 if s in weights]
    if save_weight_copy:
        assert kept, saved
    else:  # backward quantizes the weights again: no copy of theirs is held from forward
        assert kept == [], saved



class NormedBlock(Block):
    """Block behind an RMS norm, as a decoder layer's projections are."""

    def forward(self, x):
        f = x.float()  # one rounding, compiled or not
        n = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return super().forward(n)


@compiled_tests
def test_a_compiled_block_that_requantizes_its_inputs_recomputes_the_normed_input(ops_on_cpu):
    """``save_input_copy=False``: backward quantizes the input again, so the partitioner may
    recompute a norm's output from what the norm's backward keeps anyway (its input and the
    reciprocal root) instead of holding an FP8 copy of it; the results stay eager mode's. (It
    still keeps the FP8 copy of a GEMM's output, gate/up's input: one byte an element instead
    of the two of the bf16 tensor.)"""
    torch.manual_seed(0)
    kept = []
    for save_input_copy in (True, False):
        block = NormedBlock(save_weight_copy=False, save_input_copy=save_input_copy)
        x = _x()
        saved, got = _saved_by_inductor(block, x)
        want = _run(block, block, x)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert i == 1 or torch.equal(a, b), i
        kept.append([s for s, dtype in saved if dtype == torch.uint8 and 0 not in s])
    assert (64, 40) in kept[0] and (64, 40) not in kept[1], kept
