"""``convert`` / ``unconvert``: an existing model's ``torch.nn.Linear`` layers as quantized
:class:`~quant_recipes.Linear` layers and back, in place, sharing the same Parameters.

Which modules are Linear layers: ``torch.nn.Linear`` and its subclasses that keep its
``forward`` (such as ``NonDynamicallyQuantizableLinear``); a subclass that overrides ``forward``
computes something else, so it is left as it is (logged at INFO, with the reason). A module
registered under several names (a shared layer) is replaced by one new layer at all of them.

Which layers stay in high precision (the default ``filter``, as TransformerEngine and torchao
users choose by hand): the output layer and language-model heads, whose logits feed a softmax
over the vocabulary and lose the most to quantization, that is every Linear named ``lm_head``,
``head``, ``output``, ``classifier`` or ``score`` and the last Linear of the model in
registration order. Pass ``filter=lambda fqn, module: True`` to convert every layer, or your own
rule (``fqn`` is the layer's fully qualified name in the model); a shared layer is converted
when the filter accepts every name it has.
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


def _is_plain_linear(m: torch.nn.Module) -> bool:
    """An ``nn.Linear`` (or subclass) that computes ``nn.Linear.forward``, not quant's own."""
    return (isinstance(m, torch.nn.Linear) and not isinstance(m, Linear)
            and type(m).forward is torch.nn.Linear.forward)


def _occurrences(model: torch.nn.Module, wanted: Callable[[torch.nn.Module], bool]
                 ) -> list[tuple[torch.nn.Module, list[str]]]:
    """Every module ``wanted`` accepts, once, with all the names it is registered under (in
    registration order; the model itself excluded)."""
    names: dict[int, tuple[torch.nn.Module, list[str]]] = {}
    for fqn, m in model.named_modules(remove_duplicate=False):
        if fqn and wanted(m):
            names.setdefault(id(m), (m, []))[1].append(fqn)
    return list(names.values())


def _log_overridden_forwards(model: torch.nn.Module) -> None:
    for m, fqns in _occurrences(model, lambda m: isinstance(m, torch.nn.Linear)
                                and not isinstance(m, Linear) and not _is_plain_linear(m)):
        log.info("convert: %s stays as it is: %s overrides nn.Linear.forward", fqns[0],
                 type(m).__name__)


def default_filter(model: torch.nn.Module) -> Callable[[str, torch.nn.Module], bool]:
    """The default rule for ``model``: convert every Linear but the heads (:data:`HEAD_NAMES`)
    and the model's last Linear."""
    found = [fqn for fqn, m in model.named_modules(remove_duplicate=False)
             if fqn and _is_plain_linear(m)]
    last = found[-1] if found else None

    def keep_quantized(fqn: str, module: torch.nn.Module) -> bool:
        return fqn != last and fqn.rsplit(".", 1)[-1] not in HEAD_NAMES

    return keep_quantized


def unsupported_shape(recipe: Recipe, fqn: str, in_features: int, out_features: int,
                      dtype: torch.dtype, rows: int | None = None) -> str | None:
    """Why ``recipe`` cannot quantize a Linear of this shape (its block sizes), or None. With
    ``rows`` (the tokens of one step) the input and the gradient are quantized on the meta
    device, so the rules on rows and input dtypes apply too (NVFP4's Hadamard transform)."""
    slots = (("forward", ("input", "weight", "output")),
             ("backward", ("grad_output", "grad_input")))
    m = 16 if rows is None else rows
    shapes = {"input": (m, in_features), "weight": (out_features, in_features),
              "grad_output": (m, out_features)}
    for mode, types in slots:
        roles = [QuantizerRole("linear", t, fqn) for t in types]
        state = RecipeState.create(recipe, mode=mode, num_quantizers=len(roles), roles=roles)
        for role, q in zip(roles, state.make_quantizers(), strict=True):
            if q is None or role.tensor_type not in shapes:
                continue
            shape = shapes[role.tensor_type]
            try:
                if rows is not None and role.tensor_type != "weight":
                    q.quantize(torch.empty(shape, dtype=dtype, device="meta"))
                else:
                    q.make_empty(shape, dtype=dtype, device="meta")
            except ValueError as e:
                return f"{role.tensor_type}: {e}"
    return None


def _swap(model: torch.nn.Module, fqns: list[str], new: torch.nn.Module) -> None:
    for fqn in fqns:
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
    """Replace, in place, each Linear layer of ``model`` (an ``nn.Linear``, or a subclass that
    keeps its ``forward``) that ``filter(fqn, module)`` accepts (default:
    :func:`default_filter`) by a :class:`~quant_recipes.Linear` named ``fqn``
    (so ``CustomRecipe`` factories see ``QuantizerRole(name=fqn)``) that holds the very same
    ``weight`` and ``bias`` Parameters: no copy, optimizer state stays valid, ``state_dict``
    keys are unchanged. With ``recipe``, layers whose shapes it cannot take (K or N not a
    multiple of its block) are left as they are, with a warning naming the layer. Forward hooks
    registered on a replaced layer are not carried over. Returns ``model``.

    A model that is itself a bare ``nn.Linear`` cannot be replaced in place: wrap it first. A
    layer registered under several names is replaced by one new layer at all of them (named by
    its first name), so sharing survives.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.nn.Linear):
        raise TypeError("convert: model is a bare nn.Linear; convert a module that contains it")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"convert: recipe must be a quant_recipes.Recipe, got {recipe!r}")
    accept = filter if filter is not None else default_filter(model)
    _log_overridden_forwards(model)
    for old, fqns in _occurrences(model, _is_plain_linear):
        fqn = fqns[0]
        if not all(accept(name, old) for name in fqns):
            log.info("convert: %s stays in high precision (filter)", ", ".join(fqns))
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
        _swap(model, fqns, _adopt(new, old))
    return model


def unconvert(model: torch.nn.Module) -> torch.nn.Module:
    """Replace, in place, every :class:`~quant_recipes.Linear` of ``model`` by a plain
    ``torch.nn.Linear`` holding the same Parameters (delayed-scaling state is dropped), one per
    shared layer at all its names. Returns ``model``."""
    for old, fqns in _occurrences(model, lambda m: isinstance(m, Linear)):
        new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                              device="meta", dtype=old.weight.dtype)
        _swap(model, fqns, _adopt(new, old))
    return model


__all__ = ["convert", "unconvert", "default_filter", "unsupported_shape", "HEAD_NAMES"]
