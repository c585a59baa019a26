"""Pure-torch reference numerics: the ground truth and the CPU path (`docs/numerics.md`).

Every function runs on any device, takes plain tensor and scalar arguments, and produces exactly
the bytes of the spec. A backend (quant-kernels' ``triton``) provides the same names with the same
signatures and must return the same bytes. Inputs ``x`` are 2D ``[M, K]`` views (the quantizer
flattens leading dims), contiguous, of dtype fp32, bf16 or fp16; the quantizers validate shapes and
dtypes before calling in. Every buffer is uint8 unless stated (FP8 data is returned as its raw
bytes), padding of scale buffers is zero, and a direction that was not asked for is ``None``.

Per-tensor FP8 (current and delayed scaling, §2–§4):
    ``amax(x) -> fp32 (1,)``; NaN-dropping ``max|x|``, 0 for an empty tensor.
    ``current_scale(amax, *, fp8_dtype, force_pow_2_scales, amax_epsilon) -> fp32 (1,)``.
    ``fp8_quantize(x, scale, *, fp8_dtype, rowwise, columnwise, amax_out=None)
        -> (data [M, K] | None, transpose [K, M] | None, scale_inv fp32 (1,))``; when ``amax_out``
        (fp32 (1,)) is given, ``max|x|`` is max-accumulated into it in place (delayed scaling).
    ``fp8_current_quantize(x, *, fp8_dtype, force_pow_2_scales, amax_epsilon, rowwise,
        columnwise)``: the three steps of current scaling in one call, same result as
        ``fp8_quantize(x, current_scale(amax(x), ...), ...)`` (a backend may fuse them).
    ``fp8_dequantize(data, scale_inv, *, fp8_dtype, dtype) -> Tensor`` (any shape of ``data``).

MXFP8 (§5):
    ``mxfp8_quantize(x, *, fp8_dtype, rowwise, columnwise, with_2d_quantization, swizzle)
        -> (row_data [M, K], row_scale, col_data [M, K], col_scale)``; scales E8M0 bytes in the
        padded shapes of ``quant_core.shapes``; with ``swizzle`` they hold the GEMM-swizzled bytes
        in the same shape (columnwise: the swizzle of the transposed scale matrix).
    ``mxfp8_dequantize(data, scale, *, fp8_dtype, columnwise, swizzled, dtype) -> [M, K]``.

FP8 block scaling (§6):
    ``fp8_block_quantize(x, *, fp8_dtype, block_scaling_dim, force_pow_2_scales, amax_epsilon,
        rowwise, columnwise) -> (row_data [M, K], row_scale_inv fp32, col_data [K, M],
        col_scale_inv fp32)`` in the GEMM-ready layouts of the spec.
    ``fp8_block_dequantize(data, scale_inv, *, fp8_dtype, block_scaling_dim, columnwise, dtype)
        -> [M, K]`` (columnwise data is transposed back).

NVFP4 (§7):
    ``nvfp4_amax(x, *, rowwise, columnwise, with_rht, rht_sign_mask)
        -> (amax_row (1,), amax_col (1,))``
        (the columnwise amax is taken after the bf16-rounded RHT when ``with_rht``).
    ``nvfp4_quantize(x, amax_rowwise, amax_columnwise, *, rowwise, columnwise, with_rht,
        rht_sign_mask, with_2d_quantization, stochastic_rounding, rng_seed, swizzle)
        -> (row_data [M, K/2], row_scale, col_data [K, ceil(M/2)], col_scale)``; ``rng_seed`` is an
        int64 tensor of shape (1,) (ignored without stochastic rounding); the random byte of
        element ``i`` is ``sr_random_byte(seed, i)``, a counter-based hash any backend can repeat.
    ``nvfp4_dequantize(data, scale, amax, *, swizzled, dtype) -> [M, K]`` (rowwise data only).

GEMMs of row operands ``A [M, K]``, ``B [N, K]`` (contraction along dim 1; DESIGN.md contract 6):
    ``mxfp8_gemm(a, a_scale, b, b_scale, *, a_dtype, b_dtype, a_swizzled, b_swizzled, bias,
        out_dtype) -> A @ B.T`` and ``nvfp4_gemm(a, a_scale, a_amax, b, b_scale, b_amax, *,
        a_swizzled, b_swizzled, bias, out_dtype)``: exact decoded elements, fp32 products and
        sums; a fast backend may differ only in the order of the fp32 accumulation.

Scale swizzle (§5, GEMM layout):
    ``swizzle_scales(s [R, C]) -> [R, C]`` and ``unswizzle_scales(s) -> [R, C]`` for
    ``R % 128 == 0`` and ``C % 4 == 0``.
"""

from __future__ import annotations

from .fp8_block import fp8_block_dequantize, fp8_block_quantize  # noqa: F401
from .fp8_tensor import (  # noqa: F401
    amax,
    current_scale,
    fp8_current_quantize,
    fp8_dequantize,
    fp8_quantize,
)
from .gemm import mxfp8_gemm, nvfp4_gemm  # noqa: F401
from .mxfp8 import mxfp8_dequantize, mxfp8_quantize  # noqa: F401
from .nvfp4 import nvfp4_amax, nvfp4_dequantize, nvfp4_quantize  # noqa: F401
from .rht import rht_matrix  # noqa: F401
from .swizzle import swizzle_scales, unswizzle_scales  # noqa: F401
