"""Reference per-group FP8 current scaling (mixture-of-experts GEMM operands): each group of rows
quantized with its own NaN-dropping amax and the scale current scaling derives from it
(`numerics.md` §3), so a group's bytes are those of one per-tensor quantize call on its rows.

Two row layouts (the backend contract's ``fp8_group_quantize_rows`` / ``_experts``):

- **tokens**: ``x [T, K]`` with ``gid [T]`` the group of each row, written in a *padded* layout
  of ``P`` rows: padded row ``p`` holds source row ``src[p]`` (``-1``: a zero padding row) of
  group ``grp[p]``. The transposed copy is ``[K, P]``; the rowwise copy is ``[P, K]``
  (``row_padded``) or keeps the source rows ``[T, K]``.
- **experts**: ``w [E * N, K]``, group ``r // N``; the transposed copy is each expert's
  ``[K, N]``, experts end to end (``[E, K, N]``).

Scale-inverses are ``[E, scale_pitch]`` fp32, column 0 each group's ``div_rn(1, scale)``,
column 1 (a pitch of 2 or more) the group's amax, the rest zero (a pitch of 4 puts each group's
on a 16-byte boundary, as cuBLAS requires). A caller that passes that amax back (``amax``, to
quantize the same tensor again) gets the same bytes without the amax pass.
"""

from __future__ import annotations

import torch

from ..constants import FLT_MAX
from ..dtypes import DType, check_fp8
from ..inputs import check_input_dtype, check_row_index, given_group_amax, given_row_amax
from ._rounding import compute_scale_from_amax, div_rn, fp8_encode, nan_to_zero_abs, to_fp32


def check_x_rows(x: torch.Tensor, x_rows: torch.Tensor | None, rows: int, what: str) -> None:
    """A clear error unless ``x_rows`` (when given) indexes ``rows`` token rows of ``x``."""
    if x_rows is not None:
        check_row_index(x, x_rows, what, arg="x_rows", count=rows,
                        meaning="the row of x each token row reads")


def row_amaxes(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T]``: the NaN-dropping amax of each row of ``x [T, K]`` (0 for rows of no
    columns). Plain torch ops, so that a compiler can compute them in the kernel that produces
    ``x``."""
    amax = nan_to_zero_abs(x).amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    return amax.to(torch.float32)


def group_amaxes(row_amax: torch.Tensor, gid: torch.Tensor, groups: int) -> torch.Tensor:
    """fp32 ``[groups]``: the largest of each group's :func:`row_amaxes` (``gid [T]`` the group
    of each row; 0 for a group of no rows): the group's NaN-dropping amax, exactly."""
    amax = torch.zeros(groups, dtype=torch.float32, device=row_amax.device)
    return amax.scatter_reduce(0, gid.to(torch.int64), row_amax.to(torch.float32), "amax")


def _scales(x: torch.Tensor, gid: torch.Tensor, groups: int, fp8_dtype: DType,
            force_pow_2_scales: bool, amax_epsilon: float, scale_pitch: int,
            amax: torch.Tensor | None, what: str):
    """``(scale [E], scale_inv [E, scale_pitch])`` of each group's amax (``amax`` when given)."""
    if amax is None:
        amax = group_amaxes(row_amaxes(x), gid, groups)
    else:
        amax = given_group_amax(amax, groups, x.device, what)
    scale = compute_scale_from_amax(amax, fp8_dtype.max, force_pow_2_scales=force_pow_2_scales,
                                    amax_epsilon=amax_epsilon, value_for_inf=FLT_MAX)
    sinv = amax.new_zeros((groups, scale_pitch))
    sinv[:, 0] = div_rn(torch.ones_like(scale), scale)
    if scale_pitch > 1:
        sinv[:, 1] = amax
    return scale, sinv


def fp8_group_quantize_rows(x: torch.Tensor, gid: torch.Tensor, src: torch.Tensor,
                            grp: torch.Tensor, *, groups: int, fp8_dtype: DType,
                            force_pow_2_scales: bool, amax_epsilon: float, rowwise: bool,
                            columnwise: bool, row_padded: bool, scale_pitch: int = 1,
                            amax: torch.Tensor | None = None,
                            x_rows: torch.Tensor | None = None,
                            row_amax: torch.Tensor | None = None):
    """``(data | None, transpose [K, P] | None, scale_inv [E, scale_pitch])`` of the token rows
    ``x [T, K]``, or ``x[x_rows]`` (the tokens layout above; ``grp`` is implied by ``src`` and
    ``gid`` here)."""
    check_input_dtype(x, "fp8_group_quantize_rows")
    check_fp8(fp8_dtype, "fp8_dtype")
    check_x_rows(x, x_rows, gid.shape[0], "fp8_group_quantize_rows")
    if x_rows is not None:
        x = x[x_rows.to(torch.int64)]
    if amax is None and row_amax is not None:
        amax = group_amaxes(given_row_amax(row_amax, gid.shape[0], x.device,
                                           "fp8_group_quantize_rows"), gid, groups)
    gid = gid.to(torch.int64)
    scale, sinv = _scales(x, gid, groups, fp8_dtype, force_pow_2_scales, amax_epsilon,
                          scale_pitch, amax, "fp8_group_quantize_rows")
    q8 = fp8_encode(to_fp32(x) * scale[gid][:, None], fp8_dtype)
    src = src.to(torch.int64)
    padded = torch.where((src >= 0)[:, None], q8[src.clamp(min=0)], 0) if q8.shape[0] else (
        q8.new_zeros((src.shape[0], x.shape[1])))
    data = (padded if row_padded else q8) if rowwise else None
    return data, padded.t().contiguous() if columnwise else None, sinv


def fp8_group_quantize_experts(w: torch.Tensor, *, groups: int, fp8_dtype: DType,
                               force_pow_2_scales: bool, amax_epsilon: float, rowwise: bool,
                               columnwise: bool, scale_pitch: int = 1,
                               amax: torch.Tensor | None = None):
    """``(data [E * N, K] | None, transpose [E, K, N] | None, scale_inv [E, scale_pitch])`` of
    the experts' rows ``w [E * N, K]`` (the experts layout above)."""
    check_input_dtype(w, "fp8_group_quantize_experts")
    check_fp8(fp8_dtype, "fp8_dtype")
    rows, k = w.shape
    n = rows // groups if groups else 0
    gid = torch.arange(groups, device=w.device).repeat_interleave(n)
    scale, sinv = _scales(w, gid, groups, fp8_dtype, force_pow_2_scales, amax_epsilon,
                          scale_pitch, amax, "fp8_group_quantize_experts")
    q8 = fp8_encode(to_fp32(w) * scale[gid][:, None], fp8_dtype)
    trans = q8.view(groups, n, k).transpose(1, 2).contiguous() if columnwise else None
    return q8 if rowwise else None, trans, sinv
