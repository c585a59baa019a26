"""``accelerate_prepare``: quant under Hugging Face accelerate's ``Accelerator``.

``Accelerator(mixed_precision="fp8")`` chooses among accelerate's own FP8 backends; quant runs
beside accelerate's ``"bf16"`` (or ``"fp16"``, ``"no"``) mixed precision instead. The model's
Linear layers are converted and bound to the recipe (``convert(..., always_quantize=True)``),
so they quantize inside accelerate's loop, which enters no context of quant's; they give their
outputs in the dtype of accelerate's ``torch.autocast``, under which every other operation
runs. The conversion comes before
``accelerator.prepare``, which wraps the model (DDP, FSDP) and patches its forward: the wrapper
then holds quant's layers, and the optimizer, built before or after, holds the same Parameters.
``accelerator.save_state`` / ``load_state`` save and restore the model, optimizer and RNG
states as for any model (the ``state_dict`` keys do not change). Importing this module does not
import accelerate.
"""

from __future__ import annotations

from typing import Any

from .convert import convert
from .recipe_names import as_recipe
from .recipes import Recipe


def accelerate_prepare(accelerator: Any, model, *objects: Any, recipe: Recipe | str,
                       filter=None, module_filter_fn=None, **options: Any):
    """Convert ``model`` for ``recipe`` (a :class:`~quant_recipes.Recipe`, or a name
    :func:`~quant_recipes.recipe` knows, with ``options``), bound to its layers, then return
    ``accelerator.prepare(model, *objects)`` (the optimizer, dataloaders, scheduler as
    accelerate takes them). ``filter`` and ``module_filter_fn`` are
    :func:`~quant_recipes.convert`'s: by default the output heads stay in high precision.

    ``model, optimizer = accelerate_prepare(accelerator, model, optimizer, recipe="mxfp8")``.
    """
    recipe = as_recipe(recipe, "accelerate_prepare", **options)
    convert(model, recipe=recipe, filter=filter, module_filter_fn=module_filter_fn,
            always_quantize=True)
    return accelerator.prepare(model, *objects)
