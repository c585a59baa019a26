"""``cached_weights()`` on 2 ranks, where the weights change without a version bump: FSDP2
refills the unsharded weight in place (version preserved) from the shards the step updated, and
``ZeroRedundancyOptimizer`` broadcasts each rank's updated shard of the parameters into the other
ranks' copies. Each rank's losses equal, bit for bit, those of the run without the cache.

On the CPU, FSDP2's refill lands at a new address after each reshard, which the cache's key
already tells apart; CUDA's caching allocator may hand back the same block, the case
``test_weight_cache.py::test_a_weight_refilled_in_place_after_a_step_quantizes_again`` pins in
one process."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
import torch.distributed as dist
from _dist_helpers import init, spawn

STEPS, MICRO_BATCHES = 3, 2


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(qr.Linear(64, 64, bias=False, device=device) for _ in range(2)))


def _losses(rank, model, opt, sync_grads=lambda: None):
    gen = torch.Generator().manual_seed(rank)
    device = next(model.parameters()).device
    losses = []
    for i in range(STEPS * MICRO_BATCHES):
        x = torch.randn(32, 64, generator=gen).to(device)
        with qr.autocast(recipe=qr.Float8CurrentScaling()):
            loss = model(x).pow(2).mean()
        loss.backward()
        losses.append(loss.detach().cpu())
        if i % MICRO_BATCHES == MICRO_BATCHES - 1:
            sync_grads()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses


def _cached_and_not(rank, train) -> bool:
    want = train()
    with qr.cached_weights():
        got = train()
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _fsdp2_worker(rank: int, port: int, out) -> None:
    from torch.distributed.fsdp import fully_shard

    device = init(rank, port)
    try:
        def train():
            model = _model(device)
            for layer in model:
                fully_shard(layer)
            fully_shard(model)
            return _losses(rank, model, torch.optim.AdamW(model.parameters(), lr=1e-2))

        out[rank] = _cached_and_not(rank, train)
    finally:
        dist.destroy_process_group()


def _zero_worker(rank: int, port: int, out) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    device = init(rank, port)
    try:
        def train():
            model = _model(device)
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                          lr=0.5)

            def sync_grads():
                for p in model.parameters():
                    dist.all_reduce(p.grad)

            return _losses(rank, model, opt, sync_grads)

        out[rank] = _cached_and_not(rank, train)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_fsdp2_refilled_weights_are_quantized_again_after_each_step():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip("this torch has no FSDP2")
    assert spawn(_fsdp2_worker) == {0: True, 1: True}


@pytest.mark.timeout(180)
def test_zero_redundancy_broadcast_weights_are_quantized_again_after_each_step():
    assert spawn(_zero_worker) == {0: True, 1: True}
