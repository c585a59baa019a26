"""The forward of a tensor-parallel ``Linear``: quantized GEMMs on the local shards.

The parallel styles (:mod:`.styles`) keep the layer's parameters as DTensors and hand its
forward local tensors. :func:`forward` takes the local weight shard (``DTensor.to_local``, so the
gradient reaches the DTensor parameter with the parameter's placement), quantizes the local
operands with the layer's recipe quantizers and runs the GEMMs of :class:`TensorParallelLinearFn`
on them. Each operand's tensor-wide amax (FP8 current scaling, NVFP4) is all-reduced (MAX) over
the groups whose ranks hold other pieces of the tensor a single process would have quantized
whole (:func:`operand_groups`), so every rank quantizes with the scale of the unsharded run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from quant_core.distributed import reduce_amax
from quant_core.storage import QuantizedStorage, absent_buffer, storage_class

from ..compiling import compiling, dynamo
from ..fsdp_layout import base, columnwise_buffer_list
from ..gemm import HP_META, is_high_precision, quantizer_meta
from ..module import is_value, module_frame
from ..operands import (
    Operand,
    amax_per_row,
    dgrad,
    fprop,
    output_dtype,
    plan_operands,
    quantize_buffers,
    save_operands,
    saved_operands,
    wgrad,
    without_autocast,
)

COLWISE, ROWWISE = "colwise", "rowwise"


def quantize_over(x: torch.Tensor, q, groups: tuple) -> list[torch.Tensor]:
    """``q``'s buffers of ``x`` with the tensor amax all-reduced (MAX) over each group of
    ``groups`` (``None`` entries skipped); no group: :func:`quant_recipes.operands.quantize_buffers`
    (its eager sharing of one quantization between layers included)."""
    groups = tuple(g for g in groups if g is not None)
    if not groups or is_high_precision(q) or not q.reduces_amax:
        return quantize_buffers(x, q, None)
    if compiling():
        ops = dynamo()
        amax = ops.amax(x, q)
        for g in groups:
            amax = reduce_amax(amax, g)
        return list(ops.quantize_with_amax(x, amax, q))
    amax = q.local_amax(x)
    for g in groups:
        amax = reduce_amax(amax, g)
    return q.quantize_with_amax(x, amax).buffer_list(x)


def operand_groups(kind: str, tp_group, frame_group, input_per_row: bool = False
                   ) -> tuple[tuple, tuple, tuple]:
    """``(input, weight, grad_output)`` amax groups of a layer parallelized ``kind``.

    The weight is always a shard of the weight one process would quantize whole: its amax is
    reduced over the TP group. Column-parallel: the input is replicated (or arrives quantized
    from :class:`~quant_recipes.PrepareQuantModuleInput`, its amax already reduced), the
    output gradient holds this rank's output features (reduced). Row-parallel: the input holds
    this rank's slice of K (reduced); the output gradient is the gradient of the reduced,
    replicated output, whole on every rank (not reduced). ``frame_group`` (autocast's
    ``amax_reduction_group``) is added to every operand, as autocast does for plain layers,
    but to an input quantized with one amax per row (``input_per_row``,
    :func:`~quant_recipes.operands.amax_per_row`): the ranks of that group hold other rows, the
    TP group of a row-parallel layer the other columns of this rank's rows (the per-row amaxes
    are reduced elementwise over it)."""
    sharded = (tp_group, frame_group)
    whole = (frame_group,)
    if kind == COLWISE:
        return (() if input_per_row else whole), sharded, sharded
    return ((tp_group,) if input_per_row else sharded), sharded, whole


class TensorParallelLinearFn(torch.autograd.Function):
    """``y = x Wᵀ (+ b)`` on local tensors with one amax group tuple per operand and the
    quantizers of :func:`~quant_recipes.operands.plan_operands`. ``x`` is 2-D high precision,
    or a quantized storage (an input gathered quantized) of any rank."""

    @staticmethod
    @without_autocast
    def forward(ctx, x, w, b, plan, groups, out_dtype):
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        n = w.shape[0]
        if isinstance(x, QuantizedStorage):  # every buffer, with the wgrad GEMM's columnwise copy
            xb = (columnwise_buffer_list(x, w, plan.input) if plan.columnwise
                  and ctx.needs_input_grad[1] else _buffers(x, plan.input, w))
        else:
            xb = quantize_over(x, plan.input, groups[0])
        xop = Operand(xb, quantizer_meta(plan.input), (m, k))
        wop = Operand(quantize_over(w, plan.weight, groups[1]), quantizer_meta(plan.weight),
                      (n, k))
        y = fprop(xop, wop, b, out_dtype, fast_accum=plan.fast_accum[0])
        save_operands(ctx, x, xop, w, wop, plan)
        ctx.grad_q, ctx.groups, ctx.columnwise = plan.grad, groups, plan.columnwise
        ctx.fast_accum = plan.fast_accum
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype, out_dtype)
        ctx.x_shape = tuple(x.shape)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, gy):
        gy = gy.contiguous()
        x, w = saved_operands(ctx, gy, lambda t, q, i: quantize_over(t, q, ctx.groups[i]))
        if ctx.columnwise:
            g = Operand(quantize_over(gy, ctx.grad_q, ctx.groups[2]), quantizer_meta(ctx.grad_q),
                        tuple(gy.shape))
        else:
            g = Operand([gy], list(HP_META), tuple(gy.shape))
        (x_dtype, w_dtype, b_dtype, out_dtype), dx, dw, db = ctx.dtypes, None, None, None
        if ctx.needs_input_grad[0]:
            dx = dgrad(g, w, ctx.columnwise, out_dtype,
                       fast_accum=ctx.fast_accum[1]).reshape(ctx.x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = wgrad(g, x, ctx.columnwise, out_dtype, fast_accum=ctx.fast_accum[2]).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = gy.to(torch.float32).sum(0).to(b_dtype)
        return dx, dw, db, None, None, None


def _buffers(s: QuantizedStorage, q, like: torch.Tensor) -> list[torch.Tensor]:
    """The buffer list of ``s`` (a storage of ``q``'s format) by attribute reads, which
    compiled code can do on a traced quantized tensor (its method calls are taken for tensor
    methods)."""
    names = storage_class(q.storage_format).buffer_names
    return [absent_buffer(like) if getattr(s, n) is None else getattr(s, n) for n in names]


class AddBias(torch.autograd.Function):
    """``y + b`` after a row-parallel reduction; the bias gradient is summed in fp32 (as the
    quantized linear's is) and, for an output sharded over ``group`` (sequence parallel),
    all-reduced in fp32 before its rounding."""

    @staticmethod
    def forward(ctx, y, b, group):
        ctx.group, ctx.dtype = group, b.dtype
        if b.dtype == y.dtype:
            return y + b
        # under torch.autocast y is in its dtype: the bias added in fp32, the sum rounded once
        return (y.to(torch.float32) + b.to(torch.float32)).to(y.dtype)

    @staticmethod
    def backward(ctx, g):
        db = g.reshape(-1, g.shape[-1]).to(torch.float32).sum(0)
        if ctx.group is not None:
            from torch.distributed import _functional_collectives as funcol

            db = funcol.all_reduce(db, "sum", ctx.group)
            wait = getattr(db, "wait", None)
            db = wait() if wait is not None else db
        return g, db.to(ctx.dtype), None


def block_of(q) -> int:
    """The elements one scale covers along a sharded dimension of ``q``'s operands (1 for a
    per-tensor format)."""
    if is_high_precision(q):
        return 1
    # fields and registered members only: traced code (torch 2.11) reads nothing else
    if "block_len" in (q.value_fields() or ()):
        return q.block_len
    return q.shape_rule()[1]


def shard_sizes(full: int, world: int) -> list[int]:
    """Each rank's share of a dimension of ``full`` elements sharded over ``world`` ranks, as
    DTensor's ``Shard`` splits it (``torch.chunk``: ``ceil(full / world)`` per rank, the last
    ranks what remains, possibly nothing)."""
    chunk = -(-full // world)
    return [max(0, min(chunk, full - r * chunk)) for r in range(world)]


def check_alignment(module, kind: str, world: int, quantizers) -> None:
    """``ValueError`` unless each rank's slice of the sharded dimension (out_features for a
    column-parallel layer, in_features for a row-parallel one; uneven as DTensor shards it) is a
    whole number of the format's blocks: a block across a shard boundary would be scaled from a
    part of its elements. A per-tensor format (block 1) shards at any width."""
    full = module.out_features if kind == COLWISE else module.in_features
    dim = "out_features" if kind == COLWISE else "in_features"
    sizes = shard_sizes(full, world)
    for q in quantizers:
        block = block_of(q)
        if any(size % block for size in sizes):
            per_rank = str(sizes[0]) if len(set(sizes)) == 1 else "/".join(map(str, sizes))
            raise ValueError(
                f"{'QuantColwiseParallel' if kind == COLWISE else 'QuantRowwiseParallel'}: "
                f"layer {layer_name(module)} shards {dim}={full} over {world} ranks into "
                f"{per_rank} per rank, not a multiple of the {q.storage_format} block of "
                f"{block} along that dimension ({type(q).__name__}); use a width whose shards "
                "hold whole blocks, or another recipe")


def check_stateless(module, qset, recipe) -> None:
    """``ValueError`` naming the layer unless the quantizers it runs (input, weight, output
    gradient) are values: a stateful quantizer (delayed scaling: ``DelayedScaling``, or a
    ``CustomRecipe`` factory's ``DelayedScalingRequest``) scales by a per-process state that
    no tensor-parallel reduction reaches, so the ranks would not quantize with the unsharded
    tensor's scale."""
    for what, q in (("input", qset.fwd[0]), ("weight", qset.fwd[1]),
                    ("output gradient", qset.bwd[0])):
        if is_value(q):
            continue
        if recipe.delayed():
            source = "DelayedScaling, whose amax histories and scales are per process"
        else:  # a DelayedScalingRequest becomes a Float8Quantizer on the request's state
            source = (f"{type(recipe).__name__}, whose factory gives the {what} a stateful "
                      f"{type(q).__name__} (delayed scaling: per-process amax history and "
                      "scale)")
        raise ValueError(
            f"tensor parallelism: layer {layer_name(module)} runs under {source}; no "
            "tensor-parallel amax reduction reaches that state, so each rank would scale its "
            "shard by its own state, not the unsharded tensor's. Use a stateless recipe "
            "(Float8CurrentScaling, ...) or a CustomRecipe whose factory returns value "
            "quantizers")


def check_gathered_input(x: QuantizedStorage, q, module) -> None:
    """``ValueError`` unless the gathered input was quantized by ``q`` up to usages: its bytes
    are the GEMM operand, quantizing their dequantized value again would round twice."""
    if not (is_value(x.quantizer) and is_value(q) and base(x.quantizer) == base(q)):
        raise ValueError(
            f"tensor parallelism: layer {layer_name(module)} takes an input gathered quantized "
            f"by {x.quantizer!r}, but its recipe quantizes its input with {q!r}; give "
            "PrepareQuantModuleInput the consuming layer's recipe (run both under one autocast)")


def layer_name(module) -> str:
    return repr(module.name) if module.name else (
        f"Linear(in_features={module.in_features}, out_features={module.out_features})")


def forward(module, x: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel layer's forward on its local input (a high-precision tensor, or the
    quantized tensor :class:`~quant_recipes.PrepareQuantModuleInput` gathered); a row-parallel
    layer returns its partial sum without the bias (its style reduces it and adds the bias)."""
    kind, tp_group, world = module._quant_tp
    w = module.weight.to_local()
    b = module.bias.to_local() if kind == COLWISE and module.bias is not None else None
    frame = module_frame(module)
    quantized_x = isinstance(x, QuantizedStorage)
    if frame is None or not frame.enabled:  # high precision (calibration has no state here)
        xh = x.dequantize(dtype=x.dtype) if quantized_x else x
        return F.linear(xh, w, b)
    if x.dim() == 0 or x.shape[-1] != w.shape[1]:
        raise RuntimeError(f"Linear: the input's last dimension must be the local in_features="
                           f"{w.shape[1]}, got input shape {tuple(x.shape)}")
    qset = module.quantizers(frame, device=w.device)
    if not compiling():
        check_stateless(module, qset, frame.recipe)
    if not compiling() or dynamo().DERIVES_IN_GRAPH:
        check_alignment(module, kind, world, (qset.fwd[0], qset.fwd[1], qset.bwd[0]))
    grad = torch.is_grad_enabled()
    override = frame.recipe.backward_override
    # as Linear: no copy an override skips; an operand saved as is where the layer says so.
    # The flags' default (None) keeps the copies here: quantizing again in backward would
    # all-reduce the amax over the groups once more
    plan = plan_operands(qset, override, wgrad=grad and w.requires_grad,
                         dgrad=grad and x.requires_grad,
                         keep_weight=module.save_weight_copy is not False,
                         keep_input=module.save_input_copy is not False,
                         input_quantized=quantized_x)
    if quantized_x and not compiling():
        check_gathered_input(x, qset.fwd[0], module)
    groups = operand_groups(kind, tp_group, frame.amax_reduction_group,
                            amax_per_row(qset.fwd[0]))
    lead = x.shape[:-1]
    x2 = x if quantized_x or x.dim() == 2 else x.reshape(lead.numel(), x.shape[-1])
    y = TensorParallelLinearFn.apply(x2, w, b, plan, groups, output_dtype(x))
    return y if x.dim() == 2 else y.reshape(*lead, w.shape[0])
