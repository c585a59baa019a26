"""Triton kernels of the batched per-group FP8 current scaling (:mod:`.grouped_fp8`): every
group's NaN-dropping amax in one pass, then one cast of all rows, each row with its group's
scale. Built from quant-kernels' rounding helpers (the per-tensor kernels' amax, scale and cast
rules, `numerics.md` §2-§3), so a group's bytes are those of one per-tensor quantize call.

Rows ``r`` of ``x [R, K]`` belong to group ``gid[r]`` (or ``r // GROUP_ROWS`` for an expert
weight ``[E, GROUP_ROWS, K]``) and go to row ``dest[r]`` of the output (``r`` without ``DEST``).
Importing this module needs Triton and quant-kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.dtypes import DType
from quant_kernels._common import launch
from quant_kernels._rounding import (
    FLT_MAX,
    abs_for_max,
    f32_bits,
    fp8_rne_sat,
    fp8_rne_sat_t,
    nan_to_0,
    scale_from_amax,
    scale_inverse,
    widen,
)

#: Rows and columns of a tile (the per-tensor cast kernel's tile on a GPU).
BM, BK = 32, 128


@triton.jit
def _group_of(rm, gid_ptr, rmask, GROUP_ROWS: tl.constexpr):
    if GROUP_ROWS > 0:
        return rm // GROUP_ROWS
    else:
        return tl.load(gid_ptr + rm, mask=rmask, other=0).to(tl.int64)


@triton.jit
def _group_amax_kernel(x_ptr, gid_ptr, amax_bits_ptr, R, K, GROUP_ROWS: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr):
    """Each row's NaN-dropping ``max|x|``, atomically max-ed into its group's amax.

    x_ptr: x ``[R, K]``, contiguous (fp32, bf16 or fp16).
    gid_ptr: int32/int64 group of each row (unused with ``GROUP_ROWS``).
    amax_bits_ptr: fp32 ``[groups]`` amaxes (zeros before the call) viewed as int32.
    """
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rm < R
    acc = tl.zeros([BM, BK], tl.float32)
    k0 = 0
    while k0 < K:  # a while loop: the interpreter cannot iterate range() of a runtime int
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :],
                    mask=rmask[:, None] & (rk[None, :] < K), other=0.0)
        acc = tl.maximum(acc, abs_for_max(x))
        k0 += BK
    row = nan_to_0(tl.max(acc, axis=1))
    g = _group_of(rm, gid_ptr, rmask, GROUP_ROWS)
    tl.atomic_max(amax_bits_ptr + g, f32_bits(row), mask=rmask)


@triton.jit
def _group_scale_inv_kernel(amax_ptr, out_ptr, n, eps, FP8_MAX: tl.constexpr,
                            POW2: tl.constexpr, BLOCK: tl.constexpr):
    """``div_rn(1, scale)`` of each group's current-scaling scale (``out [n]`` fp32)."""
    i = tl.arange(0, BLOCK)
    s = scale_from_amax(tl.load(amax_ptr + i, mask=i < n, other=0.0), eps, FP8_MAX, POW2,
                        FLT_MAX)
    tl.store(out_ptr + i, scale_inverse(s, POW2), mask=i < n)


@triton.jit
def _group_cast_kernel(
    x_ptr, gid_ptr, dest_ptr, amax_ptr, data_ptr, t_ptr, R, K, t_stride, eps,
    ROW: tl.constexpr, COL: tl.constexpr, DEST: tl.constexpr, GROUP_ROWS: tl.constexpr,
    IS_E4M3: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    """One ``[BM, BK]`` tile: ``fp8_satfinite_rne(float(x) * scale[group])``.

    data_ptr: uint8 ``[*, K]``, row ``dest[r]`` written when ``ROW``.
    t_ptr: uint8 transposed data, written when ``COL``: ``[K, t_stride]`` (column ``dest[r]``),
        or with ``GROUP_ROWS`` each expert's ``[K, GROUP_ROWS]`` transpose, experts end to end.
    amax_ptr: fp32 ``[groups]`` amaxes (:func:`_group_amax_kernel`).
    """
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = rm < R
    mask = rmask[:, None] & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0)
    g = _group_of(rm, gid_ptr, rmask, GROUP_ROWS)
    s = scale_from_amax(tl.load(amax_ptr + g, mask=rmask, other=0.0), eps, FP8_MAX, POW2,
                        FLT_MAX)
    v = widen(x) * s[:, None]
    if DEST:
        p = tl.load(dest_ptr + rm, mask=rmask, other=0).to(tl.int64)
    else:
        p = rm
    if ROW:
        tl.store(data_ptr + p[:, None] * K + rk[None, :],
                 fp8_rne_sat(v, IS_E4M3).to(data_ptr.dtype.element_ty, bitcast=True), mask=mask)
    if COL:
        if GROUP_ROWS > 0:
            base = (rm // GROUP_ROWS) * K * GROUP_ROWS + rm % GROUP_ROWS
            addr = rk[:, None].to(tl.int64) * GROUP_ROWS + base[None, :]
        else:
            addr = rk[:, None].to(tl.int64) * t_stride + p[None, :]
        tl.store(t_ptr + addr,
                 tl.trans(fp8_rne_sat_t(v, IS_E4M3)).to(t_ptr.dtype.element_ty, bitcast=True),
                 mask=tl.trans(mask))


def group_quantize(x: torch.Tensor, gid: torch.Tensor | None, dest: torch.Tensor | None,
                   groups: int, data: torch.Tensor | None, trans: torch.Tensor | None,
                   fp8_dtype: DType, force_pow_2_scales: bool, amax_epsilon: float,
                   group_rows: int = 0) -> torch.Tensor:
    """Fill ``data`` / ``trans`` (preallocated uint8, see :func:`_group_cast_kernel`) with the
    per-group current-scaling cast of ``x [R, K]``; returns the groups' fp32 ``scale_inv``."""
    r, k = x.shape
    amax = torch.zeros(groups, dtype=torch.float32, device=x.device)
    scale_inv = torch.empty(groups, dtype=torch.float32, device=x.device)
    eps, pow2 = float(amax_epsilon), bool(force_pow_2_scales)
    dummy = amax
    if r:
        launch(_group_amax_kernel, (triton.cdiv(r, BM),), x, gid if gid is not None else dummy,
               amax.view(torch.int32), r, k, GROUP_ROWS=group_rows, BM=BM, BK=BK)
        launch(_group_cast_kernel, (triton.cdiv(r, BM), triton.cdiv(k, BK)), x,
               gid if gid is not None else dummy, dest if dest is not None else dummy, amax,
               data if data is not None else dummy, trans if trans is not None else dummy,
               r, k, trans.shape[1] if trans is not None and not group_rows else 0, eps,
               ROW=data is not None, COL=trans is not None, DEST=dest is not None,
               GROUP_ROWS=group_rows, IS_E4M3=fp8_dtype == DType.E4M3, FP8_MAX=fp8_dtype.max,
               POW2=pow2, BM=BM, BK=BK, num_warps=4)
    launch(_group_scale_inv_kernel, (1,), amax, scale_inv, groups, eps, FP8_MAX=fp8_dtype.max,
           POW2=pow2, BLOCK=triton.next_power_of_2(max(groups, 16)))
    return scale_inv
