"""NVFP4 kernels (`numerics.md` §7, §8): E2M1 data with E4M3 block scales and an fp32 global
amax. Rowwise 1x16 blocks; columnwise 16x1 blocks of ``xᵀ`` (optionally through the 16x16
RHT: the exact sum by an fp64 butterfly, rounded to fp32 and then bf16) stored
``[K, ceil(M/2)]``; 2D 16x16 blocks; stochastic rounding with the shared counter hash; packing
low nibble first. Row-scaled NVFP4 (one amax, so one ``S_enc``, per row; rowwise only) reads the
amax per row; 4over6's kernels are in :mod:`.nvfp4_4over6`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from quant_core import reference, shapes
from quant_core.constants import E2M1_MAX, rcp_f32
from quant_core.inputs import (
    check_input_dtype,
    check_k_multiple,
    check_nvfp4_modes,
    check_rht_input,
)
from quant_core.reference.nvfp4 import check_row_scaled, row_amax
from quant_core.shapes import ceil_div

from ._amax import amax_into
from ._common import launch, out_code
from ._layout import scale_offset
from ._rounding import (
    FLT_MAX,
    NVFP4_GLOBAL_MAX,
    RCP_6,
    abs_for_max,
    abs_nan0,
    bf16_round,
    e2m1_decode,
    e2m1_rne,
    e2m1_sr,
    f32_bits,
    fp8_decode,
    fp8_rne_sat,
    nan_to_0,
    sr_random_byte,
    sr_seed_state,
    to_out,
    widen,
)
from .configs import launch_config


@triton.jit
def _encode_scale(amax, TOP: tl.constexpr):
    """``S_enc`` of fp32 amaxes (§7.2): ``fminf(fp32(TOP / amax), FLT_MAX)`` (a NaN amax gives
    FLT_MAX), 1 where ``amax == 0`` or that is 0; ``TOP`` is ``6 * e4m3_max``."""
    s_enc = tl.math.div_rn(tl.full(amax.shape, TOP, tl.float32), amax)
    s_enc = tl.where((s_enc != s_enc) | (s_enc > FLT_MAX), FLT_MAX, s_enc)
    return tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)


@triton.jit
def _load_amax(amax_ptr, rows, M, ROW_SCALED: tl.constexpr):
    """The fp32 amax of §7.1: the tensor's ``(1,)``, or with ``ROW_SCALED`` one per row of
    ``rows`` (``[R, 1]``, 0 past ``M``)."""
    if ROW_SCALED:
        return tl.load(amax_ptr + rows, mask=rows < M, other=0.0)[:, None]
    else:
        return tl.load(amax_ptr)


@triton.jit
def _global_scales(amax):
    """(``S_dec``, ``t = fp32(S_enc * fp32(1/6))``) of §7.2 from the amax."""
    s_enc = _encode_scale(amax, NVFP4_GLOBAL_MAX)
    return tl.math.div_rn(1.0, s_enc), s_enc * RCP_6


@triton.jit
def _block_scales(block_amax, s_dec, t):
    """E4M3 byte (int32) and ``enc_b`` of block amaxes, in the order of §7.3."""
    e4 = fp8_rne_sat(tl.minimum(block_amax * t, FLT_MAX), True)
    enc = tl.math.div_rn(1.0, fp8_decode(e4, True) * s_dec)
    return e4, tl.where(enc > FLT_MAX, FLT_MAX, enc)


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
def _store_row_scales(s_ptr, e4, rm, kb, M, K, S_C, SWIZZLE: tl.constexpr):
    """Store the E4M3 bytes ``e4 [R, NB]`` of rows ``rm`` and blocks ``kb`` (rowwise scales)."""
    tl.store(s_ptr + scale_offset(rm[:, None], kb[None, :], S_C, SWIZZLE), e4.to(tl.uint8),
             mask=(rm[:, None] < M) & (kb[None, :] < K // 16))


@triton.jit
def _load_row(x_ptr, base, ROW: tl.constexpr, gi, M, K, kmask):
    return widen(tl.load(x_ptr + base + ROW * K, mask=((gi * 16 + ROW) < M)[:, None] & kmask,
                         other=0.0))


@triton.jit
def _load16(x_ptr, pid_m, pid_k, M, K, G: tl.constexpr, BK: tl.constexpr):
    """Rows ``i = 0..15`` of the G 16-row groups of the tile, each ``[G, BK]`` fp32 (0 past M)."""
    gi = pid_m * G + tl.arange(0, G)
    rk = pid_k * BK + tl.arange(0, BK)
    kmask = (rk < K)[None, :]
    base = gi[:, None].to(tl.int64) * (16 * K) + rk[None, :]
    return (_load_row(x_ptr, base, 0, gi, M, K, kmask), _load_row(x_ptr, base, 1, gi, M, K, kmask),
            _load_row(x_ptr, base, 2, gi, M, K, kmask), _load_row(x_ptr, base, 3, gi, M, K, kmask),
            _load_row(x_ptr, base, 4, gi, M, K, kmask), _load_row(x_ptr, base, 5, gi, M, K, kmask),
            _load_row(x_ptr, base, 6, gi, M, K, kmask), _load_row(x_ptr, base, 7, gi, M, K, kmask),
            _load_row(x_ptr, base, 8, gi, M, K, kmask), _load_row(x_ptr, base, 9, gi, M, K, kmask),
            _load_row(x_ptr, base, 10, gi, M, K, kmask),
            _load_row(x_ptr, base, 11, gi, M, K, kmask),
            _load_row(x_ptr, base, 12, gi, M, K, kmask),
            _load_row(x_ptr, base, 13, gi, M, K, kmask),
            _load_row(x_ptr, base, 14, gi, M, K, kmask),
            _load_row(x_ptr, base, 15, gi, M, K, kmask))


@triton.jit
def _signed_quarter(x, ROW: tl.constexpr, MASK: tl.constexpr):
    """``x_ROW * s_ROW / 4`` in fp64 (exact): the RHT's input to the Hadamard butterfly."""
    q = x.to(tl.float64) * 0.25
    if (MASK >> ROW) & 1:
        return -q
    else:
        return q


@triton.jit
def _butterfly(a, b):
    """One Walsh-Hadamard pair: ``(a + b, a - b)``, exact in fp64 for these terms."""
    return a + b, a - b


@triton.jit
def _exact_to_bf16(y):
    """The exact sum ``y`` (fp64) rounded once to fp32 (RNE, overflow to ±Inf), then to bf16 as
    an fp32 value; an exact zero is +0 (§7.6), whatever the butterfly's sign of zero."""
    y = tl.where(y == 0, tl.zeros_like(y), y)
    return bf16_round(y.to(tl.float32))


@triton.jit
def _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
           MASK: tl.constexpr):
    """``y_j = bf16(fp32(Σ_i x_i s_i H16[i, j] / 4))`` for j = 0..15, the sums exact (§7.6).

    A 4-stage fast Walsh-Hadamard transform in fp64 (4 adds per element): the products are
    exact in fp64 and so is every partial sum of 16 bf16-derived terms unless their magnitudes
    span more than 2^45, so the result is the exact sum and nothing overflows partway.
    """
    a0, a1 = _signed_quarter(x0, 0, MASK), _signed_quarter(x1, 1, MASK)
    a2, a3 = _signed_quarter(x2, 2, MASK), _signed_quarter(x3, 3, MASK)
    a4, a5 = _signed_quarter(x4, 4, MASK), _signed_quarter(x5, 5, MASK)
    a6, a7 = _signed_quarter(x6, 6, MASK), _signed_quarter(x7, 7, MASK)
    a8, a9 = _signed_quarter(x8, 8, MASK), _signed_quarter(x9, 9, MASK)
    a10, a11 = _signed_quarter(x10, 10, MASK), _signed_quarter(x11, 11, MASK)
    a12, a13 = _signed_quarter(x12, 12, MASK), _signed_quarter(x13, 13, MASK)
    a14, a15 = _signed_quarter(x14, 14, MASK), _signed_quarter(x15, 15, MASK)
    # stage 1: pairs i, i + 1
    a0, a1 = _butterfly(a0, a1)
    a2, a3 = _butterfly(a2, a3)
    a4, a5 = _butterfly(a4, a5)
    a6, a7 = _butterfly(a6, a7)
    a8, a9 = _butterfly(a8, a9)
    a10, a11 = _butterfly(a10, a11)
    a12, a13 = _butterfly(a12, a13)
    a14, a15 = _butterfly(a14, a15)
    # stage 2: pairs i, i + 2
    a0, a2 = _butterfly(a0, a2)
    a1, a3 = _butterfly(a1, a3)
    a4, a6 = _butterfly(a4, a6)
    a5, a7 = _butterfly(a5, a7)
    a8, a10 = _butterfly(a8, a10)
    a9, a11 = _butterfly(a9, a11)
    a12, a14 = _butterfly(a12, a14)
    a13, a15 = _butterfly(a13, a15)
    # stage 3: pairs i, i + 4
    a0, a4 = _butterfly(a0, a4)
    a1, a5 = _butterfly(a1, a5)
    a2, a6 = _butterfly(a2, a6)
    a3, a7 = _butterfly(a3, a7)
    a8, a12 = _butterfly(a8, a12)
    a9, a13 = _butterfly(a9, a13)
    a10, a14 = _butterfly(a10, a14)
    a11, a15 = _butterfly(a11, a15)
    # stage 4: pairs i, i + 8
    a0, a8 = _butterfly(a0, a8)
    a1, a9 = _butterfly(a1, a9)
    a2, a10 = _butterfly(a2, a10)
    a3, a11 = _butterfly(a3, a11)
    a4, a12 = _butterfly(a4, a12)
    a5, a13 = _butterfly(a5, a13)
    a6, a14 = _butterfly(a6, a14)
    a7, a15 = _butterfly(a7, a15)
    return (
        _exact_to_bf16(a0), _exact_to_bf16(a1), _exact_to_bf16(a2), _exact_to_bf16(a3),
        _exact_to_bf16(a4), _exact_to_bf16(a5), _exact_to_bf16(a6), _exact_to_bf16(a7),
        _exact_to_bf16(a8), _exact_to_bf16(a9), _exact_to_bf16(a10), _exact_to_bf16(a11),
        _exact_to_bf16(a12), _exact_to_bf16(a13), _exact_to_bf16(a14), _exact_to_bf16(a15),
    )


@triton.jit
def _col_values(x_ptr, pid_m, pid_k, M, K, RHT: tl.constexpr, MASK: tl.constexpr,
                G: tl.constexpr, BK: tl.constexpr):
    """The 16 columnwise values ``y_j [G, BK]`` (row j of each 16-row group) of the tile: x
    itself (zero past M), or its bf16-rounded RHT. Everything stays elementwise on [G, BK]."""
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _load16(
        x_ptr, pid_m, pid_k, M, K, G, BK)
    if RHT:
        return _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, MASK)
    else:
        return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15):
    """Elementwise NaN-dropping ``max_j |y_j|``."""
    a = tl.maximum(abs_for_max(y0), abs_for_max(y1))
    a = tl.maximum(a, tl.maximum(abs_for_max(y2), abs_for_max(y3)))
    a = tl.maximum(a, tl.maximum(abs_for_max(y4), abs_for_max(y5)))
    a = tl.maximum(a, tl.maximum(abs_for_max(y6), abs_for_max(y7)))
    a = tl.maximum(a, tl.maximum(abs_for_max(y8), abs_for_max(y9)))
    a = tl.maximum(a, tl.maximum(abs_for_max(y10), abs_for_max(y11)))
    a = tl.maximum(a, tl.maximum(abs_for_max(y12), abs_for_max(y13)))
    return nan_to_0(tl.maximum(a, tl.maximum(abs_for_max(y14), abs_for_max(y15))))


@triton.jit
def _tile_amax(bmax, AXIS: tl.constexpr):
    """Block amaxes ``bmax [R, C]`` (1x16 or 16x1 blocks) to the amaxes of their 16x16 tiles,
    one per block: the max over each run of 16 along ``AXIS`` (0 or 1, whose length is a
    multiple of 16)."""
    R: tl.constexpr = bmax.shape[0]
    C: tl.constexpr = bmax.shape[1]
    if AXIS == 0:
        t = tl.max(tl.reshape(bmax, [R // 16, 16, C]), axis=1)
        return tl.reshape(tl.broadcast_to(t[:, None, :], [R // 16, 16, C]), [R, C])
    else:
        t = tl.max(tl.reshape(bmax, [R, C // 16, 16]), axis=2)
        return tl.reshape(tl.broadcast_to(t[:, :, None], [R, C // 16, 16]), [R, C])


@triton.jit
def _rht_amax_kernel(x_ptr, out_bits_ptr, M, K, MASK: tl.constexpr, G: tl.constexpr,
                     BK: tl.constexpr):
    """Atomic max of ``max|RHT(x)|`` over a ``[16G, BK]`` tile (:func:`nvfp4_amax`).

    x_ptr: bf16 input x ``[M, K]``, contiguous.
    out_bits_ptr: fp32 columnwise amax ``(1,)`` as int32, zero-initialised.
    M: rows of x.
    K: columns of x (a multiple of 16).
    MASK: the RHT's 16-bit sign mask (bit i set: row i of each 16-row group negated).
    G: 16-row groups per tile.
    BK: tile columns.
    """
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _col_values(
        x_ptr, tl.program_id(0), tl.program_id(1), M, K, True, MASK, G, BK)
    a = _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
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
def _store_col(d_ptr, s_ptr, w, e4, pid_m, pid_k, M, K, MHW, S_C, SWIZZLE: tl.constexpr,
               G: tl.constexpr, BK: tl.constexpr):
    """Store a ``[16G, BK]`` tile's columnwise words ``w [G, BK]`` and E4M3 bytes
    ``e4 [G, BK]`` transposed: data ``[K, MHW]`` int64 words, scales ``[., S_C]`` bytes."""
    gi = pid_m * G + tl.arange(0, G)
    rk = pid_k * BK + tl.arange(0, BK)
    tl.store(d_ptr + rk[:, None].to(tl.int64) * MHW + gi[None, :], tl.trans(w),
             mask=(rk[:, None] < K) & (gi[None, :] < MHW))
    so = scale_offset(rk[:, None], gi[None, :], S_C, SWIZZLE)
    tl.store(s_ptr + so, tl.trans(e4.to(tl.uint8)),
             mask=(rk[:, None] < K) & (gi[None, :] < (M + 15) // 16))


@triton.jit
def _nvfp4_col_kernel(
    x_ptr, amax_ptr, seed_ptr, d_ptr, s_ptr, M, K, MHW, S_C,
    RHT: tl.constexpr, MASK: tl.constexpr, SR: tl.constexpr, TWO_D: tl.constexpr,
    SWIZZLE: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
):
    """Columnwise: 16 row loads per group, elementwise block math on [G, BK], the 8 packed bytes
    of a group gathered into one int64 word; only the words are transposed for the
    ``[K, ceil(M/2)]`` store (``d_ptr`` is the int64 view, ``MHW`` words per row).

    x_ptr: input x ``[M, K]``, contiguous (fp32, bf16 or fp16; bf16 with ``RHT``).
    amax_ptr: fp32 columnwise global amax ``(1,)``.
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
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _col_values(
        x_ptr, pid_m, pid_k, M, K, RHT, MASK, G, BK)
    bmax = _amax16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15)
    if TWO_D:
        bmax = _tile_amax(bmax, 1)
    s_dec, t = _global_scales(tl.load(amax_ptr))
    e4, enc = _block_scales(bmax, s_dec, t)
    gi = pid_m * G + tl.arange(0, G)
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


def row_grid(m: int, k: int, cfg: Mapping[str, int]) -> tuple[int, int]:
    """The grid of a rowwise launch over ``[BM, BK]`` tiles."""
    return (ceil_div(m, cfg["BM"]), ceil_div(k, cfg["BK"]))


def col_grid(m: int, k: int, cfg: Mapping[str, int]) -> tuple[int, int]:
    """The grid of a columnwise launch over ``[16G, BK]`` tiles."""
    return (ceil_div(m, 16 * cfg["G"]), ceil_div(k, cfg["BK"]))


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
    if row_scaled:
        check_row_scaled(columnwise=columnwise, with_rht=with_rht)
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
                    x, col.view(torch.int32), m, k, MASK=int(rht_sign_mask),
                    **kw,
                )
        else:
            col = row.clone()
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
    """One kernel per direction: rowwise ``[M, K/2]`` from ``[BM, BK]`` tiles; columnwise
    ``[K, ceil(M/2)]`` from ``[16G, BK]`` tiles (RHT fused). Scales E4M3 bytes, zero-padded,
    swizzled in place when asked. 4over6 runs the kernels of :mod:`.nvfp4_4over6`;
    ``row_scaled`` reads ``amax_rowwise`` ``(M,)`` one per row (rowwise only). Mirrors
    ``reference.nvfp4_quantize``, and refuses what it refuses with its messages."""
    if row_scaled:
        check_row_scaled(columnwise=columnwise, with_rht=with_rht,
                         with_2d_quantization=with_2d_quantization,
                         stochastic_rounding=stochastic_rounding)
        amax_rowwise = row_amax(amax_rowwise, x.shape[0], x.shape[0]).reshape(-1)
    if (four_over_six and (with_rht or stochastic_rounding)) or (
            not four_over_six and e4m3_max != 448):
        return reference.nvfp4_quantize(  # raises its ValueError
            x, amax_rowwise, amax_columnwise, rowwise=rowwise, columnwise=columnwise,
            with_rht=with_rht, rht_sign_mask=rht_sign_mask,
            with_2d_quantization=with_2d_quantization, stochastic_rounding=stochastic_rounding,
            rng_seed=rng_seed, swizzle=swizzle, four_over_six=four_over_six, e4m3_max=e4m3_max,
            err_mode=err_mode,
        )
    if four_over_six:
        from .nvfp4_4over6 import nvfp4_4over6_quantize

        return nvfp4_4over6_quantize(
            x, amax_rowwise, amax_columnwise, rowwise=rowwise, columnwise=columnwise,
            with_2d_quantization=with_2d_quantization, e4m3_max=e4m3_max, err_mode=err_mode,
            swizzle=swizzle, row_scaled=row_scaled,
        )
    check_input_dtype(x, "nvfp4_quantize")
    m, k = x.shape
    check_k_multiple(k, shapes.NVFP4_BLOCK, "NVFP4")
    check_nvfp4_modes(with_rht, with_2d_quantization, stochastic_rounding, rng_seed)
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
                SWIZZLE=bool(swizzle), **kw,
            )
        cd = col_data(cdw, m, k)
    return rd, rs, cd, cs


def row_buffers(m: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The rowwise data ``[M, K/2]`` (uninitialised) and zeroed scale buffers."""
    return (torch.empty(shapes.nvfp4_rowwise_data_shape(m, k), dtype=torch.uint8, device=dev),
            torch.zeros(shapes.nvfp4_rowwise_scale_shape(m, k), dtype=torch.uint8, device=dev))


def col_buffers(m: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The columnwise data with rows padded to whole int64 words (8 bytes = one 16-row group;
    :func:`col_data` cuts it back), the zeroed scales, and the words per data row."""
    mhw = ceil_div(shapes.nvfp4_columnwise_data_shape(m, k)[1], 8)
    return (torch.empty((k, mhw * 8), dtype=torch.uint8, device=dev),
            torch.zeros(shapes.nvfp4_columnwise_scale_shape(m, k), dtype=torch.uint8, device=dev),
            mhw)


def col_data(cdw: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """The columnwise data ``[K, ceil(M/2)]`` of the word-padded buffer of :func:`col_buffers`."""
    width = shapes.nvfp4_columnwise_data_shape(m, k)[1]
    return cdw if cdw.shape[1] == width else cdw[:, :width].contiguous()


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
