"""Batched per-group FP8 current scaling for :class:`~quant_recipes.GroupedLinear`, and its
grouped GEMMs through ``torch._scaled_grouped_mm``.

Quantization: every group's amax (NaN dropped) in one pass, its scale by the reference's rule
(`numerics.md` §3), then one cast of all rows, each row with its group's scale: the bytes and
``scale_inv`` of one per-tensor quantize call per group, which is what the per-group path makes.
The Triton kernels (:mod:`.grouped_fp8_kernels`) run where the Triton backend serves the device;
elsewhere the reference's torch ops do the same steps.

Layout (:class:`Layout`): the groups' rows end to end, each group padded with zero rows to a
multiple of ``align`` (an empty group to ``align`` rows: the K-grouped wgrad needs every group
non-empty), in a buffer of the static ``roundup(T, align) + E * align`` rows; ``dest[r]`` is the
padded row of row ``r``. The padded group ``g`` is the per-group path's padded operand of
group ``g``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from quant_core import backends
from quant_core.constants import FLT_MAX
from quant_core.reference._rounding import (
    compute_scale_from_amax,
    div_rn,
    fp8_encode,
    nan_to_zero_abs,
    to_fp32,
)

#: Device types whose per-tensor FP8 grouped GEMMs may run through ``torch._scaled_grouped_mm``
#: (tests add "cpu" with a stand-in for the op).
SCALED_GROUPED_MM_DEVICES = {"cuda"}


def takes(q) -> bool:
    """``q`` is FP8 current scaling without an amax reduction (a group's amax is its own)."""
    return (q.storage_format == "fp8" and hasattr(q, "amax_epsilon")
            and not q.with_amax_reduction)


@dataclass(frozen=True)
class Layout:
    """The padded row layout of ``T`` rows in ``E`` groups (device tensors, no host sync)."""

    gid: torch.Tensor  # int64 [T]: the group of each row
    dest: torch.Tensor  # int64 [T]: the padded row of each row
    ends: torch.Tensor  # int32 [E]: cumulative padded ends (``offs`` of the padded groups)
    rows: int  # the padded buffer's rows, T + E * align
    groups: int

    def row_group(self) -> torch.Tensor:
        """int64 ``[rows]``: the group of each padded row (the last group past the end)."""
        r = torch.arange(self.rows, device=self.ends.device, dtype=torch.int32)
        return torch.searchsorted(self.ends, r, right=True).clamp_(max=self.groups - 1)


def layout(offs: torch.Tensor, total: int, align: int) -> Layout:
    """The :class:`Layout` of ``offs`` (cumulative end offsets of ``total`` rows)."""
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = ends - starts
    padded = torch.where(counts > 0, (counts + align - 1) // align * align, align)
    pends = padded.cumsum(0)
    r = torch.arange(total, device=offs.device)
    gid = torch.searchsorted(ends, r, right=True)
    dest = r - starts[gid] + (pends - padded)[gid]
    rows = -(-total // align) * align + offs.shape[0] * align  # a multiple of 16 (align is)
    return Layout(gid, dest, pends.to(torch.int32), rows, offs.shape[0])


def padded_starts(bounds: list[int], align: int) -> list[int]:
    """The host-side starts of the padded groups of :func:`layout` (``bounds``: ``offs``)."""
    starts, at, last = [], 0, 0
    for end in bounds:
        starts.append(at)
        m = end - last
        at += -(-m // align) * align if m else align
        last = end
    return starts


def _triton(device: torch.device) -> bool:
    return backends.get(None, device).name == "triton"


def _quantize_torch(x, gid, dest, groups, data, trans, q, group_rows):
    """The reference's steps over all groups at once (any device)."""
    row_amax = nan_to_zero_abs(x).amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    amax = torch.zeros(groups, dtype=torch.float32, device=x.device)
    amax = amax.scatter_reduce(0, gid, row_amax.to(torch.float32), "amax")
    scale = compute_scale_from_amax(amax, q.dtype.max, force_pow_2_scales=q.force_pow_2_scales,
                                    amax_epsilon=q.amax_epsilon, value_for_inf=FLT_MAX)
    q8 = fp8_encode(to_fp32(x) * scale[gid][:, None], q.dtype)
    if data is not None:
        data[dest] = q8
    if trans is not None:
        if group_rows:
            trans.copy_(q8.reshape(groups, group_rows, -1).transpose(1, 2).reshape(trans.shape))
        else:
            trans[:, dest] = q8.t()
    return div_rn(torch.ones_like(scale), scale)


def quantize_rows(x: torch.Tensor, lay: Layout, q, rowwise: bool, columnwise: bool):
    """``(data [rows, K] | None, transpose [K, rows] | None, scale_inv [E])``: each group of
    ``x [T, K]`` quantized by ``q`` with its own amax, in the padded layout (padding zero)."""
    k = x.shape[1]
    x = x.contiguous()
    data = x.new_zeros((lay.rows, k), dtype=torch.uint8) if rowwise else None
    trans = x.new_zeros((k, lay.rows), dtype=torch.uint8) if columnwise else None
    return data, trans, _quantize(x, lay.gid, lay.dest, lay.groups, data, trans, q, 0)


def quantize_experts(w: torch.Tensor, q, rowwise: bool, columnwise: bool):
    """``(data [E, N, K] | None, transpose [E, K, N] | None, scale_inv [E])``: each expert's
    weight quantized by ``q`` (one per-tensor quantize call per expert)."""
    e, n, k = w.shape
    w2 = w.contiguous().reshape(e * n, k)
    data = w.new_empty((e, n, k), dtype=torch.uint8) if rowwise else None
    trans = w.new_empty((e, k, n), dtype=torch.uint8) if columnwise else None
    gid = torch.arange(e, device=w.device).repeat_interleave(n)
    sinv = _quantize(w2, gid, None, e, None if data is None else data.view(e * n, k), trans, q, n)
    return data, trans, sinv


def _quantize(x, gid, dest, groups, data, trans, q, group_rows):
    if _triton(x.device):
        from .grouped_fp8_kernels import group_quantize

        return group_quantize(x, None if group_rows else gid, dest, groups, data, trans,
                              q.dtype, q.force_pow_2_scales, q.amax_epsilon, group_rows)
    if dest is None:
        dest = torch.arange(x.shape[0], device=x.device)
    return _quantize_torch(x, gid, dest, groups, data, trans, q, group_rows)


# --------------------------------------------------------------------- the grouped GEMMs
def scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """``torch._scaled_grouped_mm`` with fp32 accumulation and a bf16 output (tests replace
    it by an emulation on the CPU)."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=False)


@functools.cache
def _runs(device_type: str, a_dtype: torch.dtype) -> bool:
    """``torch._scaled_grouped_mm`` runs an ``a_dtype`` x E4M3 problem on this device type and
    gives the right values (a torch that reads E5M2 bytes as E4M3 fails the check)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False
    try:
        a = torch.full((32, 16), 1.5, device=device_type).to(a_dtype)
        b = torch.full((2, 16, 16), 0.5, device=device_type).to(torch.float8_e4m3fn)
        sa = torch.full((32,), 2.0, device=device_type)
        sb = torch.full((2, 16), 4.0, device=device_type)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device_type)
        out = scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs)
        return bool((out == 16 * 0.75 * 8.0).all())
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


def gemm_takes(qa, qb, device: torch.device, out_dtype: torch.dtype, *dims: int) -> bool:
    """Whether ``torch._scaled_grouped_mm`` may multiply operands of ``qa`` and ``qb``: both FP8
    current scaling, ``qb`` E4M3 and ``qa`` a type this torch runs, bf16 output, widths multiples
    of 16, fewer than 1024 groups."""
    if device.type not in SCALED_GROUPED_MM_DEVICES or out_dtype != torch.bfloat16:
        return False
    if not (takes(qa) and takes(qb)) or qb.dtype.torch_dtype != torch.float8_e4m3fn:
        return False
    return all(d % 16 == 0 for d in dims[1:]) and dims[0] < 1024 and _runs(
        device.type, qa.dtype.torch_dtype)


def _fp8(t: torch.Tensor, q) -> torch.Tensor:
    return t.view(q.dtype.torch_dtype)


def _by_experts(a, offs, w, qa, qw, align: int, transposed: bool) -> torch.Tensor:
    """Group ``g`` of ``a [T, *]`` times ``w[g]ᵀ`` (``transposed``: times ``w[g]``), one
    ``torch._scaled_grouped_mm`` whose B is each expert's column-major operand."""
    lay = layout(offs, a.shape[0], align)
    ad, _, sa = quantize_rows(a, lay, qa, True, False)
    wd, wt, sw = quantize_experts(w, qw, not transposed, transposed)
    b = wt if transposed else wd  # [E, cols, contraction]: its transpose is column-major
    out = scaled_grouped_mm(_fp8(ad, qa), _fp8(b, qw).transpose(-2, -1), sa[lay.row_group()],
                            sw[:, None].expand(b.shape[:2]).contiguous(), lay.ends)
    return out[lay.dest]


def fprop(x, offs, w, qx, qw, align: int) -> torch.Tensor:
    """``y [T, N]``: group ``g`` of ``x`` times ``w[g]ᵀ``."""
    return _by_experts(x, offs, w, qx, qw, align, False)


def dgrad(gy, offs, w, qg, qw, align: int) -> torch.Tensor:
    """``dx [T, K]``: group ``g`` of ``gy`` times ``w[g]`` (from the weight's transpose)."""
    return _by_experts(gy, offs, w, qg, qw, align, True)


def wgrad(gy, x, offs, qg, qx, align: int) -> torch.Tensor:
    """``dw [E, N, K]``: per expert ``gy_gᵀ @ x_g``, the groups along the contraction."""
    n, k = gy.shape[1], x.shape[1]
    lay = layout(offs, x.shape[0], align)
    _, gt, sg = quantize_rows(gy, lay, qg, False, True)
    _, xt, sx = quantize_rows(x, lay, qx, False, True)
    return scaled_grouped_mm(_fp8(gt, qg), _fp8(xt, qx).t(), sg.repeat_interleave(n),
                             sx.repeat_interleave(k), lay.ends)
