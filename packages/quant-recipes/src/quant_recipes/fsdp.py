"""FSDP2 all-gather of quant ``Linear`` weights in the quantized format.

``enable_fsdp_quantized_all_gather(model, recipe)``, called *before* ``fully_shard``, wraps each
``Linear`` weight in :class:`QuantizedAllGatherWeight`: the sharded parameter stays in high
precision (the optimizer updates it as before), and FSDP2's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) sends the shard quantized with the recipe's
weight quantizer instead of the high-precision bytes, then hands the layer the full weight as a
``quant_core.tensor.QuantizedTensor``, which ``Linear`` consumes without quantizing again. The
bytes equal quantizing the unsharded weight on one device (tensor-wide amaxes are all-reduced
with MAX over the FSDP group before the cast): :mod:`quant_recipes.fsdp_layout` says per format
what travels. A weight whose format or shape does not shard cleanly all-gathers the
high-precision weight as before, with a one-time warning that says why.

This is torchao's ``enable_fsdp_float8_all_gather`` design (``WeightWithDynamicFloat8CastTensor``)
for every quant recipe. The layers must run under ``autocast`` with an equal weight quantizer
(the same recipe); outside autocast the gathered weight is dequantized.
:func:`all_gather_bytes` counts what the extension sent.
"""

from __future__ import annotations

import collections
import warnings

import torch
from quant_core import Quantizer
from quant_core.reference.pad import zero_pad
from quant_core.shapes import ceil_div
from torch.utils import _pytree as pytree

from . import fsdp_layout
from .recipes import Recipe

_BYTES: collections.Counter = collections.Counter()
_WARNED: set = set()

_aten = torch.ops.aten
#: Ops whose results stay wrapped (FSDP2's sharding, moves and copies of the parameter); every
#: other op (the optimizer's arithmetic, ``F.linear`` outside FSDP) sees the plain tensor.
_PRESERVE = {
    _aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor, _aten.copy_.default,
    _aten.view.default, _aten.as_strided.default, _aten._to_copy.default,
    _aten._pin_memory.default, _aten.split.Tensor, _aten.clone.default, _aten.detach.default,
    _aten.alias.default, _aten.narrow.default,
}


def all_gather_bytes() -> dict[str, int]:
    """Bytes this process's FSDP2 all-gathers received through the extension since the last
    :func:`reset_all_gather_bytes` (all ranks' inputs, i.e. the output size), split into
    ``"quantized"`` and ``"high_precision"`` (the fallback)."""
    return dict(_BYTES)


def reset_all_gather_bytes() -> None:
    _BYTES.clear()


def _fallback_warning(shape, quantizer: Quantizer, reason: str) -> None:
    key = (tuple(shape), quantizer, reason)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"FSDP2 quantized all-gather: the weight of shape {tuple(shape)} is all-gathered "
            f"in high precision and quantized after the gather: {reason}", stacklevel=3)


class QuantizedAllGatherWeight(torch.Tensor):
    """A high-precision weight (the FSDP2-sharded parameter) whose all-gather sends quantized
    bytes. ``quantizer`` is the layer's weight quantizer under the recipe it was enabled with."""

    _tensor: torch.Tensor
    _quantizer: Quantizer

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, quantizer: Quantizer):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, quantizer: Quantizer) -> None:
        self._tensor = tensor
        self._quantizer = quantizer

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        quantizer = None

        def unwrap(t):
            nonlocal quantizer
            quantizer = t._quantizer
            return t._tensor

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, quantizer), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._quantizer

    @staticmethod
    def __tensor_unflatten__(inner, quantizer, outer_size, outer_stride):
        return QuantizedAllGatherWeight(inner["_tensor"], quantizer)

    def __repr__(self) -> str:
        return f"QuantizedAllGatherWeight({self._tensor!r}, quantizer={self._quantizer!r})"

    # ------------------------------------------------------------------ FSDP2 extension
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """``(all-gather inputs, metadata)``: the shard quantized as the full weight would be,
        or the high-precision shard in ``mp_policy.param_dtype`` where the format does not shard
        cleanly."""
        group = mesh.get_group()
        world = mesh.size()
        dtype = (mp_policy.param_dtype if mp_policy is not None else None) or self.dtype
        # dgrad reads the columnwise copy whenever the layer's input needs a gradient, frozen
        # weight or not. Which inputs will is not known here (FSDP2 gathers under no_grad,
        # before forward), and forward and backward must gather the same buffers: a layer in
        # training mode, or with a trainable weight, gathers it
        owner = getattr(module, "weight", None)
        columnwise = bool(getattr(module, "training", True)
                          or getattr(owner, "requires_grad", True))
        p = fsdp_layout.plan(self._quantizer, outer_size, world, columnwise=columnwise)
        if not isinstance(p, str) and world == 1 and len(p.gathered) > 1:
            # FSDP2's one-rank path copies only the first all-gather input into place: send
            # the weight itself (nothing crosses a wire; the layer quantizes it, same bytes)
            p = "one rank: FSDP2 copies only one all-gather input"
        if isinstance(p, str):
            if world > 1:
                _fallback_warning(outer_size, self._quantizer, p)
            inputs = (self._tensor.to(dtype),)
            meta = None
        else:
            storage = fsdp_layout.quantize_shard(p, self._tensor.to(dtype), group)
            inputs = tuple(getattr(storage, n) for n in p.gathered)
            meta = (p, {n: getattr(storage, n) for n in p.shared}, tuple(outer_size))
        rows = ceil_div(outer_size[0], world)  # FSDP2's padded shard (an uneven split's last rank)
        if len(inputs) == 1 and inputs[0].shape[0] != rows:  # block formats split evenly
            inputs = (zero_pad(inputs[0], rows, inputs[0].shape[1]),)
        kind = "high_precision" if meta is None else "quantized"
        _BYTES[kind] += world * sum(t.numel() * t.element_size() for t in inputs)
        return inputs, meta

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded weight: a ``QuantizedTensor`` over the gathered buffers (views, freed
        and refilled by FSDP2), or the high-precision tensor of the fallback. With ``out`` (the
        weight of an earlier all-gather, whose buffers FSDP2 refilled in place) only the shared
        buffers are copied in."""
        if metadata is None:
            if out is not None:
                return None
            return all_gather_outputs[0], ()
        p, shared, shape = metadata
        if out is not None:
            for name, t in shared.items():
                buf = getattr(out, name)
                # as FSDP2 refills its all-gather outputs: the same values within a step, so a
                # graph that saved this buffer for backward must not see a version bump
                with torch.autograd._unsafe_preserve_version_counter(buf):
                    buf.copy_(t)
            return None
        storage = fsdp_layout.assemble(p, dict(zip(p.gathered, all_gather_outputs, strict=True)),
                                       shared, torch.Size(shape), param_dtype)
        from quant_core.tensor import QuantizedTensor

        return QuantizedTensor.from_storage(storage), ()


def plain_weight(t):
    """``t`` with a :class:`QuantizedAllGatherWeight` (also as a DTensor's local tensor)
    replaced by the plain tensor it wraps, which shares its storage: what a state dict holds,
    so that ``torch.load(weights_only=True)`` and ``torch.distributed.checkpoint`` take it, and
    loading into it in place writes the parameter."""
    if isinstance(t, QuantizedAllGatherWeight):
        return t._tensor
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, QuantizedAllGatherWeight):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local._tensor, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t


def _plain_state_dict(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = plain_weight(state_dict[key])


def enable_fsdp_quantized_all_gather(model: torch.nn.Module, recipe: Recipe) -> torch.nn.Module:
    """Make every ``quant_recipes.Linear`` weight in ``model`` all-gather in ``recipe``'s weight
    format under FSDP2; returns ``model``. Call it before ``fully_shard`` and run the layers
    under ``autocast(recipe=...)`` with an equal recipe (``Linear`` refuses a gathered weight
    quantized for another weight quantizer). State dicts hold the plain weights
    (:func:`plain_weight`)."""
    from .linear import Linear

    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a quant_recipes.Recipe, got {recipe!r}")
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        w = module.weight
        if isinstance(w, QuantizedAllGatherWeight):
            continue
        if type(w.data) is not torch.Tensor:
            raise TypeError(
                f"enable_fsdp_quantized_all_gather: {name or 'model'}.weight is a "
                f"{type(w.data).__name__}, not a plain tensor; call it before fully_shard and "
                "not on quantized parameters (quantized_model_init)")
        wrapped = QuantizedAllGatherWeight(w.data, module.weight_quantizer(recipe))
        module.weight = torch.nn.Parameter(wrapped, requires_grad=w.requires_grad)
        module.register_state_dict_post_hook(_plain_state_dict)
    return model
