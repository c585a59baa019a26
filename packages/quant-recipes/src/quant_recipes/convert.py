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
model when it is a Linear (the layer that produces the model's output). LoRA adapters stay in
high precision too: every Linear under a module named ``lora_A`` or ``lora_B`` (PEFT's adapter
layers, ``<layer>.lora_A.<adapter name>``), small rank-``r`` layers that are the ones trained,
so that converting before or after ``peft.get_peft_model`` quantizes the same layers: the base
layers, not the adapters. Pass ``filter=lambda fqn, module: True`` to convert every layer, or
your own rule.

The filter is called as ``filter(fqn, module)``, name first. A filter written for torchao's
``quantize_`` / ``convert_to_float8_training`` takes ``(module, fqn)``: pass it as
``module_filter_fn=`` instead, which ``convert`` calls in torchao's order (one or the other,
never both). The filter is called for each module ``convert`` could
convert, in this order: the Linear layers it can replace; the ``transformers`` experts modules
(below: not ``nn.Linear`` layers, they have no ``in_features``); with ``always_quantize=True``
the quant layers the model already holds (``Linear``, ``GroupedLinear``, converted experts
modules). A module registered under several names is asked under each (``fqn``: its fully
qualified name) until the filter refuses one, and converted when it accepts all. Modules left as
they are for another reason (below) are not asked.

Hugging Face ``transformers`` mixture-of-experts blocks (the experts module of Mixtral,
Qwen-MoE, OLMoE, DeepSeek-V3, GPT-OSS and the others built with ``use_experts_implementation``:
3-D ``gate_up_proj`` / ``down_proj`` parameters) are converted too: their two projections run as
quant's grouped GEMMs, named ``<fqn>.gate_up_proj`` and ``<fqn>.down_proj`` with
``module_type="grouped_linear"`` (:mod:`quant_recipes.hf_experts`). Experts kept as a
``ModuleList`` of MLPs are converted layer by layer (one dense GEMM per expert); to batch them,
hold their weights in a :class:`~quant_recipes.GroupedLinear` and call it on the tokens sorted by
expert.

Also left as they are: a Linear whose parameters are parametrized
(``torch.nn.utils.parametrize``: ``weight_norm``, ``spectral_norm``, ``orthogonal``) or computed
by a hook (the older ``torch.nn.utils.weight_norm``), whose computation a swap would drop, and an
``nn.LazyLinear`` not materialized yet (convert it after its first forward).

Every layer left as it is is reported once at WARNING on the ``quant_recipes`` logger, with its
name and the reason (one line per reason), and a call that converts nothing says so with the
layer types it saw: a model that silently trains in full precision is the failure to avoid.

``convert`` is all or nothing: it decides about every layer (calling the filter, checking the
recipe) before it swaps the first, so an exception from the filter or a refusal leaves the model
as it was.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from .checkpointing import wire_hf_checkpointing
from .linear import Linear
from .module import QuantizedModule, check_bindable
from .moe import GroupedLinear, hf_experts
from .recipe_names import as_recipe
from .recipes import Recipe
from .role import QuantizerRole
from .states import RecipeState
from .tensor_parallel.styles import parallel_style

log = logging.getLogger("quant_recipes")

#: Final names of the layers the default filter keeps in high precision.
HEAD_NAMES = frozenset({"lm_head", "head", "output", "classifier", "score"})
#: Names of the modules that hold LoRA adapter layers (PEFT's), kept in high precision by the
#: default filter.
ADAPTER_NAMES = frozenset({"lora_A", "lora_B"})


def is_lora_adapter(fqn: str) -> bool:
    """Whether the layer named ``fqn`` is a LoRA adapter layer: it lies under a module named as
    in :data:`ADAPTER_NAMES`."""
    return not ADAPTER_NAMES.isdisjoint(fqn.split("."))


def kept_by_name(fqn: str) -> bool:
    """Whether the default filter keeps the layer named ``fqn`` in high precision by its name
    alone: an output head (:data:`HEAD_NAMES`) or a LoRA adapter layer."""
    return fqn.rsplit(".", 1)[-1] in HEAD_NAMES or is_lora_adapter(fqn)


def _is_plain_linear(m: torch.nn.Module) -> bool:
    """An ``nn.Linear`` (or subclass) that computes ``nn.Linear.forward``, not quant's own."""
    return (isinstance(m, torch.nn.Linear) and not isinstance(m, Linear)
            and type(m).forward is torch.nn.Linear.forward)


def _is_quant_layer(m: torch.nn.Module) -> bool:
    """One of quant's layers: its ``Linear``, ``GroupedLinear``, a converted experts module."""
    return isinstance(m, (Linear, GroupedLinear)) or hf_experts.is_quantized_experts(m)


def _quant_gemms(m: torch.nn.Module) -> list[tuple[QuantizedModule, str, int, int, torch.dtype]]:
    """``(module that holds the bound recipe, module_type, in_features, out_features,
    parameter dtype)`` of each quantized GEMM of the quant layer ``m``."""
    if hf_experts.is_quantized_experts(m):
        return [(p, "grouped_linear", p.in_features, p.out_features, m.down_proj.dtype)
                for p in (m._quant_up, m._quant_down)]
    kind = "linear" if isinstance(m, Linear) else "grouped_linear"
    return [(m, kind, m.in_features, m.out_features, m.weight.dtype)]


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
    if isinstance(m, torch.nn.Linear) and not isinstance(m, Linear):
        if not _is_plain_linear(m):
            return f"{type(m).__name__} overrides nn.Linear.forward"
        if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
            return (f"{type(m).__name__} has not been materialized (convert it after its first "
                    "forward)")
        if parametrize.is_parametrized(m):
            return ("its parameters are parametrized (torch.nn.utils.parametrize: weight_norm, "
                    "spectral_norm, orthogonal, ...), which a swap would drop")
        for name in ("weight", "bias"):
            t = getattr(m, name)
            if t is not None and not isinstance(t, torch.nn.Parameter):
                return (f"its {name} is not a Parameter (a hook computes it, as the older "
                        "torch.nn.utils.weight_norm does), which a swap would drop")
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
    :data:`HEAD_NAMES`, the output embedding, the last module of a Sequential model) and the
    LoRA adapters (:func:`is_lora_adapter`)."""
    heads = _output_heads(model)

    def keep_quantized(fqn: str, module: torch.nn.Module) -> bool:
        return id(module) not in heads and not kept_by_name(fqn)

    return keep_quantized


def _names(fqns: list[str], most: int = 8) -> str:
    shown = ", ".join(fqns[:most])
    return shown if len(fqns) <= most else f"{shown} and {len(fqns) - most} more"


def _report(model: torch.nn.Module, skipped: dict[str, list[str]], converted: int,
            bound_to: Recipe | None) -> None:
    """One WARNING per reason a layer was left as it is; one more when the model will train in
    full precision: nothing converted and no quant layer in it (converting a converted model
    again is not a mistake), or, binding ``bound_to``, no layer bound to a recipe."""
    for why, fqns in skipped.items():
        log.warning("convert: %s layer%s left as %s: %s (%s)", len(fqns),
                    "" if len(fqns) == 1 else "s", "it is" if len(fqns) == 1 else "they are",
                    why, _names(fqns))
    if bound_to is not None:
        if any(isinstance(m, QuantizedModule) and m.bound_recipe is not None
               for m in model.modules()):
            return
        what = (f"is bound to {type(bound_to).__name__}, so it will train in full precision "
                "outside autocast")
    elif converted == 0 and not any(_is_quant_layer(m) for m in model.modules()):
        what = "was converted, so it will train in full precision"
    else:
        return
    seen = Counter(type(m).__name__ for _, m in model.named_modules() if m is not model
                   and not list(m.children()))
    kinds = ", ".join(f"{n} x{c}" for n, c in seen.most_common(12)) or "none"
    log.warning("convert: no layer of %s %s; layer types found: %s", type(model).__name__, what,
                kinds)


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
                      module_type: str = "linear", *, name: str | None = None) -> None:
    """``ValueError`` when ``recipe`` quantizes bfloat16 inputs of layer ``fqn`` (its roles
    named ``name``, default ``fqn``) but not inputs of its parameters' ``dtype`` (NVFP4's
    Hadamard transform takes bfloat16 only); the quantizer's message names the fix."""
    q = dict(_layer_quantizers(recipe, fqn if name is None else name, module_type))["input"]
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


def _asked(accept: Callable[[str, torch.nn.Module], bool]
           ) -> Callable[[list[str], torch.nn.Module], bool]:
    """Whether ``accept`` takes a module under every one of its names; an exception it raises
    gets a note naming the module (Python 3.11 and later)."""
    def every_name(fqns: list[str], module: torch.nn.Module) -> bool:
        for fqn in fqns:
            try:
                if not accept(fqn, module):
                    return False
            except Exception as e:
                if hasattr(e, "add_note"):
                    e.add_note(f"convert: raised by the filter on {fqn!r} "
                               f"({type(module).__name__}); the model was left as it was")
                raise
        return True

    return every_name


def _refusal(recipe: Recipe | None, fqn: str, name: str, k: int, n: int, dtype: torch.dtype,
             module_type: str = "linear") -> str | None:
    """Why ``recipe`` leaves layer ``fqn`` (roles named ``name``, ``k`` in and ``n`` out
    features) as it is, or None; a dtype it cannot take raises (:func:`check_input_dtype`)."""
    if recipe is None:
        return None
    check_input_dtype(recipe, fqn, dtype, module_type, name=name)
    why = unsupported_shape(recipe, name, k, n, dtype, module_type=module_type)
    return None if why is None else f"{fqn} (in_features={k}, out_features={n}: {why})"


class _Plan:
    """What one ``convert`` call does, decided before it changes anything: the swaps, the
    experts modules to convert, the quant layers to bind, and the layers left as they are."""

    def __init__(self, recipe: Recipe | None, default: bool) -> None:
        self.recipe, self.default = recipe, default
        self.swaps: list[tuple[list[str], Linear]] = []
        self.experts: list[tuple[torch.nn.Module, str]] = []
        self.bind: list[QuantizedModule] = []
        self.skipped: dict[str, list[str]] = {}

    def skip(self, why: str, what: str) -> None:
        self.skipped.setdefault(why, []).append(what)

    def kept_by_filter(self, fqns: list[str]) -> None:
        if not self.default:
            why = "the filter keeps them in high precision"
        elif any(is_lora_adapter(fqn) for fqn in fqns):
            why = "the default filter keeps LoRA adapters (lora_A, lora_B) in high precision"
        else:
            why = "the default filter keeps output heads in high precision"
        self.skip(why, ", ".join(fqns))

    def shape_refused(self, what: str) -> None:
        self.skip(f"{type(self.recipe).__name__} cannot take their shapes", what)


def _plan_linears(model: torch.nn.Module, plan: _Plan, accepts, bind: bool) -> None:
    for old, fqns in _occurrences(model, lambda m: _unconvertible(m) is not None):
        plan.skip(_unconvertible(old), fqns[0])
    for old, fqns in _occurrences(model, lambda m: _is_plain_linear(m)
                                  and _unconvertible(m) is None):
        fqn = fqns[0]
        if not accepts(fqns, old):
            plan.kept_by_filter(fqns)
            continue
        why = _refusal(plan.recipe, fqn, fqn, old.in_features, old.out_features, old.weight.dtype)
        if why is not None:
            plan.shape_refused(why)
            continue
        new = Linear(old.in_features, old.out_features, bias=old.bias is not None,
                     device="meta", dtype=old.weight.dtype, name=fqn)
        if bind:
            new.bound_recipe = plan.recipe
        plan.swaps.append((fqns, _adopt(new, old)))


def _plan_experts(model: torch.nn.Module, plan: _Plan, accepts) -> None:
    for m, fqns in _occurrences(model, hf_experts.is_hf_experts):
        fqn = fqns[0]
        why = hf_experts.unsupported_reason(m)
        if why is not None:
            plan.skip(why, fqn)
            continue
        if not accepts(fqns, m):
            plan.kept_by_filter([fqn])
            continue
        for name, (k, n) in hf_experts.projection_shapes(m).items():
            why = _refusal(plan.recipe, f"{fqn}.{name}", f"{fqn}.{name}", k, n,
                           m.down_proj.dtype, "grouped_linear")
            if why is not None:
                plan.shape_refused(why)
                break
        else:
            plan.experts.append((m, fqn))


def _plan_bindings(model: torch.nn.Module, plan: _Plan, accepts) -> None:
    """Bind the quant layers ``model`` already holds (built with them, or converted before), as
    the layers this call converts are bound: those ``accepts`` takes (None: all of them) whose
    shapes the recipe takes."""
    for m, fqns in _occurrences(model, _is_quant_layer):
        fqn = fqns[0]
        gemms = _quant_gemms(m)
        if accepts is not None and not accepts(fqns, m):
            if all(q.bound_recipe is None for q, *_ in gemms):
                plan.kept_by_filter(fqns)
            continue
        whys = [_refusal(plan.recipe, fqn if q is m else f"{fqn}.{q.name.rpartition('.')[2]}",
                         q.name, k, n, dtype, kind) for q, kind, k, n, dtype in gemms]
        why = next((w for w in whys if w is not None), None)
        if why is not None:
            plan.shape_refused(why)
            continue
        plan.bind.extend(q for q, *_ in gemms)


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


def _name_first(module_filter_fn: Callable[[torch.nn.Module, str], bool]
                ) -> Callable[[str, torch.nn.Module], bool]:
    """A ``filter(fqn, module)`` that asks torchao's ``module_filter_fn(module, fqn)``."""
    if not callable(module_filter_fn):
        raise TypeError(f"convert: module_filter_fn must be callable, got {module_filter_fn!r}")

    def filter(fqn: str, module: torch.nn.Module) -> bool:  # noqa: A001  (convert's name)
        return module_filter_fn(module, fqn)

    return filter


def convert(model: torch.nn.Module, *, filter: Callable[[str, torch.nn.Module], bool] | None = None,
            recipe: Recipe | str | None = None, always_quantize: bool = False,
            module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None
            ) -> torch.nn.Module:
    """Replace, in place, each Linear layer of ``model`` (an ``nn.Linear``, or a subclass that
    keeps its ``forward``) that ``filter(fqn, module)`` accepts (default:
    :func:`default_filter`) by a :class:`~quant_recipes.Linear` named ``fqn``
    (so ``CustomRecipe`` factories see ``QuantizerRole(name=fqn)``) that holds the very same
    ``weight`` and ``bias`` Parameters: no copy, optimizer state stays valid, ``state_dict``
    keys are unchanged. With ``recipe``, layers whose shapes it cannot take (K or N not a
    multiple of its block) are left as they are, with a warning naming the layer. Forward hooks
    registered on a replaced layer are not carried over. Returns ``model``.

    ``recipe`` is a :class:`~quant_recipes.Recipe` or a name :func:`~quant_recipes.recipe`
    knows (``"mxfp8"``). ``module_filter_fn(module, fqn)`` is ``filter`` with torchao's argument
    order (module first), for a filter written for torchao; give one of the two.

    ``filter`` is also called with ``transformers`` experts modules, which are not
    ``nn.Linear`` layers, and with ``always_quantize=True`` with the quant layers already in
    the model (see the module docstring). All or nothing: an exception from ``filter`` or a
    recipe check leaves ``model`` as it was.

    With ``always_quantize=True`` the converted layers are bound to ``recipe``
    (:attr:`~quant_recipes.QuantizedModule.bound_recipe`): they quantize with it even when no
    :func:`~quant_recipes.autocast` is active, for training loops a framework owns. So are the
    quant layers ``model`` already holds (its own ``Linear`` and ``GroupedLinear``, layers
    converted before): all of them with the default filter, which chooses among plain Linear
    layers only, those ``filter`` accepts when one is given, each where ``recipe`` takes its
    shapes. An enclosing autocast still decides (its recipe, or ``enabled=False``). The default
    keeps quantization inside autocast only, as TransformerEngine does.

    A ``transformers`` model's gradient checkpointing, enabled before or after, recomputes
    under the forward's autocast frame, also for layers compiled on their own
    (:func:`~quant_recipes.in_forward_frame`).

    A model that is itself a bare ``nn.Linear`` cannot be replaced in place: wrap it first. A
    layer registered under several names is replaced by one new layer at all of them (named by
    its first name), so sharing survives.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.nn.Linear):
        raise TypeError("convert: model is a bare nn.Linear; convert a module that contains it")
    if recipe is not None:
        recipe = as_recipe(recipe, "convert")
    if module_filter_fn is not None:
        if filter is not None:
            raise TypeError("convert: give filter (called as filter(fqn, module)) or "
                            "module_filter_fn (torchao's order: module_filter_fn(module, fqn)), "
                            "not both")
        filter = _name_first(module_filter_fn)
    if always_quantize:
        if recipe is None:
            raise ValueError("convert: always_quantize=True needs the recipe to quantize with "
                             "(recipe=...)")
        check_bindable(recipe, "convert")
    accepts = _asked(filter if filter is not None else default_filter(model))
    plan = _Plan(recipe, filter is None)
    _plan_linears(model, plan, accepts, always_quantize)
    _plan_experts(model, plan, accepts)
    if always_quantize:
        _plan_bindings(model, plan, None if filter is None else accepts)
    # every decision is made: from here on nothing raises, the model changes as a whole
    for fqns, new in plan.swaps:
        _swap(model, fqns, new)
    for m, fqn in plan.experts:
        hf_experts.quantize_experts(m, fqn, recipe if always_quantize else None)
    for q in plan.bind:
        q.bound_recipe = recipe
    wire_hf_checkpointing(model)
    _report(model, plan.skipped, len(plan.swaps) + len(plan.experts),
            recipe if always_quantize else None)
    return model


def _parallel_refusal(m: Linear) -> str | None:
    """Why ``unconvert`` cannot give the layer ``m`` a plain ``nn.Linear``, or None."""
    style = parallel_style(m)
    if style is not None:
        return (f"is tensor-parallel ({style}): a plain nn.Linear would hold its DTensor "
                "parameters without the style's input and output hooks and fail at its next "
                "forward; unconvert the model before parallelize_module (then parallelize it with "
                "torch's ColwiseParallel/RowwiseParallel), or load its state_dict into a model "
                "that is not parallelized")
    if any(isinstance(p, DTensor) for p in m.parameters(recurse=False)):
        return ("has DTensor parameters (sharded by fully_shard or another DTensor API), which "
                "the sharding keeps updating on this module, not on a new one; unconvert the "
                "model before fully_shard or parallelize_module, or load its state_dict into a "
                "model that is not sharded")
    return None


def unconvert(model: torch.nn.Module) -> torch.nn.Module:
    """Replace, in place, every :class:`~quant_recipes.Linear` of ``model`` by a plain
    ``torch.nn.Linear`` holding the same Parameters (delayed-scaling state is dropped), one per
    shared layer at all its names, and give converted ``transformers`` experts modules their
    own forward back. Returns ``model``.

    A layer that is tensor-parallel (:class:`~quant_recipes.QuantColwiseParallel`, ...) or
    otherwise holds DTensor parameters (``fully_shard``) raises ``ValueError`` naming it, and
    the model is left as it was: unconvert before parallelizing."""
    layers = _occurrences(model, lambda m: isinstance(m, Linear))
    for old, fqns in layers:
        why = _parallel_refusal(old)
        if why is not None:
            raise ValueError(f"unconvert: layer {fqns[0]!r} {why}")
    for old, fqns in layers:
        new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                              device="meta", dtype=old.weight.dtype)
        _swap(model, fqns, _adopt(new, old))
    for m, _ in _occurrences(model, hf_experts.is_quantized_experts):
        hf_experts.restore_experts(m)
    return model
