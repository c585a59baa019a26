"""``QuantConverter``: quant as a torchtitan-style model converter.

Frameworks in the style of torchtitan swap modules before training through converter objects
with two methods: ``convert(model)`` once, after the model is built and before it is
parallelized and compiled, and ``post_optimizer_hook(model)`` after every optimizer step. Their
loops enter no context of quant's, so the converter binds the recipe to the layers
(``convert(..., always_quantize=True)``). A trainer needs two lines::

    converter = QuantConverter("mxfp8")          # or a recipe object
    converter.convert(model)                     # before fully_shard / torch.compile
    ...
    converter.post_optimizer_hook(model)         # after optimizer.step()

There is no per-step work: quant's recipes (other than delayed scaling, which cannot be bound)
derive every scale from the tensors of the step, so ``post_optimizer_hook`` does nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from .convert import convert
from .recipe_names import as_recipe
from .recipes import Recipe


class QuantConverter:
    """Converts a model's ``nn.Linear`` layers to quant's, bound to ``recipe`` (a
    :class:`~quant_recipes.Recipe` or a name :func:`~quant_recipes.recipe` knows, with
    ``options``); ``filter`` is :func:`~quant_recipes.convert`'s."""

    def __init__(self, recipe: Recipe | str, *, filter=None, **options: Any) -> None:
        self.recipe = as_recipe(recipe, "QuantConverter", **options)
        self.filter = filter

    def convert(self, model: torch.nn.Module) -> torch.nn.Module:
        """Convert ``model`` in place (returns it), its layers quantizing without autocast."""
        return convert(model, recipe=self.recipe, filter=self.filter, always_quantize=True)

    def post_optimizer_hook(self, model: torch.nn.Module | list[torch.nn.Module]) -> None:
        """Nothing to do after an optimizer step (see the module docstring)."""
