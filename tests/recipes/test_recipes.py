"""Recipes, roles and recipe states (behaviour.md §4-§6, §9; TE test_custom_recipe.py 16, 25-40)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import quant_recipes as qr
import torch
from quant_core import (
    DType,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from quant_recipes import QuantizerRole as Role


def test_recipes_are_frozen_values():
    assert qr.Float8CurrentScaling() == qr.Float8CurrentScaling()
    assert qr.Float8CurrentScaling(use_power_2_scales=True) != qr.Float8CurrentScaling()
    assert hash(qr.MXFP8BlockScaling()) == hash(qr.MXFP8BlockScaling())
    with pytest.raises(dataclasses.FrozenInstanceError):
        qr.DelayedScaling().margin = 1


def test_defaults_and_derived_qparams():
    d = qr.DelayedScaling()
    assert (d.margin, d.fp8_format, d.amax_history_len, d.amax_compute_algo) == (
        0, qr.Format.HYBRID, 1024, "max")
    cs = qr.Float8CurrentScaling(use_power_2_scales=True)
    assert cs.fp8_quant_fwd_inp == qr.QParams(power_2_scale=True)
    assert cs.fp8_gemm_fprop == qr.MMParams(False)
    b = qr.Float8BlockScaling(use_f32_scales=False)
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (1, 2, 1)
    assert b.fp8_quant_fwd_weight.power_2_scale
    nv = qr.NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False,
                              disable_2d_quantization=False)
    assert nv.fp4_quant_fwd_inp.random_hadamard_transform
    assert nv.fp4_quant_fwd_weight.fp4_2d_quantization
    assert nv.fp4_quant_bwd_grad.stochastic_rounding
    assert qr.Format.HYBRID.max_fwd == 448 and qr.Format.HYBRID.max_bwd == 57344
    assert qr.Format.E2M1.max_fwd == 6 and qr.Format.E5M2.max_fwd == 57344


def test_env_defaults_are_read_at_construction(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    assert qr.Float8CurrentScaling().use_power_2_scales
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0")
    assert not qr.Float8CurrentScaling().use_power_2_scales


@pytest.mark.parametrize("bad", [
    lambda: qr.DelayedScaling(fp8_format=qr.Format.E5M2),
    lambda: qr.DelayedScaling(backward_override="dequantized"),
    lambda: qr.Float8BlockScaling(x_block_scaling_dim=3),
    lambda: qr.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=2),
    lambda: qr.Float8CurrentScaling(backward_override="nope"),
    lambda: qr.NVFP4BlockScaling(nvfp4_4over6="some"),
])
def test_invalid_recipes_raise(bad):
    with pytest.raises(ValueError):
        bad()


def test_predicates():
    kinds = {
        qr.DelayedScaling(): "delayed", qr.Float8CurrentScaling(): "float8_current_scaling",
        qr.MXFP8BlockScaling(): "mxfp8", qr.Float8BlockScaling(): "float8_block_scaling",
        qr.NVFP4BlockScaling(): "nvfp4", qr.CustomRecipe(qfactory=lambda r: None): "custom",
    }
    names = set(kinds.values())
    for recipe, kind in kinds.items():
        assert [n for n in sorted(names) if getattr(recipe, n)()] == [kind]


def test_custom_recipe_alignment_contract():
    calls = []

    def factory(role):
        calls.append(role)

    assert qr.CustomRecipe(qfactory=factory).quantization_alignment == 128
    assert qr.CustomRecipe(qfactory=factory, quantization_alignment=32).quantization_alignment == 32
    with pytest.raises(ValueError, match="quantization_alignment must be positive"):
        qr.CustomRecipe(qfactory=factory, quantization_alignment=0)
    assert calls == []


def test_quantizer_factory_key():
    @qr.quantizer_factory(key=("cs", 1))
    def f(role):
        return Float8CurrentScalingQuantizer()

    assert qr.CustomRecipe(qfactory=f).qfactory_key == ("cs", 1)
    with pytest.raises(ValueError):
        qr.quantizer_factory(key=("", 1))


def test_role_str_and_frozen():
    assert str(Role("linear", "weight", "fc1")) == "linear|weight|fc1"
    assert str(Role(module_type="moe_expert")) == "moe_expert"
    assert str(Role()) == ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        Role().name = "x"


def _state(recipe, mode="forward", n=3, roles=None):
    return qr.RecipeState.create(recipe, mode=mode, num_quantizers=n, roles=roles)


LINEAR_FWD = [Role("linear", "input"), Role("linear", "weight"), Role("linear", "output")]


def test_slot_role_and_tensor_type():
    dpa = Role("dpa", "qkv")
    s = _state(qr.Float8CurrentScaling(), roles=[dpa, None, Role(module_type="moe")])
    assert s._slot_role(0) is dpa
    assert s._slot_role(1) == Role()
    assert s._slot_tensor_type(0) == "input"
    assert s._slot_tensor_type(2) == "output"
    assert [_state(qr.Float8CurrentScaling(), n=4)._slot_tensor_type(i) for i in range(4)] == [
        "input", "weight", "output", "input"]
    b = _state(qr.Float8CurrentScaling(), mode="backward", n=3)
    assert [b._slot_tensor_type(i) for i in range(3)] == [
        "grad_output", "grad_input", "grad_output"]


def test_block_scaling_role_dispatch():
    r = qr.Float8BlockScaling()
    fwd = _state(r, roles=LINEAR_FWD).make_quantizers()
    assert [q.block_scaling_dim for q in fwd] == [1, 2, 1]
    assert fwd == _state(r).make_quantizers()  # positional fallback
    bwd = _state(r, mode="backward", n=2).make_quantizers()
    assert [q.block_scaling_dim for q in bwd] == [1, 1]
    assert [q.block_scaling_dim for q in _state(r, n=2).make_quantizers()] == [1, 2]
    odd = _state(r, roles=[Role(), Role("dpa", "qkv"), None]).make_quantizers()
    assert [q.block_scaling_dim for q in odd] == [1, 2, 1]
    assert all(isinstance(q, Float8BlockQuantizer) for q in fwd + bwd)


def test_nvfp4_role_dispatch():
    r = qr.NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False,
                             disable_2d_quantization=False)
    inp, w, out = _state(r, roles=LINEAR_FWD).make_quantizers()
    assert inp.with_rht and inp.with_post_rht_amax and not inp.with_2d_quantization
    assert w.with_2d_quantization and not w.with_rht
    assert out == inp
    g, gi = _state(r, mode="backward", n=2).make_quantizers()
    assert g.with_rht and g.stochastic_rounding and gi == g
    assert _state(r).make_quantizers() == [inp, w, out]
    assert all(isinstance(q, NVFP4Quantizer) for q in (inp, w, g))


def test_current_scaling_and_mxfp8_states():
    fwd = _state(qr.Float8CurrentScaling(use_power_2_scales=True)).make_quantizers()
    assert all(q.dtype is DType.E4M3 and q.force_pow_2_scales for q in fwd)
    bwd = _state(qr.Float8CurrentScaling(), mode="backward", n=2).make_quantizers()
    assert all(q.dtype is DType.E5M2 for q in bwd)
    mx = _state(qr.MXFP8BlockScaling(enable_2d_quantization=True), roles=LINEAR_FWD)
    assert [q.with_2d_quantization for q in mx.make_quantizers()] == [False, True, False]
    assert not any(q.with_2d_quantization for q in _state(
        qr.MXFP8BlockScaling(enable_2d_quantization=True)).make_quantizers())
    assert all(isinstance(q, MXFP8Quantizer) for q in mx.make_quantizers())


def test_custom_factory_called_once_per_slot_with_roles():
    seen = []

    def factory(role):
        seen.append(role)
        return qr.IdentityQuantizer()

    roles = [*LINEAR_FWD[:2], None]
    out = _state(qr.CustomRecipe(qfactory=factory), roles=roles).make_quantizers()
    assert seen == roles and len(out) == 3


def test_custom_factory_none_raises():
    with pytest.raises(ValueError, match="IdentityQuantizer"):
        _state(qr.CustomRecipe(qfactory=lambda role: None)).make_quantizers()


def test_delayed_scaling_request_wiring():
    req = qr.DelayedScalingRequest(qr.Format.HYBRID, amax_history_len=16)
    s = _state(qr.CustomRecipe(qfactory=lambda role: req), roles=LINEAR_FWD)
    qs = s.make_quantizers()
    assert all(type(q) is Float8Quantizer for q in qs) and s.has_delayed_scaling
    assert s.scale.shape == (3,) and s.amax_history.shape == (16, 3)
    for i, q in enumerate(qs):
        assert q.scale.data_ptr() == s.scale[i].data_ptr()
        assert q.amax.data_ptr() == s.amax_history[0][i].data_ptr()
    assert s._inner_delayed_scaling_recipe == qr.DelayedScaling(amax_history_len=16)
    # a new state inheriting from this one keeps the same inner state and tensors
    s2 = _state(qr.CustomRecipe(qfactory=lambda role: req), roles=LINEAR_FWD)
    s2.inherit_state_from(s)
    s2.make_quantizers()
    assert s2.inner_delayed_scaling_state is s.inner_delayed_scaling_state


def test_mixed_delayed_and_stateless():
    def factory(role):
        if role is not None and role.tensor_type == "weight":
            return qr.DelayedScalingRequest()
        return Float8CurrentScalingQuantizer()

    s = _state(qr.CustomRecipe(qfactory=factory), roles=LINEAR_FWD)
    qs = s.make_quantizers()
    assert [type(q) for q in qs] == [
        Float8CurrentScalingQuantizer, Float8Quantizer, Float8CurrentScalingQuantizer]
    assert s.scale.shape == (1,) and s.amax_history.shape == (1024, 1)


def test_delayed_state_inherit_keeps_tensor_objects():
    r = qr.DelayedScaling(amax_history_len=8)
    a, b = _state(r), _state(r)
    a.scale.fill_(3.14)
    b.inherit_state_from(a)
    assert b.scale is a.scale and b.amax_history is a.amax_history
    assert torch.equal(b.make_quantizers()[0].scale, torch.tensor(3.14))


def test_identity_quantizer_passthrough():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    q = qr.IdentityQuantizer()
    assert torch.equal(q.quantize(x).dequantize(), x)
    assert q == qr.IdentityQuantizer()


@pytest.mark.parametrize("make, error, message", [
    (lambda: qr.DelayedScaling(margin=200), ValueError, "margin must be an int in"),
    (lambda: qr.DelayedScaling(margin=-1), ValueError, "margin must be an int in"),
    (lambda: qr.DelayedScaling(margin=1.5), TypeError, "DelayedScaling.margin must be an int"),
    (lambda: qr.DelayedScaling(margin="1"), TypeError, "DelayedScaling.margin must be an int"),
    (lambda: qr.MXFP8BlockScaling(enable_2d_quantization="no"), TypeError,
     "enable_2d_quantization must be a bool"),
    (lambda: qr.NVFP4BlockScaling(disable_rht=1), TypeError, "disable_rht must be a bool"),
    (lambda: qr.Float8BlockScaling(x_block_scaling_dim=True), TypeError,
     "x_block_scaling_dim must be an int"),
    (lambda: qr.QParams(amax_epsilon=float("inf")), ValueError, "amax_epsilon must be a finite"),
    (lambda: qr.QParams(amax_epsilon=1e39), ValueError, "amax_epsilon must be a finite"),
    (lambda: qr.QParams(amax_epsilon="0"), TypeError, "amax_epsilon must be a float"),
    (lambda: qr.QParams(power_2_scale="yes"), TypeError, "power_2_scale must be a bool"),
    (lambda: qr.MMParams(use_split_accumulator=0), TypeError, "must be a bool"),
])
def test_recipe_fields_validated_at_construction(make, error, message):
    """A wrong type or range is refused when the recipe is built, naming the
    field (margin 200 used to make every scale 0 and every output NaN from step 2)."""
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("spelling, value", [
    ("0", False), ("false", False), ("FALSE", False), ("False", False), ("off", False),
    ("no", False), (" 0 ", False), ("", False), ("1", True), ("true", True), ("yes", True),
])
def test_nvte_flags_parse_the_usual_false_spellings(monkeypatch, spelling, value):
    """``NVTE_*=FALSE`` (or off, no) used to mean True."""
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", spelling)
    assert qr.NVFP4BlockScaling().disable_rht is value


def test_row_scaled_nvfp4_without_what_it_needs_is_refused_at_construction():
    """A row-scaled activation has no columnwise form and takes no RHT: the recipe says so when
    it is made, not at the first forward."""
    with pytest.raises(ValueError, match="needs backward_override='dequantized'"):
        qr.NVFP4BlockScaling(row_scaled_activation=True, disable_rht=True)
    with pytest.raises(ValueError, match="fp4_quant_fwd_inp has random_hadamard_transform=True"):
        qr.NVFP4BlockScaling(row_scaled_activation=True, backward_override="dequantized")
    r = qr.NVFP4BlockScaling(row_scaled_activation=True, disable_rht=True,
                             backward_override="dequantized")
    assert r.row_scaled_activation


def _no_quantizer(role):
    return None


_EVERY_RECIPE = [
    qr.DelayedScaling, qr.Float8CurrentScaling, qr.MXFP8BlockScaling, qr.Float8BlockScaling,
    qr.NVFP4BlockScaling, functools.partial(qr.CustomRecipe, qfactory=_no_quantizer),
]
_RECIPE_IDS = ["delayed", "current", "mxfp8", "block", "nvfp4", "custom"]


@pytest.mark.parametrize("make", _EVERY_RECIPE, ids=_RECIPE_IDS)
@pytest.mark.parametrize("flag", ["fp8_dpa", "fp8_mha"])
def test_fp8_attention_switches_are_refused(make, flag):
    """TransformerEngine's FP8 attention switches have no effect here (only Linear layers are
    quantized): a ported config that sets one is told so when the recipe is built."""
    with pytest.raises(ValueError, match=rf"{flag}=True\): quant has no FP8 attention; it "
                                         "quantizes Linear layers only"):
        make(**{flag: True})
    assert getattr(make(**{flag: False}), flag) is False


@pytest.mark.parametrize("make", [*_EVERY_RECIPE, qr.DelayedScalingRequest],
                         ids=[*_RECIPE_IDS, "delayed-request"])
def test_every_recipe_takes_format_names(make):
    """Every recipe class converts a format's name (any case) at construction, and refuses an
    unknown one listing the names."""
    assert make(fp8_format="e4m3").fp8_format is qr.Format.E4M3
    assert make(fp8_format="e4m3") == make(fp8_format=qr.Format.E4M3)
    with pytest.raises(ValueError, match=r"fp8_format: unknown Format 'fp8'; allowed: 'E4M3'"):
        make(fp8_format="fp8")
