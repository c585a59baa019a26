"""MXFP8: E8M0 scales per 1x32 block, 32x1 block or 32x32 tile (`numerics.md` §5, §8, §10)."""

from __future__ import annotations

import torch

from .. import shapes
from ..constants import RCP_E4M3, RCP_E5M2
from ..dtypes import DType, check_fp8
from ..inputs import (
    check_input_dtype,
    check_k_multiple,
    check_output_dtype,
    check_row_index,
)
from ._blocks import block_amax, expand_blocks
from ._rounding import (
    e8m0_roundup,
    e8m0_to_encode_multiplier,
    e8m0_to_scale,
    fp8_decode,
    fp8_encode,
    to_fp32,
)
from .pad import gathered_rows, zero_pad
from .swizzle import swizzle_scales, unswizzle_scales

BLOCK = shapes.MXFP8_BLOCK
#: ``fp32(1 / fp8_max)`` per FP8 format (exact as Python floats).
_RCP = {DType.E4M3: RCP_E4M3, DType.E5M2: RCP_E5M2}


def _pad_to(s: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return zero_pad(s, shape[0], shape[1])


def _quantize_blocks(x, block_rows, block_cols, fp8_dtype):
    """Data bytes ``[M, K]`` and the unpadded E8M0 bytes per block."""
    m, k = x.shape
    e = e8m0_roundup(block_amax(x, block_rows, block_cols) * _RCP[fp8_dtype])
    s_inv = expand_blocks(e8m0_to_encode_multiplier(e), block_rows, block_cols, m, k)
    return fp8_encode(to_fp32(x) * s_inv, fp8_dtype), e


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
    check_input_dtype(x, "mxfp8_quantize")
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
    check_output_dtype(dtype, "mxfp8_dequantize")
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


def mxfp8_quantize_decoded(
    x: torch.Tensor,
    *,
    fp8_dtype: DType,
    rowwise: bool,
    columnwise: bool,
    with_2d_quantization: bool,
    dtype: torch.dtype,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(row_values [M, K], col_values [M, K])`` in ``dtype`` (``None`` for a direction not
    asked for): what :func:`mxfp8_dequantize` gives for each direction of
    :func:`mxfp8_quantize` of ``x``, for a consumer that multiplies decoded values and never
    reads the FP8 bytes (a bf16 GEMM on hardware without MXFP8 tensor cores). With ``rows``
    (int32/int64 ``[P]``, ``M = P``) the tensor quantized is ``x``'s rows in that order, a zero
    row for each ``rows[p] < 0`` (a grouped operand's padded layout)."""
    check_output_dtype(dtype, "mxfp8_quantize_decoded")
    check_input_dtype(x, "mxfp8_quantize_decoded")
    if rows is not None:
        check_row_index(x, rows, "mxfp8_quantize_decoded")
        x = gathered_rows(x, rows)
    row_data, row_scale, col_data, col_scale = mxfp8_quantize(
        x, fp8_dtype=fp8_dtype, rowwise=rowwise, columnwise=columnwise,
        with_2d_quantization=with_2d_quantization, swizzle=False)
    return tuple(
        None if data is None else mxfp8_dequantize(
            data, scale, fp8_dtype=fp8_dtype, columnwise=col, swizzled=False, dtype=dtype)
        for data, scale, col in ((row_data, row_scale, False), (col_data, col_scale, True)))
