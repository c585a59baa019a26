"""NVFP4 kernels (`numerics.md` §7, §8): E2M1 data with E4M3 block scales and an fp32 global
amax, the TE-default block scaling, with the amaxes and the dequantization every variant shares.
Rowwise 1x16 blocks; columnwise 16x1 blocks of ``xᵀ`` (optionally through the 16x16 RHT of
:mod:`.nvfp4_common`) stored ``[K, ceil(M/2)]``; 2D 16x16 blocks; stochastic rounding with the
shared counter hash; packing low nibble first. Row-scaled NVFP4 (one amax, so one ``S_enc``, per
row; rowwise only) reads the amax per row; per-group NVFP4 (:mod:`.nvfp4_grouped`) reads one
per row and, columnwise, one per 16-row group. 4over6's kernels are in :mod:`.nvfp4_4over6`,
beside these, both built on :mod:`.nvfp4_common`; the backend's ``nvfp4_quantize``
(:mod:`.backend`) picks the variant."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core import reference, shapes
from quant_core.constants import E2M1_MAX, rcp_f32
from quant_core.inputs import (
    check_input_dtype,
    check_k_multiple,
    check_nvfp4_variant,
    check_output_dtype,
    check_rht_input,
)
from quant_core.reference.nvfp4_common import row_amax
from quant_core.shapes import ceil_div

from ._amax import amax_into
from ._common import launch, out_code
from ._layout import scale_offset
from ._rounding import (
    NVFP4_GLOBAL_MAX,
    RCP_6,
    abs_for_max,
    abs_nan0,
    e2m1_decode,
    e2m1_rne,
    e2m1_sr,
    f32_bits,
    fp8_decode,
    nan_to_0,
    sr_random_byte,
    sr_seed_state,
    to_out,
)
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
def _global_scales(amax):
    """(``S_dec``, ``t = fp32(S_enc * fp32(1/6))``) of §7.2 from the amax."""
    s_enc = _encode_scale(amax, NVFP4_GLOBAL_MAX)
    return tl.math.div_rn(1.0, s_enc), s_enc * RCP_6


@triton.jit
def _encode(v, index, state, SR: tl.constexpr):
    if SR:
        return e2m1_sr(v, sr_random_byte(state, index))
    else:
        return e2m1_rne(v)


@triton.jit
def _unpair(p, DT: tl.constexpr):
    """Exact fp32 (even, odd) elements of pair words ``p``: int64 holding two fp32 (DT 0), int32
    holding two bf16 (DT 1) or two fp16 (DT 2), little-endian (element 2j in the low half)."""
    if DT == 0:
        lo = (p & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        hi = (p >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif DT == 1:
        lo = (p << 16).to(tl.float32, bitcast=True)
        hi = (p & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _nvfp4_row_kernel(
    xp_ptr, amax_ptr, seed_ptr, d_ptr, s_ptr, M, K, S_C,
    DT: tl.constexpr, SR: tl.constexpr, TWO_D: tl.constexpr, SWIZZLE: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, ROW_SCALED: tl.constexpr = False,
):
    """Rowwise: the input is read as pair words, so the even and odd elements of each packed
    byte come out in the same layout (no split / join).

    xp_ptr: input x ``[M, K]`` as pair words ``[M, K/2]``: int64 (fp32) or int32 (bf16, fp16).
    amax_ptr: fp32 rowwise global amax ``(1,)``, or ``(M,)`` with ``ROW_SCALED``.
    seed_ptr: int64 stochastic-rounding seed ``(1,)`` (read only when ``SR``).
    d_ptr: uint8 packed E2M1 data ``[M, K/2]``, low nibble first.
    s_ptr: uint8 E4M3 scales ``[roundup(M, 128), S_C]``, zero-initialised.
    M: rows of x.
    K: columns of x (a multiple of 16).
    S_C: dim 1 of the scales, ``roundup(K/16, 4)``.
    DT: dtype of x's pair words (``_unpair``: 0 fp32, 1 bf16, 2 fp16).
    SR: stochastic rounding, else RNE.
    TWO_D: 16x16 blocks, else 1x16.
    SWIZZLE: scales in the GEMM swizzle.
    BM: tile rows (a multiple of 16 with ``TWO_D``).
    BK: tile columns in elements (a multiple of 16).
    ROW_SCALED: one amax (so one ``S_enc``) per row.
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rp = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    mask = (rm[:, None] < M) & (rp[None, :] < K // 2)
    poffs = rm[:, None].to(tl.int64) * (K // 2) + rp[None, :]
    lo, hi = _unpair(tl.load(xp_ptr + poffs, mask=mask, other=0), DT)
    a = tl.maximum(abs_for_max(lo), abs_for_max(hi))
    if TWO_D:
        t2 = nan_to_0(tl.max(tl.max(tl.reshape(a, [BM // 16, 16, BK // 16, 8]), axis=3), axis=1))
        bmax = tl.reshape(tl.broadcast_to(t2[:, None, :], [BM // 16, 16, BK // 16]),
                          [BM, BK // 16])
    else:
        bmax = nan_to_0(tl.max(tl.reshape(a, [BM, BK // 16, 8]), axis=2))
    s_dec, t = _global_scales(_load_amax(amax_ptr, rm, M, ROW_SCALED))
    e4, enc = _block_scales(bmax, s_dec, t)
    enc = tl.reshape(tl.broadcast_to(enc[:, :, None], [BM, BK // 16, 8]), [BM, BK // 2])
    state = sr_seed_state(seed_ptr) if SR else 0
    c_lo = _encode(lo * enc, 2 * poffs, state, SR)
    c_hi = _encode(hi * enc, 2 * poffs + 1, state, SR)
    tl.store(d_ptr + poffs, (c_lo | (c_hi << 4)).to(tl.uint8), mask=mask)
    _store_row_scales(s_ptr, e4, rm, pid_k * (BK // 16) + tl.arange(0, BK // 16), M, K, S_C,
                      SWIZZLE)


@triton.jit
def _rht_amax_kernel(x_ptr, out_bits_ptr, M, K, MASK: tl.constexpr, G: tl.constexpr,
                     BK: tl.constexpr, BLOCKS: tl.constexpr = False):
    """Atomic max of ``max|RHT(x)|`` over a ``[16G, BK]`` tile (:func:`nvfp4_amax`), or with
    ``BLOCKS`` of each 16-row group's.

    x_ptr: bf16 input x ``[M, K]``, contiguous.
    out_bits_ptr: fp32 columnwise amax ``(1,)``, or ``(M/16,)`` one per 16-row group with
        ``BLOCKS``, as int32, zero-initialised.
    M: rows of x.
    K: columns of x (a multiple of 16).
    MASK: the RHT's 16-bit sign mask (bit i set: row i of each 16-row group negated).
    G: 16-row groups per tile.
    BK: tile columns.
    BLOCKS: one amax per 16-row group, else one for x.
    """
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _col_values(
        x_ptr, tl.program_id(0), tl.program_id(1), M, K, True, MASK, G, BK)
    a = _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
    if BLOCKS:
        gi = tl.program_id(0) * G + tl.arange(0, G)
        tl.atomic_max(out_bits_ptr + gi, f32_bits(tl.max(a, axis=1)), mask=gi < M // 16)
    else:
        tl.atomic_max(out_bits_ptr, f32_bits(tl.max(tl.max(a, axis=1), axis=0)))


@triton.jit
def _byte(ye, yo, enc, idx, J: tl.constexpr, state, SR: tl.constexpr):
    """Packed byte (int64) of rows ``J`` (low nibble) and ``J + 1`` of each group."""
    lo = _encode(ye * enc, idx + J, state, SR)
    hi = _encode(yo * enc, idx + (J + 1), state, SR)
    return (lo | (hi << 4)).to(tl.int64)


@triton.jit
def _pack16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, enc, idx,
            state, SR: tl.constexpr):
    """The 16 E2M1 codes of ``y_j * enc`` packed into one int64 word per block: element ``j``
    in bits ``4j .. 4j + 3`` (byte ``j // 2``, low nibble first); ``idx + j`` numbers the
    elements for stochastic rounding."""
    w = _byte(y0, y1, enc, idx, 0, state, SR)
    w = w | (_byte(y2, y3, enc, idx, 2, state, SR) << 8)
    w = w | (_byte(y4, y5, enc, idx, 4, state, SR) << 16)
    w = w | (_byte(y6, y7, enc, idx, 6, state, SR) << 24)
    w = w | (_byte(y8, y9, enc, idx, 8, state, SR) << 32)
    w = w | (_byte(y10, y11, enc, idx, 10, state, SR) << 40)
    w = w | (_byte(y12, y13, enc, idx, 12, state, SR) << 48)
    return w | (_byte(y14, y15, enc, idx, 14, state, SR) << 56)


@triton.jit
def _nvfp4_col_kernel(
    x_ptr, amax_ptr, seed_ptr, d_ptr, s_ptr, M, K, MHW, S_C,
    RHT: tl.constexpr, MASK: tl.constexpr, SR: tl.constexpr, TWO_D: tl.constexpr,
    SWIZZLE: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, COL_SCALED: tl.constexpr = False,
):
    """Columnwise: 16 row loads per group, elementwise block math on [G, BK], the 8 packed bytes
    of a group gathered into one int64 word; only the words are transposed for the
    ``[K, ceil(M/2)]`` store (``d_ptr`` is the int64 view, ``MHW`` words per row).

    x_ptr: input x ``[M, K]``, contiguous (fp32, bf16 or fp16; bf16 with ``RHT``).
    amax_ptr: fp32 columnwise global amax ``(1,)``, or with ``COL_SCALED`` ``(M,)`` one per
        row of x, of which each 16-row group reads its first row's.
    seed_ptr: int64 stochastic-rounding seed ``(1,)`` (read only when ``SR``).
    d_ptr: packed E2M1 data of x transposed, ``[K, ceil(M/2)]`` bytes padded to ``[K, MHW]`` int64.
    s_ptr: uint8 E4M3 scales ``[roundup(K, 128), S_C]``, zero-initialised.
    M: rows of x.
    K: columns of x (a multiple of 16).
    MHW: int64 words per data row, ``ceil(ceil(M/2) / 8)``.
    S_C: dim 1 of the scales, ``roundup(ceil(M/16), 4)``.
    RHT: quantize the 16x16 RHT of each 16-row group, else x itself.
    MASK: the RHT's 16-bit sign mask (bit i set: row i of each 16-row group negated).
    SR: stochastic rounding, else RNE.
    TWO_D: 16x16 blocks, else 16x1.
    SWIZZLE: scales in the GEMM swizzle.
    G: 16-row groups per tile.
    BK: tile columns.
    COL_SCALED: one amax (so one ``S_enc``) per 16-row group.
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _col_values(
        x_ptr, pid_m, pid_k, M, K, RHT, MASK, G, BK)
    bmax = _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
    if TWO_D:
        bmax = _tile_amax(bmax, 1)
    gi = pid_m * G + tl.arange(0, G)
    s_dec, t = _global_scales(_load_amax(amax_ptr, gi * 16, M, COL_SCALED))
    e4, enc = _block_scales(bmax, s_dec, t)
    rk = pid_k * BK + tl.arange(0, BK)
    state = sr_seed_state(seed_ptr) if SR else 0
    if SR:
        idx = M.to(tl.int64) * K + rk[None, :].to(tl.int64) * M + gi[:, None].to(tl.int64) * 16
    else:
        idx = 0
    w = _pack16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, enc, idx,
                state, SR)
    _store_col(d_ptr, s_ptr, w, e4, pid_m, pid_k, M, K, MHW, S_C, SWIZZLE, G, BK)


def _pairs(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` viewed as pair words (int64 for fp32, int32 for bf16/fp16) and its ``DT`` code."""
    x = x.contiguous()
    if x.storage_offset() % 2:
        x = x.clone()
    if x.dtype == torch.float32:
        return x.view(torch.int64), 0
    return x.view(torch.int32), 1 if x.dtype == torch.bfloat16 else 2


@triton.jit
def _row_amax_kernel(x_ptr, out_bits_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr):
    """Atomic max of each row's ``max|x|`` over a ``[BM, BK]`` tile (row-scaled
    :func:`nvfp4_amax`).

    x_ptr: input x ``[M, K]``, contiguous.
    out_bits_ptr: fp32 row amaxes ``(M,)`` as int32, zero-initialised.
    M: rows of x.
    K: columns of x.
    BM: tile rows.
    BK: tile columns.
    """
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :],
                mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
    tl.atomic_max(out_bits_ptr + rm, f32_bits(tl.max(abs_nan0(x), axis=1)), mask=rm < M)


def nvfp4_amax(
    x: torch.Tensor, *, rowwise: bool, columnwise: bool, with_rht: bool, rht_sign_mask: int,
    row_scaled: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """NaN-dropping amaxes (atomic max on fp32 bits); with RHT the columnwise one is taken over
    the bf16-rounded RHT computed in-kernel (never materialised); ``row_scaled``: one rowwise
    amax per row ``(M,)`` and no columnwise one. Mirrors ``reference.nvfp4_amax``."""
    check_input_dtype(x, "nvfp4_amax")
    m, k = x.shape
    check_k_multiple(k, shapes.NVFP4_BLOCK, "NVFP4")
    dev = x.device
    check_nvfp4_variant(columnwise=columnwise, with_rht=with_rht, row_scaled=row_scaled)
    if row_scaled:
        row = torch.zeros(m, dtype=torch.float32, device=dev)
        if m and k:
            cfg, kw = launch_config("nvfp4_row")
            launch(_row_amax_kernel, row_grid(m, k, cfg), x.contiguous(), row.view(torch.int32),
                   m, k, **kw)
        return row, None
    row = col = None
    if rowwise or (columnwise and not with_rht):
        row = torch.zeros(1, dtype=torch.float32, device=dev)
        amax_into(x.reshape(-1), row)
    if columnwise:
        if with_rht:
            check_rht_input(x)
            col = torch.zeros(1, dtype=torch.float32, device=dev)
            if m and k:
                cfg, kw = launch_config("nvfp4_col")
                launch(
                    _rht_amax_kernel, col_grid(m, k, cfg),
                    x, col.view(torch.int32), m, k, MASK=int(rht_sign_mask), BLOCKS=False,
                    **kw,
                )
        else:
            col = row.clone()
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
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One kernel per direction: rowwise ``[M, K/2]`` from ``[BM, BK]`` tiles; columnwise
    ``[K, ceil(M/2)]`` from ``[16G, BK]`` tiles (RHT fused). Scales E4M3 bytes, zero-padded,
    swizzled in place when asked; ``row_scaled`` reads ``amax_rowwise`` ``(M,)`` one per row
    (rowwise only). Mirrors ``reference.nvfp4.nvfp4_base_quantize``, and refuses what it refuses
    with its messages."""
    check_nvfp4_variant(columnwise=columnwise, with_rht=with_rht,
                        with_2d_quantization=with_2d_quantization,
                        stochastic_rounding=stochastic_rounding, rng_seed=rng_seed,
                        row_scaled=row_scaled)
    if row_scaled:
        amax_rowwise = row_amax(amax_rowwise, x.shape[0], x.shape[0]).reshape(-1)
    check_input_dtype(x, "nvfp4_quantize")
    m, k = x.shape
    check_k_multiple(k, shapes.NVFP4_BLOCK, "NVFP4")
    if columnwise and with_rht:
        check_rht_input(x)
    dev = x.device
    seed = (rng_seed.to(device=dev, dtype=torch.int64).reshape(1) if stochastic_rounding
            else torch.zeros(1, dtype=torch.int64, device=dev))
    rd = rs = cd = cs = None
    if rowwise:
        rd, rs = row_buffers(m, k, dev)
        if m and k:
            cfg, kw = launch_config("nvfp4_row")
            xp, dt = _pairs(x)
            launch(
                _nvfp4_row_kernel, row_grid(m, k, cfg),
                xp, amax_rowwise.to(torch.float32).reshape(-1), seed, rd, rs, m, k, rs.shape[1],
                DT=dt, SR=bool(stochastic_rounding), TWO_D=bool(with_2d_quantization),
                SWIZZLE=bool(swizzle), ROW_SCALED=bool(row_scaled), **kw,
            )
    if columnwise:
        cdw, cs, mhw = col_buffers(m, k, dev)
        if m and k:
            cfg, kw = launch_config("nvfp4_col")
            launch(
                _nvfp4_col_kernel, col_grid(m, k, cfg),
                x, amax_columnwise.to(torch.float32).reshape(1), seed, cdw.view(torch.int64), cs,
                m, k, mhw, cs.shape[1], RHT=bool(with_rht), MASK=int(rht_sign_mask),
                SR=bool(stochastic_rounding), TWO_D=bool(with_2d_quantization),
                SWIZZLE=bool(swizzle), COL_SCALED=False, **kw,
            )
        cd = col_data(cdw, m, k)
    return rd, rs, cd, cs


@triton.jit
def _nvfp4_dequant_kernel(
    d_ptr, s_ptr, amax_ptr, out_ptr, M, K, S_C, SWIZZLE: tl.constexpr, OUT: tl.constexpr,
    RCP: tl.constexpr, ROW_SCALED: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """One ``[BM, BK]`` tile of :func:`nvfp4_dequantize`.

    d_ptr: uint8 packed E2M1 rowwise data ``[M, K/2]``, low nibble first, contiguous.
    s_ptr: uint8 E4M3 scales, row length ``S_C``, contiguous.
    amax_ptr: fp32 global amax ``(1,)``, or ``(M,)`` with ``ROW_SCALED``.
    out_ptr: output ``[M, K]`` of the dtype ``OUT`` codes.
    M: rows.
    K: columns in elements (twice the data's bytes per row).
    S_C: dim 1 of the scales.
    SWIZZLE: scales in the GEMM swizzle.
    OUT: output dtype code (``out_code``: 0 fp32, 1 bf16, 2 fp16).
    RCP: ``fp32(1 / (6 * e4m3_max))``, the global bound's decode factor.
    ROW_SCALED: one amax per row.
    BM: tile rows.
    BK: tile columns in elements (a multiple of 16).
    """
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rb = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    b = tl.load(d_ptr + rm[:, None].to(tl.int64) * (K // 2) + rb[None, :],
                mask=(rm[:, None] < M) & (rb[None, :] < K // 2), other=0).to(tl.int32)
    codes = tl.reshape(tl.join(b & 0xF, b >> 4), [BM, BK])
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    e4 = tl.load(s_ptr + scale_offset(rm[:, None], rk[None, :] // 16, S_C, SWIZZLE), mask=mask,
                 other=0)
    s = fp8_decode(e4, True) * _load_amax(amax_ptr, rm, M, ROW_SCALED)
    s = s * RCP
    v = e2m1_decode(codes) * s
    tl.store(out_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], to_out(v, OUT), mask=mask)


def nvfp4_dequantize(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, *, swizzled: bool, dtype,
    e4m3_max: int = 448,
) -> torch.Tensor:
    """Rowwise ``[M, K/2]`` to ``dtype [M, K]``:
    ``e2m1(code) * fp32(fp32(float(e4m3_b) * amax) * fp32(1/(6 * e4m3_max)))``, RNE cast;
    ``amax`` ``(1,)``, or ``(M,)`` for a row-scaled tensor. Mirrors
    ``reference.nvfp4_dequantize``."""
    check_output_dtype(dtype, "nvfp4_dequantize")
    m, k = data.shape[0], data.shape[1] * 2
    if amax.numel() not in (1, m):
        return reference.nvfp4_dequantize(data, scale, amax, swizzled=swizzled, dtype=dtype,
                                          e4m3_max=e4m3_max)  # raises its ValueError
    out = torch.empty((m, k), dtype=dtype, device=data.device)
    if m == 0 or k == 0:
        return out
    cfg, kw = launch_config("nvfp4_dequant")
    grid = (ceil_div(m, cfg["BM"]), ceil_div(k, cfg["BK"]))
    launch(
        _nvfp4_dequant_kernel, grid,
        data.contiguous(), scale.contiguous(), amax.to(torch.float32).reshape(-1), out, m, k,
        scale.shape[1], SWIZZLE=bool(swizzled), OUT=out_code(dtype),
        RCP=rcp_f32(E2M1_MAX * e4m3_max), ROW_SCALED=amax.numel() != 1, **kw,
    )
    return out
