"""Per-group FP8 current scaling of grouped rows (mixture-of-experts GEMM operands): every
group's NaN-dropping amax in one pass, then one cast of all rows into the rowwise and/or the
transposed layout, each row with its group's scale. Built from the per-tensor kernels' rounding
helpers (amax, scale and cast rules, `numerics.md` §2-§3), so a group's bytes are those of one
per-tensor quantize call on its rows.

Two row layouts:

- **tokens**: ``x [T, K]``, rows sorted by group, ``gid [T]`` the group of each row. The output
  is laid out in *padded* rows: ``src [P]`` gives the source row of each padded row (``-1``: a
  padding row, written as zero bytes). The transposed copy ``[K, P]`` always takes the padded
  layout (grouped GEMMs contracting over tokens need 16-aligned group starts); the rowwise copy
  takes it too (``ROW_PADDED``) or keeps the source rows ``[T, K]``.
- **experts**: ``w [E * N, K]``, group ``r // N`` (``GROUP_ROWS = N``), no padding; the
  transposed copy is each expert's ``[K, N]``, experts end to end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.dtypes import DType, check_fp8
from quant_core.inputs import check_input_dtype, given_group_amax, given_row_amax
from quant_core.reference.fp8_grouped import check_x_rows, row_amaxes
from quant_core.shapes import ceil_div

from ._common import fp8_data, launch
from ._layout import group_transposed_offsets
from ._rounding import (
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
from .configs import launch_config

#: Groups per step of the cast kernel's loop over the scale-inverses.
SCALE_INV_BLOCK = tl.constexpr(256)


@triton.jit
def _row_groups(rm, rmask, gid_ptr, GROUP_ROWS: tl.constexpr):
    if GROUP_ROWS > 0:
        return rm // GROUP_ROWS
    else:
        return tl.load(gid_ptr + rm, mask=rmask, other=0).to(tl.int64)


@triton.jit
def _group_amax_kernel(x_ptr, gid_ptr, amax_bits_ptr, R, K, GROUP_ROWS: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr):
    """One ``[BM, BK]`` tile's NaN-dropping ``max|x|`` per group: one atomic max for the rows of
    the tile's first group, one per row for rows of later groups (a tile spanning a boundary).

    x_ptr: x ``[R, K]``, contiguous (fp32, bf16 or fp16).
    gid_ptr: int32/int64 group of each row (unused with ``GROUP_ROWS``).
    amax_bits_ptr: fp32 ``[groups]`` amaxes (zeros before the call) viewed as int32.
    """
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = rm < R
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rmask[:, None] & (rk[None, :] < K),
                other=0.0)
    row = nan_to_0(tl.max(abs_for_max(x), axis=1))
    g = _row_groups(rm, rmask, gid_ptr, GROUP_ROWS)
    g0 = tl.min(tl.where(rmask, g, R), axis=0)
    first = rmask & (g == g0)
    tl.atomic_max(amax_bits_ptr + g0, f32_bits(tl.max(tl.where(first, row, 0.0), axis=0)))
    tl.atomic_max(amax_bits_ptr + g, f32_bits(row), mask=rmask & (g != g0))


@triton.jit
def store_scale_inv_of(amax, out_ptr, i, mask, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                       PITCH: tl.constexpr, BLOCK: tl.constexpr):
    """Groups ``i`` (a ``[BLOCK]`` vector, where ``mask``) of amaxes ``amax``: ``div_rn(1,
    scale)`` of each group's current-scaling scale in column 0 of ``out [groups, PITCH]``
    (fp32), the amax in column 1 (``PITCH`` >= 2); the other columns written zero, so the
    buffer needs no clearing first."""
    s = scale_from_amax(amax, eps, FP8_MAX, POW2, FLT_MAX)
    tl.store(out_ptr + i * PITCH, scale_inverse(s, POW2), mask=mask)
    if PITCH > 1:
        tl.store(out_ptr + i * PITCH + 1, amax, mask=mask)
    for c in tl.static_range(2, PITCH):
        tl.store(out_ptr + i * PITCH + c, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)


@triton.jit
def _store_scale_inv(amax_ptr, out_ptr, i, n, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                     PITCH: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`store_scale_inv_of` of groups ``i`` (a ``[BLOCK]`` range, those below ``n``),
    their amaxes read from ``amax_ptr``."""
    store_scale_inv_of(tl.load(amax_ptr + i, mask=i < n, other=0.0), out_ptr, i, i < n, eps,
                       FP8_MAX, POW2, PITCH, BLOCK)


@triton.jit
def store_fp8_tile(v, data_ptr, t_ptr, row_offs, t_offs, row_mask, t_mask, ROW: tl.constexpr,
                   COL: tl.constexpr, IS_E4M3: tl.constexpr):
    """``fp8_satfinite_rne`` of the scaled fp32 tile ``v [BM, BK]``: at ``data_ptr + row_offs``
    (``[BM, BK]`` offsets, where ``row_mask``) when ``ROW``, transposed at ``t_ptr + t_offs``
    (``[BK, BM]``, where ``t_mask``) when ``COL``."""
    if ROW:
        tl.store(data_ptr + row_offs,
                 fp8_rne_sat(v, IS_E4M3).to(data_ptr.dtype.element_ty, bitcast=True),
                 mask=row_mask)
    if COL:
        tl.store(t_ptr + t_offs,
                 tl.trans(fp8_rne_sat_t(v, IS_E4M3)).to(t_ptr.dtype.element_ty, bitcast=True),
                 mask=t_mask)


@triton.jit
def _group_scale_inv_kernel(amax_ptr, out_ptr, n, eps, FP8_MAX: tl.constexpr,
                            POW2: tl.constexpr, PITCH: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_store_scale_inv` of ``BLOCK`` groups per program."""
    _store_scale_inv(amax_ptr, out_ptr, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), n, eps,
                     FP8_MAX, POW2, PITCH, BLOCK)


@triton.jit
def _group_cast_kernel(
    x_ptr, src_ptr, grp_ptr, amax_ptr, data_ptr, t_ptr, xrows_ptr, sinv_ptr, P, K, groups, eps,
    ROW: tl.constexpr, COL: tl.constexpr, ROW_PADDED: tl.constexpr, GROUP_ROWS: tl.constexpr,
    GATHER: tl.constexpr, IS_E4M3: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
    PITCH: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """One ``[BM, BK]`` tile of output rows: ``fp8_satfinite_rne(float(x) * scale[group])``;
    the first program also writes the ``groups`` groups' scale-inverses into ``sinv_ptr``
    (:func:`_store_scale_inv`, ``PITCH`` > 0), so that no launch of its own makes them.

    Output row ``p`` (of ``P``) reads source row ``src[p]`` (``-1``: zeros) of group
    ``grp[p]``, which is row ``xrows[src[p]]`` of ``x`` with ``GATHER``; with ``GROUP_ROWS``
    it reads row ``p`` of group ``p // GROUP_ROWS``.
    data_ptr: uint8/FP8 rowwise data, row ``p`` (``ROW_PADDED`` or ``GROUP_ROWS``) or row
        ``src[p]`` written when ``ROW``.
    t_ptr: uint8/FP8 transposed data when ``COL``: ``[K, P]``, or with ``GROUP_ROWS`` each
        group's ``[K, GROUP_ROWS]``, groups end to end.
    amax_ptr: fp32 ``[groups]`` amaxes (:func:`_group_amax_kernel`).
    """
    if PITCH > 0:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            for g0 in range(0, groups, SCALE_INV_BLOCK):
                _store_scale_inv(amax_ptr, sinv_ptr, g0 + tl.arange(0, SCALE_INV_BLOCK), groups,
                                 eps, FP8_MAX, POW2, PITCH, SCALE_INV_BLOCK)
    p0 = tl.program_id(0) * BM
    rp = (p0 + tl.arange(0, BM)).to(tl.int64)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    pmask = rp < P
    kmask = rk < K
    if GROUP_ROWS > 0:
        src = rp
        valid = pmask
        g = rp // GROUP_ROWS
    else:
        src = tl.load(src_ptr + rp, mask=pmask, other=-1).to(tl.int64)
        valid = src >= 0
        g = tl.load(grp_ptr + rp, mask=pmask, other=0).to(tl.int64)
    if GATHER:
        xr = tl.load(xrows_ptr + src, mask=valid, other=0).to(tl.int64)
    else:
        xr = src
    x = tl.load(x_ptr + xr[:, None] * K + rk[None, :], mask=valid[:, None] & kmask[None, :],
                other=0.0)
    s = scale_from_amax(tl.load(amax_ptr + g, mask=pmask, other=0.0), eps, FP8_MAX, POW2, FLT_MAX)
    v = widen(x) * s[:, None]  # padding rows: 0 * a finite scale
    if ROW_PADDED or GROUP_ROWS > 0:
        row_offs = rp[:, None] * K + rk[None, :]
        row_mask = pmask[:, None] & kmask[None, :]
    else:
        row_offs = src[:, None] * K + rk[None, :]
        row_mask = valid[:, None] & kmask[None, :]
    if GROUP_ROWS > 0:
        if GROUP_ROWS % BM == 0:  # the tile lies in one group: contiguous columns
            e = p0 // GROUP_ROWS
            cols = (p0 - e * GROUP_ROWS + tl.arange(0, BM)).to(tl.int64)
            t_offs = group_transposed_offsets(e, rk, cols, K, GROUP_ROWS)
        else:
            t_offs = group_transposed_offsets(g, rk, rp % GROUP_ROWS, K, GROUP_ROWS)
    else:
        t_offs = rk[:, None].to(tl.int64) * P + rp[None, :]
    store_fp8_tile(v, data_ptr, t_ptr, row_offs, t_offs, row_mask,
                   kmask[:, None] & pmask[None, :], ROW, COL, IS_E4M3)


def group_amax(x: torch.Tensor, groups: int, gid: torch.Tensor | None,
               group_rows: int = 0) -> torch.Tensor:
    """fp32 ``[groups]``: each group's NaN-dropping ``max|x|`` (0 for a group with no rows);
    rows of group ``gid[r]``, or ``r // group_rows``."""
    r, k = x.shape
    amax = torch.zeros(groups, dtype=torch.float32, device=x.device)
    if r and k:
        cfg, kw = launch_config("fp8_group_amax")
        launch(_group_amax_kernel, (ceil_div(r, cfg["BM"]), ceil_div(k, cfg["BK"])), x,
               gid if gid is not None else amax, amax.view(torch.int32), r, k,
               GROUP_ROWS=group_rows, **kw)
    return amax


def group_scale_inv(amax: torch.Tensor, fp8_dtype: DType, force_pow_2_scales: bool,
                    amax_epsilon: float, pitch: int = 1,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[groups, pitch]`` (``out`` where given): column 0 holds each group's
    ``div_rn(1, scale)``, column 1 (a pitch of 2 or more) its amax, the rest 0 (a pitch of 4
    puts each group's scale on its own 16-byte boundary, as cuBLAS requires of a scale
    pointer)."""
    n = amax.shape[0]
    if out is None:
        out = torch.empty((n, pitch), dtype=torch.float32, device=amax.device)
    pitch = out.shape[1]
    block = 1024
    launch(_group_scale_inv_kernel, (max(ceil_div(n, block), 1),), amax, out, n,
           float(amax_epsilon), FP8_MAX=fp8_dtype.max, POW2=bool(force_pow_2_scales),
           PITCH=pitch, BLOCK=block)
    return out


def quantized_with_scale_inv(x, amax, fp8_dtype, force_pow_2_scales, amax_epsilon, scale_pitch,
                             **kw):
    """``(data, transpose, scale_inv)``: :func:`fp8_group_quantize` of ``x``, the cast's launch
    also writing :func:`group_scale_inv`'s ``[groups, scale_pitch]`` (a launch of its own only
    where nothing is cast)."""
    sinv = torch.empty((amax.shape[0], scale_pitch), dtype=torch.float32, device=x.device)
    data, trans = fp8_group_quantize(x, amax, fp8_dtype=fp8_dtype,
                                     force_pow_2_scales=force_pow_2_scales,
                                     amax_epsilon=amax_epsilon, scale_inv=sinv, **kw)
    return data, trans, sinv


def fp8_group_quantize(
    x: torch.Tensor,
    amax: torch.Tensor,
    *,
    fp8_dtype: DType,
    force_pow_2_scales: bool,
    amax_epsilon: float,
    rowwise: bool,
    columnwise: bool,
    src: torch.Tensor | None = None,
    grp: torch.Tensor | None = None,
    row_padded: bool = False,
    group_rows: int = 0,
    x_rows: torch.Tensor | None = None,
    scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(data, transpose)``: ``x``'s rows cast with their groups' current-scaling scales
    (from ``amax``, :func:`group_amax`). Tokens (``src``, ``grp`` of ``P`` padded rows): data
    ``[P, K]`` when ``row_padded`` else ``[T, K]``, transpose ``[K, P]``; token row ``t`` is
    row ``x_rows[t]`` of ``x`` where ``x_rows [T]`` is given. Experts (``group_rows = N``,
    ``x [E * N, K]``): data ``[E * N, K]``, transpose ``[E, K, N]``. ``scale_inv``: an fp32
    ``[groups, pitch]`` buffer that receives :func:`group_scale_inv`'s values too."""
    check_input_dtype(x, "fp8_group_quantize")
    check_fp8(fp8_dtype, "fp8_dtype")
    r, k = x.shape[0] if x_rows is None else x_rows.shape[0], x.shape[1]
    dev = x.device
    if group_rows:
        p = r
        data_shape, t_shape = (r, k), (r // group_rows, k, group_rows)
    else:
        p = src.shape[0]
        data_shape, t_shape = ((p, k) if row_padded else (r, k)), (k, p)
    data_arg, data = fp8_data(data_shape, fp8_dtype, dev) if rowwise else (None, None)
    t_arg, trans = fp8_data(t_shape, fp8_dtype, dev) if columnwise else (None, None)
    if p and k and (rowwise or columnwise):
        cfg, kw = launch_config("fp8_group_cast")
        launch(_group_cast_kernel, (ceil_div(p, cfg["BM"]), ceil_div(k, cfg["BK"])), x,
               amax if src is None else src, amax if grp is None else grp, amax,
               data_arg if rowwise else amax, t_arg if columnwise else amax,
               amax if x_rows is None else x_rows, amax if scale_inv is None else scale_inv, p,
               k, amax.shape[0], float(amax_epsilon), ROW=rowwise, COL=columnwise,
               ROW_PADDED=row_padded, GROUP_ROWS=group_rows, GATHER=x_rows is not None,
               IS_E4M3=fp8_dtype == DType.E4M3, FP8_MAX=fp8_dtype.max,
               POW2=bool(force_pow_2_scales),
               PITCH=0 if scale_inv is None else scale_inv.shape[1], **kw)
    elif scale_inv is not None:
        group_scale_inv(amax, fp8_dtype, force_pow_2_scales, amax_epsilon, out=scale_inv)
    return data, trans


def fp8_group_quantize_rows(x: torch.Tensor, gid: torch.Tensor, src: torch.Tensor,
                            grp: torch.Tensor, *, groups: int, fp8_dtype: DType,
                            force_pow_2_scales: bool, amax_epsilon: float, rowwise: bool,
                            columnwise: bool, row_padded: bool, scale_pitch: int = 1,
                            amax: torch.Tensor | None = None,
                            x_rows: torch.Tensor | None = None,
                            row_amax: torch.Tensor | None = None):
    """The backend contract's ``fp8_group_quantize_rows``: the groups' amaxes, the cast
    (:func:`fp8_group_quantize`) and :func:`group_scale_inv`. The amaxes are ``amax`` when
    given; else :func:`group_amax` of the given ``row_amax``, of gathered rows' (``x_rows``)
    amaxes of each row of ``x``, or of the rows themselves."""
    what = "fp8_group_quantize_rows"
    check_input_dtype(x, what)
    rows = gid.shape[0]
    check_x_rows(x, x_rows, rows, what)
    if amax is not None:
        amax = given_group_amax(amax, groups, x.device, what)
    elif row_amax is not None:
        amax = group_amax(given_row_amax(row_amax, rows, x.device, what)[:, None], groups, gid)
    elif x_rows is None:
        amax = group_amax(x, groups, gid)
    else:
        amax = group_amax(row_amaxes(x)[x_rows.to(torch.int64), None], groups, gid)
    return quantized_with_scale_inv(x, amax, fp8_dtype, force_pow_2_scales, amax_epsilon,
                                    scale_pitch, rowwise=rowwise, columnwise=columnwise,
                                    src=src, grp=grp, row_padded=row_padded, x_rows=x_rows)
