"""The quantizers a built-in recipe object keeps for dense Linear layers (module.keep_linear_slots):
made once per recipe object at autocast's entry, read by compiled code instead of tracing the
recipe states that make them."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import formats
import pytest
import quant_recipes as qr
import torch
from quant_recipes import module as qmodule
from quant_recipes.autocast import Frame
from quant_recipes.moe.linear import GroupedProjection
from quant_recipes.recipe import LINEAR_SLOTS
from quant_recipes.role import QuantizerRole
from quant_recipes.states import RecipeState

#: Every format's built-in recipe (tests/formats.py).
RECIPES = {name: make() for name, make in formats.default_recipes().items()}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_kept_slots_are_the_slots_a_named_linear_builds(name):
    """A built-in recipe keeps from its construction input, weight and output-gradient
    quantizers equal to those a Linear builds from its own roles (its name, an output and a
    grad-input role set): no built-in recipe reads a role's name or the unread slots."""
    recipe = RECIPES[name]
    kept = getattr(recipe, LINEAR_SLOTS)
    m = qr.Linear(32, 16, name="fc1")
    m.output_quantizer_role = QuantizerRole("linear", "output", "fc1")
    m.grad_input_quantizer_role = QuantizerRole("linear", "grad_input", "fc1")
    built = m.quantizers(Frame(True, recipe, False, None))
    assert (*kept.fwd, *kept.bwd) == (built.fwd[0], built.fwd[1], built.bwd[0])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_kept_slots_are_the_slots_a_grouped_layer_builds(name):
    """Grouped layers read the same kept quantizers: no built-in recipe tells a grouped layer's
    roles from a dense Linear's."""
    recipe = RECIPES[name]
    kept = getattr(recipe, LINEAR_SLOTS)
    built = GroupedProjection(4, 32, 16, name="experts").quantizers(
        Frame(True, recipe, False, None))
    assert (*kept.fwd, *kept.bwd) == (built.fwd[0], built.fwd[1], built.bwd[0])


def test_a_subclass_with_its_own_roles_builds_its_own():
    """A Linear subclass that precomputes other roles is not handed the kept set."""
    class Weightless(qr.Linear):
        def _roles_changed(self) -> None:
            super()._roles_changed()
            self._fwd_roles = (QuantizerRole("linear", "input"),) * 3

    recipe = qr.recipe("fp8_block")
    assert qmodule.kept_linear_slots(Weightless(32, 16), qr.Linear, recipe, 1) is None
    assert qmodule.kept_linear_slots(qr.Linear(32, 16), qr.Linear, recipe, 1) is getattr(
        recipe, LINEAR_SLOTS)
    built = Weightless(32, 16).quantizers(Frame(True, recipe, False, None))
    assert built.fwd[1] != getattr(recipe, LINEAR_SLOTS).fwd[1]  # an input's 1x128 blocks


def test_custom_and_delayed_recipes_keep_none():
    custom = qr.CustomRecipe(qfactory=lambda role: None)
    for recipe in (custom, qr.recipe("delayed")):
        qmodule.keep_linear_slots(recipe)
        assert LINEAR_SLOTS not in recipe.__dict__


@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy, pickle.dumps,
                                    lambda r: dataclasses.replace(r)])
def test_copies_and_pickles_make_their_own(copier):
    """A pickle holds no kept quantizers (they are interned per process); an unpickled,
    copied or replaced recipe keeps the same interned ones again."""
    recipe = qr.recipe("fp8_current")
    kept = getattr(recipe, LINEAR_SLOTS)
    other = copier(recipe)
    if isinstance(other, bytes):
        assert b"_linear_slots" not in other
        other = pickle.loads(other)
    assert other == recipe and other._fast_accumulation == recipe._fast_accumulation
    again = getattr(other, LINEAR_SLOTS)
    assert all(a is b for a, b in zip((*again.fwd, *again.bwd), (*kept.fwd, *kept.bwd),
                                      strict=True))


def test_a_subclass_keeps_its_slots_after_its_own_validation():
    """The slots are made once the outermost ``__post_init__`` has run, from the complete
    recipe (a subclass that changes a field after its parent's validation)."""
    @dataclasses.dataclass(frozen=True)
    class E5M2Weights(qr.Float8CurrentScaling):
        def __post_init__(self) -> None:
            super().__post_init__()
            object.__setattr__(self, "fp8_quant_fwd_weight", qr.QParams(power_2_scale=True))

    kept = getattr(E5M2Weights(), LINEAR_SLOTS)
    assert kept.fwd[1].force_pow_2_scales and not kept.fwd[0].force_pow_2_scales


def test_compiled_linear_reads_the_kept_slots_and_equal_recipes_share_its_graph(monkeypatch):
    """Under compile the Linear takes the recipe's kept quantizers (no recipe state is made
    while tracing); a new but equal recipe object each step runs the same graph; the results
    are the eager ones, bit for bit."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not (quant_dynamo.compile_supported() and quant_dynamo.DERIVES_IN_GRAPH):
        pytest.skip("this torch cannot read a baked quantizer's value key")
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = qr.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    made = []
    create = RecipeState.create

    def recording(*args, **kwargs):
        made.append(args[0])
        return create(*args, **kwargs)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, fullgraph=True, backend=counter)
    results = []
    for fn in (compiled, compiled, m):
        xi = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        with qr.autocast(recipe=qr.Float8CurrentScaling()):
            monkeypatch.setattr(RecipeState, "create", staticmethod(recording))
            y = fn(xi)
            monkeypatch.setattr(RecipeState, "create", create)
        y.float().sum().backward()
        results.append((y, xi.grad, m.weight.grad))
    assert counter.frame_count == 1
    assert len(made) == 2  # the eager call's states; none while tracing
    for got in results[:2]:
        for a, b in zip(got, results[2], strict=True):
            assert torch.equal(a, b)
