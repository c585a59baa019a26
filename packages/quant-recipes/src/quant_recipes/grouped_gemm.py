"""Grouped GEMMs of :class:`~quant_recipes.GroupedLinear`: one GEMM per expert group of rows.

Groups are given as ``offs``, ``torch._grouped_mm``'s convention: int32/int64 cumulative end
offsets, group ``g`` being rows ``offs[g-1]:offs[g]`` of ``x [T, K]`` (``offs[-1] == T``).
Each group is padded with zero rows to a multiple of ``align`` (:func:`token_alignment`) and then
quantized and multiplied exactly as the dense :class:`~quant_recipes.Linear` quantizes and
multiplies those padded rows: its own quantize calls (so a tensor-wide amax is the group's
amax), the same quantizer variants, the same :func:`~quant_recipes.gemm.qgemm_impl`. The padding
rows are zero in every operand: they add nothing to a product over tokens and their output rows
are dropped.

The paths (:func:`~quant_recipes.grouped_gemm_paths` counts one per grouped GEMM):

- ``"per_group"``: one :func:`~quant_recipes.gemm.qgemm_impl` per group, on every device (its
  own path per group is counted by :func:`~quant_recipes.gemm_paths`); the definition;
- ``"grouped_mm"``: on devices in :data:`GROUPED_MM_DEVICES` where ``torch._grouped_mm`` runs,
  for bf16 outputs without bias, when every operand of every group dequantizes exactly to bf16
  (high precision, MXFP8, FP8 with power-of-2 scales; never NVFP4, whose per-tensor factors apply
  to the product): the operands' fp32 values as bf16, one ``torch._grouped_mm``. It differs from
  ``"per_group"`` only in the order of the fp32 accumulation;
- ``"scaled_grouped_mm"``, ``"scaled_mm_per_group"``: FP8 current scaling on FP8 tensor cores,
  every group quantized at once (:mod:`.grouped_fp8_gemm`, which the layer calls directly when
  all three GEMMs are FP8 current scaling; here only the forward GEMM of a backward override).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from quant_core.shapes import roundup

from . import grouped_fp8_gemm
from .gemm import HP, dequantize, qgemm_impl, quantizer_meta
from .grouped_paths import count_path

#: Device types whose grouped GEMMs may run through ``torch._grouped_mm`` (tests add "cpu").
GROUPED_MM_DEVICES = {"cuda"}


def token_alignment(recipe, quantizers) -> int:
    """The row multiple each group is padded to under ``recipe``: a ``CustomRecipe``'s
    ``quantization_alignment``, else the largest ``row_alignment()`` of the layer's quantizers
    (32 for MXFP8's 32-row columnwise blocks, 128 for FP8 blocks, 16 otherwise: cuBLAS's row
    multiple, NVFP4's 16-row Hadamard transform)."""
    if recipe.custom():
        return recipe.quantization_alignment
    return max(q.row_alignment() for q in quantizers)


def check_offsets(bounds: list[int], total: int, what: str = "offs") -> None:
    """``ValueError`` unless ``bounds`` rise from 0 to ``total`` (the rows of ``x``)."""
    last = 0
    for g, end in enumerate(bounds):
        if end < last:
            raise ValueError(f"GroupedLinear: {what} must be non-decreasing cumulative end "
                             f"offsets (a group has a negative count at group {g}): {bounds}")
        last = end
    if last != total:
        raise ValueError(f"GroupedLinear: {what} must end at the number of rows of x "
                         f"({total}), got {bounds[-1] if bounds else 0}")


def _groups(offs: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """``(start, rows)`` of each group (one host sync)."""
    bounds = [int(v) for v in offs.tolist()]
    check_offsets(bounds, total)
    return [(s, e - s) for s, e in zip([0, *bounds[:-1]], bounds, strict=True)]


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t [m, ...]`` with zero rows appended up to ``rows``."""
    return t if t.shape[0] == rows else F.pad(t, (0, 0, 0, rows - t.shape[0]))


def quantized(x: torch.Tensor, q) -> list[torch.Tensor]:
    """``q``'s buffers of ``x`` (``[x]`` for a high-precision quantizer)."""
    return [x] if quantizer_meta(q)[0] == HP else q.quantize(x).buffer_list(x)


# ----------------------------------------------------------------------- the grouped_mm path
@functools.cache
def _grouped_mm_runs(device_type: str) -> bool:
    """``torch._grouped_mm`` exists and runs a small bf16 problem on this device type."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros((32, 16), dtype=torch.bfloat16, device=device_type)
        b = torch.zeros((2, 16, 16), dtype=torch.bfloat16, device=device_type)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device_type)
        torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def grouped_mm_available(device: torch.device) -> bool:
    """Whether the ``"grouped_mm"`` path may run on ``device``."""
    device = torch.device(device)
    return device.type in GROUPED_MM_DEVICES and _grouped_mm_runs(device.type)


def _bf16_exact(values: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``values`` (fp32) as bf16 when every element is exactly a bf16, else None."""
    out = [v.to(torch.bfloat16) for v in values]
    if all(torch.equal(o.to(torch.float32), v) for o, v in zip(out, values, strict=True)):
        return out
    return None


def _grouped_mm(a_vals, b_vals, kind: str, rows: list[int]):
    """One ``torch._grouped_mm`` over bf16 operand values, or ``None`` (a value that is not
    exactly a bf16, rows or widths not multiples of 16, a layout this torch refuses). ``kind``:
    ``"fprop"`` (``a_vals`` the groups' ``[rows, K]`` blocks, ``b_vals`` each expert's
    ``[N, K]``), ``"dgrad"`` (``[rows, N]`` blocks times ``[N, K]``), ``"wgrad"`` (both operands
    row blocks, contracted over the rows)."""
    if any(r % 16 for r in rows) or any(d % 16 for d in (*a_vals[0].shape, *b_vals[0].shape)):
        return None
    a = _bf16_exact(a_vals)
    b = _bf16_exact(b_vals) if a is not None else None
    if b is None:
        return None
    offs = torch.tensor(rows, device=a[0].device).cumsum(0).to(torch.int32)
    cat = torch.cat(a)
    try:
        if kind == "fprop":
            return torch._grouped_mm(cat, torch.stack(b).transpose(1, 2), offs=offs)
        if kind == "dgrad":
            return torch._grouped_mm(cat, torch.stack(b), offs=offs)
        return torch._grouped_mm(cat.t(), torch.cat(b), offs=offs)
    except RuntimeError:  # a layout or alignment rule of this torch's kernel
        return None


def _grouped_takes(quantizers, device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether the ``"grouped_mm"`` path may take operands of ``quantizers`` (bf16 output; no
    NVFP4, whose per-tensor factors scale the product, not the elements)."""
    return (out_dtype == torch.bfloat16 and grouped_mm_available(device)
            and all(q.storage_format != "nvfp4" for q in quantizers))


def _values(bufs: list, meta: list[int], rows, width: int, col: bool) -> list[torch.Tensor]:
    """The fp32 GEMM values of each group's operand (``rows``: one count per group, or one
    count for all)."""
    rows = rows if isinstance(rows, list) else [rows] * len(bufs)
    return [dequantize(b, meta, r, width, col) for b, r in zip(bufs, rows, strict=True)]


def _work(offs: torch.Tensor, total: int, align: int) -> list[tuple[int, int, int, int]]:
    """``(group, start, rows, padded rows)`` of each non-empty group."""
    return [(g, s, m, roundup(m, align)) for g, (s, m) in enumerate(_groups(offs, total)) if m]


def grouped_fprop(x: torch.Tensor, offs: torch.Tensor, w: torch.Tensor, b, qx, qw, align: int
                  ) -> torch.Tensor:
    """``y [T, N]``: group ``g``'s rows of ``x [T, K]`` times ``w[g]ᵀ`` (``w [E, N, K]``) plus
    ``b[g]``, each group quantized (``qx``, ``qw``) and multiplied as the dense Linear does."""
    (total, k), n = x.shape, w.shape[1]
    if b is None and grouped_fp8_gemm.takes((qx, qw), x.device, x.dtype, align, k, n):
        return grouped_fp8_gemm.forward(x, offs, w, qx, qw, align, False, False)[0]
    y = x.new_zeros((total, n))
    work = _work(offs, total, align)
    if not work:
        return y
    xm, wm = quantizer_meta(qx), quantizer_meta(qw)
    xbs = [quantized(_padded(x[s:s + m], mp), qx) for _, s, m, mp in work]
    wbs = [quantized(w[g], qw) for g, *_ in work]
    if b is None and _grouped_takes((qx, qw), x.device, x.dtype):
        rows = [mp for *_, mp in work]
        out = _grouped_mm(_values(xbs, xm, rows, k, False), _values(wbs, wm, n, k, False),
                          "fprop", rows)
        if out is not None:
            _scatter(y, out, work)
            count_path("grouped_mm")
            return y
    for xb, wb, (g, s, m, mp) in zip(xbs, wbs, work, strict=True):
        yg = qgemm_impl(xb, xm, (mp, k), False, False, wb, wm, (n, k), False, True,
                        None if b is None else b[g], x.dtype)
        y[s:s + m] = yg[:m]
    count_path("per_group")
    return y


def _scatter(out: torch.Tensor, padded: torch.Tensor, work) -> None:
    """The real rows of each group of ``padded`` (groups laid end to end) into ``out``."""
    at = 0
    for _, s, m, mp in work:
        out[s:s + m] = padded[at:at + m]
        at += mp


def grouped_bprop(gy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, w: torch.Tensor,
                  qg, qx, qw, col: bool, align: int, dgrad: bool, wgrad: bool, bias: bool):
    """``(dx, dw, db)`` of :func:`grouped_fprop` for the output gradient ``gy``: per group the
    dense Linear's backward GEMMs on ``gy`` quantized by ``qg`` and on ``x`` / ``w`` quantized
    again by ``qx`` / ``qw`` (their columnwise copies when ``col``, else their rowwise forms or
    the originals: the backward overrides). Outputs not asked for are empty."""
    (total, k), (experts, n) = x.shape, w.shape[:2]
    dx = x.new_zeros((total, k) if dgrad else (0,))
    dw = w.new_zeros((experts, n, k) if wgrad else (0,))
    db = w.new_zeros((experts, n) if bias else (0,))
    work = _work(offs, total, align)
    if not work:
        return dx, dw, db
    gm, xm, wm = quantizer_meta(qg), quantizer_meta(qx), quantizer_meta(qw)
    gbs = [quantized(_padded(gy[s:s + m], mp), qg) for _, s, m, mp in work]
    rows = [mp for *_, mp in work]
    if bias:
        for g, s, m, mp in work:
            db[g] = _padded(gy[s:s + m], mp).to(torch.float32).sum(0).to(w.dtype)
    if dgrad:
        wbs = [quantized(w[g], qw) for g, *_ in work]
        out = None
        if _grouped_takes((qg, qw), x.device, x.dtype):
            out = _grouped_mm(_values(gbs, gm, rows, n, False), _values(wbs, wm, n, k, col),
                              "dgrad", rows)
        if out is not None:
            _scatter(dx, out, work)
            count_path("grouped_mm")
        else:
            for gb, wb, (_, s, m, mp) in zip(gbs, wbs, work, strict=True):
                dx[s:s + m] = qgemm_impl(gb, gm, (mp, n), False, False, wb, wm, (n, k), col,
                                         False, None, x.dtype)[:m]
            count_path("per_group")
    if wgrad:
        xbs = [quantized(_padded(x[s:s + m], mp), qx) for _, s, m, mp in work]
        out = None
        if _grouped_takes((qg, qx), x.device, w.dtype):
            out = _grouped_mm(_values(gbs, gm, rows, n, col), _values(xbs, xm, rows, k, col),
                              "wgrad", rows)
        if out is not None:
            for i, (g, *_) in enumerate(work):
                dw[g] = out[i]
            count_path("grouped_mm")
        else:
            for gb, xb, (g, _, _, mp) in zip(gbs, xbs, work, strict=True):
                dw[g] = qgemm_impl(gb, gm, (mp, n), col, True, xb, xm, (mp, k), col, False,
                                   None, w.dtype)
            count_path("per_group")
    return dx, dw, db
