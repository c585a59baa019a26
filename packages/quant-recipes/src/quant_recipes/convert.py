"""``convert`` / ``unconvert``: an existing model's ``torch.nn.Linear`` layers as quantized
:class:`~quant_recipes.Linear` layers and back, in place, sharing the same Parameters.

Which modules are Linear layers: ``torch.nn.Linear`` and its subclasses that keep its
``forward`` (such as ``NonDynamicallyQuantizableLinear``); a subclass that overrides ``forward``
computes something else, so it is left as it is. Hugging Face's ``transformers`` ``Conv1D``
(GPT-2's projections) is a linear layer whose weight is stored ``[in, out]``; it is not an
``nn.Linear`` and is left as it is. A module registered under several names (a shared layer) is
replaced by one new layer at all of them.

Which layers stay in high precision (the default ``filter``, as TransformerEngine and torchao
users choose by hand): the output heads, whose logits feed a softmax over the vocabulary and lose
the most to quantization. They are every Linear named ``lm_head``, ``head``, ``output``,
``classifier`` or ``score``; the model's output embedding when it has
``get_output_embeddings()`` (Hugging Face models); and the last module of an ``nn.Sequential``
model when it is a Linear (the layer that produces the model's output). Pass
``filter=lambda fqn, module: True`` to convert every layer, or your own rule (``fqn`` is the
layer's fully qualified name in the model); a shared layer is converted when the filter accepts
every name it has.

Hugging Face ``transformers`` mixture-of-experts blocks (the experts module of Mixtral,
Qwen-MoE, OLMoE, DeepSeek-V3, GPT-OSS and the others built with ``use_experts_implementation``:
3-D ``gate_up_proj`` / ``down_proj`` parameters) are converted too: their two projections run as
quant's grouped GEMMs, named ``<fqn>.gate_up_proj`` and ``<fqn>.down_proj`` with
``module_type="grouped_linear"`` (:mod:`quant_recipes.hf_experts`). Experts kept as a
``ModuleList`` of MLPs are converted layer by layer (one dense GEMM per expert); to batch them,
hold their weights in a :class:`~quant_recipes.GroupedLinear` and call it on the tokens sorted by
expert.

Every layer left as it is is reported once at WARNING on the ``quant_recipes`` logger, with its
name and the reason (one line per reason), and a call that converts nothing says so with the
layer types it saw: a model that silently trains in full precision is the failure to avoid.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch

from .linear import Linear
from .module import check_bindable
from .moe import hf_experts
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


def _is_transposed_linear(m: torch.nn.Module) -> bool:
    """Hugging Face's ``transformers.pytorch_utils.Conv1D``: ``x @ W + b`` with ``W [in, out]``."""
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers")


def _unconvertible(m: torch.nn.Module) -> str | None:
    """Why a linear-like module that ``convert`` does not replace is left as it is, or None."""
    if isinstance(m, torch.nn.Linear) and not isinstance(m, Linear) and not _is_plain_linear(m):
        return f"{type(m).__name__} overrides nn.Linear.forward"
    if _is_transposed_linear(m):
        return ("transformers Conv1D stores its weight [in, out] and is not an nn.Linear; "
                "convert supports nn.Linear layers only")
    return None


def _output_heads(model: torch.nn.Module) -> set[int]:
    """``id`` of the modules that produce ``model``'s output: Hugging Face's output embedding
    and the last module of a (nested) ``nn.Sequential`` model."""
    heads = set()
    get = getattr(model, "get_output_embeddings", None)
    emb = get() if callable(get) else None
    if isinstance(emb, torch.nn.Module):
        heads.add(id(emb))
    last = model
    while isinstance(last, torch.nn.Sequential) and len(last):
        last = last[-1]
    if last is not model:
        heads.add(id(last))
    return heads


def default_filter(model: torch.nn.Module) -> Callable[[str, torch.nn.Module], bool]:
    """The default rule for ``model``: convert every Linear but the output heads (named as in
    :data:`HEAD_NAMES`, the output embedding, the last module of a Sequential model)."""
    heads = _output_heads(model)

    def keep_quantized(fqn: str, module: torch.nn.Module) -> bool:
        return id(module) not in heads and fqn.rsplit(".", 1)[-1] not in HEAD_NAMES

    return keep_quantized


def _names(fqns: list[str], most: int = 8) -> str:
    shown = ", ".join(fqns[:most])
    return shown if len(fqns) <= most else f"{shown} and {len(fqns) - most} more"


def _report(model: torch.nn.Module, skipped: dict[str, list[str]], converted: int) -> None:
    """One WARNING per reason a layer was left as it is; one more when nothing was converted
    and the model holds no quant layer (converting a converted model again is not a mistake)."""
    for why, fqns in skipped.items():
        log.warning("convert: %s layer%s left as %s: %s (%s)", len(fqns),
                    "" if len(fqns) == 1 else "s", "it is" if len(fqns) == 1 else "they are",
                    why, _names(fqns))
    if converted == 0 and not any(isinstance(m, Linear) or hf_experts.is_quantized_experts(m)
                                  for m in model.modules()):
        seen = Counter(type(m).__name__ for _, m in model.named_modules() if m is not model
                       and not list(m.children()))
        kinds = ", ".join(f"{n} x{c}" for n, c in seen.most_common(12)) or "none"
        log.warning("convert: no layer of %s was converted, so it will train in full "
                    "precision; layer types found: %s", type(model).__name__, kinds)


def _layer_quantizers(recipe: Recipe, fqn: str, module_type: str = "linear"):
    """``(tensor type, quantizer or None)`` of each slot ``recipe`` gives a layer of
    ``module_type`` named ``fqn``, forward slots first."""
    for mode, types in (("forward", ("input", "weight", "output")),
                        ("backward", ("grad_output", "grad_input"))):
        roles = [QuantizerRole(module_type, t, fqn) for t in types]
        state = RecipeState.create(recipe, mode=mode, num_quantizers=len(roles), roles=roles)
        yield from zip(types, state.make_quantizers(), strict=True)


def unsupported_shape(recipe: Recipe, fqn: str, in_features: int, out_features: int,
                      dtype: torch.dtype, rows: int | None = None,
                      module_type: str = "linear") -> str | None:
    """Why ``recipe`` cannot quantize a Linear of this shape (its block sizes), or None. With
    ``rows`` (the tokens of one step) the input and the gradient are quantized on the meta
    device, so the rules on rows and input dtypes apply too (NVFP4's Hadamard transform)."""
    m = 16 if rows is None else rows
    shapes = {"input": (m, in_features), "weight": (out_features, in_features),
              "grad_output": (m, out_features)}
    for tensor_type, q in _layer_quantizers(recipe, fqn, module_type):
        if q is None or tensor_type not in shapes:
            continue
        shape = shapes[tensor_type]
        try:
            if rows is not None and tensor_type != "weight":
                q.quantize(torch.empty(shape, dtype=dtype, device="meta"))
            else:
                q.make_empty(shape, dtype=dtype, device="meta")
        except ValueError as e:
            return f"{tensor_type}: {e}"
    return None


def check_input_dtype(recipe: Recipe, fqn: str, dtype: torch.dtype,
                      module_type: str = "linear") -> None:
    """``ValueError`` when ``recipe`` quantizes bfloat16 inputs of layer ``fqn`` but not inputs
    of its parameters' ``dtype`` (NVFP4's Hadamard transform takes bfloat16 only); the
    quantizer's message names the fix."""
    q = dict(_layer_quantizers(recipe, fqn, module_type))["input"]
    if q is None or dtype == torch.bfloat16:
        return

    def refusal(dt: torch.dtype) -> ValueError | None:
        try:
            q.quantize(torch.empty((16, 16), dtype=dt, device="meta"))
        except ValueError as e:
            return e
        except (RuntimeError, NotImplementedError):  # state on a real device: no probe on meta
            return None
        return None

    why = refusal(dtype)
    if why is not None and refusal(torch.bfloat16) is None:
        raise ValueError(f"convert: layer {fqn!r} has {dtype} parameters, which "
                         f"{type(recipe).__name__} cannot take: {why}") from None


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
            recipe: Recipe | None = None, always_quantize: bool = False) -> torch.nn.Module:
    """Replace, in place, each Linear layer of ``model`` (an ``nn.Linear``, or a subclass that
    keeps its ``forward``) that ``filter(fqn, module)`` accepts (default:
    :func:`default_filter`) by a :class:`~quant_recipes.Linear` named ``fqn``
    (so ``CustomRecipe`` factories see ``QuantizerRole(name=fqn)``) that holds the very same
    ``weight`` and ``bias`` Parameters: no copy, optimizer state stays valid, ``state_dict``
    keys are unchanged. With ``recipe``, layers whose shapes it cannot take (K or N not a
    multiple of its block) are left as they are, with a warning naming the layer. Forward hooks
    registered on a replaced layer are not carried over. Returns ``model``.

    With ``always_quantize=True`` the converted layers are bound to ``recipe``
    (:attr:`~quant_recipes.QuantizedModule.bound_recipe`): they quantize with it even when no
    :func:`~quant_recipes.autocast` is active, for training loops a framework owns. An
    enclosing autocast still decides (its recipe, or ``enabled=False``). The default keeps
    quantization inside autocast only, as TransformerEngine does.

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
    if always_quantize:
        if recipe is None:
            raise ValueError("convert: always_quantize=True needs the recipe to quantize with "
                             "(recipe=...)")
        check_bindable(recipe)  # before any swap
    accept = filter if filter is not None else default_filter(model)
    skipped: dict[str, list[str]] = {}
    for m, fqns in _occurrences(model, lambda m: _unconvertible(m) is not None):
        skipped.setdefault(_unconvertible(m), []).append(fqns[0])
    converted = 0
    for old, fqns in _occurrences(model, _is_plain_linear):
        fqn = fqns[0]
        if not all(accept(name, old) for name in fqns):
            why = ("the default filter keeps output heads in high precision" if filter is None
                   else "the filter keeps them in high precision")
            skipped.setdefault(why, []).append(", ".join(fqns))
            continue
        if recipe is not None:
            check_input_dtype(recipe, fqn, old.weight.dtype)
            why = unsupported_shape(recipe, fqn, old.in_features, old.out_features,
                                    old.weight.dtype)
            if why is not None:
                skipped.setdefault(f"{type(recipe).__name__} cannot take their shapes", []).append(
                    f"{fqn} (in_features={old.in_features}, out_features={old.out_features}: "
                    f"{why})")
                continue
        new = Linear(old.in_features, old.out_features, bias=old.bias is not None,
                     device="meta", dtype=old.weight.dtype, name=fqn)
        if always_quantize:
            new.bound_recipe = recipe
        _swap(model, fqns, _adopt(new, old))
        converted += 1
    converted += _convert_experts(model, accept, filter is None, recipe, always_quantize, skipped)
    _report(model, skipped, converted)
    return model


def _convert_experts(model, accept, default_filter: bool, recipe, always_quantize: bool,
                     skipped: dict[str, list[str]]) -> int:
    """Convert the ``transformers`` experts modules of ``model`` (see the module docstring);
    returns how many."""
    converted = 0
    for m, fqns in _occurrences(model, hf_experts.is_hf_experts):
        fqn = fqns[0]
        why = hf_experts.unsupported_reason(m)
        if why is None and not all(accept(name, m) for name in fqns):
            why = ("the default filter keeps them in high precision" if default_filter
                   else "the filter keeps them in high precision")
        if why is None and recipe is not None:
            for name, (k, n) in hf_experts.projection_shapes(m).items():
                check_input_dtype(recipe, f"{fqn}.{name}", m.down_proj.dtype, "grouped_linear")
                bad = unsupported_shape(recipe, f"{fqn}.{name}", k, n, m.down_proj.dtype,
                                        module_type="grouped_linear")
                if bad is not None:
                    why = f"{type(recipe).__name__} cannot take their shapes"
                    fqn = f"{fqn}.{name} (in_features={k}, out_features={n}: {bad})"
                    break
        if why is not None:
            skipped.setdefault(why, []).append(fqn)
            continue
        hf_experts.quantize_experts(m, fqn, recipe if always_quantize else None)
        converted += 1
    return converted


def unconvert(model: torch.nn.Module) -> torch.nn.Module:
    """Replace, in place, every :class:`~quant_recipes.Linear` of ``model`` by a plain
    ``torch.nn.Linear`` holding the same Parameters (delayed-scaling state is dropped), one per
    shared layer at all its names, and give converted ``transformers`` experts modules their
    own forward back. Returns ``model``."""
    for old, fqns in _occurrences(model, lambda m: isinstance(m, Linear)):
        new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                              device="meta", dtype=old.weight.dtype)
        _swap(model, fqns, _adopt(new, old))
    for m, _ in _occurrences(model, hf_experts.is_quantized_experts):
        hf_experts.restore_experts(m)
    return model
