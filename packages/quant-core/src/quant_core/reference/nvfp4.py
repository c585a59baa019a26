"""NVFP4 reference: two-level scaled E2M1 with E4M3 block scales (`numerics.md` §7, §8, §10).

This module is the TE-default core (``nvfp4_e4m3_max = 448``); 4over6's block-scale selection
is :mod:`.nvfp4_4over6`. Row-scaled NVFP4 (§7.9) takes one amax per row, so ``S_enc`` and
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
from ..constants import E2M1_MAX, FLT_MAX, NVFP4_GLOBAL_MAX, RCP_NVFP4_GLOBAL_MAX, rcp_f32
from ..dtypes import DType
from ..inputs import check_input_dtype, check_k_multiple, check_nvfp4_modes
from ._rounding import (
    e2m1_decode,
    e2m1_encode,
    fp8_decode,
    fp8_encode,
    nan_to_zero_abs,
    sr_random_byte,
    sr_round_e2m1,
)
from .pad import zero_pad
from .rht import rht_columnwise

BLOCK = shapes.NVFP4_BLOCK


def f32(value: float, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[R, 2C]`` into bytes ``[R, C]``: ``byte = code[2j] | code[2j+1] << 4``."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """Codes (int64) ``[R, 2C]`` of packed bytes ``[R, C]`` (low nibble first)."""
    b = data.to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(data.shape[0], 2 * data.shape[1])


def global_encode_scale(amax: torch.Tensor, e4m3_max: int = 448) -> torch.Tensor:
    """``S_enc`` (fp32 ``(1,)``) of §7.2: ``fminf(fp32(6 * e4m3_max / amax), FLT_MAX)`` (2688 for
    the standard bound 448; 4over6 may bound by 256, §7.9), 1 if that is 0 or ``amax == 0``. Like
    TE's ``fminf``, a NaN amax gives FLT_MAX."""
    amax = amax.to(torch.float32)
    top = NVFP4_GLOBAL_MAX if e4m3_max == 448 else E2M1_MAX * e4m3_max
    s = torch.fmin(f32(top, amax.device) / amax, f32(FLT_MAX, amax.device))
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


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


def blocks_amax(v: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """NaN-dropping amax of ``v`` ``[R, C]`` (C % 16 == 0, R % rows_per_block == 0) per block of
    ``rows_per_block x 16``, repeated back to one value per row: ``[R, C/16]``."""
    r, c = v.shape
    a = nan_to_zero_abs(v).reshape(r // rows_per_block, rows_per_block, c // BLOCK, BLOCK)
    a = a.amax(dim=(1, 3))
    return a.repeat_interleave(rows_per_block, dim=0)


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
    codes = e2m1_encode(scaled)[:valid_rows, :valid_cols]
    codes = zero_pad(codes, codes.shape[0], codes.shape[1] + valid_cols % 2)  # last nibble 0
    data = pack_e2m1(codes)
    e4m3 = e4m3[:valid_rows, : c // BLOCK]
    return data, zero_pad(e4m3, scale_shape[0], scale_shape[1])


def check_row_scaled(*, columnwise: bool, with_rht: bool, with_2d_quantization: bool = False,
                     stochastic_rounding: bool = False) -> None:
    """``ValueError`` for what row-scaled NVFP4 does not take: a columnwise direction, RHT, 2D
    blocks or stochastic rounding."""
    refused = [name for name, on in (("columnwise", columnwise), ("with_rht", with_rht),
                                     ("with_2d_quantization", with_2d_quantization),
                                     ("stochastic_rounding", stochastic_rounding)) if on]
    if refused:
        raise ValueError(f"row-scaled NVFP4 is rowwise only, with 1x16 blocks rounded to "
                         f"nearest; it takes no {', '.join(refused)}")


def row_amax(amax: torch.Tensor, rows: int, padded_rows: int) -> torch.Tensor:
    """A row-scaled amax ``(rows,)`` as fp32 ``[padded_rows, 1]`` (zero past ``rows``), to
    broadcast over the rows of a block-padded tensor."""
    if amax.shape != (rows,):
        raise ValueError(f"row-scaled NVFP4: the rowwise amax must hold one value per row, "
                         f"shape ({rows},), got {tuple(amax.shape)}")
    return zero_pad(amax.to(torch.float32).reshape(rows, 1), padded_rows, 1)


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
    if row_scaled:
        check_row_scaled(columnwise=columnwise, with_rht=with_rht)
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


def nvfp4_quantize(
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
    four_over_six: bool = False,
    e4m3_max: int = 448,
    err_mode: str = "MAE",
    row_scaled: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Quantize ``x`` ``[M, K]`` to NVFP4 with the given per-direction amaxes (§7.2–§7.8).

    Returns ``(row_data [M, K/2], row_scale, col_data [K, ceil(M/2)], col_scale)`` (uint8; scales
    E4M3 bytes in ``quant_core.shapes``' padded shapes, padding 0; a direction not asked for is
    ``None``). With RHT (bf16 ``x``, ``M % 16 == 0``) the columnwise direction quantizes the RHT of
    ``xᵀ``. 2D mode uses one block scale per 16x16 tile for both directions (exclusive with RHT).
    With ``swizzle`` the scale buffers hold the GEMM-swizzled bytes (same shapes).
    ``four_over_six``: 4over6 block scaling with the global bound ``e4m3_max`` and the error
    metric ``err_mode`` (§7.9, :mod:`.nvfp4_4over6`; no RHT, no stochastic rounding).
    ``row_scaled``: ``amax_rowwise`` holds one value per row (``(M,)``) and each row has its own
    ``S_enc`` (§7.9); rowwise only, 1x16 blocks, round to nearest.
    """
    if row_scaled:
        check_row_scaled(columnwise=columnwise, with_rht=with_rht,
                         with_2d_quantization=with_2d_quantization,
                         stochastic_rounding=stochastic_rounding)
        amax_rowwise = row_amax(amax_rowwise, x.shape[0], shapes.roundup(x.shape[0], BLOCK))
    if four_over_six:
        from .nvfp4_4over6 import nvfp4_4over6_quantize

        if with_rht or stochastic_rounding:
            raise ValueError("NVFP4 4over6 takes neither with_rht nor stochastic_rounding")
        return nvfp4_4over6_quantize(
            x, amax_rowwise, amax_columnwise, rowwise=rowwise, columnwise=columnwise,
            with_2d_quantization=with_2d_quantization, e4m3_max=e4m3_max, err_mode=err_mode,
            swizzle=swizzle,
        )
    if e4m3_max != 448:
        raise ValueError(f"nvfp4_quantize: e4m3_max must be 448 without 4over6, got {e4m3_max}")
    check_input_dtype(x, "nvfp4_quantize")
    m, k = x.shape
    check_k_multiple(k, BLOCK, "NVFP4")
    check_nvfp4_modes(with_rht, with_2d_quantization, stochastic_rounding, rng_seed)
    mp = shapes.roundup(m, BLOCK)
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
        if with_2d_quantization:
            blk = tile_amax[::BLOCK].t().repeat_interleave(BLOCK, dim=0)  # [K, Mp/16]
        else:
            blk = blocks_amax(vt, 1)
        col_data, col_scale = _quantize_direction(
            vt, k, m, amax_columnwise, blk, shapes.nvfp4_columnwise_scale_shape(m, k),
            m * k if stochastic_rounding else None, rng_seed,
        )
    if swizzle:
        from .swizzle import swizzle_scales

        row_scale = None if row_scale is None else swizzle_scales(row_scale)
        col_scale = None if col_scale is None else swizzle_scales(col_scale)
    # storages hold contiguous buffers (custom ops and checkpoints rely on the layout)
    return tuple(
        None if t is None else t.contiguous() for t in (row_data, row_scale, col_data, col_scale)
    )


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
