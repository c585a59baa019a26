"""Two-rank process groups for the distributed tests: gloo on the CPU by default,
``QUANT_DIST_BACKEND=nccl`` for one GPU per rank (bench/device.sh fsdp2 runs them on two H200s)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKEND = os.environ.get("QUANT_DIST_BACKEND", "gloo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, port: int, world: int = 2) -> torch.device:
    """Join the test's process group; returns the rank's device (on NCCL its GPU, with the
    Triton backend registered: source trees lack quant-kernels' entry point)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(BACKEND, rank=rank, world_size=world)
    if BACKEND != "nccl":
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    try:
        from quant_core import backends
        from quant_kernels.backend import BACKEND as TRITON

        backends.register(TRITON)
    except ImportError:
        pass
    return torch.device(f"cuda:{rank}")


def spawn(worker, *args, world: int = 2) -> dict:
    """Run ``worker(rank, port, *args, out)`` on ``world`` ranks; returns ``out`` (rank ->
    result). Skips where torch.distributed, or the GPUs NCCL needs, are missing."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if BACKEND == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"QUANT_DIST_BACKEND=nccl needs {world} GPUs")
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(worker, args=(free_port(), *args, out), nprocs=world, join=True)
    return dict(out)
