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
  for bf16 operands, when no quantizer scales by a tensor-wide amax and every
  quantizer decodes exactly to bf16 (``decodes_exactly_to_bf16``: high precision, MXFP8, FP8
  with power-of-2 scales; never NVFP4, whose per-tensor factors scale the product) and the
  expert widths close the weight quantizer's row blocks: all groups at once, in the padded
  layout of :mod:`.fp8` (no group bound is read on the host). Each operand is quantized
  in one call over every padded group (the same bytes as one call per padded group: no block
  crosses a group), decoded to bf16 in one pass, and each GEMM is one ``torch._grouped_mm``
  (the input gradient of experts past 1 GiB decoded: one per slice of columns,
  ``quant_core.decoded_slices``). It
  differs from ``"per_group"`` only in the order of the fp32 accumulation. ``torch._grouped_mm``
  gives bf16 only, so a forward GEMM with a bias takes ``"decoded_grouped_gemm"``: the same
  decoded operands multiplied by the backend's ``grouped_rows_gemm`` into fp32;
- ``"fp8_block_grouped_gemm"``: FP8 blocks (1x128 inputs and gradients, 128x128 weights,
  power-of-2 scales, widths multiples of 128) on FP8 tensor cores, the block scales applied in
  the GEMMs' main loop, on devices in :data:`.fp8_block_gemm.DEVICES` (:mod:`.fp8_block_gemm`);
  checked before ``"grouped_mm"``;
- ``"nvfp4_grouped_gemm"``: NVFP4 (TransformerEngine's block scaling, widths multiples of 16),
  every group quantized with its own amaxes in one call, each GEMM one launch that scales each
  group's product by its factors, on devices in :data:`.nvfp4_gemm.DEVICES`
  (:mod:`.nvfp4_gemm`);
- ``"scaled_grouped_mm"``, ``"scaled_mm_per_group"``: FP8 current scaling on FP8 tensor cores,
  every group quantized at once (:mod:`.fp8_gemm`, which the layer calls directly when
  all three GEMMs are FP8 current scaling; here only the forward GEMM of a backward override).

Expert biases take the same paths (:mod:`.bias`): the forward GEMM's fp32 products plus each
row's group bias, rounded once, and the bias gradient as each group's sum of the output
gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from quant_core import backends
from quant_core.decoded_slices import column_slices
from quant_core.shapes import roundup

from .. import operands
from ..compiling import device_probe
from ..gemm import HP, dequantize, is_high_precision, qgemm_impl, quantizer_meta
from ..operands import Operand
from . import backward_parts, fp8, fp8_block_gemm, fp8_gemm, nvfp4_gemm
from .backward_parts import Route
from .bias import added as bias_added
from .bias import group_sums as bias_sums
from .paths import count_path

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


def check_on_device(valid: torch.Tensor, message) -> None:
    """Every element of ``valid`` is true: on the CPU a ``ValueError`` saying ``message()``; on
    another device an asynchronous device assertion, since reading the tensor back would stall
    the host on every step (the error surfaces at the next synchronization)."""
    if valid.device.type == "cpu":
        if not bool(valid.all()):
            raise ValueError(message())
    else:
        torch._assert_async(valid.all(), "GroupedLinear: invalid group sizes (offs or counts)")


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
    return [x] if is_high_precision(q) else q.quantize(x).buffer_list(x)


# ----------------------------------------------------------------------- the grouped_mm path
@device_probe
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


def _batched_takes(quantizers, device: torch.device, dtypes, widths, experts_q=None) -> bool:
    """The ``"grouped_mm"`` path takes a GEMM of these quantizers: bf16 operands on a device
    where ``torch._grouped_mm`` runs, widths multiples of 16, no tensor-wide amax, values exact
    in bf16, and (``experts_q``, the weight's quantizer) expert widths that close its row
    blocks, so that all experts quantize as one tensor."""
    return (all(d == torch.bfloat16 for d in dtypes) and grouped_mm_available(device)
            and all(w % 16 == 0 for w in widths)
            and all(not q.reduces_amax and q.decodes_exactly_to_bf16() for q in quantizers)
            and (experts_q is None or widths[0] % experts_q.row_alignment() == 0))


def _decoded(t: torch.Tensor, q, columnwise: bool, lay: fp8.Layout | None = None,
             t_rows: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 values of ``t [m, k]`` (``t[t_rows]``; of its padded layout ``lay``, when given)
    quantized by ``q`` (one call), read from its columnwise buffers when ``columnwise``."""
    return _decoded_pair(t, q, not columnwise, columnwise, lay, t_rows)[columnwise]


def _decoded_pair(t: torch.Tensor, q, row: bool, col: bool, lay: fp8.Layout | None = None,
                  t_rows: torch.Tensor | None = None):
    """``(rowwise values | None, columnwise values | None)`` of ``t`` (``t[t_rows]``; of its
    padded layout ``lay``, when given) quantized once by ``q`` in the asked directions: in one
    pass where the quantizer has one (``Quantizer.quantize_decoded``, which reads the rows of
    ``t`` through a row index: no padded or gathered copy), else its buffers dequantized."""
    meta = quantizer_meta(q)
    rows = t_rows if lay is None else fp8.source_rows(lay, t_rows)
    values = None if meta[0] == HP else q.quantize_decoded(
        t, rowwise=row, columnwise=col, dtype=torch.bfloat16, rows=rows)
    if values is not None:
        return values
    t = (t if t_rows is None else t[t_rows]) if lay is None else fp8.padded(t, lay, t_rows)
    if meta[0] == HP:
        return (t if row else None), (t if col else None)
    q = q.with_usage(row, col)
    meta, (m, k) = quantizer_meta(q), t.shape
    bufs = q.quantize(t).buffer_list(t)
    return tuple(dequantize(bufs, meta, m, k, c, torch.bfloat16) if want else None
                 for c, want in ((False, row), (True, col)))


def _experts(w: torch.Tensor, q, columnwise: bool) -> torch.Tensor:
    """bf16 ``[E, N, K]`` values of every expert's weight ``w [E, N, K]``, quantized as one
    ``[E * N, K]`` tensor (one call; the caller checked that N closes ``q``'s row blocks)."""
    e, n, k = w.shape
    return _decoded(w.reshape(e * n, k), q, columnwise).view(e, n, k)


def _forward_rows(x: torch.Tensor, lay: fp8.Layout, q, x_rows: torch.Tensor | None = None):
    """``(bf16 values of x (x[x_rows]) quantized rowwise by q, the ends of its groups' rows)``:
    the rows where they are when ``q`` quantizes rows apart, else the padded layout
    (``lay.ends``)."""
    if lay.total and q.rows_quantize_apart():
        return _decoded(x, q, False, None, x_rows), lay.offs
    return _decoded(x, q, False, lay, x_rows), lay.ends


def batched_fprop(x, lay: fp8.Layout, w, qx, qw, b=None, x_rows=None) -> torch.Tensor:
    """:func:`grouped_fprop` on the ``"grouped_mm"`` path (see the module docstring); with a
    bias ``b``, on ``"decoded_grouped_gemm"``: the same decoded operands multiplied by the
    backend's ``grouped_rows_gemm`` into fp32, each row's bias added before the one rounding
    (:mod:`.bias`)."""
    (xv, a_ends), wv = _forward_rows(x, lay, qx, x_rows), _experts(w, qw, False)
    if b is not None:
        y = backends.get(None, x.device).grouped_rows_gemm(
            xv, wv, lay.offs, a_ends, total=lay.total, out_dtype=torch.float32)
        count_path("decoded_grouped_gemm")
        return bias_added(y, b, lay.gid, x.dtype)
    out = torch._grouped_mm(xv, wv.transpose(1, 2), offs=a_ends)
    count_path("grouped_mm")
    return out if a_ends is lay.offs else out[lay.dest]


def _grouped_mm_dgrad(g_row, lay: fp8.Layout, w, qw, col: bool) -> torch.Tensor:
    """``dx [T, K]``: the gradient's decoded rowwise values ``g_row`` times each expert's
    decoded weight (its columnwise copy when ``col``, else its rowwise form); wide experts a
    slice of columns at a time (``quant_core.decoded_slices``), each slice decoded from a
    contiguous bf16 copy of its columns (slices of 128 columns cut no 1x32 or 32x32 block)."""
    e, n, k = w.shape
    # a slice holds its bf16 copy and its decoded values: 4 bytes per element
    slices = column_slices(k, e * n * 4, e * n * k * 2)
    count_path("grouped_mm")
    if len(slices) == 1:
        return torch._grouped_mm(g_row, _experts(w, qw, col), offs=lay.ends)[lay.dest]
    dx = g_row.new_empty((lay.total, k))
    for k0, k1 in slices:
        wv = _experts(w[:, :, k0:k1].contiguous(), qw, col)
        dx[:, k0:k1] = torch._grouped_mm(g_row, wv, offs=lay.ends)[lay.dest]
        del wv
    return dx


def _grouped_mm_wgrad(g, x, lay: fp8.Layout, qx, col: bool, x_rows=None) -> torch.Tensor:
    """``dw [E, N, K]``: the gradient's decoded values ``g [rows, N]`` times the input's,
    decoded here (columnwise when ``col``)."""
    dw = torch._grouped_mm(g.t(), _decoded(x, qx, col, lay, x_rows), offs=lay.ends)
    count_path("grouped_mm")
    return dw


def _decoded_gradient(gy, lay: fp8.Layout, qg, dgrad: bool, wgrad: bool):
    """``((rowwise values,), (columnwise values,))`` of the output gradient ``gy`` quantized
    once in the padded layout ``lay`` and decoded to bf16 (an empty tuple where not asked)."""
    g_row, g_col = _decoded_pair(gy, qg, dgrad, wgrad, lay)
    return (g_row,) if dgrad else (), (g_col,) if wgrad else ()


def _decoded_gradient_like(gy, lay: fp8.Layout, qg, dgrad: bool, wgrad: bool):
    """:func:`_decoded_gradient`'s tensors, empty (bf16 ``[rows, N]`` each)."""
    def values():
        return (gy.new_empty((lay.rows, gy.shape[1]), dtype=torch.bfloat16),)
    return values() if dgrad else (), values() if wgrad else ()


def _decoded_input_gradient(g, lay: fp8.Layout, w, qg, qw) -> torch.Tensor:
    return _grouped_mm_dgrad(g[0], lay, w, qw, True)


def _decoded_weight_gradient(g, x, lay: fp8.Layout, qg, qx, x_rows=None) -> torch.Tensor:
    return _grouped_mm_wgrad(g[0], x, lay, qx, True, x_rows)


#: The ``"grouped_mm"`` path's backward in parts (:mod:`.backward_parts`), with the columnwise
#: copies.
DECODED_ROUTE = Route("grouped_mm", _decoded_gradient, _decoded_gradient_like,
                      _decoded_input_gradient, _decoded_weight_gradient, 1)


def batched_bprop(gy, x, lay: fp8.Layout, w, qg, qx, qw, dgrad: bool, wgrad: bool,
                  x_rows=None):
    """``(dx | None, dw | None)`` of :func:`grouped_bprop` on the ``"grouped_mm"`` path under
    the backward overrides (no columnwise copies): both GEMMs read the gradient's decoded
    rowwise values, and the weight's and input's rowwise forms. With the columnwise copies the
    path's backward is :data:`DECODED_ROUTE`."""
    g_row = _decoded(gy, qg, False, lay)
    dx = _grouped_mm_dgrad(g_row, lay, w, qw, False) if dgrad else None
    dw = _grouped_mm_wgrad(g_row, x, lay, qx, False, x_rows) if wgrad else None
    return dx, dw


#: Every route whose backward runs in parts, by name.
ROUTES = {r.name: r for r in (fp8_block_gemm.ROUTE, nvfp4_gemm.ROUTE, DECODED_ROUTE)}


def backward_route(qg, qx, qw, device: torch.device, dtypes, widths, align: int, col: bool
                   ) -> Route | None:
    """The route whose backward runs in parts (:mod:`.backward_parts`) for a layer of these
    quantizers, operand ``dtypes`` and expert ``widths`` ``(N, K)``; None where backward takes
    the per-group path or the backward overrides' ``"grouped_mm"`` form."""
    for route in (fp8_block_gemm, nvfp4_gemm):
        if route.takes(qx, qw, qg, device, dtypes, widths, align, col):
            return route.ROUTE
    if col and _batched_takes((qg, qx, qw), device, dtypes, widths, qw):
        return DECODED_ROUTE
    return None


def _work(offs: torch.Tensor, total: int, align: int) -> list[tuple[int, int, int, int]]:
    """``(group, start, rows, padded rows)`` of each non-empty group."""
    return [(g, s, m, roundup(m, align)) for g, (s, m) in enumerate(_groups(offs, total)) if m]


def grouped_fprop(x: torch.Tensor, lay: fp8.Layout, w: torch.Tensor, b, qx, qw, align: int,
                  fast_accum: bool = False, x_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``y [T, N]``: group ``g``'s rows of ``x [T, K]`` times ``w[g]ᵀ`` (``w [E, N, K]``) plus
    ``b[g]``, each group quantized (``qx``, ``qw``) and multiplied as the dense Linear does
    (``fast_accum`` its plan's); ``lay`` the groups' layout padded to ``align`` rows
    (:func:`.fp8.layout`). ``x_rows`` (int64 ``[T]``): the rows are ``x[x_rows]``, read where
    they lie by the grouped routes (gathered first on the per-group path)."""
    total, k, n = lay.total, x.shape[1], w.shape[1]
    if fp8_gemm.takes((qx, qw), x.device, x.dtype, align, k, n):
        return fp8_gemm.forward(x, lay, w, qx, qw, False, False, b, fast_accum, None,
                                x_rows)[0]
    for route in (fp8_block_gemm, nvfp4_gemm):
        if route.takes(qx, qw, None, x.device, (x.dtype, w.dtype), (n, k), align):
            return route.forward(x, lay, w, qx, qw, b, x_rows)
    if _batched_takes((qx, qw), x.device, (x.dtype, w.dtype), (n, k), qw):
        return batched_fprop(x, lay, w, qx, qw, b, x_rows)
    x = x if x_rows is None else x[x_rows]
    y = x.new_zeros((total, n))
    work = _work(lay.offs, total, align)
    if not work:
        return y
    xm, wm = quantizer_meta(qx), quantizer_meta(qw)
    xbs = [quantized(_padded(x[s:s + m], mp), qx) for _, s, m, mp in work]
    wbs = [quantized(w[g], qw) for g, *_ in work]
    for xb, wb, (g, s, m, mp) in zip(xbs, wbs, work, strict=True):
        yg = operands.fprop(Operand(xb, xm, (mp, k)), Operand(wb, wm, (n, k)),
                            None if b is None else b[g], x.dtype, qgemm_impl, fast_accum)
        y[s:s + m] = yg[:m]
    count_path("per_group")
    return y


def grouped_bprop(gy: torch.Tensor, x: torch.Tensor, lay: fp8.Layout, w: torch.Tensor,
                  qg, qx, qw, col: bool, align: int, dgrad: bool, wgrad: bool, bias: bool,
                  fast_dgrad: bool = False, fast_wgrad: bool = False,
                  x_rows: torch.Tensor | None = None):
    """``(dx, dw, db)`` of :func:`grouped_fprop` for the output gradient ``gy``: per group the
    dense Linear's backward GEMMs on ``gy`` quantized by ``qg`` and on ``x`` / ``w`` quantized
    again by ``qx`` / ``qw`` (their columnwise copies when ``col``, else their rowwise forms or
    the originals: the backward overrides). Outputs not asked for are empty. ``x_rows``: as
    :func:`grouped_fprop`'s; ``dx`` is then the gradient of the rows, ``[T, K]``."""
    (total, k), (experts, n) = (gy.shape[0], x.shape[1]), w.shape[:2]
    dtypes = (gy.dtype, x.dtype, w.dtype)
    grouped, route = None, backward_route(qg, qx, qw, x.device, dtypes, (n, k), align, col)
    if route is not None:
        grouped = backward_parts.backward(route, gy, x, lay, w, qg, qx, qw, dgrad, wgrad,
                                          x_rows)
    elif _batched_takes((qg, qx, qw), x.device, dtypes, (n, k), qw):
        grouped = batched_bprop(gy, x, lay, w, qg, qx, qw, dgrad, wgrad, x_rows)
    if grouped is not None:
        dx, dw = grouped
        return (dx if dgrad else x.new_zeros((0,)), dw if wgrad else w.new_zeros((0,)),
                bias_sums(gy, lay.offs, w.dtype) if bias else w.new_zeros((0,)))
    dx = x.new_zeros((total, k) if dgrad else (0,))
    dw = w.new_zeros((experts, n, k) if wgrad else (0,))
    db = w.new_zeros((experts, n) if bias else (0,))
    work = _work(lay.offs, total, align)
    if not work:
        return dx, dw, db
    gm, xm, wm = quantizer_meta(qg), quantizer_meta(qx), quantizer_meta(qw)
    gbs = [quantized(_padded(gy[s:s + m], mp), qg) for _, s, m, mp in work]
    if bias:
        for g, s, m, mp in work:
            db[g] = _padded(gy[s:s + m], mp).to(torch.float32).sum(0).to(w.dtype)
    if dgrad:
        wbs = [quantized(w[g], qw) for g, *_ in work]
        for gb, wb, (_, s, m, mp) in zip(gbs, wbs, work, strict=True):
            dx[s:s + m] = operands.dgrad(Operand(gb, gm, (mp, n)), Operand(wb, wm, (n, k)),
                                         col, x.dtype, qgemm_impl, fast_dgrad)[:m]
        count_path("per_group")
    if wgrad:
        x = x if x_rows is None else x[x_rows]
        xbs = [quantized(_padded(x[s:s + m], mp), qx) for _, s, m, mp in work]
        for gb, xb, (g, _, _, mp) in zip(gbs, xbs, work, strict=True):
            dw[g] = operands.wgrad(Operand(gb, gm, (mp, n)), Operand(xb, xm, (mp, k)), col,
                                   w.dtype, qgemm_impl, fast_wgrad)
        count_path("per_group")
    return dx, dw, db
