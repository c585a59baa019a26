"""``convert`` / ``unconvert``: an existing model's ``torch.nn.Linear`` layers as quantized
:class:`~quant_recipes.Linear` layers and back, in place, sharing the same Parameters.

Which layers stay in high precision (the default ``filter``, as TransformerEngine and torchao
users choose by hand): the output layer and language-model heads, whose logits feed a softmax
over the vocabulary and lose the most to quantization, that is every Linear named ``lm_head``,
``head``, ``output``, ``classifier`` or ``score`` and the last Linear of the model in
registration order. Pass ``filter=lambda fqn, module: True`` to convert every layer, or your own
rule (``fqn`` is the layer's fully qualified name in the model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .linear import Linear
from .recipes import Recipe
from .role import QuantizerRole
from .states import RecipeState

log = logging.getLogger("quant_recipes")

#: Final names of the layers the default filter keeps in high precision.
HEAD_NAMES = frozenset({"lm_head", "head", "output", "classifier", "score"})


def _linears(model: torch.nn.Module, kind: type) -> list[tuple[str, torch.nn.Module]]:
    """``(fqn, module)`` of every module of exactly ``kind`` (subclasses are someone else's)."""
    return [(fqn, m) for fqn, m in model.named_modules() if type(m) is kind and fqn]


def default_filter(model: torch.nn.Module) -> Callable[[str, torch.nn.Module], bool]:
    """The default rule for ``model``: convert every Linear but the heads (:data:`HEAD_NAMES`)
    and the model's last Linear."""
    found = _linears(model, torch.nn.Linear)
    last = found[-1][0] if found else None

    def keep_quantized(fqn: str, module: torch.nn.Module) -> bool:
        return fqn != last and fqn.rsplit(".", 1)[-1] not in HEAD_NAMES

    return keep_quantized


def unsupported_shape(recipe: Recipe, fqn: str, in_features: int, out_features: int,
                      dtype: torch.dtype) -> str | None:
    """Why ``recipe`` cannot quantize a Linear of this shape (its block sizes), or None."""
    slots = (("forward", ("input", "weight", "output")),
             ("backward", ("grad_output", "grad_input")))
    shapes = {"input": (16, in_features), "weight": (out_features, in_features),
              "grad_output": (16, out_features)}
    for mode, types in slots:
        roles = [QuantizerRole("linear", t, fqn) for t in types]
        state = RecipeState.create(recipe, mode=mode, num_quantizers=len(roles), roles=roles)
        for role, q in zip(roles, state.make_quantizers(), strict=True):
            if q is None or role.tensor_type not in shapes:
                continue
            try:
                q.make_empty(shapes[role.tensor_type], dtype=dtype, device="meta")
            except ValueError as e:
                return f"{role.tensor_type}: {e}"
    return None


def _swap(model: torch.nn.Module, fqn: str, new: torch.nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _adopt(new: torch.nn.Module, old: torch.nn.Module) -> torch.nn.Module:
    """``new`` (built on the meta device) holding ``old``'s Parameters, mode and hooks-free."""
    new.weight = old.weight
    new.bias = old.bias
    new.train(old.training)
    return new


def convert(model: torch.nn.Module, *, filter: Callable[[str, torch.nn.Module], bool] | None = None,
            recipe: Recipe | None = None) -> torch.nn.Module:
    """Replace, in place, each ``torch.nn.Linear`` of ``model`` that ``filter(fqn, module)``
    accepts (default: :func:`default_filter`) by a :class:`~quant_recipes.Linear` named ``fqn``
    (so ``CustomRecipe`` factories see ``QuantizerRole(name=fqn)``) that holds the very same
    ``weight`` and ``bias`` Parameters: no copy, optimizer state stays valid, ``state_dict``
    keys are unchanged. With ``recipe``, layers whose shapes it cannot take (K or N not a
    multiple of its block) are left as they are, with a warning naming the layer. Forward hooks
    registered on a replaced layer are not carried over. Returns ``model``.

    A model that is itself a bare ``nn.Linear`` cannot be replaced in place: wrap it first.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if type(model) is torch.nn.Linear:
        raise TypeError("convert: model is a bare nn.Linear; convert a module that contains it")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"convert: recipe must be a quant_recipes.Recipe, got {recipe!r}")
    accept = filter if filter is not None else default_filter(model)
    for fqn, old in _linears(model, torch.nn.Linear):
        if not accept(fqn, old):
            log.info("convert: %s stays in high precision (filter)", fqn)
            continue
        why = (unsupported_shape(recipe, fqn, old.in_features, old.out_features,
                                 old.weight.dtype) if recipe is not None else None)
        if why is not None:
            log.warning("convert: %s stays in high precision: %s cannot take "
                        "in_features=%d, out_features=%d (%s)", fqn, type(recipe).__name__,
                        old.in_features, old.out_features, why)
            continue
        new = Linear(old.in_features, old.out_features, bias=old.bias is not None,
                     device="meta", dtype=old.weight.dtype, name=fqn)
        _swap(model, fqn, _adopt(new, old))
    return model


def unconvert(model: torch.nn.Module) -> torch.nn.Module:
    """Replace, in place, every :class:`~quant_recipes.Linear` of ``model`` by a plain
    ``torch.nn.Linear`` holding the same Parameters (delayed-scaling state is dropped).
    Returns ``model``."""
    for fqn, old in _linears(model, Linear):
        new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                              device="meta", dtype=old.weight.dtype)
        _swap(model, fqn, _adopt(new, old))
    return model


__all__ = ["convert", "unconvert", "default_filter", "unsupported_shape", "HEAD_NAMES"]
