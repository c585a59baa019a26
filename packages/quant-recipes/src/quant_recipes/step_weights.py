"""``quantize_weights_per_step(model, recipe)``: each Linear's weight quantized once per optimizer
step, for compiled code as for eager code.

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

Not kept: weights that are not plain Parameters (FSDP2's and tensor parallelism's DTensors,
quantized parameters of :func:`~quant_recipes.quantized_model_init`, which are quantized once per
step already), delayed scaling, stochastic rounding, and the experts' weights of grouped layers
(:class:`~quant_recipes.GroupedLinear`, converted experts modules): only ``Linear`` layers. Memory: the copies live from one step to
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
from .compiling import FOLDS_CONSTANTS, compiling, trace_time_constant
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
    Parameter or with another quantizer, or (eagerly) ``w`` changed since."""
    if kept.weight is not w:
        return None
    if compiling():
        same = _same_quantizer(kept.quantizer, q) if FOLDS_CONSTANTS else kept.quantizer is q
        return kept.buffers if same else None
    if kept.quantizer == q and contents_key(w, None) == kept.key:
        return kept.buffers
    return None


def drop(layer: torch.nn.Module) -> None:
    """Forget ``layer``'s kept weight (it quantizes in forward until refreshed)."""
    layer._step_weight = None


def _keep(layer, recipe) -> KeptWeight | None:
    """``layer``'s weight quantized as its training forward under ``recipe`` quantizes it, or
    None where that is not kept (see the module docstring)."""
    from .linear import check_step_shapes

    w = layer.weight
    if type(w) is not torch.nn.Parameter or w.is_inference():
        return None
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


_lock = threading.Lock()
_handles: set[StepWeights] = set()  # live handles: held here until removed, so none goes stale
_hook = None  # the optimizer step post-hook, while any handle is live


def _stepped(optimizer, _args, _kwargs) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for handle in list(_handles):
        handle.refresh(lambda layer: id(layer.weight) in stepped)


def _loaded(layer, _incompatible) -> None:
    """``load_state_dict`` post-hook: refresh ``layer``'s kept weight."""
    for handle in list(_handles):
        if layer in handle._layers:
            handle.refresh(lambda other: other is layer)


def refresh_all() -> None:
    """Refresh every kept weight of every live handle (:func:`invalidate_cached_weights`)."""
    for handle in list(_handles):
        handle.refresh()


class StepWeights:
    """The handle :func:`quantize_weights_per_step` returns: ``refresh()`` quantizes the kept
    weights again now, ``remove()`` drops them and stops refreshing them."""

    def __init__(self, layers: Iterable[torch.nn.Module], recipe) -> None:
        self.recipe = recipe
        self._layers = weakref.WeakSet(layers)
        # a module-level function: a hook that held the handle would not pickle, and a copy
        # of the model would carry a copy of the handle
        self._hooks = [layer.register_load_state_dict_post_hook(_loaded)
                       for layer in self._layers]

    def refresh(self, which=None) -> None:
        """Quantize the kept weights again (those of the layers ``which(layer)`` is true for)."""
        for layer in list(self._layers):
            if which is None or which(layer):
                drop(layer)  # the old buffers go before the new ones are made
                layer._step_weight = _keep(layer, self.recipe)

    def remove(self) -> None:
        """Drop the kept weights; forwards quantize their weights again, steps refresh nothing."""
        global _hook
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for layer in list(self._layers):
            drop(layer)
        self._layers = weakref.WeakSet()
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
    from .linear import Linear

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"quantize_weights_per_step: model must be a torch.nn.Module, "
                        f"got {type(model).__name__}")
    recipe = default_recipe() if recipe is None else as_recipe(recipe, "quantize_weights_per_step")
    handle = StepWeights((m for m in model.modules() if isinstance(m, Linear)), recipe)
    with _lock:
        _handles.add(handle)
        if _hook is None:
            _hook = register_optimizer_step_post_hook(_stepped)
    handle.refresh()
    return handle
