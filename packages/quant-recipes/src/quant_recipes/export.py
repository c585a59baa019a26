"""Export a trained model's FP8 weights as a compressed-tensors checkpoint (what vLLM loads).

:func:`compressed_tensors_state_dict` turns a model's :class:`~quant_recipes.Linear` layers
into the tensors of compressed-tensors' ``float-quantized`` format: ``<layer>.weight``
(``float8_e4m3fn``) and ``<layer>.weight_scale`` (fp32, the dequantization multiplier: the
value is ``weight * weight_scale``). The bytes are those the recipe's weight quantizer produces
for that weight in training (the quantized weight itself, for a weight stored quantized), so
the served model multiplies by exactly the weights the trained one did:

- ``Float8CurrentScaling``: per-tensor E4M3, ``weight_scale`` of shape ``[1]``; weights
  ``strategy: "tensor"``, inputs ``strategy: "tensor", dynamic: true``. With
  ``per_channel=True`` the same bytes in the per-channel layout, for engines whose kernels take
  a scale per output channel: the tensor's scale repeated, ``weight_scale`` of shape ``[N, 1]``,
  weights ``strategy: "channel"``.
- ``Float8BlockScaling`` (128x128 weight blocks): ``weight_scale`` of shape
  ``[ceil(N/128), ceil(K/128)]``; weights ``strategy: "block", block_structure: [128, 128]``,
  inputs ``strategy: "group", group_size: 128, dynamic: true`` (its 1x128 input blocks).

The input (activation) entry describes the granularity training quantized inputs at; the
engine quantizes them itself at serving time, so their bytes are its own (power-of-two scales,
for one, are not part of the layout). Other formats are refused, naming the recipe and the
layer: MXFP8 and NVFP4 (their scales are not these layouts), 1x128 weight blocks, E5M2
weights, delayed scaling (its weight scale is recipe state, not a function of the weight) and
the grouped layers (:class:`~quant_recipes.GroupedLinear`, converted experts).

Everything else in ``model.state_dict()`` is exported as it is (biases, norms, embeddings, the
layers ``convert`` left out); the modules that hold such parameters themselves and are not
exported quantized are listed in the config's ``ignore``.

Layout source: vllm-project/compressed-tensors, ``src/compressed_tensors/quantization/``
(``quant_config.py``: ``QuantizationConfig``; ``quant_scheme.py``: the ``FP8_DYNAMIC`` and
``FP8_BLOCK`` presets; ``lifecycle/initialize.py``: scale shapes ``(1,)`` per tensor and
``(ceil(N/bn), ceil(K/bk))`` per block) and vLLM's
``vllm/model_executor/layers/quantization/utils/fp8_utils.py`` (``create_fp8_scale_parameter``:
fp32 scale parameters, which is why the scales are written in fp32, not the weight's dtype).
"""

from __future__ import annotations

import json
import os

import torch
from quant_core import Float8BlockQuantizer, Float8CurrentScalingQuantizer, Quantizer
from quant_core.dtypes import DType
from quant_core.shapes import FP8_BLOCK, ceil_div, m_k
from quant_core.storage import QuantizedStorage
from torch.distributed.tensor import DTensor

from .autocast import default_recipe
from .fsdp_layout import base
from .identity import IdentityQuantizer
from .linear import Linear
from .module import QuantizedModule, is_value
from .recipe_names import as_recipe
from .recipes import Recipe
from .states import RecipeState

_WHO = "compressed-tensors export"
_LAYOUTS = ("per-tensor FP8 E4M3 (Float8CurrentScaling) and 128x128 FP8 E4M3 blocks "
            "(Float8BlockScaling with w_block_scaling_dim=2)")
#: compressed-tensors' ``format`` of FP8 weights with their scales.
FLOAT_QUANTIZED = "float-quantized"


def _fp8_args(strategy: str, dynamic: bool, **more) -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
            "dynamic": dynamic, **more}


def _weight_args(q: Quantizer, what: str, per_channel: bool) -> dict | None:
    """compressed-tensors' ``weights`` entry for weight quantizer ``q`` (None: not quantized),
    per output channel where ``per_channel`` asks for it; ``ValueError`` naming ``what`` (the
    recipe and the layer) where the layout has none."""
    if isinstance(q, IdentityQuantizer):
        return None
    if isinstance(q, (Float8CurrentScalingQuantizer, Float8BlockQuantizer)) and (
            q.dtype is not DType.E4M3):
        raise ValueError(f"{_WHO}: {what} quantizes the weight as {q.dtype.name}; "
                         "compressed-tensors' 8-bit float weights are E4M3")
    if isinstance(q, Float8CurrentScalingQuantizer):
        return _fp8_args("channel" if per_channel else "tensor", False)
    if per_channel:
        raise ValueError(f"{_WHO}: {what}: per_channel=True repeats a per-tensor scale per "
                         f"output channel; this weight has other scales ({q!r}): export it "
                         "without per_channel")
    if isinstance(q, Float8BlockQuantizer) and q.block_scaling_dim == 2:
        return _fp8_args("block", False, block_structure=[FP8_BLOCK, FP8_BLOCK])
    if isinstance(q, Float8BlockQuantizer):
        why = "1x128 weight blocks"
    elif not is_value(q):
        why = "delayed scaling (the weight's scale is recipe state, not the weight's own)"
    else:
        why = f"the {q.storage_format!r} format ({type(q).__name__})"
    raise ValueError(f"{_WHO}: {what} quantizes the weight with {why}; the export writes "
                     f"{_LAYOUTS}")


def _input_args(q: Quantizer, what: str) -> dict | None:
    """compressed-tensors' ``input_activations`` entry for input quantizer ``q``."""
    if isinstance(q, IdentityQuantizer):
        return None
    if getattr(q, "dtype", None) is DType.E4M3:
        if isinstance(q, Float8CurrentScalingQuantizer):
            return _fp8_args("tensor", True)
        if isinstance(q, Float8BlockQuantizer) and q.block_scaling_dim == 1:
            return _fp8_args("group", True, group_size=FP8_BLOCK)
    raise ValueError(f"{_WHO}: {what} quantizes the input with {q!r}, which compressed-tensors' "
                     "dynamic FP8 inputs (per tensor, or in groups of 128) do not describe")


def _layer_quantizers(layer: Linear, recipe: Recipe) -> tuple[Quantizer, Quantizer]:
    """The (input, weight) quantizers ``recipe`` gives ``layer`` in forward (as
    ``Linear.weight_quantizer`` builds them)."""
    state = RecipeState.create(recipe, mode="forward", num_quantizers=3, roles=layer._fwd_roles)
    q = state.make_quantizers()
    return q[0], q[1]


def _weight_and_scale(layer: Linear, q: Quantizer, what: str, per_channel: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer``'s weight as ``q`` quantizes it (or its quantized weight, checked against
    ``q``): the E4M3 data ``[N, K]`` and the fp32 scale-inverse in compressed-tensors' shape
    (``[N, 1]``, the tensor's repeated, for ``per_channel``)."""
    w = layer.weight
    if isinstance(w, DTensor):
        raise ValueError(f"{_WHO}: {what}: the weight is a sharded DTensor; export from a model "
                         "holding the full weights (one rank, after gathering them)")
    if isinstance(w, QuantizedStorage):
        if not (is_value(w.quantizer) and base(w.quantizer) == base(q)):
            raise ValueError(f"{_WHO}: {what}: the weight is stored quantized by "
                             f"{w.quantizer!r}, but the recipe quantizes it with {q!r}; export "
                             "with the recipe the weight was quantized for")
        s = w
    else:
        s = q.replace(columnwise_usage=False).quantize(w.detach())
    if isinstance(q, Float8CurrentScalingQuantizer):
        data, scale = s._data, s._scale_inv.reshape(1)
        if per_channel:
            scale = scale.expand(m_k(s.shape)[0], 1)
    else:
        n, k = m_k(s.shape)
        data = s._rowwise_data
        scale = s._rowwise_scale_inv[:ceil_div(n, FP8_BLOCK), :ceil_div(k, FP8_BLOCK)]
    if data is None:
        raise ValueError(f"{_WHO}: {what}: the quantized weight holds no rowwise data")
    fp8 = data.reshape(s.shape).view(torch.float8_e4m3fn)
    return fp8.detach().clone(), scale.detach().to(torch.float32).contiguous().clone()


def compressed_tensors_state_dict(model: torch.nn.Module, recipe: Recipe | str | None = None,
                                  *, per_channel: bool = False,
                                  **options) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, quantization_config)``: ``model``'s tensors in compressed-tensors'
    ``float-quantized`` layout and the ``quantization_config`` entry of a Hugging Face
    ``config.json`` that describes them (see the module docstring).

    ``recipe``: the recipe the model trained under (a recipe or its name, ``options`` its
    fields, as :func:`~quant_recipes.recipe` takes them); ``None`` uses each layer's
    ``bound_recipe``, else the default recipe (``Float8CurrentScaling``), as forward outside
    autocast and ``autocast()`` do. Every :class:`~quant_recipes.Linear` is exported quantized
    unless the recipe keeps its weight in high precision (a ``CustomRecipe`` returning an
    ``IdentityQuantizer``); ``ValueError`` names the recipe and the layer that the layout cannot
    carry, and a model with no quantized layer. ``per_channel``: per-tensor weights in the
    per-channel layout (their scale repeated per output channel; the same bytes)."""
    if recipe is not None:
        recipe = as_recipe(recipe, _WHO, **options)
    elif options:
        raise TypeError(f"{_WHO}: options {sorted(options)} need a recipe name")
    state = model.state_dict()
    groups: dict[str, list[str]] = {}  # the scheme (as JSON) -> its layers
    schemes: dict[str, dict] = {}
    quantized: set[str] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, Linear):
            r = recipe or module.bound_recipe
            if r is None:
                r = default_recipe()
            what = f"{type(r).__name__} (layer {name!r})"
            if r.delayed():
                raise ValueError(f"{_WHO}: {what}: delayed scaling keeps the weight's scale in "
                                 f"recipe state, not in the weight; the export writes {_LAYOUTS}")
            qi, qw = _layer_quantizers(module, r)
            weights = _weight_args(qw, what, per_channel)
            if weights is None:
                continue
            scheme = {"weights": weights, "input_activations": _input_args(qi, what)}
            state[f"{name}.weight"], state[f"{name}.weight_scale"] = _weight_and_scale(
                module, qw, what, per_channel)
            key = json.dumps(scheme, sort_keys=True)
            schemes[key] = scheme
            groups.setdefault(key, []).append(name)
            quantized.add(name)
        elif isinstance(module, QuantizedModule):
            raise ValueError(f"{_WHO}: {type(module).__name__} {name!r} has no compressed-tensors "
                             "layout here; only quant_recipes.Linear layers are exported")
    if not quantized:
        raise ValueError(f"{_WHO}: the model has no quant_recipes.Linear layer whose weight the "
                         "recipe quantizes (convert the model first: quant_recipes.convert)")
    for key, t in state.items():
        if isinstance(t, QuantizedStorage):
            raise ValueError(f"{_WHO}: {key!r} is a quantized tensor outside a Linear layer")
    ignore = sorted({name for name, module in model.named_modules(remove_duplicate=False)
                     if name not in quantized and name
                     and any(True for _ in module.parameters(recurse=False))})
    config_groups = {}
    for i, (key, names) in enumerate(groups.items()):
        targets = ["Linear"] if len(groups) == 1 else sorted(names)
        config_groups[f"group_{i}"] = {"targets": targets, **schemes[key],
                                       "output_activations": None, "format": FLOAT_QUANTIZED}
    config = {"quant_method": "compressed-tensors", "format": FLOAT_QUANTIZED,
              "quantization_status": "compressed", "config_groups": config_groups,
              "ignore": ignore, "kv_cache_scheme": None}
    return _unshared(state), config


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with a tensor whose storage an earlier entry holds (tied weights) copied:
    safetensors refuses shared storage."""
    seen: set[tuple] = set()
    out = {}
    for key, t in state.items():
        t = t.detach()
        ident = (t.untyped_storage().data_ptr(), t.device) if t.numel() else None
        if ident is not None and ident in seen:
            t = t.clone()
        elif ident is not None:
            seen.add(ident)
        out[key] = t.contiguous()
    return out


def save_compressed_tensors(model: torch.nn.Module, directory: str | os.PathLike,
                            recipe: Recipe | str | None = None, *, per_channel: bool = False,
                            **options) -> dict:
    """Write :func:`compressed_tensors_state_dict` of ``model`` to ``directory``:
    ``model.safetensors``, and the ``quantization_config`` merged into ``config.json`` (the
    file in ``directory`` when there is one; else, for a Hugging Face model, its
    ``model.config`` saved there first). Returns the ``quantization_config``. Needs the
    ``safetensors`` package."""
    from safetensors.torch import save_file

    state, config = compressed_tensors_state_dict(model, recipe, per_channel=per_channel,
                                                  **options)
    os.makedirs(directory, exist_ok=True)
    save_file({k: t.cpu() for k, t in state.items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(directory, "config.json")
    hf_config = getattr(model, "config", None)
    if not os.path.exists(path) and hasattr(hf_config, "save_pretrained"):
        hf_config.save_pretrained(directory)
    if os.path.exists(path):
        with open(path) as f:
            merged = json.load(f)
        merged["quantization_config"] = config
        with open(path, "w") as f:
            json.dump(merged, f, indent=2)
    return config
