"""Every registered format reaches every registry above quant-core: a recipe whose state makes
its quantizers, a GEMM route in ``gemm_fast``, and the custom-op wire of ``qgemm``. A format added
to quant-core without these fails here."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from quant_core import storage_formats
from quant_recipes import gemm, gemm_fast
from quant_recipes.recipe import Recipe
from quant_recipes.states import RecipeState

FORMATS = storage_formats()


def _recipe_classes() -> list[type[Recipe]]:
    seen, todo = [], list(Recipe.__subclasses__())
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo += cls.__subclasses__()
    return [c for c in seen if c.__module__.startswith("quant_recipes.recipes.")]


def _formats_made_by(name: str) -> set[str]:
    states = [RecipeState.create(qr.recipe(name), mode=mode, num_quantizers=3)
              for mode in ("forward", "backward")]
    return {q.storage_format for s in states for q in s.make_quantizers()}


def test_every_recipe_class_names_its_state():
    for cls in _recipe_classes():
        assert cls.state_class is not None and issubclass(cls.state_class, RecipeState), cls


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_named_recipe_makes_quantizers_of_every_format(fmt):
    made = {n: _formats_made_by(n) for n in qr.RECIPE_NAMES}
    assert any(fmt in m for m in made.values()), made


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_fast_has_a_route_for_every_format(fmt):
    assert fmt in [r.format for r in gemm_fast.routes(torch.device("cpu"))]


@pytest.mark.parametrize("name", [n for n in qr.RECIPE_NAMES if n != "delayed"])
def test_qgemm_meta_is_the_format_index_then_the_storage_tags(name):
    state = RecipeState.create(qr.recipe(name), num_quantizers=3)
    for q in state.make_quantizers():
        meta = gemm.quantizer_meta(q)
        assert storage_formats()[meta[0] - 1] == q.storage_format
        assert len(meta) == 1 + len(q._storage_class.tag_names)
