"""``quantize_weights_per_step(model, recipe)``: each Linear's (and grouped experts') weight
quantized once per optimizer step, for compiled code as for eager code.

A training forward quantizes every weight again, though the weight changes only when the
optimizer steps: with gradient accumulation each micro-batch quantizes it, with activation
checkpointing the recomputed forward does too. :func:`quantize_weights_per_step` quantizes the
weights of a model's quantized ``Linear`` layers right away and again after every optimizer step
that updates them, and keeps the result on each layer. A forward under ``autocast`` with the
same recipe then reads the kept buffers instead of quantizing, compiled or not; backward's
input-gradient GEMM reads the kept columnwise copy (so the layer saves nothing of the weight,
whatever ``save_weight_copy`` says). The bytes are those the forward would make: the same
quantizer of the same tensor (value quantizers whose requantization gives the same bits only,
``Quantizer.is_requantization_safe``).

The kept copies are used by a forward whose weight quantizer is the one they were made with:
a grad-enabled forward whose input needs a gradient, under the recipe given here, without an
amax reduction group (``autocast(amax_reduction_group=...)``: the tensor-parallel weights).
Every other forward (``torch.no_grad`` evaluation, another recipe) quantizes as before.

What refreshes the copies, and what drops them (the layer then quantizes in forward, as
without them, until the next step refreshes it):

- a ``torch.optim.Optimizer.step()`` over the weight, in any thread, refreshes it (a global
  step post-hook, fused optimizers included);
- ``load_state_dict`` on the model or the layer refreshes it;
- a refresh writes the new bytes into the buffers already kept (their addresses stay, as CUDA
  graphs of compiled layers require), holding both copies of one layer's weight for a moment;
- :func:`~quant_recipes.invalidate_cached_weights` refreshes every kept weight;
- ``module.to()``, ``.half()`` and the other conversions drop them, as do ``copy.deepcopy`` and
  pickling (the copy is not refreshed by this handle);
- a weight that is not the Parameter they were made from (``torch.func.functional_call``,
  a replaced Parameter) is quantized in forward.

Eagerly a forward also checks the weight's version and storage, so any in-place change is seen.
Compiled code cannot read a tensor's version: after writing a weight outside an optimizer step
(``.data`` assignment, an in-place update under ``torch.no_grad``, ``copy_`` from an EMA, a
checkpoint loaded in place by ``torch.distributed.checkpoint.load``, a collective into the
weight, an optimizer wrapper that broadcasts updated shards after its inner
step such as ``ZeroRedundancyOptimizer``) call :func:`~quant_recipes.invalidate_cached_weights`
before the next compiled training forward.

Grouped experts (:class:`~quant_recipes.GroupedLinear`, converted ``transformers`` experts
modules) keep their weights where they run the FP8 current-scaling quantize-once path
(:mod:`~quant_recipes.moe.fp8_gemm`): the rowwise bytes, one scale per expert and the
transposed bytes, which forward and backward read instead of casting the weights (at
Qwen3-MoE widths the weights are most of the bytes a layer's step quantizes). Their other
paths quantize in forward.

Not kept: weights that are not plain Parameters (FSDP2's and tensor parallelism's DTensors,
quantized parameters of :func:`~quant_recipes.quantized_model_init`, which are quantized once per
step already), delayed scaling, stochastic rounding. Memory: the copies live from one step to
the next, both usages of every weight (two bytes per parameter for the FP8 formats), where a
forward otherwise makes the rowwise copy transiently.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
from quant_core import Quantizer
from torch.optim.optimizer import register_optimizer_step_post_hook

from .autocast import Frame, default_recipe
from .compiling import DERIVES_IN_GRAPH, FOLDS_CONSTANTS, compiling, trace_time_constant
from .gemm import is_high_precision
from .operands import plan_operands, requantizable
from .recipe_names import as_recipe
from .reuse import contents_key


class KeptWeight:
    """A layer's weight quantized by ``quantizer``: the storage buffers, the Parameter they were
    made from and its contents key at the time (:func:`~quant_recipes.reuse.contents_key`).
    Copies and pickles of a layer do not carry it (None in their place)."""

    __slots__ = ("weight", "quantizer", "buffers", "key")

    def __init__(self, weight: torch.nn.Parameter, quantizer: Quantizer,
                 buffers: tuple[torch.Tensor, ...], key: tuple) -> None:
        self.weight = weight
        self.quantizer = quantizer
        self.buffers = buffers
        self.key = key

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return _nothing, ()


def _nothing() -> None:
    return None


@trace_time_constant
def _same_quantizer(kept: Quantizer, q: Quantizer) -> bool:
    return kept == q


def kept_buffers(kept: KeptWeight, w: torch.Tensor, q: Quantizer
                 ) -> tuple[torch.Tensor, ...] | None:
    """The buffers ``kept`` holds of ``w`` quantized by ``q``, or None: made from another
    Parameter or with another quantizer, or (eagerly) ``w`` changed since. Compiled code
    compares the quantizers by value where it reads value quantizers' members (a quantizer
    derived in the trace is a new object), by identity on torch 2.10 (the recipe's kept
    quantizers, which a dense Linear reads)."""
    if kept.weight is not w:
        return None
    if compiling():
        same = (_same_quantizer(kept.quantizer, q) if FOLDS_CONSTANTS or DERIVES_IN_GRAPH
                else kept.quantizer is q)
        return kept.buffers if same else None
    if kept.quantizer == q and contents_key(w, None) == kept.key:
        return kept.buffers
    return None


def drop(layer: torch.nn.Module) -> None:
    """Forget ``layer``'s kept weight (it quantizes in forward until refreshed)."""
    layer._step_weight = None


def _keep(layer, owner, name: str, recipe) -> KeptWeight | None:
    """The Parameter ``name`` of ``owner`` quantized as ``layer``'s training forward under
    ``recipe`` quantizes it, or None where that is not kept (see the module docstring)."""
    w = getattr(owner, name, None)
    if type(w) is not torch.nn.Parameter or w.is_inference():
        return None
    from .moe.hf_experts import is_quantized_experts, projection_weight
    from .moe.linear import GroupedProjection

    if isinstance(layer, GroupedProjection):
        return layer.kept_weight(w, projection_weight(owner, name)
                                 if is_quantized_experts(owner) else w, recipe)
    from .linear import check_step_shapes

    qset = layer.quantizers(Frame(True, recipe, False, None), device=w.device)
    q = plan_operands(qset, recipe.backward_override, wgrad=w.requires_grad, dgrad=True,
                      keep_input=layer.save_input_copy).weight
    if is_high_precision(q) or not requantizable(q):
        return None
    check_step_shapes(layer.name, layer.in_features, layer.out_features, recipe,
                      [("weight", q, w)])
    key = contents_key(w, None)
    with torch.no_grad():
        buffers = tuple(q.quantize(w).buffer_list(w))
    return KeptWeight(w, q, buffers, key)


def _refreshed(old: KeptWeight | None, new: KeptWeight | None) -> KeptWeight | None:
    """``new``, its bytes written into ``old``'s buffers where both are of the same Parameter,
    quantizer and buffer shapes: the kept buffers keep their addresses from step to step, so a
    compiled graph replayed as a CUDA graph reads them where it recorded them (new tensors would
    have it record again, or copy them in, on every step). A graph that saved the old bytes for
    a backward still to run sees the write as an in-place change (autograd's version check)."""
    if (old is None or new is None or old.weight is not new.weight
            or old.quantizer != new.quantizer or len(old.buffers) != len(new.buffers)
            or any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
                   for a, b in zip(old.buffers, new.buffers, strict=True))):
        return new
    with torch.no_grad():
        for a, b in zip(old.buffers, new.buffers, strict=True):
            a.copy_(b)
    old.key = new.key
    return old


_lock = threading.Lock()
_handles: set[StepWeights] = set()  # live handles: held here until removed, so none goes stale
_hook = None  # the optimizer step post-hook, while any handle is live


def _stepped(optimizer, _args, _kwargs) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for handle in list(_handles):
        handle.refresh(lambda owner, name: id(getattr(owner, name, None)) in stepped)


def _loaded(module, _incompatible) -> None:
    """``load_state_dict`` post-hook: refresh the kept weights of ``module``'s Parameters."""
    for handle in list(_handles):
        handle.refresh(lambda owner, _name: owner is module)


def refresh_all() -> None:
    """Refresh every kept weight of every live handle (:func:`invalidate_cached_weights`)."""
    for handle in list(_handles):
        handle.refresh()


class StepWeights:
    """The handle :func:`quantize_weights_per_step` returns: ``refresh()`` quantizes the kept
    weights again now, ``remove()`` drops them and stops refreshing them."""

    def __init__(self, layers: Iterable[tuple[torch.nn.Module, torch.nn.Module, str]],
                 recipe) -> None:
        self.recipe = recipe
        # layer -> (its weight's owner, the Parameter's name): a Linear owns its weight, a
        # converted experts module the weights of its two projections
        self._layers = weakref.WeakKeyDictionary(
            (layer, (weakref.ref(owner), name)) for layer, owner, name in layers)
        owners = {id(o()): o() for o, _ in self._layers.values()}.values()
        # a module-level function: a hook that held the handle would not pickle, and a copy
        # of the model would carry a copy of the handle
        self._hooks = [owner.register_load_state_dict_post_hook(_loaded) for owner in owners]

    def refresh(self, which=None) -> None:
        """Quantize the kept weights again (those whose owner and Parameter name
        ``which(owner, name)`` is true for)."""
        for layer, (owner_ref, name) in list(self._layers.items()):
            owner = owner_ref()
            if owner is not None and (which is None or which(owner, name)):
                layer._step_weight = _refreshed(layer._step_weight,
                                                _keep(layer, owner, name, self.recipe))

    def remove(self) -> None:
        """Drop the kept weights; forwards quantize their weights again, steps refresh nothing."""
        global _hook
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for layer in list(self._layers):
            drop(layer)
        self._layers = weakref.WeakKeyDictionary()
        with _lock:
            _handles.discard(self)
            if not _handles and _hook is not None:
                _hook.remove()
                _hook = None

    def __len__(self) -> int:
        """How many layers hold a kept weight."""
        return sum(layer._step_weight is not None for layer in self._layers)


def quantize_weights_per_step(model: torch.nn.Module, recipe=None) -> StepWeights:
    """Keep the weights of ``model``'s quantized ``Linear`` layers quantized by ``recipe`` (a
    recipe or its name; default: the default recipe), refreshed after every optimizer step that
    updates them; forwards under ``autocast`` with that recipe read them instead of quantizing
    (see the module docstring for the contract). Returns the handle; ``handle.remove()`` undoes
    it."""
    global _hook
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"quantize_weights_per_step: model must be a torch.nn.Module, "
                        f"got {type(model).__name__}")
    recipe = default_recipe() if recipe is None else as_recipe(recipe, "quantize_weights_per_step")
    handle = StepWeights(_weights(model), recipe)
    with _lock:
        _handles.add(handle)
        if _hook is None:
            _hook = register_optimizer_step_post_hook(_stepped)
    handle.refresh()
    return handle


def _weights(model: torch.nn.Module):
    """``(layer, owner, name)`` for each weight :func:`quantize_weights_per_step` keeps: every
    quantized ``Linear``'s and ``GroupedLinear``'s own, and the two projections' weights of
    every converted experts module."""
    from .linear import Linear
    from .moe.hf_experts import is_quantized_experts, projections
    from .moe.linear import GroupedLinear

    for m in model.modules():
        if isinstance(m, (Linear, GroupedLinear)):
            yield m, m, "weight"
        elif is_quantized_experts(m):
            for layer, name in projections(m):
                yield layer, m, name
