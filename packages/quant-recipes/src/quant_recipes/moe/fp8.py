"""Batched per-group FP8 current scaling for :class:`~quant_recipes.GroupedLinear`: every group
quantized in one pass over all rows.

Quantization: the backend's ``fp8_group_quantize_rows`` / ``fp8_group_quantize_experts``
(``quant_core.reference.fp8_grouped`` defines them; quant-kernels' Triton kernels on GPUs): every
group's amax (NaN dropped) in one pass, its scale by current scaling's rule (`numerics.md` §3),
then one cast of all rows into the rowwise and/or the transposed layout, each row with its
group's scale: the bytes and ``scale_inv`` of one per-tensor quantize call per group, which is
what the per-group path makes.

Layout (:class:`Layout`): the groups' rows end to end, each group padded with zero rows to a
multiple of ``align`` (an empty group to ``align`` rows: a GEMM contracting over the groups needs
every group non-empty), in a buffer of the static ``roundup(T, align) + E * align`` rows. The
padded group ``g`` is the per-group path's padded operand of group ``g``. Transposed copies
always take the padded layout; a rowwise copy takes it or keeps the rows where they are.

Amaxes: a layer under ``torch.compile`` computes each row's amax (``row_amaxes`` of
``quant_core.reference.fp8_grouped``, torch ops) next to the operation that makes the rows,
where Inductor fuses it into that kernel, and the grouped quantize reduces them to the groups'
instead of reading the rows once more; the maximum is exact, so the bytes do not change.

Scale-inverses are ``[E, SCALE_PITCH]`` fp32, column 0 the groups' ``scale_inv``: each group's
scale starts on a 16-byte boundary, as cuBLAS requires of a scale pointer. Column 1 holds the
groups' amaxes, so that a backward that quantizes the same tensor again (a layer that keeps no
quantized copy) skips the amax pass and makes the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from quant_core import Float8CurrentScalingQuantizer, backends
from quant_core.reference.pad import gathered_rows
from quant_core.shapes import roundup

#: fp32 elements between two groups' scale-inverses (a 16-byte pitch, for cuBLAS).
SCALE_PITCH = 4


def takes(q) -> bool:
    """``q`` is FP8 current scaling without an amax reduction (a group's amax is its own).
    Asked through members traced code can read (torch 2.11 traces a wrapper of the quantizer,
    which is no instance of its class)."""
    return (q.storage_format == Float8CurrentScalingQuantizer.storage_format
            and hasattr(q, "amax_epsilon") and not q.with_amax_reduction)


@dataclass(frozen=True)
class Layout:
    """The padded row layout of ``T`` rows in ``E`` groups (device tensors, no host sync).

    A layer computes it once per step and alignment, outside the grouped ops (in a compiled
    graph Inductor fuses its index arithmetic), and hands it to every grouped GEMM of the step:
    both projections of an experts block, forward and backward. The ops take it as the list
    :meth:`tensors`."""

    gid: torch.Tensor  # int64 [T]: the group of each row
    dest: torch.Tensor  # int64 [T]: the padded row of each row
    src: torch.Tensor  # int32 [rows]: the row of each padded row, -1 for a padding row
    grp: torch.Tensor  # int32 [rows]: the group of each padded row (the last past the end)
    ends: torch.Tensor  # int32 [E]: cumulative padded ends (``offs`` of the padded groups)
    offs: torch.Tensor  # int32 [E]: cumulative ends of the groups' rows
    pad: torch.Tensor  # int64 [rows - T]: the padding rows, ascending

    #: How many tensors :meth:`tensors` lists.
    FIELDS = 7

    @property
    def rows(self):
        """The padded buffer's rows, ``roundup(T, align) + E * align``."""
        return self.src.shape[0]

    @property
    def total(self):
        """The layer's rows ``T`` (unpadded; an int or a SymInt)."""
        return self.gid.shape[0]

    @property
    def groups(self) -> int:
        return self.offs.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        """The fields in order: what a grouped op takes as its ``Tensor[] lay``."""
        return [self.gid, self.dest, self.src, self.grp, self.ends, self.offs, self.pad]


def padded_rows(total, groups: int, align: int):
    """Rows of the padded layout of ``total`` rows in ``groups`` groups: ``roundup(total,
    align) + groups * align``, at least the sum of the padded groups (an int or a SymInt)."""
    return roundup(total, align) + groups * align


def layout(offs: torch.Tensor, total: int, align: int) -> Layout:
    """The :class:`Layout` of ``offs`` (cumulative end offsets of ``total`` rows)."""
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = ends - starts
    padded = torch.where(counts > 0, roundup(counts, align), align)
    pends = padded.cumsum(0)
    pstarts = pends - padded
    r = torch.arange(total, device=offs.device)
    gid = torch.searchsorted(ends, r, right=True)
    dest = r - starts[gid] + pstarts[gid]
    rows = padded_rows(total, offs.shape[0], align)
    p = torch.arange(rows, device=offs.device)
    grp = torch.searchsorted(pends, p, right=True).clamp_(max=offs.shape[0] - 1)
    within = p - pstarts[grp]
    src = torch.where(within < counts[grp], starts[grp] + within, -1)
    return Layout(gid, dest, src.to(torch.int32), grp.to(torch.int32), pends.to(torch.int32),
                  offs.to(torch.int32), _padding_rows(counts, padded, pstarts, rows - total))


def _padding_rows(counts: torch.Tensor, sizes: torch.Tensor, pstarts: torch.Tensor, n):
    """int64 ``[n]``: the padding rows of the padded layout in ascending order (each group's
    rows past its ``counts`` of ``sizes``, then the rows past the last group), with no host
    read: ``n``, the buffer's rows less the real ones, is static."""
    room = sizes - counts
    cum = room.cumsum(0)
    j = torch.arange(n, device=counts.device)
    g = torch.searchsorted(cum, j, right=True).clamp_(max=counts.shape[0] - 1)
    inside = pstarts[g] + counts[g] + j - (cum[g] - room[g])
    past = pstarts[-1] + sizes[-1] + j - cum[-1]
    return torch.where(j < cum[-1], inside, past)


def source_rows(lay: Layout, x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The row of ``x`` each padded row reads, -1 for a padding row: ``lay.src``, or, where the
    layer's rows are ``x[x_rows]`` (a routing's tokens read where they lie), ``x_rows`` of
    it."""
    if x_rows is None:
        return lay.src
    # -1 (a padding row) reads the appended -1: no clamp, and no index past an empty x_rows
    ext = torch.cat([x_rows.to(lay.src.dtype), lay.src.new_full((1,), -1)])
    return ext[lay.src.long()]


def padded(x: torch.Tensor, lay: Layout, x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, K]`` (``x[x_rows]`` with ``x_rows``) in the padded layout ``[rows, K]`` (zero
    padding rows): one gather of the rows and one fill of the padding rows, not a zero fill of
    the whole buffer and a scatter."""
    return gathered_rows(x, source_rows(lay, x_rows), lay.pad)


def rows_moved(t: torch.Tensor) -> torch.Tensor:
    """``t [A, B, C]`` as a contiguous ``[B, A, C]``: whole rows of ``C`` elements moved, 8 bytes
    at a time where the rows allow it (one-byte elements copied one by one reach a fraction of
    the memory bandwidth)."""
    size = t.element_size()
    if t.is_contiguous() and t.shape[2] * size % 8 == 0 and t.storage_offset() * size % 8 == 0:
        return t.view(torch.int64).transpose(0, 1).contiguous().view(t.dtype)
    return t.transpose(0, 1).contiguous()


def padded_starts(bounds: list[int], align: int) -> list[int]:
    """The host-side starts of the padded groups of :func:`layout` (``bounds``: ``offs``)."""
    starts, at, last = [], 0, 0
    for end in bounds:
        starts.append(at)
        m = end - last
        at += roundup(m, align) if m else align
        last = end
    return starts


def _cast_args(q) -> dict:
    """The backend's grouped-cast keywords of current-scaling quantizer ``q``."""
    return {"fp8_dtype": q.dtype, "force_pow_2_scales": q.force_pow_2_scales,
            "amax_epsilon": q.amax_epsilon, "scale_pitch": SCALE_PITCH}


def quantize_rows(x: torch.Tensor, lay: Layout, q, rowwise: bool, columnwise: bool,
                  row_padded: bool = False, scale_inv: torch.Tensor | None = None,
                  row_amax: torch.Tensor | None = None, x_rows: torch.Tensor | None = None):
    """``(data | None, transpose [K, rows] | None, scale_inv [E, SCALE_PITCH])``: each group of
    ``x [T, K]`` (or of ``x[x_rows]``, read where the rows lie) quantized by ``q`` with its own
    amax (the backend's ``fp8_group_quantize_rows``). ``data`` is ``[rows, K]`` in the padded
    layout when ``row_padded``, else ``[T, K]`` (the rows where they are); padding is zero.
    ``scale_inv``: an earlier quantize's of the same rows by ``q``, whose column 1 holds the
    amaxes; ``row_amax``: the ``[T]`` rows' ``row_amaxes``, computed where the rows were made.
    Either spares the amax pass; the bytes are the same."""
    return backends.get(None, x.device).fp8_group_quantize_rows(
        x.contiguous(), lay.gid, lay.src, lay.grp, groups=lay.groups, rowwise=rowwise,
        columnwise=columnwise, row_padded=row_padded, amax=_amaxes(scale_inv), x_rows=x_rows,
        row_amax=row_amax, **_cast_args(q))


def _amaxes(scale_inv: torch.Tensor | None) -> torch.Tensor | None:
    """The groups' amaxes an earlier grouped quantize left in column 1 of its ``scale_inv``."""
    return None if scale_inv is None else scale_inv[:, 1]


def quantize_experts(w: torch.Tensor, q, rowwise: bool, columnwise: bool,
                     scale_inv: torch.Tensor | None = None):
    """``(data [E, N, K] | None, transpose [E, K, N] | None, scale_inv [E, SCALE_PITCH])``: each
    expert's weight quantized by ``q`` (one per-tensor quantize call per expert; the backend's
    ``fp8_group_quantize_experts``; ``scale_inv`` as :func:`quantize_rows`'). A weight stored
    transposed (``w`` a transposed view of ``[E, K, N]``, as GPT-OSS stores its experts) is
    quantized where it lies, its two layouts swapped: one scale per expert makes the bytes of
    one layout the transpose of the other's, so no contiguous copy is made."""
    if w.dim() == 3 and not w.is_contiguous() and w.transpose(1, 2).is_contiguous():
        trans, data, sinv = quantize_experts(w.transpose(1, 2), q, columnwise, rowwise,
                                             scale_inv)
        return data, trans, sinv
    e, n, k = w.shape
    data, trans, sinv = backends.get(None, w.device).fp8_group_quantize_experts(
        w.contiguous().reshape(e * n, k), groups=e, rowwise=rowwise, columnwise=columnwise,
        amax=_amaxes(scale_inv), **_cast_args(q))
    return None if data is None else data.view(e, n, k), trans, sinv
