"""NVFP4 4over6 through the recipe: which slots take it and with which bound (TransformerEngine's
rules), the quantizer's bytes equal to the reference's, and a Linear that trains under it."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from quant_core import NVFP4Quantizer
from quant_core.reference import nvfp4_4over6_quantize
from quant_recipes import fsdp_layout
from quant_recipes.role import QuantizerRole
from quant_recipes.states import RecipeState

SLOTS = ("input", "weight", "output")


def _forward(recipe):
    roles = [QuantizerRole(module_type="linear", tensor_type=t) for t in SLOTS]
    return dict(zip(SLOTS, RecipeState.create(recipe, num_quantizers=3, roles=roles)
                    .make_quantizers(), strict=True))


def _backward(recipe):
    return RecipeState.create(recipe, mode="backward", num_quantizers=2).make_quantizers()


@pytest.mark.parametrize("scope, expected", [
    ("none", set()), ("weights", {"weight"}), ("activations", {"input", "output"}),
    ("all", set(SLOTS)),
])
def test_the_scope_selects_the_forward_slots_and_never_gradients(scope, expected):
    recipe = qr.NVFP4BlockScaling(nvfp4_4over6=scope, disable_rht=True)
    fwd = _forward(recipe)
    assert {t for t, q in fwd.items() if q.nvfp4_use_4over6} == expected
    assert {t for t, q in fwd.items() if q.nvfp4_e4m3_max == 256} == expected
    assert not any(q.nvfp4_use_4over6 for q in _backward(recipe))


def test_the_256_bound_follows_its_own_scope():
    recipe = qr.NVFP4BlockScaling(nvfp4_4over6="all", nvfp4_4over6_e4m3_use_256="weights",
                                  disable_rht=True)
    fwd = _forward(recipe)
    assert {t: q.nvfp4_e4m3_max for t, q in fwd.items()} == {
        "input": 448, "weight": 256, "output": 448}


def test_a_4over6_slot_with_rht_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="the input slot uses RHT or stochastic rounding"):
        _forward(qr.NVFP4BlockScaling(nvfp4_4over6="all"))


def test_the_quantizer_refuses_rht_sr_and_other_bounds():
    with pytest.raises(ValueError, match="takes neither with_rht=True"):
        NVFP4Quantizer(nvfp4_use_4over6=True, with_rht=True, with_post_rht_amax=True)
    with pytest.raises(ValueError, match="256 or 448 with 4over6"):
        NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=300)
    with pytest.raises(ValueError, match="448 without 4over6"):
        NVFP4Quantizer(nvfp4_e4m3_max=256)


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_the_quantizer_gives_the_references_bytes_and_dequantizes_by_its_bound(two_d):
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    q = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256, with_2d_quantization=two_d)
    s = q.quantize(x)
    amax = x.float().abs().amax().reshape(1)
    rd, rs, cd, cs = nvfp4_4over6_quantize(x, amax, amax, rowwise=True, columnwise=True,
                                           with_2d_quantization=two_d, e4m3_max=256,
                                           err_mode="MAE", swizzle=False)
    for got, want in ((s._rowwise_data, rd), (s._rowwise_scale_inv, rs),
                      (s._columnwise_data, cd), (s._columnwise_scale_inv, cs)):
        assert torch.equal(got, want)
    assert s._nvfp4_e4m3_max == 256
    # the value: e2m1 * fp32(fp32(e4m3 * amax) * fp32(1 / 1536)), per 1x16 block
    codes = torch.stack([rd.long() & 0xF, rd.long() >> 4], -1).reshape(48, 64)
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    e2m1 = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = rs[:48, :4].view(torch.float8_e4m3fn).float() * amax
    scale = scale * torch.tensor(1 / 1536, dtype=torch.float32)
    expected = (e2m1 * scale.repeat_interleave(16, dim=1)).to(torch.float32)
    assert torch.equal(s.dequantize(torch.float32), expected)


def test_a_4over6_weight_does_not_all_gather_quantized():
    q = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256, with_2d_quantization=True)
    reason = fsdp_layout.plan(q, (256, 64), 2)
    assert isinstance(reason, str) and "4over6" in reason


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_a_linear_trains_under_4over6_weights_and_compiles_to_the_same_bytes(compiled):
    if compiled:
        dynamo = pytest.importorskip("quant_dynamo", reason="compiling needs quant-dynamo")
        if not dynamo.compile_supported():
            pytest.skip(f"torch {torch.__version__} bakes no quantizer into a graph")
    recipe = qr.NVFP4BlockScaling(nvfp4_4over6="weights")
    torch.manual_seed(0)
    layer = qr.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)

    def step(fn):
        layer.zero_grad()
        x.grad = None
        with qr.autocast(recipe=recipe):
            y = fn(x)
        y.float().sum().backward()
        return y.detach(), x.grad.clone(), layer.weight.grad.clone()

    eager = step(layer)
    assert all(bool(torch.isfinite(t).all()) for t in eager)
    if compiled:
        got = step(torch.compile(layer, backend="aot_eager", fullgraph=True))
        for a, b in zip(eager, got, strict=True):
            assert torch.equal(a, b)


def test_the_bound_crosses_the_gemm_wire_and_the_emulated_gemm_decodes_by_it():
    from quant_recipes import gemm

    q = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256, internal=True)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    s = q.quantize(x)
    meta = gemm.quantizer_meta(q)
    assert meta[1 + list(type(s).tag_names).index("_nvfp4_e4m3_max")] == 256
    value = gemm.dequantize(s.buffer_list(x), meta, 32, 64, columnwise=False)
    assert torch.equal(value, s.dequantize(torch.float32))
    assert s.gemm_operand(transposed=False) is None  # the fast NVFP4 GEMMs assume 448
