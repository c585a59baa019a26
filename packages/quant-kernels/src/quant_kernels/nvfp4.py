"""NVFP4 kernels (`numerics.md` §7, §8): E2M1 data with E4M3 block scales and an fp32 global
amax. Rowwise 1x16 blocks; columnwise 16x1 blocks of ``xᵀ`` (optionally through the 16x16 RHT,
rounded to bf16, summed in the reference's sequential order) stored ``[K, ceil(M/2)]``; 2D 16x16
blocks; stochastic rounding with the shared counter hash; packing low nibble first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core import shapes

from ._common import CONFIGS, config, launch_kwargs, tile_args, tl_dtype
from ._layout import scale_offset
from ._rounding import (
    FLT_MAX,
    RCP_6,
    RCP_2688,
    abs_nan0,
    bf16_rne,
    e2m1_decode,
    e2m1_rne,
    e2m1_sr,
    f32_bits,
    fp8_decode,
    fp8_rne_sat,
    sr_random_byte,
    sr_seed_state,
    to_out,
    widen,
)
from .fp8_tensor import amax_into

CONFIGS["nvfp4_row"] = {
    "gpu": {"BM": 16, "BK": 256, "num_warps": 4},
    "interp": {"BM": 64, "BK": 64},
}
CONFIGS["nvfp4_col"] = {"gpu": {"G": 4, "BK": 64, "num_warps": 4}, "interp": {"G": 4, "BK": 64}}
CONFIGS["nvfp4_dequant"] = {
    "gpu": {"BM": 32, "BK": 64, "num_warps": 4},
    "interp": {"BM": 64, "BK": 32},
}


@triton.jit
def _global_scales(amax_ptr):
    """(``S_dec``, ``t = fp32(S_enc * fp32(1/6))``) of §7.2 from the stored amax."""
    amax = tl.load(amax_ptr)
    s_enc = tl.math.div_rn(2688.0, amax)
    s_enc = tl.where((s_enc != s_enc) | (s_enc > FLT_MAX), FLT_MAX, s_enc)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
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
def _nvfp4_row_kernel(
    x_ptr, amax_ptr, seed_ptr, d_ptr, s_ptr, M, K, S_C,
    SR: tl.constexpr, TWO_D: tl.constexpr, SWIZZLE: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    offs = rm[:, None].to(tl.int64) * K + rk[None, :]
    x = widen(tl.load(x_ptr + offs, mask=mask, other=0.0))
    a = abs_nan0(x)
    if TWO_D:
        t2 = tl.max(tl.max(tl.reshape(a, [BM // 16, 16, BK // 16, 16]), axis=3), axis=1)
        bmax = tl.reshape(tl.broadcast_to(t2[:, None, :], [BM // 16, 16, BK // 16]),
                          [BM, BK // 16])
    else:
        bmax = tl.max(tl.reshape(a, [BM, BK // 16, 16]), axis=2)
    s_dec, t = _global_scales(amax_ptr)
    e4, enc = _block_scales(bmax, s_dec, t)
    v = x * tl.reshape(tl.broadcast_to(enc[:, :, None], [BM, BK // 16, 16]), [BM, BK])
    state = sr_seed_state(seed_ptr) if SR else 0
    codes = _encode(v, offs, state, SR)
    lo, hi = tl.split(tl.reshape(codes, [BM, BK // 2, 2]))
    rk2 = pid_k * (BK // 2) + tl.arange(0, BK // 2)
    tl.store(d_ptr + rm[:, None].to(tl.int64) * (K // 2) + rk2[None, :],
             (lo | (hi << 4)).to(tl.uint8), mask=(rm[:, None] < M) & (rk2[None, :] < K // 2))
    kb = pid_k * (BK // 16) + tl.arange(0, BK // 16)
    tl.store(s_ptr + scale_offset(rm[:, None], kb[None, :], S_C, SWIZZLE), e4.to(tl.uint8),
             mask=(rm[:, None] < M) & (kb[None, :] < K // 16))


@triton.jit
def _split16(t):
    """The 16 slices ``t[..., i]`` of ``t [..., 16]`` in index order."""
    t = tl.reshape(t, [t.shape[0], t.shape[1], 2, 2, 2, 2])
    a0, a1 = tl.split(t)
    a00, a01 = tl.split(a0)
    a10, a11 = tl.split(a1)
    a000, a001 = tl.split(a00)
    a010, a011 = tl.split(a01)
    a100, a101 = tl.split(a10)
    a110, a111 = tl.split(a11)
    a0000, a0001 = tl.split(a000)
    a0010, a0011 = tl.split(a001)
    a0100, a0101 = tl.split(a010)
    a0110, a0111 = tl.split(a011)
    a1000, a1001 = tl.split(a100)
    a1010, a1011 = tl.split(a101)
    a1100, a1101 = tl.split(a110)
    a1110, a1111 = tl.split(a111)
    return (a0000, a1000, a0100, a1100, a0010, a1010, a0110, a1110,
            a0001, a1001, a0101, a1101, a0011, a1011, a0111, a1111)


@triton.jit
def _join16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15):
    """Inverse of ``_split16``: ``[..., 16]`` with ``y_i`` at index ``i``."""
    c0 = tl.join(y0, y8)
    c1 = tl.join(y1, y9)
    c2 = tl.join(y2, y10)
    c3 = tl.join(y3, y11)
    c4 = tl.join(y4, y12)
    c5 = tl.join(y5, y13)
    c6 = tl.join(y6, y14)
    c7 = tl.join(y7, y15)
    d0 = tl.join(c0, c4)
    d1 = tl.join(c1, c5)
    d2 = tl.join(c2, c6)
    d3 = tl.join(c3, c7)
    e0 = tl.join(d0, d2)
    e1 = tl.join(d1, d3)
    f = tl.join(e0, e1)
    return tl.reshape(f, [y0.shape[0], y0.shape[1], 16])


@triton.jit
def _term(v, ROW: tl.constexpr, J: tl.constexpr, MASK: tl.constexpr):
    """``v * R[ROW, J]`` with ``R = diag(s) H16 / 4`` (exact: a product with ±0.25)."""
    B: tl.constexpr = ROW & J
    PAR: tl.constexpr = (B ^ (B >> 1) ^ (B >> 2) ^ (B >> 3) ^ (MASK >> ROW)) & 1
    C: tl.constexpr = 0.25 - 0.5 * PAR
    return v * C


@triton.jit
def _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
             J: tl.constexpr, MASK: tl.constexpr):
    """``bf16(Σ_i x_i R[i, J])``, summed sequentially over i = 0..15 in fp32 as the reference."""
    acc = _term(x0, 0, J, MASK)
    acc = acc + _term(x1, 1, J, MASK)
    acc = acc + _term(x2, 2, J, MASK)
    acc = acc + _term(x3, 3, J, MASK)
    acc = acc + _term(x4, 4, J, MASK)
    acc = acc + _term(x5, 5, J, MASK)
    acc = acc + _term(x6, 6, J, MASK)
    acc = acc + _term(x7, 7, J, MASK)
    acc = acc + _term(x8, 8, J, MASK)
    acc = acc + _term(x9, 9, J, MASK)
    acc = acc + _term(x10, 10, J, MASK)
    acc = acc + _term(x11, 11, J, MASK)
    acc = acc + _term(x12, 12, J, MASK)
    acc = acc + _term(x13, 13, J, MASK)
    acc = acc + _term(x14, 14, J, MASK)
    acc = acc + _term(x15, 15, J, MASK)
    return bf16_rne(acc)


@triton.jit
def _rht(t, MASK: tl.constexpr):
    """RHT of each 16-group ``t [G, BK, 16]`` (fp32) along its last dim, rounded to bf16."""
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _split16(t)
    return _join16(
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 0, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 1, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 2, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 3, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 4, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 5, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 6, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 7, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 8, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 9, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 10, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 11, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 12, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 13, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 14, MASK),
        _rht_out(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 15, MASK),
    )


@triton.jit
def _col_values(x_ptr, pid_m, pid_k, M, K, RHT: tl.constexpr, MASK: tl.constexpr,
                G: tl.constexpr, BK: tl.constexpr):
    """The columnwise values ``[G, BK, 16]`` (group g, column k, row-in-group i) of the tile of
    rows ``16 * G * pid_m ...``: x itself (zero past M), or its bf16-rounded RHT."""
    rows = pid_m * (16 * G) + tl.arange(0, 16 * G)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0)
    t = tl.permute(tl.reshape(widen(x), [G, 16, BK]), (0, 2, 1))
    if RHT:
        t = _rht(t, MASK)
    return t


@triton.jit
def _rht_amax_kernel(x_ptr, out_bits_ptr, M, K, MASK: tl.constexpr, G: tl.constexpr,
                     BK: tl.constexpr):
    y = _col_values(x_ptr, tl.program_id(0), tl.program_id(1), M, K, True, MASK, G, BK)
    tl.atomic_max(out_bits_ptr, f32_bits(tl.max(tl.max(tl.max(abs_nan0(y), axis=2), axis=1),
                                                axis=0)))


@triton.jit
def _nvfp4_col_kernel(
    x_ptr, amax_ptr, seed_ptr, d_ptr, s_ptr, M, K, MH, S_C,
    RHT: tl.constexpr, MASK: tl.constexpr, SR: tl.constexpr, TWO_D: tl.constexpr,
    SWIZZLE: tl.constexpr, G: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    y = _col_values(x_ptr, pid_m, pid_k, M, K, RHT, MASK, G, BK)  # [G, BK, 16]
    bmax = tl.max(abs_nan0(y), axis=2)  # [G, BK]
    if TWO_D:
        t2 = tl.max(tl.reshape(bmax, [G, BK // 16, 16]), axis=2)
        bmax = tl.reshape(tl.broadcast_to(t2[:, :, None], [G, BK // 16, 16]), [G, BK])
    s_dec, t = _global_scales(amax_ptr)
    e4, enc = _block_scales(bmax, s_dec, t)
    v = y * enc[:, :, None]
    gi = pid_m * G + tl.arange(0, G)
    rk = pid_k * BK + tl.arange(0, BK)
    state = sr_seed_state(seed_ptr) if SR else 0
    if SR:
        m_idx = gi[:, None, None].to(tl.int64) * 16 + tl.arange(0, 16)[None, None, :]
        index = M.to(tl.int64) * K + rk[None, :, None].to(tl.int64) * M + m_idx
    else:
        index = 0
    codes = _encode(v, index, state, SR)  # [G, BK, 16]
    lo, hi = tl.split(tl.reshape(codes, [G, BK, 8, 2]))
    packed = tl.reshape(tl.permute((lo | (hi << 4)).to(tl.uint8), (1, 0, 2)), [BK, 8 * G])
    cols = pid_m * (8 * G) + tl.arange(0, 8 * G)
    tl.store(d_ptr + rk[:, None].to(tl.int64) * MH + cols[None, :], packed,
             mask=(rk[:, None] < K) & (cols[None, :] < MH))
    so = scale_offset(rk[:, None], gi[None, :], S_C, SWIZZLE)
    tl.store(s_ptr + so, tl.trans(e4.to(tl.uint8)),
             mask=(rk[:, None] < K) & (gi[None, :] < (M + 15) // 16))


def _check_k(k: int) -> None:
    if k % shapes.NVFP4_BLOCK:
        raise ValueError(f"NVFP4 requires K to be a multiple of 16, got K = {k}")


def _check_rht(x: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"NVFP4 RHT requires bf16 input, got {x.dtype}")
    if x.shape[0] % 16:
        raise ValueError(f"NVFP4 RHT requires M % 16 == 0 (it mixes 16 rows), got M = {x.shape[0]}")


def _col_grid(m: int, k: int, cfg: dict) -> tuple[int, int]:
    return (triton.cdiv(m, 16 * cfg["G"]), triton.cdiv(k, cfg["BK"]))


def nvfp4_amax(
    x: torch.Tensor, *, rowwise: bool, columnwise: bool, with_rht: bool, rht_sign_mask: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """NaN-dropping amaxes (atomic max on fp32 bits); with RHT the columnwise one is taken over
    the bf16-rounded RHT computed in-kernel (never materialised). Mirrors
    ``reference.nvfp4_amax``."""
    m, k = x.shape
    _check_k(k)
    dev = x.device
    row = col = None
    if rowwise or (columnwise and not with_rht):
        row = torch.zeros(1, dtype=torch.float32, device=dev)
        amax_into(x.reshape(-1), row)
    if columnwise:
        if with_rht:
            _check_rht(x)
            col = torch.zeros(1, dtype=torch.float32, device=dev)
            if m and k:
                cfg = config("nvfp4_col")
                _rht_amax_kernel[_col_grid(m, k, cfg)](
                    x, col.view(torch.int32), m, k, MASK=int(rht_sign_mask),
                    **tile_args(cfg), **launch_kwargs(cfg),
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
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One kernel per direction: rowwise ``[M, K/2]`` from ``[BM, BK]`` tiles; columnwise
    ``[K, ceil(M/2)]`` from ``[16G, BK]`` tiles (RHT fused). Scales E4M3 bytes, zero-padded,
    swizzled in place when asked. Mirrors ``reference.nvfp4_quantize``."""
    m, k = x.shape
    _check_k(k)
    if with_rht and with_2d_quantization:
        raise ValueError("NVFP4 with_rht and with_2d_quantization are exclusive (weights: no RHT)")
    if stochastic_rounding and rng_seed is None:
        raise ValueError("NVFP4 stochastic rounding needs rng_seed (int64 tensor of shape (1,))")
    if columnwise and with_rht:
        _check_rht(x)
    dev = x.device
    seed = (rng_seed.to(device=dev, dtype=torch.int64).reshape(1) if stochastic_rounding
            else torch.zeros(1, dtype=torch.int64, device=dev))
    rd = rs = cd = cs = None
    if rowwise:
        rd = torch.empty(shapes.nvfp4_rowwise_data_shape(m, k), dtype=torch.uint8, device=dev)
        rs = torch.zeros(shapes.nvfp4_rowwise_scale_shape(m, k), dtype=torch.uint8, device=dev)
        if m and k:
            cfg = config("nvfp4_row")
            grid = (triton.cdiv(m, cfg["BM"]), triton.cdiv(k, cfg["BK"]))
            _nvfp4_row_kernel[grid](
                x, amax_rowwise.to(torch.float32).reshape(1), seed, rd, rs, m, k, rs.shape[1],
                SR=bool(stochastic_rounding), TWO_D=bool(with_2d_quantization),
                SWIZZLE=bool(swizzle), **tile_args(cfg), **launch_kwargs(cfg),
            )
    if columnwise:
        cd = torch.zeros(shapes.nvfp4_columnwise_data_shape(m, k), dtype=torch.uint8, device=dev)
        cs = torch.zeros(shapes.nvfp4_columnwise_scale_shape(m, k), dtype=torch.uint8, device=dev)
        if m and k:
            cfg = config("nvfp4_col")
            _nvfp4_col_kernel[_col_grid(m, k, cfg)](
                x, amax_columnwise.to(torch.float32).reshape(1), seed, cd, cs, m, k,
                cd.shape[1], cs.shape[1], RHT=bool(with_rht), MASK=int(rht_sign_mask),
                SR=bool(stochastic_rounding), TWO_D=bool(with_2d_quantization),
                SWIZZLE=bool(swizzle), **tile_args(cfg), **launch_kwargs(cfg),
            )
    return rd, rs, cd, cs


@triton.jit
def _nvfp4_dequant_kernel(
    d_ptr, s_ptr, amax_ptr, out_ptr, M, K, S_C, SWIZZLE: tl.constexpr, OUT: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rb = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
    b = tl.load(d_ptr + rm[:, None].to(tl.int64) * (K // 2) + rb[None, :],
                mask=(rm[:, None] < M) & (rb[None, :] < K // 2), other=0).to(tl.int32)
    codes = tl.reshape(tl.join(b & 0xF, b >> 4), [BM, BK])
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    e4 = tl.load(s_ptr + scale_offset(rm[:, None], rk[None, :] // 16, S_C, SWIZZLE), mask=mask,
                 other=0)
    s = fp8_decode(e4, True) * tl.load(amax_ptr)
    s = s * RCP_2688
    v = e2m1_decode(codes) * s
    tl.store(out_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], to_out(v, OUT), mask=mask)


def nvfp4_dequantize(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, *, swizzled: bool, dtype
) -> torch.Tensor:
    """Rowwise ``[M, K/2]`` to ``dtype [M, K]``:
    ``e2m1(code) * fp32(fp32(float(e4m3_b) * amax) * fp32(1/2688))``, RNE cast. Mirrors
    ``reference.nvfp4_dequantize``."""
    m, k = data.shape[0], data.shape[1] * 2
    out = torch.empty((m, k), dtype=dtype, device=data.device)
    if m == 0 or k == 0:
        return out
    cfg = config("nvfp4_dequant")
    grid = (triton.cdiv(m, cfg["BM"]), triton.cdiv(k, cfg["BK"]))
    _nvfp4_dequant_kernel[grid](
        data.contiguous(), scale.contiguous(), amax.to(torch.float32).reshape(1), out, m, k,
        scale.shape[1], SWIZZLE=bool(swizzled), OUT=tl_dtype(dtype), **tile_args(cfg),
        **launch_kwargs(cfg),
    )
    return out
