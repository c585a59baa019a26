"""``QuantConverter``: quant as a torchtitan-style model converter.

Frameworks in the style of torchtitan swap modules before training through converter objects
with two methods: ``convert(model)`` once, after the model is built and before it is
parallelized and compiled, and ``post_optimizer_hook(model)`` after every optimizer step. Their
loops enter no context of quant's, so the converter binds the recipe to the layers
(``convert(..., always_quantize=True)``): those it converts and the quant layers the model
already holds (a model built from quant's ``Linear``, or converted before). A trainer needs two
lines::

    converter = QuantConverter("mxfp8")          # or a recipe object
    converter.convert(model)                     # before fully_shard / torch.compile
    ...
    converter.post_optimizer_hook(model)         # after optimizer.step()

There is no per-step work: quant's recipes (other than delayed scaling, which cannot be bound)
derive every scale from the tensors of the step, so ``post_optimizer_hook`` does nothing.

torchtitan builds its converters by name from the job config (``model.converters``), through
``torchtitan.protocols.model_converter.register_model_converter``, and constructs each as
``cls(job_config, parallel_dims)``. Where torchtitan is importable, importing this module
registers one converter per bindable recipe name: ``quant_fp8_current``, ``quant_fp8_block``,
``quant_mxfp8`` and ``quant_nvfp4`` (:data:`TORCHTITAN_NAMES`), each converting with that
recipe's defaults. A job config names it and has torchtitan import this module::

    [model]
    converters = ["quant_mxfp8"]
    [experimental]
    custom_import = "quant_recipes.model_converter"
"""

from __future__ import annotations

from typing import Any

import torch

from .convert import convert
from .recipe_names import RECIPE_NAMES, as_recipe
from .recipes import Recipe


class QuantConverter:
    """Converts a model's ``nn.Linear`` layers to quant's, bound to ``recipe`` (a
    :class:`~quant_recipes.Recipe` or a name :func:`~quant_recipes.recipe` knows, with
    ``options``); ``filter`` is :func:`~quant_recipes.convert`'s."""

    def __init__(self, recipe: Recipe | str, *, filter=None, **options: Any) -> None:
        self.recipe = as_recipe(recipe, "QuantConverter", **options)
        self.filter = filter

    def convert(self, model: torch.nn.Module) -> torch.nn.Module:
        """Convert ``model`` in place (returns it), its quant layers, converted or already
        there, quantizing without autocast."""
        return convert(model, recipe=self.recipe, filter=self.filter, always_quantize=True)

    def post_optimizer_hook(self, model: torch.nn.Module | list[torch.nn.Module]) -> None:
        """Nothing to do after an optimizer step (see the module docstring)."""


def _named_converter(name: str) -> type[QuantConverter]:
    """A :class:`QuantConverter` of the recipe ``name`` built as torchtitan builds converters,
    from ``(job_config, parallel_dims)``, which it does not read."""

    class NamedQuantConverter(QuantConverter):
        def __init__(self, *_job_config_and_parallel_dims: Any, **_ignored: Any) -> None:
            super().__init__(name)

    NamedQuantConverter.__name__ = NamedQuantConverter.__qualname__ = f"QuantConverter_{name}"
    NamedQuantConverter.__doc__ = f"QuantConverter({name!r}), as torchtitan constructs it."
    return NamedQuantConverter


#: torchtitan converter name -> converter class (the recipes a converter can bind: not delayed).
TORCHTITAN_NAMES: dict[str, type[QuantConverter]] = {
    f"quant_{name}": _named_converter(name) for name in RECIPE_NAMES if name != "delayed"}


def register_with_torchtitan() -> bool:
    """Register :data:`TORCHTITAN_NAMES` with torchtitan's converter registry; False (and
    nothing done) when torchtitan is not importable. Called when this module is imported."""
    try:
        from torchtitan.protocols.model_converter import register_model_converter
    except ImportError:
        return False
    for name, cls in TORCHTITAN_NAMES.items():
        register_model_converter(cls, name)
    return True


register_with_torchtitan()
