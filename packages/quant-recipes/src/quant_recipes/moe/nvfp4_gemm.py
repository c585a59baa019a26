"""NVFP4's grouped GEMMs of :class:`~quant_recipes.GroupedLinear` (the ``"nvfp4_grouped_gemm"``
path): each operand quantized in one call over the padded layout of all groups, every group
with its own amaxes (the backend's ``nvfp4_group_quantize``; groups padded to 16 rows, so no
block, RHT or 16x16 tile crosses a group), then one launch per GEMM of the backend's
``nvfp4_grouped_rows_gemm`` / ``nvfp4_grouped_tokens_gemm``, which scale each group's product
by NVFP4's factors of its amaxes. Nothing is read on the host.

Against the per-group path (one dense quantize and GEMM per padded group) the bytes are the
same and the products differ only in the order of the fp32 sums, except where stochastic
rounding draws its random bytes: one stream over all groups here, one per group there. The
weight's operand for dgrad is the rowwise quantization of each expert's ``wᵀ``, taken from the
columnwise copy of the weight's quantization (the same blocks, tiles and amax without the RHT,
which weights never take).

It takes the TransformerEngine-default scaling (no 4over6, no row scaling, no amax reduction),
bf16 operands, widths multiples of 16, and the columnwise copies in backward (no
``backward_override``).
"""

from __future__ import annotations

import torch
from quant_core import NVFP4Quantizer, backends
from quant_core.reference.pad import zero_pad
from quant_core.shapes import (
    nvfp4_columnwise_data_shape,
    nvfp4_columnwise_scale_shape,
    nvfp4_rowwise_data_shape,
    nvfp4_rowwise_scale_shape,
)

from . import bias, fp8
from .backward_parts import Route
from .fp8 import rows_moved
from .paths import count_path

#: Device types where the path runs (tests add "cpu", with the reference or the interpreter).
DEVICES = {"cuda"}

_BLOCK = 16


def _is_plain_nvfp4(q) -> bool:
    """``q`` is NVFP4 with TransformerEngine's block scaling and a tensor-wide amax of its own
    (asked through members traced code can read)."""
    return (q.storage_format == NVFP4Quantizer.storage_format
            and not getattr(q, "nvfp4_use_4over6", True)
            and not getattr(q, "row_scaled_nvfp4", True) and not q.with_amax_reduction)


def takes(qx, qw, qg, device: torch.device, dtypes, widths, align: int, col: bool = True
          ) -> bool:
    """The path takes a layer of these quantizers (``qg`` None for the forward GEMM): see the
    module docstring; a device of :data:`DEVICES`, groups padded to whole 16-row blocks."""
    return (device.type in DEVICES and col and all(d == torch.bfloat16 for d in dtypes)
            and all(w % _BLOCK == 0 for w in (*widths, align))
            and all(_is_plain_nvfp4(q) for q in (qx, qw) + (() if qg is None else (qg,)))
            and not qw.with_rht)


def _quantize(t: torch.Tensor, grp: torch.Tensor, groups: int, q, rowwise: bool,
              columnwise: bool):
    """``(row_data, row_scale, col_data, col_scale, amax_row, amax_col)`` of ``t`` quantized by
    ``q``, each group of rows with its own amaxes; a stochastic-rounding seed from torch's
    generator, as the quantizer draws it."""
    seed = None
    if q.stochastic_rounding:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=t.device)
    return backends.get(None, t.device).nvfp4_group_quantize(
        t.contiguous(), grp, groups=groups, rowwise=rowwise, columnwise=columnwise,
        with_rht=q.with_rht and columnwise, rht_sign_mask=q.rht_matrix_random_sign_mask_t,
        with_2d_quantization=q.with_2d_quantization,
        stochastic_rounding=q.stochastic_rounding, rng_seed=seed, swizzle=False)


def _quantize_experts(w: torch.Tensor, qw, rowwise: bool, columnwise: bool):
    """:func:`_quantize` of every expert's ``w [E, N, K]`` as one ``[E·N, K]`` tensor, each
    expert a group with its own amaxes."""
    e, n, k = w.shape
    grp = torch.arange(e, device=w.device, dtype=torch.int32).repeat_interleave(n)
    return _quantize(w.reshape(e * n, k), grp, e, qw, rowwise, columnwise)


def _experts(w: torch.Tensor, qw):
    """``(data [E, N, K/2], scale, amax [E])``: every expert's ``w [E, N, K]`` quantized rowwise
    as one ``[E·N, K]`` tensor, each expert with its own amax."""
    e, n, k = w.shape
    data, scale, _, _, amax, _ = _quantize_experts(w, qw, True, False)
    return data.view(e, n, k // 2), scale, amax


def _experts_t(w: torch.Tensor, qw):
    """``(data [E, K, N/2], scale, amax [E])``: every expert's ``wᵀ`` quantized rowwise, as
    :func:`_experts` gives it for ``w.transpose(1, 2)``: the columnwise copy of one ``[E·N, K]``
    quantize (the same 1x16 blocks along N, 16x16 tiles and amaxes), each expert's columns
    moved into its own rows by whole-row copies instead of a transposed copy of the weight."""
    e, n, k = w.shape
    _, _, data, scale, _, amax = _quantize_experts(w, qw, False, True)
    nb = n // _BLOCK
    data = rows_moved(data.view(k, e, n // 2))
    rows = scale[:k, :e * nb].view(k, e, nb).transpose(0, 1).reshape(e * k, nb)
    return data, zero_pad(rows, *nvfp4_rowwise_scale_shape(e * k, n)), amax


def forward(x: torch.Tensor, lay: fp8.Layout, w: torch.Tensor, qx, qw,
            b: torch.Tensor | None = None, x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``y [T, N]``: group ``g`` of ``x [T, K]`` (``x[x_rows]``; the padded layout ``lay``)
    times ``w[g]ᵀ`` (plus ``b[g]``, :mod:`.bias`)."""
    xd, xs, _, _, xa, _ = _quantize(fp8.padded(x, lay, x_rows), lay.grp, lay.groups, qx, True,
                                    False)
    wd, ws, wa = _experts(w, qw)
    count_path("nvfp4_grouped_gemm")
    y = backends.get(None, x.device).nvfp4_grouped_rows_gemm(
        xd, xs, xa, wd, ws, wa, lay.offs, lay.ends, total=lay.total, a_swizzled=False,
        b_swizzled=False, out_dtype=x.dtype if b is None else torch.float32)
    return y if b is None else bias.added(y, b, lay.gid, x.dtype)


def gradient(gy: torch.Tensor, lay: fp8.Layout, qg, dgrad: bool, wgrad: bool):
    """``((rowwise data, scales, amaxes), (columnwise data, scales, amaxes))`` of the output
    gradient ``gy [T, N]`` in the padded layout ``lay``, quantized once, each group with its own
    amaxes (an empty tuple for a GEMM not asked for)."""
    gd, gs, gc, gcs, ga, gca = _quantize(fp8.padded(gy, lay), lay.grp, lay.groups, qg, dgrad,
                                         wgrad)
    return (gd, gs, ga) if dgrad else (), (gc, gcs, gca) if wgrad else ()


def gradient_like(gy: torch.Tensor, lay: fp8.Layout, qg, dgrad: bool, wgrad: bool):
    """:func:`gradient`'s tensors, empty (NVFP4's layouts of ``[rows, N]``)."""
    (rows, n), groups = (lay.rows, gy.shape[1]), lay.groups

    def empty(shape, dtype=torch.uint8):
        return gy.new_empty(shape, dtype=dtype)

    amax = empty((groups,), torch.float32)
    row = (empty(nvfp4_rowwise_data_shape(rows, n)), empty(nvfp4_rowwise_scale_shape(rows, n)),
           amax)
    col = (empty(nvfp4_columnwise_data_shape(rows, n)),
           empty(nvfp4_columnwise_scale_shape(rows, n)), amax.clone())
    return row if dgrad else (), col if wgrad else ()


def input_gradient(g, lay: fp8.Layout, w: torch.Tensor, qg, qw) -> torch.Tensor:
    """``dx [T, K]``: the gradient's rowwise operand ``g`` (:func:`gradient`) times each
    expert's weight, whose transposed FP4 bytes are made here."""
    gd, gs, ga = g
    wd, ws, wa = _experts_t(w, qw)
    count_path("nvfp4_grouped_gemm")
    return backends.get(None, w.device).nvfp4_grouped_rows_gemm(
        gd, gs, ga, wd, ws, wa, lay.offs, lay.ends, total=lay.total, a_swizzled=False,
        b_swizzled=False)


def weight_gradient(g, x: torch.Tensor, lay: fp8.Layout, qg, qx,
                    x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``dw [E, N, K]``: the gradient's columnwise operand ``g`` (:func:`gradient`) times the
    input ``x [T, K]`` (``x[x_rows]``), quantized here columnwise, each group with its own
    amax."""
    gc, gcs, gca = g
    _, _, xc, xcs, _, xca = _quantize(fp8.padded(x, lay, x_rows), lay.grp, lay.groups, qx,
                                      False, True)
    count_path("nvfp4_grouped_gemm")
    return backends.get(None, x.device).nvfp4_grouped_tokens_gemm(
        gc, gcs, gca, xc, xcs, xca, lay.ends, a_swizzled=False, b_swizzled=False)


#: The backward's parts (:mod:`.backward_parts`).
ROUTE = Route("nvfp4", gradient, gradient_like, input_gradient, weight_gradient, 3)
