"""The quantized all-gather's layout rules, in one process: every rank's shard quantized (with
the amax reduced over the shards) and concatenated along dim 0 is, byte for byte, the full
weight quantized on one device; the columnwise copy built from the rowwise one is the quantizer's
own columnwise copy; formats that do not shard cleanly say why."""

from __future__ import annotations

import formats
import pytest
import quant_recipes as qr
import torch
from quant_core.sharding import ShardPlan
from quant_recipes import fsdp_layout

#: Every format's built-in recipe and MXFP8 with 2D blocks (tests/formats.py), by qualified id.
RECIPES = {name: make() for name, make in formats.recipes(
    "mxfp8_2d", defaults=True, qualified=True).items()}


def weight_quantizer(recipe):
    return qr.Linear(32, 32).weight_quantizer(recipe)


def _assert_same_buffers(expected, got):
    for name, t in expected.buffers().items():
        u = getattr(got, name)
        assert (t is None) == (u is None), name
        if t is not None:
            assert u.shape == t.shape and u.dtype == t.dtype, name
            assert torch.equal(u, t), name


def _assert_columnwise_is(expected, row, w):
    """The buffers of ``row`` with the columnwise copy built from its rowwise one are, byte for
    byte, ``expected``'s (the quantizer's own rowwise and columnwise quantization of ``w``)."""
    got = fsdp_layout.columnwise_buffer_list(row, w)
    for name, t, u in zip(expected.buffer_names, expected.buffer_list(w), got, strict=True):
        assert u.shape == t.shape and u.dtype == t.dtype, name
        assert torch.equal(u, t), name


def _gather(p, w, world):
    """What the ranks' all-gather yields: shards quantized with the MAX of their amaxes."""
    shards = list(w.chunk(world))
    q = p.quantizer
    if p.reduce_amax:
        amax = torch.stack([q.local_amax(s) for s in shards]).amax(0)
        storages = [q.quantize_with_amax(s, amax) for s in shards]
    else:
        storages = [q.quantize(s) for s in shards]
    gathered = {n: torch.cat([getattr(s, n) for s in storages]) for n in p.gathered}
    shared = {n: getattr(storages[0], n) for n in p.shared}
    return fsdp_layout.assemble(p, gathered, shared, w.shape, w.dtype)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_quantization_is_the_full_quantization(name, dtype, world):
    q = weight_quantizer(RECIPES[name])
    w = torch.randn(128 * world * 2, 160, dtype=dtype, generator=torch.Generator().manual_seed(1))
    w[3, 5] = 40.0  # the tensor-wide amax sits in one shard only
    p = fsdp_layout.plan(q, w.shape, world)
    assert isinstance(p, ShardPlan), p
    got = _gather(p, w, world)
    full = q.with_usage(True, True).quantize(w)
    _assert_columnwise_is(full, got, w)
    # only the forward's rowwise copy travels, except MXFP8 1x32 (columnwise differs)
    assert (got.buffers().get("_columnwise_data") is not None) == (name == "mxfp8")


@pytest.mark.parametrize("name", ["fp8_current", "fp8_block", "mxfp8_2d", "nvfp4"])
@pytest.mark.parametrize("shape", [(100, 96), (33, 160), (256, 128)])
def test_columnwise_from_rowwise_is_exact(name, shape):
    q = weight_quantizer(RECIPES[name])
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    row = q.with_usage(True, False).quantize(w)
    _assert_columnwise_is(q.with_usage(True, True).quantize(w), row, w)


def test_columnwise_of_1d_blocks_is_refused():
    q = weight_quantizer(qr.MXFP8BlockScaling())
    w = torch.randn(64, 64)
    row = q.with_usage(True, False).quantize(w)
    with pytest.raises(ValueError, match="cannot be built from the rowwise"):
        fsdp_layout.columnwise_buffer_list(row, w)


def test_uneven_fp8_split_drops_the_padding_rows():
    """FSDP2 pads the last rank's shard; per-tensor FP8 gathers any split."""
    q = weight_quantizer(RECIPES["fp8_current"])
    w = torch.randn(5, 32)
    p = fsdp_layout.plan(q, w.shape, 2)
    a, b = w[:3], w[3:]
    amax = torch.maximum(q.local_amax(a), q.local_amax(b))
    sa, sb = (p.quantizer.quantize_with_amax(s, amax) for s in (a, b))
    data = torch.cat([sa._data, sb._data, sb._data.new_zeros(1, 32)])  # padded to 3 + 3 rows
    got = fsdp_layout.assemble(p, {"_data": data}, {"_scale_inv": sa._scale_inv}, w.shape,
                               w.dtype)
    _assert_same_buffers(q.with_usage(True, False).quantize(w), got)


@pytest.mark.parametrize("recipe, shape, why", [
    (qr.Float8BlockScaling(), (192, 128), "multiple of 128 rows"),
    (qr.Float8BlockScaling(w_block_scaling_dim=1), (256, 128), "1x128 weight blocks"),
    (qr.MXFP8BlockScaling(), (64, 64), "multiple of 128 rows"),
    (qr.NVFP4BlockScaling(disable_2d_quantization=True), (256, 64), "1x16 weight blocks"),
    (qr.NVFP4BlockScaling(), (128, 64), "multiple of 128 rows"),
    (qr.DelayedScaling(), (256, 64), "not a value quantizer"),
])
def test_plan_says_why_a_format_does_not_shard(recipe, shape, why):
    reason = fsdp_layout.plan(weight_quantizer(recipe), shape, 2)
    assert isinstance(reason, str) and why in reason
