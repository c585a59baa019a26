"""Mixture-of-experts layers: quantized grouped GEMMs over rows sorted by expert.

- :mod:`.linear`: :class:`GroupedLinear` (its own weights) and :class:`GroupedProjection` (the
  grouped GEMMs of weights another module owns), the layer's quantize/save policy;
- :mod:`.gemm`: the grouped GEMM paths of every recipe (one ``torch._grouped_mm`` per GEMM for
  operands exact in bf16, one GEMM per group otherwise) and the checks of the group sizes;
- :mod:`.fp8`, :mod:`.fp8_gemm`: FP8 current scaling quantized once for all groups and its
  grouped FP8 GEMMs (``torch._scaled_grouped_mm``, or the backend's grouped FP8 GEMM);
- :mod:`.fp8_block_gemm`, :mod:`.nvfp4_gemm`: FP8 blocks' and NVFP4's grouped GEMMs, one launch
  each;
- :mod:`.bias`: expert biases on those routes (added to the fp32 products, summed per group);
- :mod:`.backward_parts`: those routes' backward in three parts (the output gradient quantized
  once, then each GEMM), three ops under ``torch.compile``;
- :mod:`.ops`: those GEMMs as custom ops for ``torch.compile`` (static output shapes);
- :mod:`.paths`: which path each grouped GEMM took;
- :mod:`.hf_experts`: Hugging Face ``transformers`` experts blocks converted in place;
- :mod:`.routes`: a top-k routing's rows: the tokens gathered into expert order, each token's
  rows weighted and summed back (the un-permute).

Pickles of quant-recipes 0.1 name the modules these lived in before (``quant_recipes.
grouped_linear``, ``quant_recipes.hf_experts``, ...): :data:`MOVED_MODULES` resolves them.
"""

import sys

from . import fp8, fp8_gemm, gemm, hf_experts, linear, ops, paths
from .linear import GroupedLinear, GroupedProjection
from .paths import grouped_gemm_paths, reset_grouped_gemm_paths

#: Module paths of quant-recipes 0.1 -> the module holding their contents now.
MOVED_MODULES = {
    "quant_recipes.grouped_linear": linear,
    "quant_recipes.grouped_gemm": gemm,
    "quant_recipes.grouped_fp8": fp8,
    "quant_recipes.grouped_fp8_gemm": fp8_gemm,
    "quant_recipes.grouped_ops": ops,
    "quant_recipes.grouped_paths": paths,
    "quant_recipes.hf_experts": hf_experts,
}
for _old, _module in MOVED_MODULES.items():
    sys.modules.setdefault(_old, _module)

__all__ = ["GroupedLinear", "GroupedProjection", "grouped_gemm_paths",
           "reset_grouped_gemm_paths", "MOVED_MODULES"]
