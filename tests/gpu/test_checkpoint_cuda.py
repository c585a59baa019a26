"""Activation checkpointing and ``torch.autocast`` on CUDA, where backward runs on autograd's
device thread (behaviour.md §7): a checkpoint around a module compiled on its own recomputes
under the forward's frame (``in_forward_frame``, and Hugging Face's gradient checkpointing of a
converted model, whichever way the installed transformers checkpoints its layers); an fp32
layer under ``torch.autocast`` gives autocast's dtype, compiled equal to eager."""

from __future__ import annotations

import copy
import functools

import pytest
import quant_recipes as qr
import torch
from torch.utils.checkpoint import checkpoint

DEV = "cuda"
RECIPES = {"fp8_current": qr.Float8CurrentScaling(), "mxfp8": qr.MXFP8BlockScaling()}


def _compiled_layer_grads(recipe, checkpoint_fn, backend: str):
    torch.manual_seed(0)
    layer = qr.Linear(256, 128, dtype=torch.bfloat16, device=DEV)
    x = torch.randn(64, 256, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend)
    with qr.autocast(recipe=recipe):
        y = compiled(x) if checkpoint_fn is None else checkpoint_fn(compiled, x)
    y.float().pow(2).sum().backward()
    return y, x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", list(RECIPES))
def test_in_forward_frame_recomputes_a_compiled_layer_quantized_on_cuda(name, reentrant):
    want = _compiled_layer_grads(RECIPES[name], None, "inductor")
    run = qr.in_forward_frame(functools.partial(checkpoint, use_reentrant=reentrant))
    got = _compiled_layer_grads(RECIPES[name], run, "inductor")
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_hf_gradient_checkpointing_of_compiled_layers_on_cuda():
    """A converted Llama with transformers' gradient checkpointing and every decoder layer
    compiled (``layer.compile()``): the loss and gradients of the run without checkpointing."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(DEV, torch.bfloat16)
    ids = torch.randint(0, 256, (2, 64), device=DEV)
    recipe = RECIPES["mxfp8"]
    runs = []
    for checkpointed in (False, True):
        torch._dynamo.reset()
        model = qr.convert(copy.deepcopy(base), recipe=recipe)
        model.train()
        if checkpointed:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            layer.compile()
        with qr.autocast(recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_a_delayed_recompute_on_cuda_keeps_the_plain_runs_scales():
    recipe = qr.DelayedScaling(amax_history_len=3)
    results = []
    for wrap in (None, functools.partial(checkpoint, use_reentrant=False)):
        torch.manual_seed(0)
        layer = qr.Linear(64, 32, device=DEV)
        for spread in (4.0, 1.0, 8.0):
            x = (torch.randn(16, 64, device=DEV) * spread).requires_grad_()
            with qr.autocast(recipe=recipe):
                y = layer(x) if wrap is None else wrap(layer, x)
            y.pow(2).sum().backward()
        fwd, bwd = layer._qset.fwd_state, layer._qset.bwd_state
        results.append([layer.weight.grad, fwd.scale, fwd.amax_history, bwd.scale])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(RECIPES))
def test_an_fp32_linear_under_torch_autocast_on_cuda(name):
    """autocast's dtype out; compiled equal to eager; within one bf16 rounding of the fp32
    layer's output (cuBLAS may pick another kernel for a bf16 output than for fp32)."""
    recipe = RECIPES[name]
    torch.manual_seed(0)
    lin = qr.Linear(256, 128, device=DEV)
    x = torch.randn(64, 256, device=DEV)
    outs = []
    for amp, compiled in ((False, False), (True, False), (True, True)):
        fn = torch.compile(copy.deepcopy(lin), fullgraph=True) if compiled else lin
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=amp), qr.autocast(recipe=recipe):
            outs.append(fn(x))
    y32, y, yc = outs
    assert y.dtype == yc.dtype == torch.bfloat16
    assert torch.equal(y, yc)
    torch.testing.assert_close(y.float(), y32.bfloat16().float(), rtol=2 ** -7, atol=0)
