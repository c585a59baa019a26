"""quant's Linear under FSDP2 (``fully_shard``) on 2 gloo ranks: it trains, and quantizing the
weight again in backward (``save_weight_copy=False``, the FSDP2-friendly mode: the gathered
weight is freed after forward) gives the same sharded gradients as keeping the copy."""

from __future__ import annotations

import os
import socket

import pytest
import quant_recipes as qr
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _worker(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        grads = {}
        for save in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*(qr.Linear(64, 64, bias=False, save_weight_copy=save)
                                          for _ in range(2)))
            for layer in model:
                _fully_shard()(layer)
            _fully_shard()(model)
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
            with qr.autocast(recipe=qr.Float8CurrentScaling()):
                model(x).pow(2).sum().backward()
            grads[save] = [p.grad.to_local().clone() for p in model.parameters()]
        out[rank] = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False],
                                                          strict=True))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_fsdp2_requantized_weight_gives_the_same_gradients():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    try:
        _fully_shard()
    except ImportError:
        pytest.skip("this torch has no FSDP2")
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
    assert out[0] and out[1]
