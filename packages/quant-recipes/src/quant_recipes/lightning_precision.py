"""``QuantPrecision``: a Lightning precision plugin that trains a ``LightningModule`` under a
quant recipe, with Lightning's own loop.

As Lightning's TransformerEngine plugin does, it converts the module's ``nn.Linear`` layers when
the trainer sets the model up (``convert_module``: :func:`~quant_recipes.convert` with the
recipe) and enters :func:`~quant_recipes.autocast` around every forward, training, validation,
test and predict step (``forward_context``). Backward runs after the step's context has exited;
each layer's backward quantizers were fixed in its forward, so that is what TransformerEngine's
contexts do too. Importing this module needs ``lightning``.

``Trainer(plugins=[QuantPrecision("mxfp8")])``, or a recipe object instead of its name.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

from .autocast import autocast
from .convert import convert
from .linear import Linear
from .recipe_names import as_recipe
from .recipes import Recipe


class QuantPrecision(Precision):
    """Train under ``recipe`` (a :class:`~quant_recipes.Recipe`, or a name
    :func:`~quant_recipes.recipe` knows, with ``options``). ``filter`` is :func:`convert`'s.
    ``convert_layers=False`` converts nothing (for a model built from quant's layers); a model
    that already holds any is not converted either."""

    precision = "quant"

    def __init__(self, recipe: Recipe | str, *, filter=None, convert_layers: bool = True,
                 **options: Any) -> None:
        self.recipe = as_recipe(recipe, "QuantPrecision", **options)
        self.filter = filter
        self.convert_layers = convert_layers

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.convert_layers and not any(isinstance(m, Linear) for m in module.modules()):
            convert(module, recipe=self.recipe, filter=self.filter)
        return module

    def forward_context(self) -> AbstractContextManager:
        return autocast(recipe=self.recipe)
