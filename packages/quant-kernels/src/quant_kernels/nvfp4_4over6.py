"""NVFP4 4over6 kernels (`numerics.md` §7.9), byte-exact with
``reference.nvfp4_quantize(four_over_six=True)``.

Each block (1x16 along the row, 16x1 along M for the columnwise ``xᵀ``, or a 16x16 tile) is
scaled twice, map-to-6 (E4M3 ``e4m3(base)``) and map-to-4 (``e4m3(min(1.5 * base, 448))``), and
keeps the candidate of strictly lower error (MAE or MSE against the input, summed in the
reference's order); a tie keeps map-to-6. The kept candidate's codes, computed for its error,
are the stored data. The error's division by ``6E`` runs as FMAs (``_rounding.div_rn_by``)
unless an amax is so small that a dividend could leave that helper's exact range. Both kernels
hold a block's 16 elements as 16 elementwise tensors, so every per-block sum is a plain chain of
fp32 adds in element order.
Round-to-nearest only (no RHT, no stochastic rounding). These kernels sit beside the TE-default
ones of :mod:`.nvfp4`; both build on :mod:`.nvfp4_common`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.inputs import check_input_dtype, check_k_multiple, check_nvfp4_variant
from quant_core.reference.nvfp4_common import row_amax

from ._common import launch
from ._rounding import div_rn_by, e2m1_rne_with_value, fp8_decode, mul_rn, widen
from .configs import launch_config
from .nvfp4_common import (
    _amax16,
    _block_scales,
    _col_values,
    _encode_scale,
    _load_amax,
    _store_col,
    _store_row_scales,
    _tile_amax,
    col_buffers,
    col_data,
    col_grid,
    row_buffers,
    row_grid,
)


@triton.jit
def _element(y, enc, sf, amax, J: tl.constexpr, E: tl.constexpr, MSE: tl.constexpr,
             FAST: tl.constexpr):
    """One element under a candidate (``enc``, decoded scale ``sf``): its E2M1 code in nibble
    ``J`` of an int64 word, and its error ``d = fp32(fp32(fp32(e2m1 * sf) * amax) / (6E)) - y``
    as ``d * d`` or ``|d|``. ``FAST``: the division by FMAs (``div_rn_by``), for amaxes that
    keep every nonzero dividend above ``DIV_BY_MIN`` (``_fast_division``)."""
    code, value = e2m1_rne_with_value(y * enc)
    q = value * sf * amax
    if FAST:
        q = div_rn_by(q, 6.0 * E)
    else:
        q = tl.math.div_rn(q, tl.full(q.shape, 6.0 * E, tl.float32))
    d = q - y
    if MSE:
        err = mul_rn(d, d)  # no FMA into the sum that follows
    else:
        err = tl.abs(d)
    return code.to(tl.int64) << (4 * J), err


@triton.jit
def _candidate(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, e4, enc,
               amax, E: tl.constexpr, MSE: tl.constexpr, FAST: tl.constexpr):
    """A candidate per block: its data word (the 16 codes, element ``j`` in bits
    ``4j .. 4j + 3``, as ``nvfp4._pack16`` packs them) and its error, the 16 element errors
    summed in fp32, element 0 first."""
    sf = fp8_decode(e4, True)
    w, err = _element(y0, enc, sf, amax, 0, E, MSE, FAST)
    c, e = _element(y1, enc, sf, amax, 1, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y2, enc, sf, amax, 2, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y3, enc, sf, amax, 3, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y4, enc, sf, amax, 4, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y5, enc, sf, amax, 5, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y6, enc, sf, amax, 6, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y7, enc, sf, amax, 7, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y8, enc, sf, amax, 8, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y9, enc, sf, amax, 9, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y10, enc, sf, amax, 10, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y11, enc, sf, amax, 11, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y12, enc, sf, amax, 12, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y13, enc, sf, amax, 13, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y14, enc, sf, amax, 14, E, MSE, FAST)
    w, err = w | c, err + e
    c, e = _element(y15, enc, sf, amax, 15, E, MSE, FAST)
    return w | c, err + e


@triton.jit
def _halve(t):
    """``t [A, B, 2H]`` to ``t[..., :H] + t[..., H:]`` (``[A, B, H]``)."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    H: tl.constexpr = t.shape[2] // 2
    lo, hi = tl.split(tl.permute(tl.reshape(t, [A, B, 2, H]), (0, 1, 3, 2)))
    return lo + hi


@triton.jit
def _tile_error(err, AXIS: tl.constexpr):
    """Per-block errors ``err [R, C]`` to their 16x16 tiles' errors, one per block: each run of
    16 along ``AXIS`` summed as the tree ``r + (r + 8)``, then ``+ 4``, ``+ 2``, ``+ 1``."""
    R: tl.constexpr = err.shape[0]
    C: tl.constexpr = err.shape[1]
    if AXIS == 0:
        t = tl.permute(tl.reshape(err, [R // 16, 16, C]), (0, 2, 1))  # [R/16, C, 16]
    else:
        t = tl.reshape(err, [R, C // 16, 16])
    t = tl.reshape(_halve(_halve(_halve(_halve(t)))), [t.shape[0], t.shape[1]])
    if AXIS == 0:
        return tl.reshape(tl.broadcast_to(t[:, None, :], [R // 16, 16, C]), [R, C])
    else:
        return tl.reshape(tl.broadcast_to(t[:, :, None], [R, C // 16, 16]), [R, C])


@triton.jit
def _pick(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, bmax, amax,
          E: tl.constexpr, MSE: tl.constexpr, TWO_D: tl.constexpr, AXIS: tl.constexpr,
          FAST: tl.constexpr):
    """The E4M3 byte (int32) and the data word (int64) of the chosen candidate per block, from
    the block amaxes ``bmax`` (a tile's on each of its blocks with ``TWO_D``, whose tiles run
    along ``AXIS``) and the tensor's (or the row's) amax: ``base = fp32(fp32(bmax / 6) *
    S_enc)``, map-to-6 scales ``base``, map-to-4 ``1.5 * base`` (``_block_scales`` saturates at
    448)."""
    s_enc = _encode_scale(amax, 6.0 * E)
    s_dec = tl.math.div_rn(1.0, s_enc)
    base = tl.math.div_rn(bmax, tl.full(bmax.shape, 6.0, tl.float32)) * s_enc
    e6, enc6 = _block_scales(base, s_dec, 1.0)
    e4, enc4 = _block_scales(base, s_dec, 1.5)
    w6, err6 = _candidate(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                          e6, enc6, amax, E, MSE, FAST)
    w4, err4 = _candidate(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                          e4, enc4, amax, E, MSE, FAST)
    if TWO_D:
        err6 = _tile_error(err6, AXIS)
        err4 = _tile_error(err4, AXIS)
    pick4 = err4 < err6  # a tie or a NaN error keeps map-to-6
    return tl.where(pick4, e4, e6), tl.where(pick4, w4, w6)


#: Amaxes at or above this (or 0) keep every nonzero dividend of the error's division at or
#: above ``DIV_BY_MIN``: ``|q| >= 0.5 * 2^-9 * amax`` (the smallest E2M1 and E4M3 values).
FAST_AMAX_MIN = tl.constexpr(2.0**-80)


@triton.jit
def _fast_division(amax, ROW_SCALED: tl.constexpr):
    """Whether the program may divide by FMAs (``div_rn_by``): no amax (the tensor's, or one per
    row ``[R, 1]``) in ``(0, FAST_AMAX_MIN)``. A NaN or infinite amax makes the dividends NaN or
    infinite, which ``div_rn_by`` divides exactly; rows past the end load amax 0."""
    tiny = ((amax > 0.0) & (amax < FAST_AMAX_MIN)).to(tl.int32)
    if ROW_SCALED:
        tiny = tl.max(tl.max(tiny, axis=1), axis=0)
    return tiny == 0


@triton.jit
def _select(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, bmax, amax,
            E: tl.constexpr, MSE: tl.constexpr, TWO_D: tl.constexpr, AXIS: tl.constexpr,
            ROW_SCALED: tl.constexpr):
    """:func:`_pick`, dividing by FMAs where :func:`_fast_division` allows it (one branch per
    program)."""
    if _fast_division(amax, ROW_SCALED):
        e4, w = _pick(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, bmax,
                      amax, E, MSE, TWO_D, AXIS, True)
    else:
        e4, w = _pick(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, bmax,
                      amax, E, MSE, TWO_D, AXIS, False)
    return e4, w


@triton.jit
def _row_element(x_ptr, offs, J: tl.constexpr, mask):
    return widen(tl.load(x_ptr + offs + J, mask=mask, other=0.0))


@triton.jit
def _row_values(x_ptr, offs, mask):
    """Elements ``j = 0..15`` of the 1x16 blocks starting at ``offs [BM, NB]`` (0 where not
    ``mask``), each ``[BM, NB]`` fp32."""
    return (_row_element(x_ptr, offs, 0, mask), _row_element(x_ptr, offs, 1, mask),
            _row_element(x_ptr, offs, 2, mask), _row_element(x_ptr, offs, 3, mask),
            _row_element(x_ptr, offs, 4, mask), _row_element(x_ptr, offs, 5, mask),
            _row_element(x_ptr, offs, 6, mask), _row_element(x_ptr, offs, 7, mask),
            _row_element(x_ptr, offs, 8, mask), _row_element(x_ptr, offs, 9, mask),
            _row_element(x_ptr, offs, 10, mask), _row_element(x_ptr, offs, 11, mask),
            _row_element(x_ptr, offs, 12, mask), _row_element(x_ptr, offs, 13, mask),
            _row_element(x_ptr, offs, 14, mask), _row_element(x_ptr, offs, 15, mask))


@triton.jit
def _nvfp4_4over6_row_kernel(
    x_ptr, amax_ptr, d_ptr, s_ptr, M, K, S_C,
    E: tl.constexpr, MSE: tl.constexpr, TWO_D: tl.constexpr, SWIZZLE: tl.constexpr,
    ROW_SCALED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """Rowwise 4over6 over a ``[BM, BK]`` tile: one int64 data word and one scale byte per
    block.

    x_ptr: input x ``[M, K]``, contiguous (fp32, bf16 or fp16).
    amax_ptr: fp32 rowwise amax ``(1,)``, or ``(M,)`` with ``ROW_SCALED``.
    d_ptr: packed E2M1 data ``[M, K/2]`` bytes as int64 words ``[M, K/16]``.
    s_ptr: uint8 E4M3 scales ``[roundup(M, 128), S_C]``, zero-initialised.
    M: rows of x.
    K: columns of x (a multiple of 16).
    S_C: dim 1 of the scales, ``roundup(K/16, 4)``.
    E: the global E4M3 bound (256 or 448).
    MSE: squared errors, else absolute.
    TWO_D: 16x16 tiles, else 1x16 blocks.
    SWIZZLE: scales in the GEMM swizzle.
    ROW_SCALED: one amax (so one ``S_enc``) per row.
    BM: tile rows (a multiple of 16 with ``TWO_D``).
    BK: tile columns (a multiple of 16).
    """
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    kb = tl.program_id(1) * (BK // 16) + tl.arange(0, BK // 16)
    mask = (rm[:, None] < M) & (kb[None, :] < K // 16)
    offs = rm[:, None].to(tl.int64) * K + kb[None, :] * 16
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _row_values(
        x_ptr, offs, mask)
    bmax = _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
    if TWO_D:
        bmax = _tile_amax(bmax, 0)
    e4, w = _select(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                    bmax, _load_amax(amax_ptr, rm, M, ROW_SCALED), E, MSE, TWO_D, 0, ROW_SCALED)
    tl.store(d_ptr + rm[:, None].to(tl.int64) * (K // 16) + kb[None, :], w, mask=mask)
    _store_row_scales(s_ptr, e4, rm, kb, M, K, S_C, SWIZZLE)


@triton.jit
def _nvfp4_4over6_col_kernel(
    x_ptr, amax_ptr, d_ptr, s_ptr, M, K, MHW, S_C,
    E: tl.constexpr, MSE: tl.constexpr, TWO_D: tl.constexpr, SWIZZLE: tl.constexpr,
    G: tl.constexpr, BK: tl.constexpr,
):
    """Columnwise 4over6 (the blocks of ``xᵀ``) over a ``[16G, BK]`` tile, stored transposed as
    ``_nvfp4_col_kernel`` stores.

    x_ptr: input x ``[M, K]``, contiguous (fp32, bf16 or fp16).
    amax_ptr: fp32 columnwise amax ``(1,)``.
    d_ptr: packed E2M1 data of x transposed, ``[K, ceil(M/2)]`` bytes padded to ``[K, MHW]`` int64.
    s_ptr: uint8 E4M3 scales ``[roundup(K, 128), S_C]``, zero-initialised.
    M: rows of x.
    K: columns of x (a multiple of 16).
    MHW: int64 words per data row, ``ceil(ceil(M/2) / 8)``.
    S_C: dim 1 of the scales, ``roundup(ceil(M/16), 4)``.
    E: the global E4M3 bound (256 or 448).
    MSE: squared errors, else absolute.
    TWO_D: 16x16 tiles, else 16x1 blocks.
    SWIZZLE: scales in the GEMM swizzle.
    G: 16-row groups per tile.
    BK: tile columns (a multiple of 16).
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _col_values(
        x_ptr, pid_m, pid_k, M, K, False, 0, G, BK)
    bmax = _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
    if TWO_D:
        bmax = _tile_amax(bmax, 1)
    e4, w = _select(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15,
                    bmax, tl.load(amax_ptr), E, MSE, TWO_D, 1, False)
    _store_col(d_ptr, s_ptr, w, e4, pid_m, pid_k, M, K, MHW, S_C, SWIZZLE, G, BK)


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
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The buffers of ``reference.nvfp4_quantize(..., four_over_six=True)`` (same shapes,
    layout and bytes, padding 0, a direction not asked for ``None``); ``row_scaled``: the
    rowwise amax is ``(M,)``, one per row (rowwise only)."""
    check_nvfp4_variant(columnwise=columnwise, with_rht=False,
                        with_2d_quantization=with_2d_quantization, four_over_six=True,
                        e4m3_max=e4m3_max, err_mode=err_mode, row_scaled=row_scaled)
    if row_scaled:
        amax_rowwise = row_amax(amax_rowwise, x.shape[0], x.shape[0]).reshape(-1)
    check_input_dtype(x, "nvfp4_quantize")
    m, k = x.shape
    check_k_multiple(k, 16, "NVFP4")
    dev = x.device
    x = x.contiguous()
    opts = dict(E=int(e4m3_max), MSE=err_mode == "MSE", TWO_D=bool(with_2d_quantization),
                SWIZZLE=bool(swizzle))
    rd = rs = cd = cs = None
    if rowwise:
        rd, rs = row_buffers(m, k, dev)
        if m and k:
            cfg, kw = launch_config("nvfp4_4over6_row")
            launch(_nvfp4_4over6_row_kernel, row_grid(m, k, cfg),
                   x, amax_rowwise.to(torch.float32).reshape(-1), rd.view(torch.int64), rs, m, k,
                   rs.shape[1], ROW_SCALED=bool(row_scaled), **opts, **kw)
    if columnwise:
        cdw, cs, mhw = col_buffers(m, k, dev)
        if m and k:
            cfg, kw = launch_config("nvfp4_4over6_col")
            launch(_nvfp4_4over6_col_kernel, col_grid(m, k, cfg),
                   x, amax_columnwise.to(torch.float32).reshape(1), cdw.view(torch.int64), cs, m,
                   k, mhw, cs.shape[1], **opts, **kw)
        cd = col_data(cdw, m, k)
    return rd, rs, cd, cs
