"""NVFP4 reference: two-level scaled E2M1 with E4M3 block scales (`numerics.md` §7, §8, §10).

This module is the TE-default core (``nvfp4_e4m3_max = 448``) with the amaxes and the
dequantization every variant shares; 4over6's block-scale selection is :mod:`.nvfp4_4over6`,
beside it, both built on :mod:`.nvfp4_common`, and ``nvfp4_quantize`` (:mod:`.nvfp4_dispatch`)
picks the variant. Row-scaled NVFP4 (§7.9) takes one amax per row, so ``S_enc`` and
everything derived from it is per row; it is rowwise only. Blocks are 1x16
along K (rowwise) or along M (columnwise, the quantization of ``xᵀ`` stored as
``[K, ceil(M/2)]``), or 16x16 tiles in 2D mode. Partial blocks along M take their amax over the
valid rows only (§0 Shapes).

Stochastic rounding numbers the elements of the two directions as one stream: rowwise element
``(m, k)`` of ``x`` draws ``sr_random_byte(seed, m * K + k)`` and columnwise element ``(k, m)`` of
the (possibly transformed) ``xᵀ`` draws ``sr_random_byte(seed, M * K + k * M + m)``.
"""

from __future__ import annotations

import torch

from .. import shapes
from ..constants import E2M1_MAX, FLT_MAX, RCP_NVFP4_GLOBAL_MAX, rcp_f32
from ..dtypes import DType
from ..inputs import (
    check_input_dtype,
    check_k_multiple,
    check_nvfp4_variant,
    check_output_dtype,
)
from ._rounding import (
    e2m1_decode,
    e2m1_encode,
    fp8_decode,
    fp8_encode,
    nan_to_zero_abs,
    sr_random_byte,
    sr_round_e2m1,
)
from .nvfp4_common import (
    BLOCK,
    Buffers,
    blocks_amax,
    columnwise_block_amax,
    direction_buffers,
    f32,
    finish,
    global_encode_scale,
    row_amax,
    unpack_e2m1,
)
from .nvfp4_common import pack_e2m1 as pack_e2m1  # still importable from here
from .pad import zero_pad
from .rht import rht_columnwise


def block_scales(
    block_amax: torch.Tensor, s_enc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 bytes and fp32 encode multipliers ``enc_b`` of block amaxes, in the order of §7.3."""
    dev = block_amax.device
    one = f32(1.0, dev)
    s_dec = one / s_enc
    t = s_enc * (one / 6.0)  # fp32(S_enc * fp32(1/6)): one / 6.0 is the correctly rounded fp32
    sdec_b = block_amax * t
    e4m3 = fp8_encode(torch.fmin(sdec_b, f32(FLT_MAX, dev)), DType.E4M3)
    enc_b = torch.fmin(one / (fp8_decode(e4m3, DType.E4M3) * s_dec), f32(FLT_MAX, dev))
    return e4m3, enc_b


def _quantize_direction(
    v: torch.Tensor,
    valid_rows: int,
    valid_cols: int,
    amax: torch.Tensor,
    block_amax: torch.Tensor,
    scale_shape: tuple[int, int],
    sr_offset: int | None,
    rng_seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 ``v`` ``[R, C]`` (zero-padded past ``valid_rows x valid_cols``, C % 16 == 0)
    with 1x16 blocks along C; ``block_amax`` ``[R, C/16]``. Returns packed data
    ``[valid_rows, ceil(valid_cols/2)]`` and the zero-padded E4M3 scale bytes ``scale_shape``."""
    r, c = v.shape
    e4m3, enc_b = block_scales(block_amax, global_encode_scale(amax))
    scaled = (v.reshape(r, c // BLOCK, BLOCK) * enc_b[..., None]).reshape(r, c)
    if sr_offset is not None:
        rows = torch.arange(r, device=v.device, dtype=torch.int64)[:, None]
        cols = torch.arange(c, device=v.device, dtype=torch.int64)[None, :]
        rbyte = sr_random_byte(rng_seed, sr_offset + rows * valid_cols + cols)
        scaled = sr_round_e2m1(scaled, rbyte)
    return direction_buffers(e2m1_encode(scaled), e4m3, valid_rows, valid_cols, scale_shape)


def nvfp4_amax(
    x: torch.Tensor, *, rowwise: bool, columnwise: bool, with_rht: bool, rht_sign_mask: int,
    row_scaled: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """NaN-dropping amaxes (fp32 ``(1,)``, 0 for an empty tensor) of §7.1.

    Without RHT both directions get ``max|x|``; with RHT the columnwise amax is taken over the
    bf16-rounded RHT of ``xᵀ``. A direction not asked for is ``None``. ``row_scaled``: the
    rowwise amax is one value per row, fp32 ``(M,)`` (0 for an empty row); no columnwise one.
    """
    check_input_dtype(x, "nvfp4_amax")
    check_k_multiple(x.shape[1], BLOCK, "NVFP4")
    check_nvfp4_variant(columnwise=columnwise, with_rht=with_rht, row_scaled=row_scaled)
    if row_scaled:
        if x.shape[1] == 0:
            return torch.zeros(x.shape[0], dtype=torch.float32, device=x.device), None
        return nan_to_zero_abs(x).amax(dim=1).to(torch.float32), None

    def amax_of(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 0:
            return torch.zeros(1, dtype=torch.float32, device=t.device)
        return nan_to_zero_abs(t).amax().reshape(1)

    row = amax_of(x) if rowwise or (columnwise and not with_rht) else None
    col = None
    if columnwise:
        col = amax_of(rht_columnwise(x, rht_sign_mask)) if with_rht else row.clone()
    return (row if rowwise else None), col


def nvfp4_base_quantize(
    x: torch.Tensor,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    *,
    rowwise: bool,
    columnwise: bool,
    with_rht: bool,
    rht_sign_mask: int,
    with_2d_quantization: bool,
    stochastic_rounding: bool,
    rng_seed: torch.Tensor | None,
    swizzle: bool,
    row_scaled: bool = False,
) -> Buffers:
    """Quantize ``x`` ``[M, K]`` to NVFP4 with the given per-direction amaxes (§7.2–§7.8), the
    TE-default block scaling (global bound 448).

    Returns ``(row_data [M, K/2], row_scale, col_data [K, ceil(M/2)], col_scale)`` (uint8; scales
    E4M3 bytes in ``quant_core.shapes``' padded shapes, padding 0; a direction not asked for is
    ``None``). With RHT (bf16 ``x``, ``M % 16 == 0``) the columnwise direction quantizes the RHT of
    ``xᵀ``. 2D mode uses one block scale per 16x16 tile for both directions (exclusive with RHT).
    With ``swizzle`` the scale buffers hold the GEMM-swizzled bytes (same shapes).
    ``row_scaled``: ``amax_rowwise`` holds one value per row (``(M,)``) and each row has its own
    ``S_enc`` (§7.9); rowwise only, 1x16 blocks, round to nearest.
    """
    check_nvfp4_variant(columnwise=columnwise, with_rht=with_rht,
                        with_2d_quantization=with_2d_quantization,
                        stochastic_rounding=stochastic_rounding, rng_seed=rng_seed,
                        row_scaled=row_scaled)
    check_input_dtype(x, "nvfp4_quantize")
    m, k = x.shape
    check_k_multiple(k, BLOCK, "NVFP4")
    mp = shapes.roundup(m, BLOCK)
    if row_scaled:
        amax_rowwise = row_amax(amax_rowwise, m, mp)
    xf = zero_pad(x.to(torch.float32), mp, k)  # [Mp, K], zero rows past M
    tile_amax = blocks_amax(xf, BLOCK) if with_2d_quantization else None  # [Mp, K/16]
    row_data = row_scale = col_data = col_scale = None
    if rowwise:
        blk = tile_amax if with_2d_quantization else blocks_amax(xf, 1)
        row_data, row_scale = _quantize_direction(
            xf, m, k, amax_rowwise, blk, shapes.nvfp4_rowwise_scale_shape(m, k),
            0 if stochastic_rounding else None, rng_seed,
        )
    if columnwise:
        if with_rht:
            vt = rht_columnwise(x, rht_sign_mask).to(torch.float32)  # [K, M], M % 16 == 0
        else:
            vt = xf.t()  # [K, Mp]
        col_data, col_scale = _quantize_direction(
            vt, k, m, amax_columnwise, columnwise_block_amax(vt, tile_amax),
            shapes.nvfp4_columnwise_scale_shape(m, k),
            m * k if stochastic_rounding else None, rng_seed,
        )
    return finish(row_data, row_scale, col_data, col_scale, swizzle=swizzle)


def nvfp4_dequantize(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, *, swizzled: bool, dtype,
    e4m3_max: int = 448,
) -> torch.Tensor:
    """Dequantize rowwise NVFP4 ``data`` ``[M, K/2]`` to ``dtype`` ``[M, K]`` (§8):
    ``e2m1(code) * fp32(fp32(float(e4m3_b) * amax) * fp32(1/2688))``, then an RNE cast; with the
    global bound ``e4m3_max`` of a 4over6 tensor, ``fp32(1 / (6 * e4m3_max))`` (§7.9). ``amax``
    is fp32 ``(1,)``, or ``(M,)`` for a row-scaled tensor (each row its own). A last partial
    block (the columnwise form of a tensor whose M is not a multiple of 16, read as a row
    operand) uses its block's scale."""
    check_output_dtype(dtype, "nvfp4_dequantize")
    if swizzled:
        from .swizzle import unswizzle_scales

        scale = unswizzle_scales(scale)
    m, k = data.shape[0], data.shape[1] * 2
    dev = data.device
    e4m3 = fp8_decode(scale[:m, : -(-k // BLOCK)].contiguous(), DType.E4M3)
    if amax.numel() not in (1, m):
        raise ValueError(f"nvfp4_dequantize: amax must have 1 or {m} (one per row) elements, "
                         f"got shape {tuple(amax.shape)}")
    s = e4m3 * amax.to(torch.float32).reshape(-1, 1)
    rcp = RCP_NVFP4_GLOBAL_MAX if e4m3_max == 448 else rcp_f32(E2M1_MAX * e4m3_max)
    s = s * f32(rcp, dev)  # fp32(1 / 2688), or fp32(1 / 1536) for a bound of 256
    vals = e2m1_decode(unpack_e2m1(data)) * s.repeat_interleave(BLOCK, dim=1)[:, :k]
    return vals.to(dtype)
