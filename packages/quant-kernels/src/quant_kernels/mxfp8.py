"""MXFP8 kernels (`numerics.md` §5, §8): E8M0 round-up scales per 1x32 (rowwise), 32x1
(columnwise) or 32x32 (2D) block; rowwise and columnwise from ONE read of each input tile, scales
written zero-padded and optionally swizzled in place, partial 32-row blocks over valid rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core import shapes
from quant_core.dtypes import DType, check_fp8
from quant_core.inputs import (
    check_input_dtype,
    check_k_multiple,
    check_output_dtype,
    check_row_index,
)
from quant_core.shapes import ceil_div

from ._common import launch, out_code
from ._layout import load_rows, scale_offset
from ._rounding import (
    RCP_E4M3,
    RCP_E5M2,
    abs_for_max,
    e8m0_decode,
    e8m0_encode_mult,
    e8m0_roundup,
    fp8_decode,
    fp8_rne_sat,
    nan_to_0,
    to_out,
    widen,
)
from .configs import launch_config


@triton.jit
def _rcp(IS_E4M3: tl.constexpr):
    if IS_E4M3:
        return RCP_E4M3
    else:
        return RCP_E5M2


@triton.jit
def _mxfp8_kernel(
    x_ptr, src_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, M, K, RS_C, CS_C, CS_SW_C,
    ROW: tl.constexpr, COL: tl.constexpr, TWO_D: tl.constexpr, SWIZZLE: tl.constexpr,
    IS_E4M3: tl.constexpr, DECODED: tl.constexpr, OUT: tl.constexpr, GATHER: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    """One ``[BM, BK]`` tile of :func:`mxfp8_quantize`, both directions from one read.

    x_ptr: input x ``[M, K]``, contiguous (fp32, bf16 or fp16); with ``GATHER`` any rows, row
        ``p`` of the quantized tensor being row ``src[p]`` of x.
    src_ptr: int32/int64 ``[M]`` source rows when ``GATHER`` (-1: a zero row; else a dummy).
    rd_ptr: uint8 FP8 rowwise data ``[M, K]``, written when ``ROW`` (else a dummy); with
        ``DECODED`` their values ``[M, K]`` in the dtype of code ``OUT``.
    rs_ptr: uint8 E8M0 rowwise scales ``[roundup(M, 128), RS_C]``, zero-initialised (not
        written with ``DECODED``).
    cd_ptr: uint8 FP8 columnwise data ``[M, K]`` (not transposed), written when ``COL``; with
        ``DECODED`` their values, as ``rd_ptr``.
    cs_ptr: uint8 E8M0 columnwise scales ``[CS_SW_C, CS_C]``, zero-initialised (not written
        with ``DECODED``).
    M: rows of x.
    K: columns of x (a multiple of 32).
    RS_C: dim 1 of the rowwise scales, ``roundup(K/32, 4)``.
    CS_C: dim 1 of the columnwise scales, ``roundup(K, 128)``.
    CS_SW_C: dim 0 of the columnwise scales, ``roundup(ceil(M/32), 4)``: the swizzle's columns.
    ROW: write the rowwise data and scales (1x32 blocks).
    COL: write the columnwise data and scales (32x1 blocks).
    TWO_D: 32x32 blocks, one scale for both directions.
    SWIZZLE: scales in the GEMM swizzle (columnwise: that of the transposed scale matrix).
    IS_E4M3: E4M3 data, else E5M2.
    DECODED: write each quantized element's value (FP8 value times its block's scale)
        instead of its byte, and no scales.
    OUT: the values' dtype code (``out_code``), read with ``DECODED``.
    GATHER: read the rows through ``src_ptr``.
    BM: tile rows (a multiple of 32).
    BK: tile columns (a multiple of 32).
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rk = pid_k * BK + tl.arange(0, BK)
    kb = pid_k * (BK // 32) + tl.arange(0, BK // 32)
    if TWO_D:
        rm = pid_m * BM + tl.arange(0, BM)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        offs = rm[:, None].to(tl.int64) * K + rk[None, :]
        x = load_rows(x_ptr, src_ptr, rm, rk, M, K, GATHER)
        xf = widen(x)
        a = abs_for_max(x)
        rb = pid_m * (BM // 32) + tl.arange(0, BM // 32)
        mb_total = (M + 31) // 32
        t = nan_to_0(tl.max(tl.max(tl.reshape(a, [BM // 32, 32, BK // 32, 32]), axis=3), axis=1))
        e = e8m0_roundup(t * _rcp(IS_E4M3))
        s = e8m0_encode_mult(e)
        s_full = tl.reshape(tl.broadcast_to(s[:, None, :, None], [BM // 32, 32, BK // 32, 32]),
                            [BM, BK])
        q = fp8_rne_sat(xf * s_full, IS_E4M3)
        eb = e.to(tl.uint8)
        d_full = tl.reshape(tl.broadcast_to(e8m0_decode(eb)[:, None, :, None],
                                            [BM // 32, 32, BK // 32, 32]), [BM, BK])
        if ROW:
            _store_q(rd_ptr, offs, q, d_full, mask, IS_E4M3, DECODED, OUT)
        if ROW and not DECODED:
            e_rows = tl.reshape(tl.broadcast_to(eb[:, None, :], [BM // 32, 32, BK // 32]),
                                [BM, BK // 32])
            so = scale_offset(rm[:, None], kb[None, :], RS_C, SWIZZLE)
            tl.store(rs_ptr + so, e_rows, mask=(rm[:, None] < M) & (kb[None, :] < K // 32))
        if COL:
            _store_q(cd_ptr, offs, q, d_full, mask, IS_E4M3, DECODED, OUT)
        if COL and not DECODED:
            e_cols = tl.reshape(tl.broadcast_to(eb[:, :, None], [BM // 32, BK // 32, 32]),
                                [BM // 32, BK])
            if SWIZZLE:
                so = scale_offset(rk[None, :], rb[:, None], CS_SW_C, True)
            else:
                so = scale_offset(rb[:, None], rk[None, :], CS_C, False)
            tl.store(cs_ptr + so, e_cols, mask=(rb[:, None] < mb_total) & (rk[None, :] < K))
    else:  # 1D: one 32-row slab at a time, so column blocks reduce over axis 0 (no reshape)
        for r in tl.static_range(BM // 32):
            _mxfp8_slab(x_ptr, src_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, M, K, RS_C, CS_C,
                        CS_SW_C, pid_m * (BM // 32) + r, rk, kb, ROW, COL, SWIZZLE, IS_E4M3,
                        DECODED, OUT, GATHER, BK)


@triton.jit
def _mxfp8_slab(
    x_ptr, src_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, M, K, RS_C, CS_C, CS_SW_C, rb, rk, kb,
    ROW: tl.constexpr, COL: tl.constexpr, SWIZZLE: tl.constexpr, IS_E4M3: tl.constexpr,
    DECODED: tl.constexpr, OUT: tl.constexpr, GATHER: tl.constexpr, BK: tl.constexpr,
):
    """1D blocks of the 32 rows of block-row ``rb`` and columns ``rk``: rowwise 1x32 blocks
    along K, columnwise 32x1 blocks as a plain max over axis 0 of the loaded tile. With
    ``GATHER`` the rows are read through ``src_ptr`` (``load_rows``)."""
    rm = rb * 32 + tl.arange(0, 32)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    offs = rm[:, None].to(tl.int64) * K + rk[None, :]
    x = load_rows(x_ptr, src_ptr, rm, rk, M, K, GATHER)
    xf = widen(x)
    a = abs_for_max(x)
    if ROW:
        t = nan_to_0(tl.max(tl.reshape(a, [32, BK // 32, 32]), axis=2))
        e = e8m0_roundup(t * _rcp(IS_E4M3))
        s = e8m0_encode_mult(e)
        s_full = tl.reshape(tl.broadcast_to(s[:, :, None], [32, BK // 32, 32]), [32, BK])
        d_full = tl.reshape(tl.broadcast_to(e8m0_decode(e)[:, :, None], [32, BK // 32, 32]),
                            [32, BK])
        _store_q(rd_ptr, offs, fp8_rne_sat(xf * s_full, IS_E4M3), d_full, mask, IS_E4M3,
                 DECODED, OUT)
        if not DECODED:
            so = scale_offset(rm[:, None], kb[None, :], RS_C, SWIZZLE)
            tl.store(rs_ptr + so, e.to(tl.uint8),
                     mask=(rm[:, None] < M) & (kb[None, :] < K // 32))
    if COL:
        e = e8m0_roundup(nan_to_0(tl.max(a, axis=0)) * _rcp(IS_E4M3))
        _store_q(cd_ptr, offs, fp8_rne_sat(xf * e8m0_encode_mult(e)[None, :], IS_E4M3),
                 e8m0_decode(e)[None, :], mask, IS_E4M3, DECODED, OUT)
        if not DECODED:
            if SWIZZLE:
                so = scale_offset(rk, rb, CS_SW_C, True)
            else:
                so = scale_offset(rb, rk, CS_C, False)
            # the slab's own bound as a vector, as the mask of a vector store must be
            slab_in = (rb + tl.zeros_like(rk)) < (M + 31) // 32
            tl.store(cs_ptr + so, e.to(tl.uint8), mask=(rk < K) & slab_in)


@triton.jit
def _store_q(ptr, offs, q, scale, mask, IS_E4M3: tl.constexpr, DECODED: tl.constexpr,
             OUT: tl.constexpr):
    """Store the FP8 bytes ``q``, or with ``DECODED`` their values ``fp8(q) * scale`` (exact
    in fp32) in the dtype of code ``OUT``."""
    if DECODED:
        tl.store(ptr + offs, to_out(fp8_decode(q, IS_E4M3) * scale, OUT), mask=mask)
    else:
        tl.store(ptr + offs, q, mask=mask)


def mxfp8_quantize(
    x: torch.Tensor,
    *,
    fp8_dtype: DType,
    rowwise: bool,
    columnwise: bool,
    with_2d_quantization: bool,
    swizzle: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One kernel reads each ``[BM, BK]`` tile once and writes the asked directions: data
    ``[M, K]`` (columnwise not transposed) and E8M0 scales in the zero-padded shapes of
    ``quant_core.shapes``, swizzled in place when ``swizzle`` (columnwise: the swizzle of the
    transposed scale matrix). Mirrors ``reference.mxfp8_quantize``."""
    m, k = _checked(x, fp8_dtype, "mxfp8_quantize")
    dev = x.device
    rd = rs = cd = cs = None
    rs_shape = shapes.mxfp8_rowwise_scale_shape(m, k)
    cs_shape = shapes.mxfp8_columnwise_scale_shape(m, k)
    if rowwise:
        rd = torch.empty((m, k), dtype=torch.uint8, device=dev)
        rs = torch.zeros(rs_shape, dtype=torch.uint8, device=dev)
    if columnwise:
        cd = torch.empty((m, k), dtype=torch.uint8, device=dev)
        cs = torch.zeros(cs_shape, dtype=torch.uint8, device=dev)
    _launch(x, rd, rs, cd, cs, rs_shape[1], cs_shape[1], cs_shape[0], fp8_dtype,
            with_2d_quantization, SWIZZLE=swizzle, DECODED=False, OUT=0)
    return rd, rs, cd, cs


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
    """The quantize kernel writing each element's decoded value in ``dtype`` instead of its
    byte, and no scales: one read of ``x`` and one write per direction, where quantize then
    dequantize read and write the bytes in between; with ``rows``, x's rows read through that
    index (no gathered copy). Mirrors ``reference.mxfp8_quantize_decoded``."""
    check_output_dtype(dtype, "mxfp8_quantize_decoded")
    m, k = _checked(x, fp8_dtype, "mxfp8_quantize_decoded")
    if rows is not None:
        check_row_index(x, rows, "mxfp8_quantize_decoded")
        m = rows.shape[0]
    rv = torch.empty((m, k), dtype=dtype, device=x.device) if rowwise else None
    cv = torch.empty((m, k), dtype=dtype, device=x.device) if columnwise else None
    _launch(x, rv, None, cv, None, 0, 0, 0, fp8_dtype, with_2d_quantization, rows=rows,
            SWIZZLE=False, DECODED=True, OUT=out_code(dtype))
    return rv, cv


def _checked(x: torch.Tensor, fp8_dtype: DType, where: str) -> tuple[int, int]:
    check_input_dtype(x, where)
    check_fp8(fp8_dtype, "fp8_dtype")
    m, k = x.shape
    check_k_multiple(k, shapes.MXFP8_BLOCK, "MXFP8")
    return m, k


def _launch(x, rd, rs, cd, cs, rs_c, cs_c, cs_sw_c, fp8_dtype, two_d, rows=None,
            **flags) -> None:
    """:func:`_mxfp8_kernel` over ``x`` (over its rows ``rows``, when given) for the directions
    whose output (``rd``, ``cd``) is given; nothing for an empty result."""
    rowwise, columnwise = rd is not None, cd is not None
    m, k = x.shape if rows is None else (rows.shape[0], x.shape[1])
    if m == 0 or k == 0 or not (rowwise or columnwise):
        return
    if rowwise and columnwise and not two_d:
        cfg, kw = launch_config("mxfp8_fused")
    else:
        cfg, kw = launch_config("mxfp8_col" if (columnwise or two_d) else "mxfp8")
    grid = (ceil_div(m, cfg["BM"]), ceil_div(k, cfg["BK"]))
    dummy = rd if rowwise else cd
    launch(
        _mxfp8_kernel, grid,
        x, dummy if rows is None else rows, dummy, rs if rs is not None else dummy,
        cd if columnwise else dummy, cs if cs is not None else dummy, m, k, rs_c, cs_c,
        cs_sw_c, ROW=rowwise, COL=columnwise, TWO_D=two_d, IS_E4M3=fp8_dtype == DType.E4M3,
        GATHER=rows is not None, **flags, **kw,
    )


@triton.jit
def _mxfp8_dequant_kernel(
    d_ptr, s_ptr, out_ptr, M, K, S_C, S_SW_C,
    COLWISE: tl.constexpr, SWIZZLE: tl.constexpr, IS_E4M3: tl.constexpr, OUT: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    """One scale load per block, not per element (per-element byte gathers throttle the memory
    pipeline: bench/RESULTS.md, section "GEMMs and the training step", its ncu of the GEMM
    implementations). Columnwise tiles have ``32 % BM == 0``
    rows, all in one 32-row block: one scale row serves the tile.

    d_ptr: uint8 FP8 data ``[M, K]`` (rowwise or columnwise, neither transposed), contiguous.
    s_ptr: uint8 E8M0 scales ``[S_SW_C, S_C]`` of that direction, contiguous.
    out_ptr: output ``[M, K]`` of the dtype ``OUT`` codes.
    M: rows of the data.
    K: columns of the data (a multiple of 32).
    S_C: dim 1 of the scale matrix.
    S_SW_C: dim 0 of the scale matrix (the columns of its transpose, which columnwise swizzles).
    COLWISE: 32x1 block scales, else 1x32.
    SWIZZLE: scales in the GEMM swizzle (columnwise: that of the transposed scale matrix).
    IS_E4M3: E4M3 data, else E5M2.
    OUT: output dtype code (``out_code``: 0 fp32, 1 bf16, 2 fp16).
    BM: tile rows (columnwise: a divisor of 32).
    BK: tile columns (a multiple of 32).
    """
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    offs = rm[:, None].to(tl.int64) * K + rk[None, :]
    b = tl.load(d_ptr + offs, mask=mask, other=0)
    if COLWISE:
        rb = (tl.program_id(0) * BM) // 32
        if SWIZZLE:
            so = scale_offset(rk, rb, S_SW_C, True)
        else:
            so = scale_offset(rb, rk, S_C, False)
        s = e8m0_decode(tl.load(s_ptr + so, mask=rk < K, other=127))[None, :]
    else:
        kb = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
        so = scale_offset(rm[:, None], kb[None, :], S_C, SWIZZLE)
        e = tl.load(s_ptr + so, mask=(rm[:, None] < M) & (kb[None, :] * 32 < K), other=127)
        s = tl.reshape(tl.broadcast_to(e8m0_decode(e)[:, :, None], (BM, BK // 32, 32)), (BM, BK))
    v = fp8_decode(b, IS_E4M3) * s
    tl.store(out_ptr + offs, to_out(v, OUT), mask=mask)


def mxfp8_dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_dtype: DType,
    columnwise: bool,
    swizzled: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``float(fp8(data)) * 2^(e - 127)`` cast to ``dtype``, ``[M, K]``; swizzled scales are read
    through the swizzle index directly. Mirrors ``reference.mxfp8_dequantize``."""
    check_output_dtype(dtype, "mxfp8_dequantize")
    check_fp8(fp8_dtype, "fp8_dtype")
    m, k = data.shape
    check_k_multiple(k, shapes.MXFP8_BLOCK, "MXFP8")
    out = torch.empty((m, k), dtype=dtype, device=data.device)
    if m == 0 or k == 0:
        return out
    cfg, kw = launch_config("mxfp8_dequant")
    if columnwise and 32 % cfg["BM"]:
        raise ValueError(f"mxfp8_dequant config: BM must divide 32, got {cfg['BM']}")
    grid = (ceil_div(m, cfg["BM"]), ceil_div(k, cfg["BK"]))
    launch(
        _mxfp8_dequant_kernel, grid,
        data.contiguous().view(torch.uint8), scale.contiguous(), out, m, k, scale.shape[1],
        scale.shape[0], COLWISE=columnwise, SWIZZLE=swizzled, IS_E4M3=fp8_dtype == DType.E4M3,
        OUT=out_code(dtype), **kw,
    )
    return out
