"""What the NVFP4 kernels of both block-scale variants share (`numerics.md` §7): the global
encode scale and E4M3 block scales, the amax loads, the columnwise tile loads (x itself or its
16x16 RHT, the exact sum by an fp64 butterfly rounded to fp32 and then bf16), block and tile
amaxes, the scale and columnwise stores, and the buffers and grids of a launch. The TE-default
kernels (:mod:`.nvfp4`) and 4over6's (:mod:`.nvfp4_4over6`) both build on this module and import
nothing from each other; the backend's ``nvfp4_quantize`` (:mod:`.backend`) picks between them."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from quant_core import shapes
from quant_core.shapes import ceil_div

from ._layout import scale_offset
from ._rounding import (
    FLT_MAX,
    abs_for_max,
    bf16_round,
    fp8_decode,
    fp8_rne_sat,
    nan_to_0,
    widen,
)


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
def _block_scales(block_amax, s_dec, t):
    """E4M3 byte (int32) and ``enc_b`` of block amaxes, in the order of §7.3."""
    e4 = fp8_rne_sat(tl.minimum(block_amax * t, FLT_MAX), True)
    enc = tl.math.div_rn(1.0, fp8_decode(e4, True) * s_dec)
    return e4, tl.where(enc > FLT_MAX, FLT_MAX, enc)


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


def row_grid(m: int, k: int, cfg: Mapping[str, int]) -> tuple[int, int]:
    """The grid of a rowwise launch over ``[BM, BK]`` tiles."""
    return (ceil_div(m, cfg["BM"]), ceil_div(k, cfg["BK"]))


def col_grid(m: int, k: int, cfg: Mapping[str, int]) -> tuple[int, int]:
    """The grid of a columnwise launch over ``[16G, BK]`` tiles."""
    return (ceil_div(m, 16 * cfg["G"]), ceil_div(k, cfg["BK"]))


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
