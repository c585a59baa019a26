"""NVFP4's 4over6 block scaling (TransformerEngine's ``nvfp4_use_4over6``, `numerics.md` §7.9).

Each block (1x16 along the row, or a 16x16 tile in 2D mode) is quantized twice: *map-to-6* with
the E4M3 block scale ``e4m3(base)`` and *map-to-4* with ``e4m3(min(1.5 * base, 448))``, where
``base = fp32(fp32(block_amax / 6) * S_enc)`` and ``S_enc = fp32(6 * E / amax)`` with the global
E4M3 bound ``E`` (256 by default, so that the x1.5 scale fits; 448 is TE's standard bound). The
block keeps the candidate whose error against the input is lower; a tie keeps map-to-6.

The error of one element is ``fp32(fp32(fp32(e2m1 * e4m3_b) * amax) / (6 * E)) - x``: its
absolute value (``"MAE"``) or its square (``"MSE"``), summed in fp32 over the block's 16 elements
in order. A 16x16 tile sums its 16 row errors as a tree: rows ``r`` and ``r + 8``, then ``r`` and
``r + 4``, ``r + 2``, ``r + 1``. The columnwise direction quantizes ``xᵀ`` the same way, so its
tile errors sum the other way round. Round-to-nearest only (no RHT, no stochastic rounding). A
row-scaled tensor (one amax, so one ``S_enc``, per row) selects the same way under its rows' own
scales. This module sits beside the TE-default :mod:`.nvfp4`; both build on :mod:`.nvfp4_common`.
"""

from __future__ import annotations

import torch

from .. import shapes
from ..constants import E2M1_MAX, E4M3_MAX, FLT_MAX, NVFP4_4OVER6_MAP4
from ..dtypes import DType
from ..inputs import check_input_dtype, check_k_multiple, check_nvfp4_variant
from ._rounding import e2m1_decode, e2m1_encode, fp8_decode, fp8_encode
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
)
from .pad import zero_pad


def _candidate(v: torch.Tensor, base: torch.Tensor, s_dec: torch.Tensor, factor: float):
    """The E4M3 bytes ``[R, C/16]`` and E2M1 codes ``[R, C]`` of scaling ``v`` ``[R, C]`` with
    the block scales ``e4m3(min(factor * base, 448))``."""
    r, c = v.shape
    dev = v.device
    e4m3 = fp8_encode(torch.clamp(base * factor, max=E4M3_MAX), DType.E4M3)
    enc = torch.fmin(f32(1.0, dev) / (fp8_decode(e4m3, DType.E4M3) * s_dec), f32(FLT_MAX, dev))
    scaled = (v.reshape(r, c // BLOCK, BLOCK) * enc[..., None]).reshape(r, c)
    return e4m3, e2m1_encode(torch.clamp(scaled, -E2M1_MAX, E2M1_MAX))


def _block_errors(v, e4m3, codes, amax, e4m3_max: int, err_mode: str) -> torch.Tensor:
    """Per row and block ``[R, C/16]``: the error of the candidate, summed over the block's 16
    elements in order."""
    r, c = v.shape
    dev = v.device
    vals = e2m1_decode(codes).reshape(r, c // BLOCK, BLOCK)
    sf = fp8_decode(e4m3, DType.E4M3)
    denom = f32(E2M1_MAX * e4m3_max, dev)
    x = v.reshape(r, c // BLOCK, BLOCK)
    err = torch.zeros((r, c // BLOCK), dtype=torch.float32, device=dev)
    for i in range(BLOCK):
        diff = vals[..., i] * sf * amax / denom - x[..., i]
        err = err + (diff * diff if err_mode == "MSE" else diff.abs())
    return err


def _tile_errors(err: torch.Tensor) -> torch.Tensor:
    """The 16-row tree sum of per-row errors ``[R, C/16]`` (R % 16 == 0), repeated back to one
    value per row."""
    rows = err.reshape(err.shape[0] // BLOCK, BLOCK, err.shape[1])
    for half in (8, 4, 2, 1):
        rows = rows[:, :half] + rows[:, half:2 * half]
    return rows[:, 0].repeat_interleave(BLOCK, dim=0)


def select_4over6(v: torch.Tensor, block_amax: torch.Tensor, amax: torch.Tensor, *,
                  e4m3_max: int, err_mode: str, tile_rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The E2M1 codes ``[R, C]`` and E4M3 block-scale bytes ``[R, C/16]`` of fp32 ``v``
    ``[R, C]`` (zero-padded, ``C % 16 == 0``, ``R % tile_rows == 0``) under 4over6, with the
    block amaxes ``block_amax`` ``[R, C/16]`` (a tile's repeated on each of its rows) and the
    tensor amax ``amax`` (fp32 ``(1,)``); ``tile_rows`` 1 (1x16 blocks) or 16 (16x16 tiles)."""
    dev = v.device
    amax = amax.to(torch.float32)
    s_enc = global_encode_scale(amax, e4m3_max)
    s_dec = f32(1.0, dev) / s_enc
    base = block_amax / f32(E2M1_MAX, dev) * s_enc
    e4m3_4, codes_4 = _candidate(v, base, s_dec, NVFP4_4OVER6_MAP4)
    e4m3_6, codes_6 = _candidate(v, base, s_dec, 1.0)
    err_4 = _block_errors(v, e4m3_4, codes_4, amax, e4m3_max, err_mode)
    err_6 = _block_errors(v, e4m3_6, codes_6, amax, e4m3_max, err_mode)
    if tile_rows == BLOCK:
        err_4, err_6 = _tile_errors(err_4), _tile_errors(err_6)
    pick_4 = err_4 < err_6
    r, c = v.shape
    codes = torch.where(pick_4[..., None], codes_4.reshape(r, c // BLOCK, BLOCK),
                        codes_6.reshape(r, c // BLOCK, BLOCK)).reshape(r, c)
    return codes, torch.where(pick_4, e4m3_4, e4m3_6)


def _direction(v, valid_rows, valid_cols, amax, block_amax, scale_shape, *, e4m3_max, err_mode,
               tile_rows):
    codes, e4m3 = select_4over6(v, block_amax, amax, e4m3_max=e4m3_max, err_mode=err_mode,
                                tile_rows=tile_rows)
    return direction_buffers(codes, e4m3, valid_rows, valid_cols, scale_shape)


def nvfp4_4over6_quantize(
    x: torch.Tensor,
    amax_rowwise: torch.Tensor | None,
    amax_columnwise: torch.Tensor | None,
    *,
    rowwise: bool,
    columnwise: bool,
    with_2d_quantization: bool,
    e4m3_max: int,
    err_mode: str,
    swizzle: bool,
    row_scaled: bool = False,
) -> Buffers:
    """Quantize ``x`` ``[M, K]`` to NVFP4 with 4over6 block scaling: the buffers of
    :func:`quant_core.reference.nvfp4_quantize` (same shapes and layout, padding 0, a direction
    not asked for ``None``), whose value is ``e2m1 * fp32(fp32(e4m3_b * amax) / (6 * e4m3_max))``
    elementwise (dequantization divides by the bound the quantization used). ``row_scaled``:
    ``amax_rowwise`` holds one value per row (``(M,)``); rowwise only, 1x16 blocks."""
    check_nvfp4_variant(columnwise=columnwise, with_rht=False,
                        with_2d_quantization=with_2d_quantization, four_over_six=True,
                        e4m3_max=e4m3_max, err_mode=err_mode, row_scaled=row_scaled)
    check_input_dtype(x, "nvfp4_4over6_quantize")
    m, k = x.shape
    check_k_multiple(k, BLOCK, "NVFP4")
    mp = shapes.roundup(m, BLOCK)
    if row_scaled:
        amax_rowwise = row_amax(amax_rowwise, m, mp)
    xf = zero_pad(x.to(torch.float32), mp, k)  # [Mp, K], zero rows past M
    tile_amax = blocks_amax(xf, BLOCK) if with_2d_quantization else None  # [Mp, K/16]
    tile_rows = BLOCK if with_2d_quantization else 1
    opts = dict(e4m3_max=e4m3_max, err_mode=err_mode, tile_rows=tile_rows)
    row_data = row_scale = col_data = col_scale = None
    if rowwise:
        blk = tile_amax if with_2d_quantization else blocks_amax(xf, 1)
        row_data, row_scale = _direction(xf, m, k, amax_rowwise, blk,
                                         shapes.nvfp4_rowwise_scale_shape(m, k), **opts)
    if columnwise:
        vt = xf.t().contiguous()  # [K, Mp]
        col_data, col_scale = _direction(vt, k, m, amax_columnwise,
                                         columnwise_block_amax(vt, tile_amax),
                                         shapes.nvfp4_columnwise_scale_shape(m, k), **opts)
    return finish(row_data, row_scale, col_data, col_scale, swizzle=swizzle)
