"""Linear and the quantizer cache (behaviour.md §8, §9.1; TE test_custom_recipe.py 4, 6, 8-13)."""

from __future__ import annotations

import formats
import pytest
import quant_recipes as qr
import torch
from quant_core import (
    DType,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

#: Every format's built-in recipe (tests/formats.py), NVFP4 without stochastic rounding.
BUILTINS = {name: make() for name, make in formats.default_recipes().items()}
BUILTINS["nvfp4"] = formats.recipe("nvfp4_no_sr")


def _run(module, x, recipe, enabled=True):
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    with qr.autocast(enabled=enabled, recipe=recipe):
        y = module(x)
    (y.float() * torch.linspace(-2, 3, y.shape[-1])).sum().backward()
    return y.detach(), x.grad, module.weight.grad, module.bias.grad


def _mirror(recipe):
    """A qfactory reproducing a built-in recipe from its own recipe state."""
    fwd = qr.RecipeState.create(recipe, mode="forward", num_quantizers=3)
    bwd = qr.RecipeState.create(recipe, mode="backward", num_quantizers=2)

    def factory(role):
        kind = role.tensor_type if role is not None else None
        if kind in ("grad_output", "grad_input"):
            state, i = bwd, ("grad_output", "grad_input").index(kind)
        else:
            state, i = fwd, ("input", "weight", "output").index(kind or "output")
        sub = qr.RecipeState.create(recipe, mode=state.mode, num_quantizers=state.num_quantizers,
                                    roles=[role if j == i else None
                                           for j in range(state.num_quantizers)])
        return sub.make_quantizers()[i]

    return qr.CustomRecipe(qfactory=factory)


@pytest.mark.parametrize("name", list(BUILTINS))
def test_custom_recipe_mirroring_builtin_is_bit_identical(name):
    torch.manual_seed(42)
    m = qr.Linear(128, 64, dtype=torch.bfloat16)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    recipe = BUILTINS[name]
    ref = _run(m, x, recipe)
    got = _run(m, x, _mirror(recipe))
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    hp = torch.nn.functional.linear(x, m.weight, m.bias)
    assert (ref[0].float() - hp.float()).abs().max() < 0.5


def test_identity_factory_matches_disabled_autocast():
    torch.manual_seed(1)
    m = qr.Linear(64, 32)
    x = torch.randn(8, 64)
    ref = _run(m, x, None, enabled=False)
    got = _run(m, x, qr.CustomRecipe(qfactory=lambda role: qr.IdentityQuantizer()))
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_current_scaling_quantizer_dtypes():
    m = qr.Linear(64, 64)
    with qr.autocast(recipe=qr.Float8CurrentScaling()):
        m(torch.randn(4, 64))
    qs = m._qset
    assert [q.dtype for q in qs.fwd] == [DType.E4M3] * 3
    assert [q.dtype for q in qs.bwd] == [DType.E5M2] * 2


def test_factory_counts_and_roles():
    seen = []

    def factory(role):
        seen.append(role)
        if role is not None:
            assert role.module_type == "linear" and role.name == "fc"
        return Float8CurrentScalingQuantizer()

    m = qr.Linear(32, 32, name="fc")
    recipe = qr.CustomRecipe(qfactory=factory)
    for _ in range(3):
        _run(m, torch.randn(16, 32), recipe)
    kinds = [r.tensor_type if r is not None else None for r in seen]
    assert sorted(kinds, key=str) == sorted(["input", "weight", None, "grad_output", None], key=str)
    assert m.quantizer_builds == 1


def test_rebuild_exactly_when_key_changes():
    m = qr.Linear(32, 32)
    x = torch.randn(4, 32)
    _run(m, x, qr.Float8CurrentScaling(use_power_2_scales=False))
    _run(m, x, qr.Float8CurrentScaling(use_power_2_scales=False))  # equal value: no rebuild
    assert m.quantizer_builds == 1
    _run(m, x, qr.Float8CurrentScaling(use_power_2_scales=True))
    assert m.quantizer_builds == 2 and m._qset.fwd[0].force_pow_2_scales
    f = lambda role: Float8CurrentScalingQuantizer()  # noqa: E731
    r1, r2 = qr.CustomRecipe(qfactory=f), qr.CustomRecipe(qfactory=f)
    assert r1 == r2  # dataclass equality: TE's level-1 cache could not tell them apart
    _run(m, x, r1)
    _run(m, x, r1)
    assert m.quantizer_builds == 3
    _run(m, x, r2)  # a different instance rebuilds (the seed's fix)
    assert m.quantizer_builds == 4

    @qr.quantizer_factory(key=("cs", 1))
    def keyed(role):
        return Float8CurrentScalingQuantizer()

    _run(m, x, qr.CustomRecipe(qfactory=keyed))
    _run(m, x, qr.CustomRecipe(qfactory=keyed))  # same semantic key: no rebuild
    assert m.quantizer_builds == 5


def test_role_change_rebuilds_and_keeps_delayed_buffers():
    m = qr.Linear(32, 32)
    recipe = qr.DelayedScaling(amax_history_len=8)
    _run(m, torch.randn(4, 32), recipe)
    state = m._qset.fwd_state
    state.scale.fill_(3.14)
    state.amax_history.fill_(2.71)
    m.output_quantizer_role = qr.QuantizerRole("linear", "input", "next")
    m.output_quantizer_role = qr.QuantizerRole("linear", "input", "next")  # equal: no-op
    with torch.no_grad(), qr.autocast(recipe=recipe):
        m(torch.randn(4, 32))
    assert m.quantizer_builds == 2
    new = m._qset.fwd_state
    assert new is not state and new.scale is state.scale
    assert new.amax_history is state.amax_history
    assert torch.all(new.scale == 3.14)


def test_interned_usage_variants():
    m1, m2 = qr.Linear(32, 32), qr.Linear(32, 32)
    x = torch.randn(4, 32)
    for m in (m1, m2):
        with qr.autocast(recipe=qr.MXFP8BlockScaling()):
            m(x)
    assert m1._qset.fwd[0] is m2._qset.fwd[0]
    assert isinstance(m1._qset.fwd[0], MXFP8Quantizer)


def test_backward_quantizers_captured_at_forward():
    log = []

    class Tagged(Float8CurrentScalingQuantizer):
        pass

    def factory(tag):
        def f(role):
            q = Float8CurrentScalingQuantizer(
                DType.E5M2 if role is not None and role.tensor_type == "grad_output"
                else DType.E4M3, force_pow_2_scales=(tag == "B"))
            return q
        return f

    m = qr.Linear(32, 32)
    x = torch.randn(4, 32, requires_grad=True)
    with qr.autocast(recipe=qr.CustomRecipe(qfactory=factory("A"))):
        y = m(x)
    with qr.autocast(recipe=qr.CustomRecipe(qfactory=factory("B"))):
        m(x)  # a later region rebuilds the module's quantizers
    y.sum().backward()
    log.append(x.grad.clone())
    # reference: backward right away under A
    x2 = x.detach().clone().requires_grad_()
    m.zero_grad()
    with qr.autocast(recipe=qr.CustomRecipe(qfactory=factory("A"))):
        y2 = m(x2)
    y2.sum().backward()
    assert torch.equal(log[0], x2.grad)


def test_outside_autocast_is_plain_linear():
    m = qr.Linear(16, 8)
    x = torch.randn(3, 16)
    assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight, m.bias))
    with qr.autocast(enabled=False):
        assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight, m.bias))


def test_gemm_path_recorded():
    qr.reset_gemm_paths()
    _run(qr.Linear(32, 32), torch.randn(4, 32), qr.Float8CurrentScaling())
    assert qr.gemm_paths() == {"emulated": 3}
    assert qr.last_gemm_path() == "emulated"


@pytest.mark.parametrize("recipe,cls", [
    (qr.Float8BlockScaling(), Float8BlockQuantizer), (BUILTINS["nvfp4"], NVFP4Quantizer)])
def test_block_formats_run_with_3d_inputs(recipe, cls):
    m = qr.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    with qr.autocast(recipe=recipe):
        y = m(x)
    y.float().sum().backward()
    assert y.shape == (2, 16, 32) and x.grad.shape == x.shape
    assert isinstance(m._qset.fwd[0], cls)


@pytest.mark.parametrize("shape", [(8, 32), (2, 4, 32), (32,)])
def test_a_two_dim_output_is_the_gemm_result_not_a_view(shape):
    """For a 2-D input the output is the GEMM's own tensor. A view of it would be an
    alias of an intermediate, which a compiled function regenerates on every call
    (``aten._unsafe_view``: 11 us of host time per step on this CPU, 20 on the H200's host).
    Other ranks are reshaped as before."""
    m = qr.Linear(32, 16, dtype=torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
    with qr.autocast(recipe=qr.Float8CurrentScaling()):
        y = m(x)
    assert y.shape == (*shape[:-1], 16)
    assert y._is_view() == (len(shape) != 2)
    y.float().sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("recipe", [qr.Float8CurrentScaling(), qr.MXFP8BlockScaling(),
                                    qr.Float8BlockScaling(), qr.NVFP4BlockScaling()])
def test_zero_in_features_gives_the_bias(recipe):
    """``Linear(0, n)`` under autocast is the bias, as ``nn.Linear`` (the
    reshape of a [M, 0] input to [-1, 0] was ambiguous), and backward gives empty gradients."""
    m = qr.Linear(0, 32, dtype=torch.bfloat16)
    x = torch.randn(16, 0, dtype=torch.bfloat16, requires_grad=True)
    with qr.autocast(recipe=recipe):
        y = m(x)
    y.float().sum().backward()
    assert torch.equal(y, m.bias.expand(16, 32))
    assert x.grad.shape == (16, 0) and m.weight.grad.shape == (32, 0)
    assert torch.equal(m.bias.grad, torch.full((32,), 16.0, dtype=torch.bfloat16))


def test_wrong_in_features_is_a_clear_error():
    """A raw reshape error before; now the expected size is named."""
    m = qr.Linear(32, 16)
    with qr.autocast(recipe=qr.MXFP8BlockScaling()):
        with pytest.raises(RuntimeError, match=r"in_features=32, got input shape \(4, 64\)"):
            m(torch.randn(4, 64))


def test_sparse_input_is_a_clear_error():
    """"reshape is not implemented for sparse tensors" before."""
    m = qr.Linear(32, 16)
    with qr.autocast(recipe=qr.Float8CurrentScaling()):
        with pytest.raises(TypeError, match="Linear: input must be a dense tensor"):
            m(torch.randn(4, 32).to_sparse())


def test_quantizer_role_fields_are_strings():
    with pytest.raises(TypeError, match="QuantizerRole.name must be a str"):
        qr.QuantizerRole("linear", "weight", 3)


def test_linear_is_an_nn_linear_with_its_keys_attributes_and_initialisation():
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 24)
    torch.manual_seed(0)
    layer = qr.Linear(48, 24)
    assert isinstance(layer, torch.nn.Linear)
    assert list(layer.state_dict()) == list(plain.state_dict()) == ["weight", "bias"]
    assert (layer.in_features, layer.out_features) == (48, 24)
    # the same draws from the same generator: nn.Linear's initialisation
    assert torch.equal(layer.weight, plain.weight) and torch.equal(layer.bias, plain.bias)
    layer.load_state_dict(plain.state_dict())
    assert repr(layer).startswith("Linear(in_features=48, out_features=24, bias=True")
    x = torch.randn(4, 48)
    assert torch.equal(layer(x), plain(x))  # outside autocast: nn.Linear's forward


def test_a_linear_pickled_without_the_copy_flags_loads_and_runs():
    """A whole Linear saved before ``save_weight_copy`` / ``save_input_copy`` existed (no such
    attributes in its state) loads with ``torch.load`` and trains with the defaults."""
    from _pickling import pickled_without

    old = pickled_without(qr.Linear(64, 32), "save_weight_copy", "save_input_copy")
    with qr.autocast(recipe=qr.Float8CurrentScaling()):
        old(torch.randn(16, 64)).sum().backward()
    assert old.weight.grad is not None and "save_weight_copy" not in repr(old)


@pytest.mark.parametrize("index", [0, 2, -1, slice(None, 2), slice(1, None), slice(-2, None),
                                   slice(0, 9), slice(None, None, 2)])
def test_lazy_slots_read_as_the_built_quantizers_do(index):
    """While tracing, a recipe state's slots are made when read (``LazySlots``): each index and
    slice gives what the eagerly built list gives."""
    from quant_recipes.module import LazySlots
    from quant_recipes.states import RecipeState

    state = RecipeState.create(qr.MXFP8BlockScaling(), mode="forward", num_quantizers=3)
    built = state.make_quantizers()
    got = LazySlots(state)[index]
    assert (tuple(got) == tuple(built[index])) if isinstance(index, slice) else got == built[index]
