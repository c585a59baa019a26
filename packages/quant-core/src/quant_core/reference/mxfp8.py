"""MXFP8: E8M0 scales per 1x32 block, 32x1 block or 32x32 tile (`numerics.md` §5, §8, §10)."""

from __future__ import annotations

import torch

from .. import shapes
from ..constants import POW2_MINUS_127_BITS, RCP_E4M3, RCP_E5M2
from ..dtypes import DType, check_fp8
from ..inputs import check_k_multiple
from ._pad import zero_pad
from ._rounding import f32_bits, f32_from_bits, fp8_decode, fp8_encode
from .fp8_block import block_amax, expand_blocks
from .swizzle import swizzle_scales, unswizzle_scales

BLOCK = shapes.MXFP8_BLOCK
E8M0_NAN = 255
#: ``fp32(1 / fp8_max)`` per FP8 format (exact as Python floats).
_RCP = {DType.E4M3: RCP_E4M3, DType.E5M2: RCP_E5M2}


def e8m0_roundup(v: torch.Tensor) -> torch.Tensor:
    """E8M0 byte of fp32 ``v >= 0``, rounding UP with satfinite (``cvt.rp.satfinite.ue8m0``).

    NaN -> 255, Inf -> 254, 0 -> 0; else the biased exponent ``E`` plus one when the mantissa is
    non-zero, except at ``E == 254`` (saturate) and for subnormals ``<= 2^-127`` (byte 0).
    Built from the bits: torch's e8m0 cast rounds to nearest.
    """
    bits = f32_bits(v.to(torch.float32)) & 0x7FFFFFFF
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 254) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + bump.to(torch.int64)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 254), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, E8M0_NAN), e)
    return e.to(torch.uint8)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(biased - 127)`` for int64 ``biased`` in ``[0, 254]``, from exponent bits;
    ``biased == 0`` is the subnormal 2^-127 (the plain ``biased << 23`` would give 0)."""
    bits = torch.where(biased >= 1, biased << 23, torch.full_like(biased, POW2_MINUS_127_BITS))
    return f32_from_bits(bits)


def e8m0_to_encode_multiplier(e: torch.Tensor) -> torch.Tensor:
    """``s_inv = 2^(127 - e)``: 0 -> 2^127, 254 -> 2^-127 (subnormal), 255 -> NaN."""
    e = e.to(torch.int64)
    s_inv = _pow2((254 - e).clamp(min=0))
    return torch.where(e == E8M0_NAN, torch.full_like(s_inv, float("nan")), s_inv)


def e8m0_to_scale(e: torch.Tensor) -> torch.Tensor:
    """Decode scale ``2^(e - 127)``: 0 -> 2^-127 (subnormal), 255 -> NaN."""
    e = e.to(torch.int64)
    scale = _pow2(e.clamp(max=254))
    return torch.where(e == E8M0_NAN, torch.full_like(scale, float("nan")), scale)


def _pad_to(s: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return zero_pad(s, shape[0], shape[1])


def _quantize_blocks(x, block_rows, block_cols, fp8_dtype):
    """Data bytes ``[M, K]`` and the unpadded E8M0 bytes per block."""
    m, k = x.shape
    e = e8m0_roundup(block_amax(x, block_rows, block_cols) * _RCP[fp8_dtype])
    s_inv = expand_blocks(e8m0_to_encode_multiplier(e), block_rows, block_cols, m, k)
    return fp8_encode(x.to(torch.float32) * s_inv, fp8_dtype), e


def mxfp8_quantize(
    x: torch.Tensor,
    *,
    fp8_dtype: DType,
    rowwise: bool,
    columnwise: bool,
    with_2d_quantization: bool,
    swizzle: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """MXFP8 of ``x [M, K]`` (any M, ``K % 32 == 0``).

    Returns ``(row_data [M, K], row_scale, col_data [M, K], col_scale)`` (``None`` for a direction
    not asked for). Column data is NOT transposed. Scales are E8M0 bytes, zero-padded to
    ``shapes.mxfp8_{rowwise,columnwise}_scale_shape``; with ``swizzle`` they hold the GEMM-swizzled
    bytes in the same shape (columnwise: the swizzle of the transposed scale matrix). In 2D mode
    one scale per 32x32 tile serves its 32 rows and its 32 columns; both data buffers are equal.
    """
    check_fp8(fp8_dtype, "fp8_dtype")
    m, k = x.shape
    check_k_multiple(k, BLOCK, "MXFP8")
    row_data = row_scale = col_data = col_scale = None
    if with_2d_quantization:
        data, e = _quantize_blocks(x, BLOCK, BLOCK, fp8_dtype)  # e: [ceil(M/32), K/32]
        if rowwise:
            row_data, row_scale = data, e.repeat_interleave(BLOCK, dim=0)[:m]
        if columnwise:
            col_data, col_scale = data.clone(), e.repeat_interleave(BLOCK, dim=1)
    else:
        if rowwise:
            row_data, row_scale = _quantize_blocks(x, 1, BLOCK, fp8_dtype)
        if columnwise:
            col_data, col_scale = _quantize_blocks(x, BLOCK, 1, fp8_dtype)
    if row_scale is not None:
        row_scale = _pad_to(row_scale, shapes.mxfp8_rowwise_scale_shape(m, k))
        if swizzle:
            row_scale = swizzle_scales(row_scale)
    if col_scale is not None:
        col_scale = _pad_to(col_scale, shapes.mxfp8_columnwise_scale_shape(m, k))
        if swizzle:
            col_scale = swizzle_scales(col_scale.t().contiguous()).reshape(col_scale.shape)
    return row_data, row_scale, col_data, col_scale


def mxfp8_dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_dtype: DType,
    columnwise: bool,
    swizzled: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``float(fp8(data)) * 2^(e - 127)`` cast to ``dtype``, ``[M, K]`` (data is never transposed).

    ``scale`` is the padded E8M0 buffer of ``mxfp8_quantize``; ``swizzled`` ones are unswizzled
    first (columnwise: the transposed matrix was swizzled). Byte 0 is 2^-127, byte 255 NaN.
    """
    m, k = data.shape
    check_k_multiple(k, BLOCK, "MXFP8")
    if swizzled:
        if columnwise:
            rows, cols = scale.shape
            scale = unswizzle_scales(scale.reshape(cols, rows)).t()
        else:
            scale = unswizzle_scales(scale)
    if columnwise:
        block_rows, block_cols = BLOCK, 1
        per_block = scale[: shapes.ceil_div(m, BLOCK), :k]
    else:
        block_rows, block_cols = 1, BLOCK
        per_block = scale[:m, : k // BLOCK]
    per_element = expand_blocks(e8m0_to_scale(per_block), block_rows, block_cols, m, k)
    return (fp8_decode(data, fp8_dtype) * per_element).to(dtype).contiguous()
