"""PEFT's LoRA on quantized layers under FSDP2 with the quantized weight all-gather, on 2 ranks
(gloo): the frozen base layers take the frozen-layer path (their columnwise copies gathered for
dgrad, no weight gradient), and every rank's adapter gradients equal the single-process run's
mean over the two ranks' batches, bit for bit."""

from __future__ import annotations

import os
import sys

import pytest
import quant_recipes as qr
import torch
import torch.distributed as dist

peft = pytest.importorskip("peft")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes"))
from _dist_helpers import init, spawn  # noqa: E402

RECIPE = qr.MXFP8BlockScaling


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 64))
    qr.convert(model, filter=lambda fqn, m: True)
    torch.manual_seed(1)  # LoRA's B starts at zero: give it values so every gradient flows
    model = peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, target_modules=["0", "2", "4"], init_lora_weights=False), model)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


def _step(model, x):
    with qr.autocast(recipe=RECIPE()):
        model(x).float().pow(2).mean().backward()


def _adapters(model):
    return [(n, p) for n, p in model.named_parameters() if "lora_" in n]


def _worker(rank: int, port: int, out) -> None:
    device = init(rank, port)
    try:
        from torch.distributed.fsdp import fully_shard

        xs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        ref = _model()
        grads = []
        for x in xs:
            ref.zero_grad(set_to_none=True)
            _step(ref, x)
            grads.append({n: p.grad.clone() for n, p in _adapters(ref)})
        mean = {n: (grads[0][n] + grads[1][n]) / 2 for n in grads[0]}
        model = _model().to(device)
        qr.enable_fsdp_quantized_all_gather(model, RECIPE())
        for i in (0, 2, 4):
            fully_shard(model[i])
        fully_shard(model)
        _step(model, xs[rank].to(device))
        base_frozen = all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
        exact = all(torch.equal(p.grad.to_local(), mean[n].chunk(2)[rank])
                    for n, p in _adapters(model))
        out[rank] = base_frozen and exact
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_lora_adapters_train_on_frozen_quantized_layers_under_fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no FSDP2")
    out = spawn(_worker)
    assert out[0] and out[1], out
