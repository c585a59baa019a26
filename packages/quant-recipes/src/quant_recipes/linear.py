"""``Linear``: ``y = x Wᵀ + b`` with quantized GEMM operands inside :func:`autocast`.

Forward quantizes the input (rowwise for fprop, columnwise for wgrad) and the weight (rowwise,
columnwise for dgrad) with the forward quantizers; backward quantizes ``grad_output`` with the
backward quantizer captured at *forward* time. What is quantized with which usages, what is
kept for backward and the GEMMs are the operand policy every quantized layer shares
(:mod:`quant_recipes.operands`); GEMMs run through :mod:`quant_recipes.gemm`.
Outside autocast, or with ``enabled=False``, it is a plain high-precision linear.

The weight may already be quantized (a ``quant_core.tensor.QuantizedTensor``: a parameter made
under :func:`~quant_recipes.quantized_model_init`, or the weight FSDP2 all-gathered in the
quantized format, :mod:`quant_recipes.fsdp`). Inside autocast its buffers feed the GEMMs as they
are, provided its quantizer equals the recipe's weight quantizer up to the usages (else
``ValueError``: quantizing the dequantized weight again would silently double-round it). The
weight tensor itself is saved for backward (no copy), and dgrad reads its columnwise copy, built
from the rowwise one where that is exact (:func:`quant_recipes.fsdp_layout.columnwise_buffer_list`).
Its gradient is the high-precision ``dW`` in the weight's nominal dtype. Outside autocast it is
dequantized.

Under ``torch.compile`` the autograd function is traced; quantization runs through
quant-dynamo's ``quant`` custom ops with the quantizer as a baked constant, the GEMMs through
``quant_recipes::qgemm``. Eager and compiled runs execute the same kernels, bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from quant_core import Quantizer
from quant_core.inputs import check_dense
from quant_core.storage import QuantizedStorage, storage_class
from quant_core.tensor import tags_of

from . import delayed_recompute
from .autocast import current_region
from .checkpointing import in_backward
from .compiling import DERIVES_IN_GRAPH, compiling, dynamo, trace_time_constant
from .delayed import update_registered
from .fsdp_layout import base
from .gemm import HP_META, quantizer_meta
from .module import (
    QuantizedModule,
    check_operands,
    intern,
    is_value,
    kept_linear_slots,
    module_frame,
)
from .operands import (
    Operand,
    dgrad,
    fprop,
    output_dtype,
    plan_operands,
    quantize_buffers,
    save_operands,
    saved_operands,
    tuple_new,
    wgrad,
    without_autocast,
)
from .role import QuantizerRole
from .states import RecipeState
from .step_weights import KeptWeight, drop, kept_buffers


def _rowwise(w: QuantizedStorage, q: Quantizer) -> torch.Tensor | None:
    """The rowwise data of ``w``, a storage of ``q``'s format (read from the quantizer: under
    compile ``w`` is a traced tensor)."""
    return getattr(w, storage_class(q.storage_format).rowwise_data_name)


@trace_time_constant
def described(q: Quantizer) -> str:
    """``repr(q)``, found at trace time where compiled code holds ``q`` as a constant (Dynamo
    cannot trace the repr of one kept on a recipe)."""
    return repr(q)


def check_weight_quantizer(w: QuantizedStorage, q: Quantizer, name: str) -> None:
    """Refuse a quantized weight whose quantizer is not ``q`` up to usages and amax reduction,
    or that lacks rowwise data. Under compile (where torch 2.10 cannot read a traced tensor's
    quantizer) the format and the storage tags that decide how its bytes decode (element
    dtype, 2D blocks, swizzled scales) are compared with those ``q`` makes; the tags where
    the torch can derive them in a graph. The compiled graph guards on the weight's quantizer
    value."""
    if compiling():
        same = isinstance(w, storage_class(q.storage_format))
        if same and dynamo().DERIVES_IN_GRAPH:
            same = all(getattr(w, tag) == value for tag, value in q._storage_tags().items())
        wq = f"a {type(w).__name__}" + ("" if same else f" with tags {tags_of(w)}")
    else:
        wq = w.quantizer
        same = is_value(wq) and is_value(q) and base(wq) == base(q)
    if not same:
        raise ValueError(
            f"Linear {name!r}: the weight is quantized by {wq!r} but autocast's recipe quantizes "
            f"this layer's weight with {described(q)}; run the layer under the recipe its "
            "weight was quantized for (quantized_model_init / enable_fsdp_quantized_all_gather)"
        )
    if _rowwise(w, q) is None:
        raise ValueError(f"Linear {name!r}: the quantized weight holds no rowwise data for the "
                         "forward GEMM (quantize it with rowwise_usage=True)")


#: Per operand of a Linear step: the feature its last dimension is, and the GEMMs that read it.
_OPERANDS = {
    "input": ("in_features", "the forward GEMM"),
    "weight": ("in_features", "the forward GEMM"),
    "grad_output": ("out_features", "the backward GEMMs"),
}
#: The columnwise copy of each operand, and the GEMM that reads it.
_COPIES = {
    "input": "the input's columnwise copy for the weight-gradient GEMM",
    "weight": "the weight's columnwise copy for the input-gradient GEMM",
    "grad_output": "grad_output's columnwise copy for the weight-gradient GEMM",
}


@trace_time_constant
def step_blocks(inputs: tuple, weights: tuple, grad) -> tuple[int, int]:
    """``(in_block, out_block)``: the least common multiple of the blocks
    (``Quantizer.shape_rule``) of a step's quantizers of operands along ``in_features``
    (``inputs``, ``weights``; None entries skipped) and along ``out_features`` (``grad``, or
    None): a width is a multiple of every block where it is one of this."""
    ins = [q.shape_rule()[1] for q in (*inputs, *weights) if q is not None]
    return math.lcm(1, *ins), 1 if grad is None else grad.shape_rule()[1]


def check_step_shapes(name: str, in_features: int, out_features: int, recipe,
                      operands) -> None:
    """``ValueError`` naming the layer, its shapes, the block and the fix when a quantizer of this
    step cannot take its operand, raised in forward before any quantize or GEMM, for the
    backward's operands too. ``operands``: ``(what, quantizer, tensor)`` per quantize the step
    makes, ``what`` one of input, weight, grad_output, ``tensor`` the operand's rows and dtype
    (the input stands for grad_output, which has them). The rules are the quantizers' own:
    the last dimension a multiple of the format's block (``Quantizer.shape_rule``, by which
    ``convert(recipe=...)`` leaves layers out), and what a columnwise copy needs
    (``Quantizer.check_columnwise_input``: under NVFP4's Hadamard transform bfloat16 with rows a
    multiple of 16)."""
    for what, q, t in operands:
        width = out_features if what == "grad_output" else in_features
        block = q.shape_rule()[1]
        if width % block:
            feature, gemms = _OPERANDS[what]
            raise ValueError(
                f"{_layer(name, in_features, out_features)}: {type(recipe).__name__} quantizes "
                f"{what} [rows, {feature}] for {gemms} in blocks of {block} along {feature}, and "
                f"{int(width)} is not a multiple of {block}; pad {feature} to a multiple of "
                f"{block}, or keep the layer in high precision (convert(model, recipe=...) "
                "leaves such layers out)")
        # eagerly: traced code on torch's opaque-object API cannot hand a quantizer method a
        # tensor; compiled, the quantize itself refuses such an input where it runs
        if q.columnwise_usage and not compiling():
            try:
                q.check_columnwise_input(t)
            except ValueError as e:
                rows = f"{int(t.shape[0])} {'weight' if what == 'weight' else 'input'} rows"
                raise ValueError(f"{_layer(name, in_features, out_features, rows)}: "
                                 f"{_COPIES[what]}: " + e.args[0]) from None


def _layer(name: str, in_features: int, out_features: int, *more: str) -> str:
    """A Linear and its shapes, for a message (built only when raising: under compile the
    widths of an FSDP2-wrapped layer are symbolic, which a traced f-string cannot format)."""
    shapes = ", ".join((f"in_features={int(in_features)}", f"out_features={int(out_features)}",
                        *more))
    return f"Linear {name!r} ({shapes})" if name else f"Linear({shapes})"


class _Dequantized(torch.autograd.Function):
    """A quantized weight's value for a high-precision linear; its gradient passes through."""

    @staticmethod
    def forward(ctx, w, dtype):
        ctx.w_dtype = w.dtype
        return w.dequantize(dtype=dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.w_dtype), None


def _high_precision(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _Dequantized.apply(w, dtype) if isinstance(w, QuantizedStorage) else w


class _QLinearFn(torch.autograd.Function):
    """Forward/backward of the quantized linear on 2D ``x``; the plan's quantizers are plain
    arguments (:func:`~quant_recipes.operands.plan_operands`)."""

    @staticmethod
    @without_autocast
    def forward(ctx, x, w, b, plan, group, region, kept_w, out_dtype):
        m, k = x.shape
        n = w.shape[0]
        # Operand(...) spelled tuple_new(Operand, (...)): the same tuple, cheaper to trace
        xop = tuple_new(Operand, (quantize_buffers(x, plan.input, group),
                                  quantizer_meta(plan.input), (m, k)))
        if kept_w is not None:  # the weight's buffers under plan.weight, made after the step
            wb = list(kept_w)
        elif isinstance(w, QuantizedStorage):
            wb = w.buffer_list(x)
        else:
            wb = quantize_buffers(w, plan.weight, group)
        wop = tuple_new(Operand, (wb, quantizer_meta(plan.weight), (n, k)))
        y = fprop(xop, wop, b, out_dtype, fast_accum=plan.fast_accum[0])
        save_operands(ctx, x, xop, w, wop, plan)
        ctx.grad_q, ctx.group, ctx.region = plan.grad, group, region
        ctx.fast_accum = plan.fast_accum
        ctx.columnwise = plan.override is None
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype, out_dtype)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, gy):
        gy = gy.contiguous()
        x, w = saved_operands(ctx, gy, lambda t, q, _: quantize_buffers(t, q, ctx.group))
        if ctx.columnwise:
            g = tuple_new(Operand, (quantize_buffers(gy, ctx.grad_q, ctx.group),
                                    quantizer_meta(ctx.grad_q), tuple(gy.shape)))
        else:  # "high_precision" keeps the originals, "dequantized" uses the rowwise forms
            g = tuple_new(Operand, ([gy], list(HP_META), tuple(gy.shape)))
        (x_dtype, w_dtype, b_dtype, out_dtype), dx, dw, db = ctx.dtypes, None, None, None
        if ctx.needs_input_grad[0]:
            dx = dgrad(g, w, ctx.columnwise, out_dtype, fast_accum=ctx.fast_accum[1]).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = wgrad(g, x, ctx.columnwise, out_dtype, fast_accum=ctx.fast_accum[2]).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            db = gy.to(torch.float32).sum(0).to(b_dtype)
        if ctx.region is not None:
            update_registered(ctx.region.backward)
        return dx, dw, db, None, None, None, None, None


class Linear(QuantizedModule, torch.nn.Linear):
    """A linear layer whose GEMMs are quantized inside :func:`autocast`.

    It is an ``nn.Linear`` (same constructor, attributes, ``state_dict`` keys and
    initialisation), so code that looks for ``isinstance(m, nn.Linear)`` (Hugging Face's weight
    init, PEFT's target matching, module filters) treats it as one; only ``forward`` differs.
    Quantizing, ``forward`` refuses before any quantize or GEMM operands on different devices
    or not floating point, as ``nn.Linear`` does, and widths that a quantize of the step,
    backward's included, cannot take (:func:`check_step_shapes`). Floating dtypes may differ:
    each operand is quantized from its own; the output has the input's dtype, or
    ``torch.autocast``'s where it is on.

    Roles: forward ``[("linear", "input", name), ("linear", "weight", name),
    output_quantizer_role]``, backward ``[("linear", "grad_output", name),
    grad_input_quantizer_role]`` (boundary roles default to ``None``).
    """

    #: Defaults for modules pickled before the two flags existed (the instance's own win).
    save_weight_copy: bool | None = None
    save_input_copy: bool | None = None
    #: The weight quantized after the last optimizer step (:mod:`quant_recipes.step_weights`).
    _step_weight: KeptWeight | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device=None, dtype=None, name: str = "", save_weight_copy: bool | None = None,
                 save_input_copy: bool | None = None) -> None:
        # nn.Linear makes weight and bias and initialises them (reset_parameters, below)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype, name=name)
        #: Keep the weight's quantized columnwise copy from forward for the input-gradient GEMM
        #: (True), or save the weight itself and quantize it again in backward (False): less
        #: memory held through the step, one more weight quantize per backward, the same bytes.
        #: False suits FSDP2, which frees the gathered weight after forward. None (default):
        #: False in a compiled graph whose backward reuses forward's amax (FP8 current scaling,
        #: no amax group: ``operands.keeps_copy``), True otherwise.
        self.save_weight_copy = save_weight_copy
        #: Keep the input's quantized columnwise copy from forward for the weight-gradient GEMM
        #: (True), or save the input itself and quantize it again in backward (False), as
        #: torchao's float8 training does: the same bytes, one more input quantize per backward.
        #: Eagerly this holds the high-precision input (more bytes than the copy unless
        #: something else keeps it anyway); compiled, the partitioner may instead recompute the
        #: input from what its producer's backward keeps (a norm's input and reciprocal root),
        #: so the layer holds nothing of its own between forward and backward. None (default):
        #: as for the weight.
        self.save_input_copy = save_input_copy
        self._roles_changed()
        from .quantized_init import quantize_at_init

        quantize_at_init(self)

    def reset_parameters(self) -> None:
        if isinstance(self.weight, QuantizedStorage):  # initialise in high precision, requantize
            from .quantized_init import (
                get_high_precision_init_val,
                keep_high_precision_init_val,
                requantize_,
            )

            w = torch.empty(self.weight.shape, dtype=self.weight.dtype, device=self.weight.device)
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            preserved = get_high_precision_init_val(self.weight) is not None
            requantize_(self.weight, w)
            if preserved:  # the new initial value replaces the old one
                keep_high_precision_init_val(self.weight, w)
        else:
            torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def weight_quantizer(self, recipe) -> Quantizer:
        """The weight quantizer ``recipe`` gives this layer, with both usages: what
        :func:`~quant_recipes.quantized_model_init` and the FSDP2 quantized all-gather quantize
        the weight with."""
        state = RecipeState.create(recipe, mode="forward", num_quantizers=3,
                                   roles=self._fwd_roles)
        return intern(state.make_quantizers()[1])

    def _roles_changed(self) -> None:
        name = self.name
        self._fwd_roles = (
            QuantizerRole("linear", "input", name),
            QuantizerRole("linear", "weight", name),
            self._output_quantizer_role,
        )
        self._bwd_roles = (
            QuantizerRole("linear", "grad_output", name),
            self._grad_input_quantizer_role,
        )

    def _kept_slots(self, recipe, num_gemms: int):
        return kept_linear_slots(self, Linear, recipe, num_gemms)

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int):
        roles = self._fwd_roles if fwd else self._bwd_roles
        if num_quantizers != len(roles):
            raise ValueError(
                f"Linear has {len(roles)} {'forward' if fwd else 'backward'} slots, "
                f"asked for {num_quantizers}"
            )
        return roles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frame = module_frame(self)
        w, b = self.weight, self.bias
        if frame is None:
            return F.linear(x, _high_precision(w, x.dtype), b)
        check_dense(x, "Linear")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise RuntimeError(
                f"Linear: the input's last dimension must be in_features={self.in_features}, "
                f"got input shape {tuple(x.shape)}"
            )
        quantized_w = isinstance(w, QuantizedStorage)
        check_operands(self, x, w, b, quantized_w)
        qset = self.quantizers(frame, device=w.device)
        if not frame.enabled:  # calibration: high precision, delayed quantizers record amaxes
            qset.fwd[0].calibrate(x)
            if not quantized_w:
                qset.fwd[1].calibrate(w)
            return F.linear(x, _high_precision(w, x.dtype), b)
        if quantized_w:
            check_weight_quantizer(w, qset.fwd[1], self.name)
        grad = torch.is_grad_enabled()
        group = frame.amax_reduction_group
        region = None
        if not compiling():  # delayed scaling: the region that updates it, a recompute's scales
            qset, region = self._delayed_step(qset, frame.recipe, group)
        kept = self._step_weight
        plan = plan_operands(qset, frame.recipe.backward_override,
                             wgrad=grad and w.requires_grad, dgrad=grad and x.requires_grad,
                             keep_weight=True if kept is not None else self.save_weight_copy,
                             keep_input=self.save_input_copy, group=group,
                             weight_quantized=quantized_w)
        kept_w = None if kept is None else kept_buffers(kept, w, plan.weight)
        # a 2-D input goes in and comes out as it is: a reshaped output would be a view, which a
        # compiled function regenerates on every call (aten._unsafe_view, host time)
        flat = x.dim() == 2
        lead = x.shape[:-1]
        x2 = x if flat else x.reshape(lead.numel(), self.in_features)
        if not compiling() or DERIVES_IN_GRAPH:  # torch 2.10 runs no quantizer method
            backward = grad and (x.requires_grad or w.requires_grad
                                 or (b is not None and b.requires_grad))
            self._check_step(frame.recipe, plan, x2, None if quantized_w else w, backward)
        y = _QLinearFn.apply(x2, w, b, plan, group, region, kept_w, output_dtype(x))
        return y if flat else y.reshape(*lead, self.out_features)

    def _apply(self, fn, recurse: bool = True):
        drop(self)  # a conversion (.to, .half) changes the weight the kept copies were made of
        return super()._apply(fn, recurse)

    def _check_step(self, recipe, plan, x2: torch.Tensor, w: torch.Tensor | None,
                    backward: bool) -> None:
        """:func:`check_step_shapes` for every quantize of this step: the input's, the weight's
        (``w``; None for a quantized weight, checked when it was quantized) and, when a backward
        follows, the output gradient's."""
        grad = backward and plan.override is None
        if compiling():  # the widths against the blocks, found at trace time; the message below
            bi, bo = step_blocks((plan.input, plan.input_bwd),
                                 (plan.weight, plan.weight_bwd) if w is not None else (),
                                 plan.grad if grad else None)
            if not (self.in_features % bi or self.out_features % bo):
                return
        # plain appends: Dynamo traces a list comprehension as a nested function
        checked = [("input", plan.input, x2)]
        if plan.input_bwd is not None:
            checked.append(("input", plan.input_bwd, x2))
        if w is not None:
            checked.append(("weight", plan.weight, w))
            if plan.weight_bwd is not None:
                checked.append(("weight", plan.weight_bwd, w))
        if grad:
            checked.append(("grad_output", plan.grad, x2))
        check_step_shapes(self.name, self.in_features, self.out_features, recipe, checked)

    def _delayed_step(self, qset, recipe, group):
        """``(quantizer set, region)`` of an eager step: the enclosing autocast region,
        registered to update this layer's delayed-scaling states when it exits (None without
        delayed states or region, or when another layer of the region was first). A recompute
        in backward registers nothing: it takes its forward's scales and region
        (:mod:`.delayed_recompute`)."""
        fwd_ds, bwd_ds = self.delayed_states(qset)
        if not (fwd_ds or bwd_ds):
            return qset, None
        if in_backward():
            return delayed_recompute.for_recompute(self, qset) or (qset, None)
        r = current_region()
        region = r if r is not None and r.add(fwd_ds, bwd_ds, recipe, group) else None
        delayed_recompute.record_forward(self, qset, region)
        return qset, region

    def extra_repr(self) -> str:
        extra = "".join(f", {flag}={getattr(self, flag)}" for flag in (
            "save_weight_copy", "save_input_copy") if getattr(self, flag) is not None)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, name={self.name!r}{extra}")
