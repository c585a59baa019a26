"""Pure-torch reference numerics: the ground truth and the CPU path (`docs/numerics.md`).

Every function runs on any device, takes plain tensor and scalar arguments, and produces exactly
the bytes of the spec. The functions and what each takes and returns are the backend contract,
one documented method each in :class:`quant_core.backend_contract.Backend`; a backend
(quant-kernels' ``triton``) provides the same names with the same signatures and must return
the same bytes (GEMMs: the same products and fp32 sums, in any order). The rounding rules
(stochastic rounding and its random bytes included) are :mod:`._rounding`'s; the block tiling
:mod:`._blocks`'s; the GEMM definitions :mod:`.gemm`'s and, grouped, :mod:`.grouped_gemm`'s; the
RHT :mod:`.rht`'s; the scale swizzle :mod:`.swizzle`'s. ``nvfp4_quantize``
(:mod:`.nvfp4_dispatch`) runs NVFP4's variant: the TE-default block scaling (:mod:`.nvfp4`) or
4over6's, ``nvfp4_4over6_quantize`` (:mod:`.nvfp4_4over6`), which backends take as
``nvfp4_quantize(four_over_six=True)``.
"""

from __future__ import annotations

from .fp8_block import fp8_block_dequantize, fp8_block_quantize
from .fp8_grouped import fp8_group_quantize_experts, fp8_group_quantize_rows
from .fp8_tensor import (
    amax,
    current_scale,
    fp8_current_quantize,
    fp8_dequantize,
    fp8_quantize,
)
from .gemm import mxfp8_gemm, nvfp4_gemm
from .grouped_gemm import (
    fp8_block_grouped_rows_gemm,
    fp8_block_grouped_tokens_gemm,
    fp8_grouped_rows_gemm,
    fp8_grouped_tokens_gemm,
    grouped_rows_gemm,
    nvfp4_grouped_rows_gemm,
    nvfp4_grouped_tokens_gemm,
)
from .mxfp8 import mxfp8_dequantize, mxfp8_quantize, mxfp8_quantize_decoded
from .nvfp4 import nvfp4_amax, nvfp4_dequantize
from .nvfp4_4over6 import nvfp4_4over6_quantize
from .nvfp4_dispatch import nvfp4_quantize
from .nvfp4_grouped import nvfp4_group_quantize
from .rht import rht_matrix
from .swizzle import swizzle_scales, unswizzle_scales

__all__ = [
    "amax", "current_scale", "fp8_quantize", "fp8_current_quantize", "fp8_dequantize",
    "mxfp8_quantize", "mxfp8_dequantize", "mxfp8_quantize_decoded", "fp8_block_quantize",
    "fp8_block_dequantize",
    "nvfp4_amax", "nvfp4_quantize", "nvfp4_dequantize", "mxfp8_gemm", "nvfp4_gemm",
    "fp8_group_quantize_rows", "fp8_group_quantize_experts", "grouped_rows_gemm",
    "fp8_grouped_rows_gemm",
    "fp8_grouped_tokens_gemm", "fp8_block_grouped_rows_gemm", "fp8_block_grouped_tokens_gemm",
    "nvfp4_group_quantize", "nvfp4_grouped_rows_gemm", "nvfp4_grouped_tokens_gemm",
    "rht_matrix",
    "swizzle_scales", "unswizzle_scales", "nvfp4_4over6_quantize",
]
