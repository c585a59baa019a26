"""Amax reduction through autocast(amax_reduction_group=...) across 2 ranks: gloo on the CPU, or
``QUANT_DIST_BACKEND=nccl`` on one GPU per rank (bench/device.sh fsdp2)."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
import torch.distributed as dist
from _dist_helpers import init, spawn


def _worker(rank: int, port: int, out) -> None:
    device = init(rank, port)
    try:
        from quant_core import Float8CurrentScalingQuantizer

        x = torch.full((4, 32), float(rank + 1), device=device)  # local amax 1 or 2, global 2
        q = Float8CurrentScalingQuantizer(with_amax_reduction=True)
        storage = q.quantize(x, amax_reduction_group=dist.group.WORLD)
        from quant_core.distributed import reduce_amax

        # eager: the collective waited for, a plain tensor kernels can read (an unwaited
        # AsyncCollectiveTensor has data_ptr 0: an illegal address for a Triton kernel)
        reduced = reduce_amax(torch.tensor([float(rank + 1)], device=device), dist.group.WORLD)
        assert type(reduced) is torch.Tensor and reduced.data_ptr() != 0, type(reduced)
        m = qr.Linear(32, 32, bias=False, device=device)
        with torch.no_grad():
            m.weight.fill_(0.5 * (rank + 1))
        with torch.no_grad(), qr.autocast(recipe=qr.Float8CurrentScaling(),
                                          amax_reduction_group=dist.group.WORLD):
            y = m(x)
        out[rank] = (storage._scale_inv.item(), y[0, 0].item())
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_amax_reduction_two_ranks():
    out = spawn(_worker)
    # scale from the global amax 2 (rank 0 alone would give 448 / 1)
    expected = (1.0 / (torch.tensor(448.0) / torch.tensor(2.0))).item()
    for rank in range(2):
        assert out[rank][0] == expected
    # both ranks quantized with the global scales: rank 0's x (1.0) and w (0.5) stay exact
    assert out[0][1] == pytest.approx(32 * 1.0 * 0.5)


def _delayed_worker(rank: int, port: int, out) -> None:
    device = init(rank, port)
    try:
        m = qr.Linear(32, 32, bias=False, device=device)
        with torch.no_grad():
            m.weight.fill_(0.25 * (rank + 1))  # weight amax 0.25 or 0.5
        x = torch.full((4, 32), float(rank + 1), requires_grad=True,
                       device=device)  # input amax 1 or 2
        with qr.autocast(recipe=qr.DelayedScaling()):
            m(x)
        # the region's exit ran the forward update with amaxes reduced over the default group
        (state,) = m.delayed_states(m._qset)[0]
        out[rank] = state.scale[:2].tolist()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_delayed_scaling_reduces_amaxes_over_the_default_group():
    """reduce_amax=True (the default) with no group: the history rows are reduced (MAX) over
    the default group before the update, so every rank gets the same scales."""
    out = spawn(_delayed_worker)
    want = [448.0 / 2.0, 448.0 / 0.5]  # the global amaxes of the input and the weight
    assert out[0] == want and out[1] == want


def _compiled_worker(rank: int, port: int, out) -> None:
    device = init(rank, port)
    try:
        results = {}
        for name, recipe in (("current", qr.Float8CurrentScaling()),
                             ("nvfp4", qr.NVFP4BlockScaling(disable_stochastic_rounding=True))):
            torch.manual_seed(0)
            m = qr.Linear(64, 32, bias=False, dtype=torch.bfloat16, device=device)
            x = (torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
                 * (rank + 1)).to(device, torch.bfloat16)

            def fn(t, m=m, recipe=recipe):
                with qr.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                    return m(t)

            torch._dynamo.reset()
            compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
            got = []
            for f in (fn, compiled):
                t = x.clone().requires_grad_()
                m.zero_grad(set_to_none=True)
                y = f(t)
                y.float().pow(2).sum().backward()
                got.append((y.detach(), t.grad, m.weight.grad))
            results[name] = all(torch.equal(a, b) for a, b in zip(*got, strict=True))
        out[rank] = results
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_amax_reduction_under_torch_compile():
    """``autocast(amax_reduction_group=g)`` compiles (fullgraph): the amax
    leaves the quantize op, a functional all-reduce combines it, and the compiled step equals
    the eager one on every rank."""
    dynamo = pytest.importorskip("quant_dynamo")
    if not dynamo.compile_supported():
        pytest.skip("no opaque-object API on this torch")
    out = spawn(_compiled_worker)
    for rank in range(2):
        assert out[rank] == {"current": True, "nvfp4": True}
