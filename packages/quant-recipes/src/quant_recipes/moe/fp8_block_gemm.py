"""FP8 block scaling's grouped GEMMs of :class:`~quant_recipes.GroupedLinear` on FP8 tensor
cores (the ``"fp8_block_grouped_gemm"`` path): each operand quantized in one call over the
padded layout of all groups (:mod:`.fp8`; groups padded to 128 rows, so no block crosses a
group and the bytes are the per-group calls'), then one launch per GEMM of the backend's
``fp8_block_grouped_rows_gemm`` / ``fp8_block_grouped_tokens_gemm``, which apply the block
scales inside the main loop (quant-kernels' Triton kernels on GPUs). Nothing is read on the
host.

It takes the recipes' default layout: 1x128 input and gradient blocks, 128x128 weight blocks,
power-of-2 scales (so every scaling is exact and the result differs from the per-group path
only in the order of the fp32 sums), widths multiples of 128, and the columnwise copies in
backward (no ``backward_override``).
"""

from __future__ import annotations

import torch
from quant_core import Float8BlockQuantizer, backends
from quant_core.shapes import (
    FP8_BLOCK,
    ceil_div,
    fp8_block_columnwise_scale_shape,
    fp8_block_rowwise_scale_shape,
)

from . import bias, fp8
from .backward_parts import Route
from .paths import count_path

#: Device types where the path runs (tests add "cpu", with the reference or the interpreter).
DEVICES = {"cuda"}


def _is_block(q, dim: int) -> bool:
    """``q`` is FP8 block scaling of ``dim`` dimensions with power-of-2 scales (asked through
    members traced code can read)."""
    return (q.storage_format == Float8BlockQuantizer.storage_format
            and getattr(q, "block_scaling_dim", None) == dim and q.decodes_exactly_to_bf16())


def takes(qx, qw, qg, device: torch.device, dtypes, widths, align: int, col: bool = True
          ) -> bool:
    """The path takes a layer of these quantizers (``qg`` None for the forward GEMM): see the
    module docstring; bf16 operands, a device of :data:`DEVICES`, groups padded to whole blocks
    (``align``: a ``CustomRecipe`` may pad to fewer rows)."""
    return (device.type in DEVICES and col and all(d == torch.bfloat16 for d in dtypes)
            and all(w % FP8_BLOCK == 0 for w in (*widths, align))
            and _is_block(qx, 1) and _is_block(qw, 2) and (qg is None or _is_block(qg, 1)))


def _rows(q, t: torch.Tensor, rowwise: bool, columnwise: bool):
    """The storage of ``t [m, k]`` quantized by ``q`` with these usages."""
    return q.with_usage(rowwise, columnwise).quantize(t)


def _indexed_rows(q, t: torch.Tensor, rows: torch.Tensor | None, rowwise: bool,
                  columnwise: bool):
    """``(row_data, row_scale_inv, col_data, col_scale_inv)`` of ``t[rows]`` (``t`` without
    ``rows``; a zero row where ``rows`` is negative) quantized by the 1x128 quantizer ``q``: one
    pass reading the rows where they are (the backend's row index), with no gathered copy of
    ``t``."""
    return backends.get(None, t.device).fp8_block_quantize(
        t.contiguous(), fp8_dtype=q.dtype, block_scaling_dim=1,
        force_pow_2_scales=q.force_pow_2_scales, amax_epsilon=q.amax_epsilon, rowwise=rowwise,
        columnwise=columnwise, rows=rows)


def _padded_rows(q, t: torch.Tensor, lay: fp8.Layout, rowwise: bool, columnwise: bool,
                 t_rows: torch.Tensor | None = None):
    """:func:`_indexed_rows` of ``t [T, K]`` (``t[t_rows]``) in the padded layout ``lay``."""
    return _indexed_rows(q, t, fp8.source_rows(lay, t_rows), rowwise, columnwise)


def _scales(scale_inv: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, blocks]`` view of 1x128 scale-inverses, which are stored transposed (``[blocks,
    >= n]``): one row per row of the rowwise data, or per column of the columnwise data."""
    return scale_inv[:, :n].t()


def _experts(w: torch.Tensor, qw):
    """``(data [E, N, K], scale_inv [E, N/128, K/128])``: every expert's weight quantized as one
    ``[E·N, K]`` tensor (its 128x128 blocks don't cross experts)."""
    e, n, k = w.shape
    s = _rows(qw, w.reshape(e * n, k), True, False)
    kb = ceil_div(k, FP8_BLOCK)
    return (s._rowwise_data.view(e, n, k),
            s._rowwise_scale_inv[:, :kb].reshape(e, n // FP8_BLOCK, kb))


def _experts_t(w: torch.Tensor, qw):
    """``(data [E, K, N], scale_inv [E, K/128, N/128])``: every expert's transposed weight, the
    columnwise copy of one ``[E·N, K]`` quantize (128x128 blocks: the transposed bytes and
    scales of :func:`_experts`) written with each expert's rows transposed on their own (the
    backend's column groups), so that no ``[K, E·N]`` copy is made and moved."""
    e, n, k = w.shape
    _, _, data, scale_inv = backends.get(None, w.device).fp8_block_quantize(
        w.reshape(e * n, k), fp8_dtype=qw.dtype, block_scaling_dim=2,
        force_pow_2_scales=qw.force_pow_2_scales, amax_epsilon=qw.amax_epsilon, rowwise=False,
        columnwise=True, groups=e)
    kb, nb = ceil_div(k, FP8_BLOCK), n // FP8_BLOCK
    return data, scale_inv[:kb, :e * nb].view(kb, e, nb).transpose(0, 1)


def forward(x: torch.Tensor, lay: fp8.Layout, w: torch.Tensor, qx, qw,
            b: torch.Tensor | None = None, x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``y [T, N]``: group ``g`` of ``x [T, K]`` (``x[x_rows]``; the padded layout ``lay``)
    times ``w[g]ᵀ`` (plus ``b[g]``, :mod:`.bias`)."""
    # 1x128 blocks: the rows quantized where they are, the kernel reads each group in place
    xd, xsi, _, _ = _indexed_rows(qx, x, x_rows, True, False)
    total = lay.total
    wd, sw = _experts(w, qw)
    count_path("fp8_block_grouped_gemm")
    y = backends.get(None, x.device).fp8_block_grouped_rows_gemm(
        xd, _scales(xsi, total), wd, sw, lay.offs, lay.offs, total=total, a_dtype=qx.dtype,
        b_dtype=qw.dtype, out_dtype=x.dtype if b is None else torch.float32)
    return y if b is None else bias.added(y, b, lay.gid, x.dtype)


def gradient(gy: torch.Tensor, lay: fp8.Layout, qg, dgrad: bool, wgrad: bool):
    """``((rowwise bytes, scale-inverses), (columnwise bytes, scale-inverses))`` of the output
    gradient ``gy [T, N]`` in the padded layout ``lay``, quantized once (an empty tuple for a
    GEMM not asked for)."""
    g_row, g_row_s, g_col, g_col_s = _padded_rows(qg, gy, lay, dgrad, wgrad)
    return (g_row, g_row_s) if dgrad else (), (g_col, g_col_s) if wgrad else ()


def gradient_like(gy: torch.Tensor, lay: fp8.Layout, qg, dgrad: bool, wgrad: bool):
    """:func:`gradient`'s tensors, empty (the 1x128 layouts of ``[rows, N]``)."""
    rows, n = lay.rows, gy.shape[1]
    row = (gy.new_empty((rows, n), dtype=torch.uint8),
           gy.new_empty(fp8_block_rowwise_scale_shape(rows, n, 1), dtype=torch.float32))
    col = (gy.new_empty((n, rows), dtype=torch.uint8),
           gy.new_empty(fp8_block_columnwise_scale_shape(rows, n, 1), dtype=torch.float32))
    return row if dgrad else (), col if wgrad else ()


def input_gradient(g, lay: fp8.Layout, w: torch.Tensor, qg, qw) -> torch.Tensor:
    """``dx [T, K]``: the gradient's rowwise bytes ``g`` (:func:`gradient`) times each
    expert's weight, whose transposed bytes are made here."""
    g_row, g_row_s = g
    wt, swt = _experts_t(w, qw)
    count_path("fp8_block_grouped_gemm")
    return backends.get(None, w.device).fp8_block_grouped_rows_gemm(
        g_row, _scales(g_row_s, lay.rows), wt, swt, lay.offs, lay.ends, total=lay.total,
        a_dtype=qg.dtype, b_dtype=qw.dtype)


def weight_gradient(g, x: torch.Tensor, lay: fp8.Layout, qg, qx,
                    x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``dw [E, N, K]``: the gradient's columnwise bytes ``g`` (:func:`gradient`) times the
    input ``x [T, K]`` (``x[x_rows]``), quantized here in its columnwise layout."""
    g_col, g_col_s = g
    n, k = g_col.shape[0], x.shape[1]
    _, _, x_col, x_col_s = _padded_rows(qx, x, lay, False, True, x_rows)
    count_path("fp8_block_grouped_gemm")
    return backends.get(None, x.device).fp8_block_grouped_tokens_gemm(
        g_col, _scales(g_col_s, n), x_col, _scales(x_col_s, k), lay.ends, a_dtype=qg.dtype,
        b_dtype=qx.dtype)


#: The backward's parts (:mod:`.backward_parts`).
ROUTE = Route("fp8_block", gradient, gradient_like, input_gradient, weight_gradient, 2)
