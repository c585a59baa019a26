"""``convert(model, recipe=R, always_quantize=True)``: converted layers quantize with R with no
``autocast`` around the call (for loops a framework owns); an enclosing autocast still decides."""

from __future__ import annotations

import copy
import logging

import pytest
import quant_recipes as qr
import torch


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def _x():
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(1))


def _step(model, x, ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        y = model(x)
    else:
        with ctx:
            y = model(x)
    y.float().pow(2).sum().backward()
    return [y.detach()] + [p.grad for p in model.parameters()]


def _equal(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_bound_layers_quantize_without_autocast_as_they_do_inside_it():
    recipe = qr.MXFP8BlockScaling()
    bound = qr.convert(_model(), recipe=recipe, always_quantize=True)
    plain = qr.convert(_model(), recipe=recipe)
    assert bound[0].bound_recipe == recipe and plain[0].bound_recipe is None
    got = _step(bound, _x())
    assert _equal(got, _step(plain, _x(), qr.autocast(recipe=recipe)))
    assert not _equal(got, _step(plain, _x()))  # unbound: high precision outside autocast


def test_an_enclosing_autocast_still_decides():
    bound = qr.convert(_model(), recipe=qr.MXFP8BlockScaling(), always_quantize=True)
    plain = qr.convert(_model())
    assert _equal(_step(bound, _x(), qr.autocast(enabled=False)), _step(plain, _x()))
    other = qr.Float8CurrentScaling()
    assert _equal(_step(bound, _x(), qr.autocast(recipe=other)),
                  _step(plain, _x(), qr.autocast(recipe=other)))


def test_the_binding_survives_deepcopy_and_leaves_state_dict_alone():
    bound = qr.convert(_model(), recipe=qr.Float8CurrentScaling(), always_quantize=True)
    assert list(bound.state_dict()) == list(_model().state_dict())
    twin = copy.deepcopy(bound)
    assert twin[0].bound_recipe == qr.Float8CurrentScaling()
    assert _equal(_step(twin, _x()), _step(bound, _x()))


def test_always_quantize_needs_a_stateless_recipe():
    with pytest.raises(ValueError, match="always_quantize=True needs the recipe"):
        qr.convert(_model(), always_quantize=True)
    model = _model()
    with pytest.raises(ValueError, match="DelayedScaling updates its scales"):
        qr.convert(model, recipe=qr.DelayedScaling(), always_quantize=True)
    assert type(model[0]) is torch.nn.Linear  # nothing converted half-way
    with pytest.raises(TypeError, match="bound_recipe must be a quant_recipes.Recipe"):
        qr.Linear(8, 8).bound_recipe = 8
    with pytest.raises(ValueError, match="DelayedScaling updates its scales"):
        qr.Linear(8, 8).bound_recipe = "delayed"
    with pytest.raises(ValueError, match="unknown name 'mxfp9'"):
        qr.Linear(8, 8).bound_recipe = "mxfp9"


def test_a_recipe_is_bound_by_its_name_as_convert_and_autocast_take_it():
    """``bound_recipe = "mxfp8"`` binds ``recipe("mxfp8")``: the layer quantizes outside autocast
    with the bits of that recipe's autocast."""
    bound, plain = (qr.convert(_model(), recipe="mxfp8") for _ in range(2))
    for layer in (bound[0], bound[2]):
        layer.bound_recipe = "mxfp8"
    assert bound[0].bound_recipe == qr.MXFP8BlockScaling()
    assert _equal(_step(bound, _x()), _step(plain, _x(), qr.autocast(recipe=qr.recipe("mxfp8"))))
    assert not _equal(_step(bound, _x()), _step(plain, _x()))  # quantized, not high precision


dynamo = pytest.importorskip("quant_dynamo", reason="compile tests need quant-dynamo")


@pytest.mark.skipif(not dynamo.compile_supported(), reason="no opaque-object API on this torch")
def test_a_bound_model_compiles_in_one_graph_with_eagers_bits():
    bound = qr.convert(_model(), recipe=qr.Float8CurrentScaling(), always_quantize=True)
    want = _step(bound, _x())
    torch._dynamo.reset()
    compiled = torch.compile(bound, backend="aot_eager", fullgraph=True)
    bound.zero_grad(set_to_none=True)
    y = compiled(_x())
    y.float().pow(2).sum().backward()
    assert _equal([y.detach()] + [p.grad for p in bound.parameters()], want)


def test_always_quantize_binds_the_quant_layers_already_in_the_model():
    """Built from quant's layers (the default filter chooses among plain Linear layers only):
    every quant layer is bound, the grouped one too."""
    model = torch.nn.Sequential(qr.Linear(64, 64), qr.GroupedLinear(2, 64, 64), qr.Linear(64, 32))
    recipe = qr.Float8CurrentScaling()
    qr.convert(model, recipe=recipe, always_quantize=True)
    assert all(m.bound_recipe == recipe for m in model)


def test_a_filter_decides_which_quant_layers_are_bound_and_the_others_are_named(caplog):
    model = torch.nn.Sequential(qr.Linear(64, 64), qr.Linear(64, 64), torch.nn.Linear(64, 32))
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(model, recipe=qr.Float8CurrentScaling(), always_quantize=True,
                   filter=lambda fqn, m: fqn != "1")
    assert [m.bound_recipe for m in model] == [qr.Float8CurrentScaling(), None,
                                               qr.Float8CurrentScaling()]
    assert "1 layer left as it is: the filter keeps them in high precision (1)" in caplog.text


def test_quant_layers_of_shapes_the_recipe_cannot_take_stay_unbound_and_nothing_bound_warns(
        caplog):
    model = torch.nn.Sequential(qr.Linear(48, 48), qr.Linear(48, 48))
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(model, recipe=qr.MXFP8BlockScaling(), always_quantize=True)
    assert [m.bound_recipe for m in model] == [None, None]
    assert "2 layers left as they are: MXFP8BlockScaling cannot take their shapes" in caplog.text
    assert ("no layer of Sequential is bound to MXFP8BlockScaling, so it will train in full "
            "precision outside autocast") in caplog.text
