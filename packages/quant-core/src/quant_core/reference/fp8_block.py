"""FP8 block scaling: 1x128 and 128x128 blocks (`numerics.md` §6, §8, §10)."""

from __future__ import annotations

import torch

from .. import shapes
from ..dtypes import DType, check_fp8
from ..inputs import (
    check_block_scaling_dim,
    check_column_groups,
    check_input_dtype,
    check_output_dtype,
    check_row_index,
)
from ._blocks import block_amax, expand_blocks
from ._rounding import compute_scale_from_amax, div_rn, fp8_decode, fp8_encode, to_fp32
from .pad import gathered_rows, zero_pad

BLOCK = shapes.FP8_BLOCK


def _pad_cols(s: torch.Tensor, cols: int) -> torch.Tensor:
    return zero_pad(s, s.shape[0], cols)


def _block_dims(block_scaling_dim: int, columnwise: bool) -> tuple[int, int]:
    if block_scaling_dim == 2:
        return BLOCK, BLOCK
    return (BLOCK, 1) if columnwise else (1, BLOCK)


def _quantize_blocks(x, block_rows, block_cols, fp8_dtype, force_pow_2_scales, amax_epsilon):
    """Data bytes ``[M, K]`` and unpadded fp32 ``scale_inv`` per block."""
    m, k = x.shape
    scale = compute_scale_from_amax(
        block_amax(x, block_rows, block_cols),
        fp8_dtype.max,
        force_pow_2_scales=force_pow_2_scales,
        amax_epsilon=amax_epsilon,
        value_for_inf=torch.finfo(x.dtype).max,
    )
    scale_inv = div_rn(torch.ones_like(scale), scale)
    data = fp8_encode(to_fp32(x) * expand_blocks(scale, block_rows, block_cols, m, k),
                      fp8_dtype)
    return data, scale_inv


def fp8_block_quantize(
    x: torch.Tensor,
    *,
    fp8_dtype: DType,
    block_scaling_dim: int,
    force_pow_2_scales: bool,
    amax_epsilon: float,
    rowwise: bool,
    columnwise: bool,
    rows: torch.Tensor | None = None,
    groups: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Block-scaled FP8 of ``x [M, K]`` (any M, K; partial edge blocks), or with ``rows``
    (int32/int64 ``[P]``) of the ``[P, K]`` tensor whose row ``p`` is ``x[rows[p]]`` and zero
    where ``rows[p] < 0`` (a grouped operand's padded layout, read where its rows are).

    Returns ``(row_data [M, K], row_scale_inv, col_data [K, M], col_scale_inv)``, ``None`` for a
    direction not asked for; with ``groups = E > 0`` (``M / E`` a multiple of 128) ``col_data``
    is ``[E, K, M / E]``, each group of rows transposed on its own. Scales are fp32 in the
    GEMM-ready layouts of ``quant_core.shapes`` (1D: transposed, inner dim padded to 4; 2D: the
    column scales are the transposed row scales); padding is 0. ``value_for_inf`` is the max
    finite value of ``x.dtype``.
    """
    check_input_dtype(x, "fp8_block_quantize")
    check_fp8(fp8_dtype, "fp8_dtype")
    check_block_scaling_dim(block_scaling_dim)
    if rows is not None:
        check_row_index(x, rows, "fp8_block_quantize")
        x = gathered_rows(x, rows)
    m, k = x.shape
    check_column_groups(m, groups, BLOCK, "fp8_block_quantize")
    row, row_s, col, col_s = _quantized(x, fp8_dtype, block_scaling_dim, force_pow_2_scales,
                                        amax_epsilon, rowwise, columnwise)
    if col is not None and groups:
        col = col.view(k, groups, m // groups).transpose(0, 1).contiguous()
    return row, row_s, col, col_s


def _quantized(x, fp8_dtype, block_scaling_dim, force_pow_2_scales, amax_epsilon, rowwise,
               columnwise):
    """:func:`fp8_block_quantize` of ``x [M, K]`` without groups."""
    m, k = x.shape
    args = (fp8_dtype, force_pow_2_scales, amax_epsilon)
    row_data = row_scale = col_data = col_scale = None
    if block_scaling_dim == 2:
        data, scale_inv = _quantize_blocks(x, BLOCK, BLOCK, *args)  # [ceil(M/128), ceil(K/128)]
        if rowwise:
            row_data = data
            row_scale = _pad_cols(scale_inv, shapes.fp8_block_rowwise_scale_shape(m, k, 2)[1])
        if columnwise:
            col_data = data.t().contiguous()
            col_scale = _pad_cols(
                scale_inv.t(), shapes.fp8_block_columnwise_scale_shape(m, k, 2)[1]
            )
        return row_data, row_scale, col_data, col_scale
    if rowwise:
        row_data, scale_inv = _quantize_blocks(x, 1, BLOCK, *args)  # [M, ceil(K/128)]
        row_scale = _pad_cols(scale_inv.t(), shapes.fp8_block_rowwise_scale_shape(m, k, 1)[1])
    if columnwise:
        data, scale_inv = _quantize_blocks(x, BLOCK, 1, *args)  # [ceil(M/128), K]
        col_data = data.t().contiguous()
        col_scale = _pad_cols(scale_inv, shapes.fp8_block_columnwise_scale_shape(m, k, 1)[1])
    return row_data, row_scale, col_data, col_scale


def fp8_block_dequantize(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    fp8_dtype: DType,
    block_scaling_dim: int,
    columnwise: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``float(fp8(data)) * scale_inv`` per block, cast to ``dtype``, as ``[M, K]``.

    ``data`` is ``[M, K]`` rowwise or ``[K, M]`` columnwise (transposed back); ``scale_inv`` is in
    the GEMM-ready layout ``fp8_block_quantize`` returns (padding ignored).
    """
    check_output_dtype(dtype, "fp8_block_dequantize")
    check_block_scaling_dim(block_scaling_dim)
    values = fp8_decode(data, fp8_dtype)
    if columnwise:
        values = values.t()
    m, k = values.shape
    n_m, n_k = shapes.ceil_div(m, BLOCK), shapes.ceil_div(k, BLOCK)
    if block_scaling_dim == 2:
        per_block = scale_inv[:, :n_m].t() if columnwise else scale_inv[:, :n_k]
    else:
        per_block = scale_inv[:, :k] if columnwise else scale_inv[:, :m].t()
    block_rows, block_cols = _block_dims(block_scaling_dim, columnwise)
    per_element = expand_blocks(per_block.to(torch.float32), block_rows, block_cols, m, k)
    return (values * per_element).to(dtype).contiguous()
