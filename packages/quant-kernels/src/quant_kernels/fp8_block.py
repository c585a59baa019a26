"""FP8 block-scaling kernels, 1x128 / 128x1 and 128x128 (`numerics.md` §6, §8): rowwise and the
transposed columnwise data from one read of each tile, fp32 scales in the GEMM-ready layouts
(1D transposed, inner dim zero-padded to 4), partial edge blocks over valid elements."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core import shapes
from quant_core.dtypes import DType, check_fp8
from quant_core.inputs import (
    check_block_scaling_dim,
    check_column_groups,
    check_input_dtype,
    check_output_dtype,
    check_row_index,
)
from quant_core.shapes import ceil_div

from ._common import fp8_data, launch, out_code
from ._layout import group_transposed_offsets, load_rows
from ._rounding import (
    abs_for_max,
    fp8_decode,
    fp8_rne_sat,
    fp8_rne_sat_t,
    nan_to_0,
    scale_from_amax,
    scale_inverse,
    to_out,
    widen,
)
from .configs import config, launch_kwargs

BLOCK = shapes.FP8_BLOCK
_DTYPE_MAX = {torch.float32: 3.4028234663852886e38, torch.bfloat16: 3.3895313892515355e38,
              torch.float16: 65504.0}


@triton.jit
def _fp8_block_kernel(
    x_ptr, src_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr, M, K, G, RS_C, CS_C, eps,
    ROW: tl.constexpr, COL: tl.constexpr, TWO_D: tl.constexpr, IS_E4M3: tl.constexpr,
    FP8_MAX: tl.constexpr, POW2: tl.constexpr, VINF: tl.constexpr, GATHER: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, SLAB: tl.constexpr,
):
    """A ``[BM, BK]`` tile in ``SLAB``-row slabs (few registers, no spills). Column (1D) or tile
    (2D) amaxes need the whole tile first: pass 1 keeps an elementwise running max over the
    slabs, pass 2 reloads each slab (from cache) and quantizes it.

    x_ptr: input x ``[M, K]``, contiguous (fp32, bf16 or fp16); with ``GATHER`` any rows, row
        ``m`` of the quantized tensor read from row ``src[m]`` (a zero row where it is -1).
    src_ptr: int32/int64 ``[M]`` source rows when ``GATHER`` (else a dummy).
    rd_ptr: FP8 rowwise data ``[M, K]`` (uint8 or torch FP8: ``fp8_data``), written when ``ROW``
        (else a dummy).
    rs_ptr: fp32 rowwise scale_inv ``[ceil(K/128), RS_C]`` (1D) or ``[ceil(M/128), RS_C]`` (2D).
    cd_ptr: FP8 columnwise data ``[M / G, K, G]`` (each group of ``G`` rows transposed; uint8 or
        torch FP8), written when ``COL``.
    cs_ptr: fp32 columnwise scale_inv ``[ceil(M/128), CS_C]`` (1D) or ``[ceil(K/128), CS_C]`` (2D).
    M: rows of x.
    K: columns of x.
    G: rows of a group of the columnwise data: ``M``, or a multiple of ``BM``.
    RS_C: dim 1 of the rowwise scales: M (1D) or ceil(K/128) (2D), rounded up to a multiple of 4.
    CS_C: dim 1 of the columnwise scales: K (1D) or ceil(M/128) (2D), rounded up to a multiple of 4.
    eps: ``amax_epsilon``, the floor of each block amax.
    ROW: write the rowwise data and scales.
    COL: write the columnwise data and scales.
    TWO_D: 128x128 blocks (one scale per tile), else 1x128 rowwise / 128x1 columnwise.
    IS_E4M3: E4M3 data, else E5M2.
    FP8_MAX: largest finite value of the FP8 format.
    POW2: scales floored to powers of two (``force_pow_2_scales``).
    VINF: the scale when ``FP8_MAX / amax`` overflows: the largest finite value of x's dtype.
    BM: tile rows (128, or ``BM_ROW`` on the rowwise-only 1D path).
    BK: tile columns (128, one block).
    SLAB: rows per slab (``BM`` on the rowwise-only 1D path).
    GATHER: read the rows through ``src_ptr``.
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rk = pid_k * BK + tl.arange(0, BK)
    if TWO_D:
        acc = tl.zeros([SLAB, BK], tl.float32)
        for r in range(BM // SLAB):  # a real loop: unrolled, the reloads would be CSEd
            rm, mask = _slab(pid_m, r, rk, M, K, BM, SLAB)
            x = load_rows(x_ptr, src_ptr, rm, rk, M, K, GATHER)
            acc = tl.maximum(acc, abs_for_max(x))  # acc starts at 0: never NaN
        s_t = scale_from_amax(tl.max(tl.max(acc, axis=1), axis=0), eps, FP8_MAX, POW2, VINF)
        s_inv = scale_inverse(s_t, POW2)
        if ROW:
            tl.store(rs_ptr + pid_m * RS_C + pid_k, s_inv)
        if COL:
            tl.store(cs_ptr + pid_k * CS_C + pid_m, s_inv)
        for r in range(BM // SLAB):
            rm, mask = _slab(pid_m, r, rk, M, K, BM, SLAB)
            x = load_rows(x_ptr, src_ptr, rm, rk, M, K, GATHER)
            xf = widen(x)
            if ROW:
                tl.store(rd_ptr + rm[:, None].to(tl.int64) * K + rk[None, :],
                         fp8_rne_sat(xf * s_t, IS_E4M3).to(rd_ptr.dtype.element_ty, bitcast=True),
                         mask=mask)
            if COL:
                q = tl.trans(fp8_rne_sat_t(xf * s_t, IS_E4M3))
                tl.store(cd_ptr + _col_offsets(pid_m, rk, rm, K, G, BM),
                         q.to(cd_ptr.dtype.element_ty, bitcast=True), mask=tl.trans(mask))
    else:
        # pass 1: the rowwise 1x128 blocks lie inside a slab; column maxima accumulate
        acc = tl.zeros([SLAB, BK], tl.float32)
        for r in range(BM // SLAB):
            rm, mask = _slab(pid_m, r, rk, M, K, BM, SLAB)
            x = load_rows(x_ptr, src_ptr, rm, rk, M, K, GATHER)
            if ROW:
                s = scale_from_amax(nan_to_0(tl.max(abs_for_max(x), axis=1)), eps, FP8_MAX,
                                    POW2, VINF)
                q = fp8_rne_sat(widen(x) * s[:, None], IS_E4M3)
                tl.store(rd_ptr + rm[:, None].to(tl.int64) * K + rk[None, :],
                         q.to(rd_ptr.dtype.element_ty, bitcast=True), mask=mask)
                tl.store(rs_ptr + pid_k * RS_C + rm, scale_inverse(s, POW2), mask=rm < M)
            if COL:
                acc = tl.maximum(acc, abs_for_max(x))
        if COL:  # pass 2: the 128x1 column blocks, slabs reloaded (from cache), stored transposed
            s_c = scale_from_amax(tl.max(acc, axis=0), eps, FP8_MAX, POW2, VINF)
            tl.store(cs_ptr + pid_m * CS_C + rk, scale_inverse(s_c, POW2), mask=rk < K)
            for r in range(BM // SLAB):
                rm, mask = _slab(pid_m, r, rk, M, K, BM, SLAB)
                x = load_rows(x_ptr, src_ptr, rm, rk, M, K, GATHER)
                q = fp8_rne_sat_t(widen(x) * s_c[None, :], IS_E4M3)
                tl.store(cd_ptr + _col_offsets(pid_m, rk, rm, K, G, BM),
                         tl.trans(q).to(cd_ptr.dtype.element_ty, bitcast=True),
                         mask=tl.trans(mask))


@triton.jit
def _col_offsets(pid_m, rk, rm, K, G, BM: tl.constexpr):
    """``[BK, SLAB]`` offsets of the columnwise elements of columns ``rk`` and rows ``rm`` of
    tile ``pid_m``, whose rows lie in one group of ``G`` (``[K, M]`` when ``G = M``)."""
    e = (pid_m * BM // G).to(tl.int64)
    return group_transposed_offsets(e, rk, rm - e * G, K, G)


@triton.jit
def _slab(pid_m, r, rk, M, K, BM: tl.constexpr, SLAB: tl.constexpr):
    """Slab ``r`` (``SLAB`` rows) of the ``BM``-row tile ``pid_m``: (rows, store mask). It takes
    no pointer: torch's write analysis of a recorded launch attributes the pointers a helper
    takes to the stores whose addresses use its results, so a helper given ``x_ptr`` that
    returned the rows the stores use would mark x as written (an input copy per call, no CUDA
    graphs). The rows are loaded by ``load_rows``, whose results feed only stored values."""
    rm = pid_m * BM + r * SLAB + tl.arange(0, SLAB)
    return rm, (rm[:, None] < M) & (rk[None, :] < K)


def _scale_buffer(shape: tuple[int, int], written: int, dev: torch.device) -> torch.Tensor:
    """An fp32 scale-inverse layout of ``shape`` whose first ``written`` columns the kernel
    writes in every row: the columns past them (the layout's padding to 4) are zeros, as the
    reference's; with no padding, no fill is launched."""
    if shape[1] == written:
        return torch.empty(shape, dtype=torch.float32, device=dev)
    return torch.zeros(shape, dtype=torch.float32, device=dev)


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
    """One pass over ``[BM, 128]`` tiles (``BM = 128`` when columnwise or 2D) writing
    ``row_data [M, K]``, ``col_data [K, M]`` (transposed; ``[E, K, M / E]`` with ``groups =
    E``, each group's rows transposed on their own) and fp32 ``scale_inv`` buffers in the
    GEMM-ready layouts; with ``rows`` the tiles read ``x``'s rows through that index (``M`` its
    length, zero rows where it is negative). Mirrors ``reference.fp8_block_quantize``."""
    check_input_dtype(x, "fp8_block_quantize")
    check_fp8(fp8_dtype, "fp8_dtype")
    check_block_scaling_dim(block_scaling_dim)
    if rows is not None:
        check_row_index(x, rows, "fp8_block_quantize")
    m, k = (x.shape[0] if rows is None else rows.shape[0]), x.shape[1]
    check_column_groups(m, groups, BLOCK, "fp8_block_quantize")
    dev = x.device
    rd = rs = cd = cs = None
    rs_shape = shapes.fp8_block_rowwise_scale_shape(m, k, block_scaling_dim)
    cs_shape = shapes.fp8_block_columnwise_scale_shape(m, k, block_scaling_dim)
    rd_arg = cd_arg = None
    two_d = block_scaling_dim == 2
    if rowwise:
        rd_arg, rd = fp8_data((m, k), fp8_dtype, dev)
        rs = _scale_buffer(rs_shape, ceil_div(k, BLOCK) if two_d else m, dev)
    if columnwise:
        cd_arg, cd = fp8_data((groups, k, m // groups) if groups else (k, m), fp8_dtype, dev)
        cs = _scale_buffer(cs_shape, ceil_div(m, BLOCK) if two_d else k, dev)
    if m == 0 or k == 0 or not (rowwise or columnwise):
        return rd, rs, cd, cs
    row_only = block_scaling_dim == 1 and not columnwise
    cfg = config("fp8_block" if row_only else
                 "fp8_block_2d" if block_scaling_dim == 2 else "fp8_block_col")
    bm = cfg["BM_ROW"] if row_only else BLOCK
    slab = bm if row_only else cfg["SLAB"]
    grid = (ceil_div(m, bm), ceil_div(k, BLOCK))
    dummy = rd_arg if rd_arg is not None else cd_arg
    dummy_s = rs if rs is not None else cs
    launch(
        _fp8_block_kernel, grid,
        x, x if rows is None else rows, rd_arg if rowwise else dummy, rs if rowwise else dummy_s,
        cd_arg if columnwise else dummy,
        cs if columnwise else dummy_s, m, k, m // groups if groups else max(m, 1), rs_shape[1],
        cs_shape[1], float(amax_epsilon),
        ROW=rowwise, COL=columnwise, TWO_D=block_scaling_dim == 2,
        IS_E4M3=fp8_dtype == DType.E4M3, FP8_MAX=fp8_dtype.max, POW2=bool(force_pow_2_scales),
        VINF=_DTYPE_MAX[x.dtype], GATHER=rows is not None, BM=bm, BK=BLOCK, SLAB=slab,
        **launch_kwargs(cfg),
    )
    return rd, rs, cd, cs


@triton.jit
def _fp8_block_dequant_kernel(
    d_ptr, s_ptr, out_ptr, M, K, S_C,
    COLWISE: tl.constexpr, TWO_D: tl.constexpr, IS_E4M3: tl.constexpr, OUT: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    """One ``[BM, BK]`` tile of ``fp8(data) * scale_inv`` per block (:func:`fp8_block_dequantize`).

    d_ptr: uint8 FP8 data ``[M, K]``, or ``[K, M]`` (transposed) when ``COLWISE``; contiguous.
    s_ptr: fp32 scale_inv buffer of the quantizer's layout, row length ``S_C``, contiguous.
    out_ptr: output ``[M, K]`` of the dtype ``OUT`` codes.
    M: rows of the output.
    K: columns of the output.
    S_C: dim 1 of the scale buffer.
    COLWISE: columnwise data and scales (128x1 blocks in 1D), else rowwise (1x128).
    TWO_D: 128x128 blocks.
    IS_E4M3: E4M3 data, else E5M2.
    OUT: output dtype code (``out_code``: 0 fp32, 1 bf16, 2 fp16).
    BM: tile rows.
    BK: tile columns.
    """
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    if COLWISE:  # data is [K, M]: load the transposed tile
        b = tl.trans(tl.load(d_ptr + rk[:, None].to(tl.int64) * M + rm[None, :],
                             mask=tl.trans(mask), other=0))
    else:
        b = tl.load(d_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0)
    mb = rm[:, None] // 128
    kb = rk[None, :] // 128
    if TWO_D:
        so = kb * S_C + mb if COLWISE else mb * S_C + kb
    else:
        so = mb * S_C + rk[None, :] if COLWISE else kb * S_C + rm[:, None]
    s = tl.load(s_ptr + so, mask=mask, other=1.0)
    v = fp8_decode(b, IS_E4M3) * s
    tl.store(out_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], to_out(v, OUT), mask=mask)


def fp8_block_dequantize(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    fp8_dtype: DType,
    block_scaling_dim: int,
    columnwise: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``float(fp8(data)) * scale_inv`` per block, cast to ``dtype``, ``[M, K]`` (columnwise data
    ``[K, M]`` is transposed back). Mirrors ``reference.fp8_block_dequantize``."""
    check_output_dtype(dtype, "fp8_block_dequantize")
    check_fp8(fp8_dtype, "fp8_dtype")
    check_block_scaling_dim(block_scaling_dim)
    m, k = (data.shape[1], data.shape[0]) if columnwise else tuple(data.shape)
    out = torch.empty((m, k), dtype=dtype, device=data.device)
    if m == 0 or k == 0:
        return out
    cfg = config("fp8_block_dequant")
    grid = (ceil_div(m, cfg["BM"]), ceil_div(k, cfg["BK"]))
    launch(
        _fp8_block_dequant_kernel, grid,
        data.contiguous().view(torch.uint8), scale_inv.to(torch.float32).contiguous(), out, m, k,
        scale_inv.shape[1], COLWISE=columnwise, TWO_D=block_scaling_dim == 2,
        IS_E4M3=fp8_dtype == DType.E4M3, OUT=out_code(dtype), BM=cfg["BM"], BK=cfg["BK"],
        **launch_kwargs(cfg),
    )
    return out
