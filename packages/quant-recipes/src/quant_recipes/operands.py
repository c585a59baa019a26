"""The operand policy of every quantized layer: dense :class:`~quant_recipes.Linear`, the
tensor-parallel layers and :class:`~quant_recipes.GroupedLinear` ask it the same questions.

A step of ``y = x Wᵀ`` runs three GEMMs on quantized operands: ``fprop(x, w)`` in forward,
``dgrad(g, w)`` (the input gradient) and ``wgrad(g, x)`` (the weight gradient) in backward.
:func:`plan_operands` turns a layer's recipe quantizers, which gradients are needed, the backward
override and the layer's save flags into an :class:`OperandPlan`: each forward quantizer's
usages (a columnwise copy only where a backward GEMM reads it), the gradient's quantizer, and
which operand backward quantizes again from the tensor saved as is instead of keeping forward's
copy. :func:`save_operands` saves for backward what that plan says and :func:`saved_operands`
gives it back as :class:`Operand` records, which :func:`fprop`, :func:`dgrad` and :func:`wgrad`
multiply. The layers differ only in how they quantize (amax groups, tensor-parallel reductions,
one quantize per expert group), which they pass in.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from quant_core import Quantizer
from quant_core.distributed import reduce_amax
from quant_core.storage import QuantizedStorage, absent_buffer

from .compiling import QUANT_DYNAMO, compiling, dynamo, trace_time_constant
from .fsdp_layout import columnwise_buffer_list
from .gemm import (
    HP_META,
    for_transposed_use,
    is_high_precision,
    qgemm,
    unread_by_transposed_use,
)
from .module import is_value
from .recipe import fast_accumulation
from .reuse import shared_quantization
from .weight_cache import cached_quantization


class Operand(NamedTuple):
    """A GEMM operand: its buffer list (one high-precision tensor, or a storage's buffers with
    absent ones empty), its :func:`~quant_recipes.gemm.quantizer_meta` and its logical 2D
    shape ``[rows, cols]``."""

    bufs: list[torch.Tensor]
    meta: list[int]
    shape: tuple


#: A GEMM with ``qgemm``'s signature: the custom op, or its body inside another op.
Gemm = Callable[..., torch.Tensor]

#: ``tuple.__new__``: ``tuple_new(Operand, (bufs, meta, shape))`` is ``Operand(bufs, meta,
#: shape)`` (what the named tuple's own ``__new__`` and ``_make`` run). Dynamo traces this call in
#: a few instructions where it traces a named tuple's constructor through a generic polyfill
#: (about forty more on torch 2.13, per operand of every layer call).
tuple_new = tuple.__new__


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of a quantized layer's GEMM outputs for input ``x``: ``torch.autocast``'s on
    ``x``'s device type where it is enabled (what ``F.linear`` gives there, and TransformerEngine's
    modules, whose activation dtype it is), else ``x``'s own. The operands are quantized from
    their own dtypes either way; backward's GEMMs give the same dtype, and each gradient takes
    its operand's dtype after them (as autograd's casts would)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


#: The device types whose ``torch.autocast`` state :func:`autocast_off` turns off.
AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_off(device_type: str):
    """A context in which ``torch.autocast`` is off on ``device_type``: a quantized layer's own
    arithmetic (the quantize references, the emulated GEMMs, NVFP4's Hadamard transform) then
    runs in the dtypes it states, as TransformerEngine's kernels do, whatever autocast does
    around the layer (it would run their matmuls in its lower precision)."""
    if device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def without_autocast(fn):
    """An autograd function's ``forward(ctx, t, ...)`` or ``backward(ctx, t, ...)`` run under
    :func:`autocast_off` on ``t``'s device type."""
    @functools.wraps(fn)
    def run(ctx, t, *args):
        with autocast_off(t.device.type):
            return fn(ctx, t, *args)

    return run


def fprop(x: Operand, w: Operand, bias, out_dtype: torch.dtype, gemm: Gemm = qgemm,
          fast_accum: bool = False):
    """``x Wᵀ (+ bias)`` from both operands' rowwise forms (``fast_accum``: the plan's, see
    :class:`OperandPlan`)."""
    return gemm(x.bufs, x.meta, x.shape, False, False, w.bufs, w.meta, w.shape, False, True,
                bias, out_dtype, fast_accum)


def dgrad(g: Operand, w: Operand, columnwise: bool, out_dtype: torch.dtype, gemm: Gemm = qgemm,
          fast_accum: bool = False):
    """``g W``: the input gradient, ``W`` from its columnwise copy when ``columnwise`` (no
    backward override), else from its rowwise form or high-precision value."""
    return gemm(g.bufs, g.meta, g.shape, False, False, w.bufs, w.meta, w.shape, columnwise, False,
                None, out_dtype, fast_accum)


def wgrad(g: Operand, x: Operand, columnwise: bool, out_dtype: torch.dtype, gemm: Gemm = qgemm,
          fast_accum: bool = False):
    """``gᵀ x``: the weight gradient, both from their columnwise copies when ``columnwise``."""
    return gemm(g.bufs, g.meta, g.shape, columnwise, True, x.bufs, x.meta, x.shape, columnwise,
                False, None, out_dtype, fast_accum)


def amax_per_row(q: Quantizer) -> bool:
    """Whether ``q`` scales each row by the row's own amax (row-scaled NVFP4): ranks that hold
    other rows (autocast's ``amax_reduction_group``, data or sequence parallel) share nothing
    with it. Read from the storage tags, as compiled code reads them (``quantizer_meta``)."""
    return bool(q._storage_tags().get("_row_scaled_nvfp4", False))


def quantize_buffers(x: torch.Tensor, q: Quantizer, group) -> list[torch.Tensor]:
    """``q``'s storage buffers for ``x`` (an absent buffer is an empty uint8 tensor), the
    tensor-wide amax all-reduced over ``group`` (a per-row amax is not: :func:`amax_per_row`).
    Eagerly a parameter's quantization is cached per optimizer step (:mod:`.weight_cache`) and
    an activation's may be shared between layers (:mod:`.reuse`)."""
    if is_high_precision(q):
        return [x]
    if group is not None and amax_per_row(q):
        group = None
    if compiling():
        ops = QUANT_DYNAMO or dynamo()
        # with a group, the layer asks every quantizer for the reduction (with_amax_reduction),
        # as eager code does; torch 2.10 cannot derive that variant in a graph, so it is not read
        if group is not None and q.reduces_amax:
            # the amax leaves the op, is all-reduced by a functional collective (it traces; the
            # group is this call's, never part of the quantizer value), and comes back in
            amax = reduce_amax(ops.amax(x, q), group)
            return list(ops.quantize_with_amax(x, amax, q))
        if not q.rowwise_usage and reuses_forward_amax(q):
            # the columnwise copy alone: one backward makes from a tensor forward quantized. Its
            # amax as torch ops is forward's (the graph merges equal expressions, or forward
            # computes it, fused where the tensor is made): backward's cast reads x once
            return list(ops.quantize_with_amax(x, ops.amax(x, q), q))
        return list(ops.quantize(x, q))

    def quantize():
        return q.quantize(x, amax_reduction_group=group).buffer_list(x)

    if isinstance(x, torch.nn.Parameter):
        return cached_quantization(x, q, group, quantize)
    return shared_quantization(x, q, group, quantize)


@trace_time_constant
def reuses_forward_amax(q: Quantizer) -> bool:
    """Whether a compiled graph quantizing a tensor again in backward with ``q`` takes
    forward's amax of it (a tensor-wide amax traced as torch ops: FP8 current scaling), so that
    backward's cast reads the tensor once."""
    return q.reduces_amax and "ops" in q.lowerings()


def keeps_copy(flag: bool | None, q: Quantizer, group) -> bool:
    """A layer's ``save_weight_copy`` / ``save_input_copy`` for an operand quantized with
    ``q``: ``None`` (the default) keeps the quantized copy from forward, except in a compiled
    graph without an amax group whose backward takes forward's amax
    (:func:`reuses_forward_amax`). There backward's cast reads the tensor once (recomputed
    by the partitioner where its producer is cheap), as cheap as writing and reading a kept
    copy, and nothing is held from forward."""
    if flag is not None:
        return flag
    return not (group is None and compiling() and reuses_forward_amax(q))


class OperandPlan(NamedTuple):
    """What one call of a quantized layer quantizes with (:func:`plan_operands`)."""

    input: Quantizer
    weight: Quantizer
    grad: Quantizer
    #: The columnwise copy backward quantizes from the weight saved as is (None: the copy is
    #: made in forward and saved, or no backward GEMM reads it).
    weight_bwd: Quantizer | None
    #: Likewise for the input.
    input_bwd: Quantizer | None
    #: The backward override (None, "dequantized" or "high_precision").
    override: str | None
    #: ``(fprop, dgrad, wgrad)``: the recipe's :func:`~quant_recipes.recipe.fast_accumulation`,
    #: which each GEMM passes on (``qgemm``'s ``fast_accum``).
    fast_accum: tuple[bool, bool, bool] = (False, False, False)

    @property
    def columnwise(self) -> bool:
        """Whether backward's GEMMs read the operands' columnwise copies (no override)."""
        return self.override is None


def plan_operands(qset, override, *, wgrad: bool, dgrad: bool,
                  keep_weight: bool | None = True, keep_input: bool | None = True, group=None,
                  weight_quantized: bool = False, input_quantized: bool = False) -> OperandPlan:
    """The plan of one layer call with the quantizers ``qset`` (a module's
    ``RecipeQuantizers``): each operand's columnwise copy only where a backward GEMM reads it
    (none under a backward ``override``), made in forward and kept (``keep_weight``,
    ``keep_input``: a layer's ``save_weight_copy``, ``save_input_copy``; ``None`` as
    :func:`keeps_copy` says) or else made in
    backward from the operand saved as is where requantizing gives the same bytes (not for an
    operand that arrives quantized), and ``with_amax_reduction`` with a ``group`` (not for a
    per-row amax: :func:`amax_per_row`)."""
    if group is None:  # the set's own method: a wrapper's frame costs every call a trace more
        variant = qset.variant
    else:
        def variant(q, **fields):
            if not amax_per_row(q):
                fields["with_amax_reduction"] = True
            return qset.variant(q, **fields)

    transposed = override is None
    fwd_in, fwd_w = qset.fwd[0], qset.fwd[1]
    # save_weight_copy=False: backward quantizes the weight's columnwise copy itself, so
    # forward makes only the rowwise form (a compiled graph would otherwise keep forward's
    # copy for backward, the two quantizations being one expression)
    requant_w = (not weight_quantized and dgrad and transposed
                 and not keeps_copy(keep_weight, fwd_w, group) and requantizable(fwd_w))
    requant_x = (not input_quantized and wgrad and transposed
                 and not keeps_copy(keep_input, fwd_in, group) and requantizable(fwd_in))
    # what backward quantizes again: the columnwise copy alone (a named tuple built with
    # tuple.__new__ and no generator: the cheapest forms for Dynamo to trace)
    return tuple_new(OperandPlan, (
        variant(fwd_in, columnwise_usage=wgrad and transposed and not requant_x),
        variant(fwd_w, columnwise_usage=dgrad and transposed and not requant_w),
        variant(qset.bwd[0], rowwise_usage=dgrad or not wgrad, columnwise_usage=wgrad),
        variant(fwd_w, rowwise_usage=False, columnwise_usage=True) if requant_w else None,
        variant(fwd_in, rowwise_usage=False, columnwise_usage=True) if requant_x else None,
        override, fast_accumulation(qset.recipe)))


def requantizing_backward(plan: OperandPlan, qset, high_precision: Quantizer):
    """``(grad, input, weight)``: what a layer that keeps no quantized copy and quantizes both
    operands again in backward (a grouped layer's per-group paths; no amax group) quantizes
    with under ``plan``: the columnwise copies without an override; the rowwise forms against
    the unquantized gradient under "dequantized"; the originals (``high_precision``) under
    "high_precision"."""
    if plan.override is None:
        return (plan.grad, *(qset.variant(q, rowwise_usage=False, columnwise_usage=True)
                             for q in qset.fwd[:2]))
    if plan.override == "dequantized":
        return high_precision, plan.input, plan.weight
    return high_precision, high_precision, high_precision


@trace_time_constant
def requantizable(q: Quantizer) -> bool:
    """Whether quantizing an operand again in backward gives the forward's bytes: a value
    quantizer that says so (``is_requantization_safe``: not with stochastic rounding); a
    delayed-scaling quantizer's scale changes when the region exits, between forward and
    backward."""
    return is_value(q) and q.is_requantization_safe()


def kept_for_backward(bufs: list[torch.Tensor], meta: list[int], override, needed: bool
                      ) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    """``(kept, dropped)``: the buffers backward keeps of a forward operand, and the positions
    of ``bufs`` it does not keep (neither saved nor made in forward: :func:`saved_operands` puts
    absent buffers there). Nothing when no backward GEMM reads the operand (x without a weight
    gradient, the weight without an input gradient); the columnwise copy alone when the backward
    GEMMs use it transposed (no override); all of it for the "dequantized" override, whose
    backward GEMMs read the rowwise forms."""
    if not needed:
        return [], tuple(range(len(bufs)))
    if override is not None:
        return bufs, ()
    dropped = unread_by_transposed_use(bufs, meta)
    # deleted from the end (the positions ascend): the cheapest form for Dynamo to trace (a
    # comprehension is a nested function, enumerate a generator)
    kept = list(bufs)
    for i in dropped[::-1]:
        del kept[i]
    return kept, dropped


def _with_absent(bufs: list[torch.Tensor], dropped: tuple[int, ...], like: torch.Tensor
                 ) -> list[torch.Tensor]:
    """``bufs`` with an absent buffer at each position of ``dropped`` (ascending)."""
    for i in dropped:
        bufs.insert(i, absent_buffer(like))
    return bufs


def save_operands(ctx, x: torch.Tensor, xop: Operand, w: torch.Tensor, wop: Operand,
                  plan: OperandPlan) -> None:
    """Save for backward what its GEMMs read of the input ``x`` and the weight ``w`` (quantized
    in forward as ``xop``, ``wop``): the originals under the "high_precision" override; else an
    operand with a backward quantizer in ``plan`` as is, the other as
    :func:`kept_for_backward` says. A weight that arrived quantized (a ``QuantizedStorage``:
    FSDP2's all-gather, ``quantized_model_init``) is saved itself, no copy. Backward reads them
    with :func:`saved_operands`."""
    needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    override = plan.override
    ctx.input_bwd_q = ctx.weight_bwd_q = None
    ctx.weight_stored = isinstance(w, QuantizedStorage)
    xm, wm = xop.meta, wop.meta
    drop_x = drop_w = ()
    if override == "high_precision":
        kept_x, xm = [x], list(HP_META)
    elif plan.input_bwd is not None:  # x itself, quantized again in backward
        kept_x, ctx.input_bwd_q = [x], plan.input_bwd
    else:
        kept_x, drop_x = kept_for_backward(xop.bufs, xm, override, needs_dw)
    if ctx.weight_stored:  # the weight tensor itself (FSDP2 refills its buffers)
        kept_w = [w]
        ctx.weight_q = plan.weight
    elif override == "high_precision":
        kept_w, wm = [w], list(HP_META)
    elif plan.weight_bwd is not None and override is None and needs_dx:
        # the weight itself (a parameter: no new memory), quantized again in backward
        kept_w, ctx.weight_bwd_q = [w], plan.weight_bwd
    else:
        kept_w, drop_w = kept_for_backward(wop.bufs, wm, override, needs_dx)
    ctx.save_for_backward(*kept_x, *kept_w)
    ctx.nx, ctx.dropped = len(kept_x), (drop_x, drop_w)
    ctx.operands = (xm, xop.shape, wm, wop.shape, w.dtype, override)


def saved_operands(ctx, like: torch.Tensor, quantize) -> tuple[Operand, Operand]:
    """The input's and the weight's :class:`Operand` records that :func:`save_operands` saved,
    an operand saved as is quantized again by ``quantize(tensor, quantizer, i)`` (``i``: 0 the
    input, 1 the weight); ``like`` (the output gradient) places absent buffers."""
    saved = ctx.saved_tensors
    xb = _with_absent(list(saved[:ctx.nx]), ctx.dropped[0], like)
    wb = _with_absent(list(saved[ctx.nx:]), ctx.dropped[1], like)
    xm, x_shape, wm, w_shape, w_dtype, override = ctx.operands
    if ctx.input_bwd_q is not None:  # the columnwise copy, from the input saved as is
        xb = quantize(xb[0], ctx.input_bwd_q, 0)
    if ctx.weight_bwd_q is not None:  # the columnwise copy, from the weight saved as is
        wb = quantize(wb[0], ctx.weight_bwd_q, 1)
    if ctx.weight_stored:
        w = wb[0]
        if override == "high_precision":
            wb, wm = [w.dequantize(dtype=w_dtype)], list(HP_META)
        elif override is None:
            wb = for_transposed_use(columnwise_buffer_list(w, like, ctx.weight_q), wm)
        else:
            wb = w.buffer_list(like)
    return tuple_new(Operand, (xb, xm, x_shape)), tuple_new(Operand, (wb, wm, w_shape))
