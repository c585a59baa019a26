"""``Linear``: ``y = x Wᵀ + b`` with quantized GEMM operands inside :func:`autocast`.

Forward quantizes the input (rowwise for fprop, columnwise for wgrad) and the weight (rowwise,
columnwise for dgrad) with the forward quantizers; backward quantizes ``grad_output`` with the
backward quantizer captured at *forward* time. GEMMs run through :mod:`quant_recipes.gemm`.
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
from typing import NamedTuple

import torch
import torch.nn.functional as F
from quant_core import Quantizer
from quant_core.distributed import reduce_amax
from quant_core.inputs import check_dense
from quant_core.storage import QuantizedStorage, absent_buffer, storage_class
from quant_core.tensor import tags_of

from .autocast import current_region
from .compiling import compiling, dynamo
from .delayed import update_registered
from .fsdp_layout import base, columnwise_buffer_list
from .gemm import HP, HP_META, for_transposed_use, qgemm, quantizer_meta
from .module import QuantizedModule, check_operands, intern, is_value, module_frame
from .reuse import shared_quantization
from .role import QuantizerRole
from .states import RecipeState
from .weight_cache import cached_quantization


def amax_per_row(q: Quantizer) -> bool:
    """Whether ``q`` scales each row by the row's own amax (row-scaled NVFP4): ranks that hold
    other rows (autocast's ``amax_reduction_group``, data or sequence parallel) share nothing
    with it. Read from the storage tags, as compiled code reads them (``quantizer_meta``)."""
    return bool(q._storage_tags().get("_row_scaled_nvfp4", False))


def quantize_buffers(x: torch.Tensor, q: Quantizer, group) -> list[torch.Tensor]:
    """``q``'s storage buffers for ``x`` (an absent buffer is an empty uint8 tensor), the
    tensor-wide amax all-reduced over ``group`` (a per-row amax is not: :func:`amax_per_row`)."""
    if quantizer_meta(q)[0] == HP:
        return [x]
    if group is not None and amax_per_row(q):
        group = None
    if compiling():
        ops = dynamo()
        # with a group, Linear asks every quantizer for the reduction (with_amax_reduction), as
        # eager code does; torch 2.10 cannot derive that variant in a graph, so it is not read
        if group is not None and q.reduces_amax:
            # the amax leaves the op, is all-reduced by a functional collective (it traces; the
            # group is this call's, never part of the quantizer value), and comes back in
            amax = reduce_amax(ops.amax(x, q), group)
            return list(ops.quantize_with_amax(x, amax, q))
        return list(ops.quantize(x, q))
    def quantize():
        return q.quantize(x, amax_reduction_group=group).buffer_list(x)

    if isinstance(x, torch.nn.Parameter):
        return cached_quantization(x, q, group, quantize)
    return shared_quantization(x, q, group, quantize)


def kept_for_backward(bufs: list[torch.Tensor], meta: list[int], override, needed: bool):
    """What backward keeps of a forward operand: nothing when no backward GEMM reads it (x
    without a weight gradient, the weight without an input gradient); the columnwise copy alone
    when the backward GEMMs use it transposed (no override); all of it for the
    "dequantized" override, whose backward GEMMs read the rowwise forms."""
    if not needed:
        return [absent_buffer(t) for t in bufs]
    return for_transposed_use(bufs, meta) if override is None else bufs


class OperandQuantizers(NamedTuple):
    """The quantizers of one quantized linear call (:func:`operand_quantizers`)."""

    input: Quantizer
    weight: Quantizer
    grad: Quantizer
    #: The columnwise copy backward quantizes from the weight saved as is (None: the copy is
    #: made in forward and saved, or no backward GEMM reads it).
    weight_bwd: Quantizer | None
    #: Likewise for the input.
    input_bwd: Quantizer | None


def operand_quantizers(layer, qset, override, *, wgrad: bool, dgrad: bool, group=None,
                       weight_quantized: bool = False, input_quantized: bool = False
                       ) -> OperandQuantizers:
    """The usage variants of ``qset``'s quantizers that a call of ``layer`` (a ``Linear``)
    quantizes with: each operand's columnwise copy only where a backward GEMM reads it (none
    under a backward override), made in backward from the operand saved as is where the layer
    says so (``save_weight_copy=False``, ``save_input_copy=False``) and requantizing gives the
    same bytes (not for an operand that arrives quantized), and ``with_amax_reduction`` with a
    ``group`` (not for a per-row amax: :func:`amax_per_row`)."""
    def red(q):
        return {} if group is None or amax_per_row(q) else {"with_amax_reduction": True}

    transposed = override is None
    fwd_in, fwd_w = qset.fwd[0], qset.fwd[1]
    # save_weight_copy=False: backward quantizes the weight's columnwise copy itself, so
    # forward makes only the rowwise form (a compiled graph would otherwise keep forward's
    # copy for backward, the two quantizations being one expression)
    requant_w = (not layer.save_weight_copy and not weight_quantized and dgrad and transposed
                 and _requantizable(fwd_w))
    requant_x = (not layer.save_input_copy and not input_quantized and wgrad and transposed
                 and _requantizable(fwd_in))
    return OperandQuantizers(
        qset.variant(fwd_in, columnwise_usage=wgrad and transposed and not requant_x,
                     **red(fwd_in)),
        qset.variant(fwd_w, columnwise_usage=dgrad and transposed and not requant_w,
                     **red(fwd_w)),
        qset.variant(qset.bwd[0], rowwise_usage=dgrad or not wgrad, columnwise_usage=wgrad,
                     **red(qset.bwd[0])),
        # what backward quantizes again: the columnwise copy alone
        *(qset.variant(q, rowwise_usage=False, columnwise_usage=True, **red(q)) if again
          else None for q, again in ((fwd_w, requant_w), (fwd_in, requant_x))))


def save_operands(ctx, x, xb, xm, w, wb, wm, override, input_bwd_q, weight_bwd_q):
    """Save for backward what its GEMMs read of the high-precision input ``x`` and weight
    ``w`` (quantized: ``xb``, ``wb`` with metas ``xm``, ``wm``): the originals for the
    "high_precision" override; else an operand with a backward quantizer (``input_bwd_q``,
    ``weight_bwd_q``, :func:`operand_quantizers`) as is, the other as
    :func:`kept_for_backward` says. Returns the metas backward reads the saved operands with;
    :func:`saved_operands` gives them back."""
    ctx.input_bwd_q = ctx.weight_bwd_q = None
    if override == "high_precision":
        ctx.save_for_backward(x, w)
        ctx.nx = 1
        return list(HP_META), list(HP_META)
    if input_bwd_q is not None:
        kept_x, ctx.input_bwd_q = [x], input_bwd_q
    else:
        kept_x = kept_for_backward(xb, xm, override, ctx.needs_input_grad[1])
    if weight_bwd_q is not None and override is None and ctx.needs_input_grad[0]:
        # the weight itself (a parameter: no new memory), quantized again in backward
        ctx.save_for_backward(*kept_x, w)
        ctx.weight_bwd_q = weight_bwd_q
    else:
        ctx.save_for_backward(*kept_x,
                              *kept_for_backward(wb, wm, override, ctx.needs_input_grad[0]))
    ctx.nx = len(kept_x)
    return xm, wm


def saved_operands(ctx, quantize) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(xb, wb)`` that :func:`save_operands` saved, an operand saved as is quantized again by
    ``quantize(tensor, quantizer, i)`` (``i``: 0 the input, 1 the weight)."""
    saved = ctx.saved_tensors
    xb, wb = list(saved[:ctx.nx]), list(saved[ctx.nx:])
    if ctx.input_bwd_q is not None:  # the columnwise copy, from the input saved as is
        xb = quantize(xb[0], ctx.input_bwd_q, 0)
    if ctx.weight_bwd_q is not None:  # the columnwise copy, from the weight saved as is
        wb = quantize(wb[0], ctx.weight_bwd_q, 1)
    return xb, wb


def _requantizable(q: Quantizer) -> bool:
    """Whether quantizing the weight again in backward gives the forward's bytes: a value
    quantizer that says so (``is_requantization_safe``: not with stochastic rounding); a
    delayed-scaling quantizer's scale changes when the region exits, between forward and
    backward."""
    return is_value(q) and q.is_requantization_safe()


def _rowwise(w: QuantizedStorage, q: Quantizer) -> torch.Tensor | None:
    """The rowwise data of ``w``, a storage of ``q``'s format (read from the quantizer: under
    compile ``w`` is a traced tensor)."""
    return getattr(w, storage_class(q.storage_format).rowwise_data_name)


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
            f"this layer's weight with {q!r}; run the layer under the recipe its weight was "
            "quantized for (quantized_model_init / enable_fsdp_quantized_all_gather)"
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
    """Forward/backward of the quantized linear on 2D ``x``; quantizers are plain arguments."""

    @staticmethod
    def forward(ctx, x, w, b, input_q, weight_q, grad_q, group, override, region, weight_bwd_q,
                input_bwd_q):
        m, k = x.shape
        n = w.shape[0]
        xb = quantize_buffers(x, input_q, group)
        ctx.weight_quantized = isinstance(w, QuantizedStorage)
        wb = w.buffer_list(x) if ctx.weight_quantized else quantize_buffers(w, weight_q, group)
        xm, wm = quantizer_meta(input_q), quantizer_meta(weight_q)
        y = qgemm(xb, xm, (m, k), False, False, wb, wm, (n, k), False, True, b, x.dtype)
        if ctx.weight_quantized:  # the weight tensor itself (FSDP2 refills its buffers)
            ctx.weight_bwd_q, ctx.input_bwd_q = None, input_bwd_q
            # x itself when backward quantizes it again, else what the wgrad GEMM reads of xb
            saved = [x] if override == "high_precision" or input_bwd_q is not None else (
                kept_for_backward(xb, xm, override, ctx.needs_input_grad[1]))
            ctx.save_for_backward(*saved, w)
            ctx.nx = len(saved)
            if override == "high_precision":
                xm = list(HP_META)
        else:
            xm, wm = save_operands(ctx, x, xb, xm, w, wb, wm, override, input_bwd_q,
                                   weight_bwd_q)
        ctx.meta = (xm, wm, (m, k), (n, k), x.dtype, w.dtype)
        ctx.grad_q, ctx.group, ctx.override, ctx.region = grad_q, group, override, region
        ctx.weight_q = weight_q
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        xb, wb = saved_operands(ctx, lambda t, q, _: quantize_buffers(t, q, ctx.group))
        xm, wm, (m, k), (n, _), x_dtype, w_dtype = ctx.meta
        if ctx.weight_quantized:
            w = wb[0]
            if ctx.override == "high_precision":
                wb, wm = [w.dequantize(dtype=w_dtype)], list(HP_META)
            elif ctx.override is None:
                wb = for_transposed_use(columnwise_buffer_list(w, gy, ctx.weight_q), wm)
            else:
                wb = w.buffer_list(gy)
        gy = gy.contiguous()
        if ctx.override is None:
            gb, gm = quantize_buffers(gy, ctx.grad_q, ctx.group), quantizer_meta(ctx.grad_q)
            col = True
        else:  # "high_precision" keeps the originals, "dequantized" uses the rowwise forms
            gb, gm = [gy], list(HP_META)
            col = False
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = qgemm(gb, gm, (m, n), False, False, wb, wm, (n, k), col, False, None, x_dtype)
        if ctx.needs_input_grad[1]:
            dw = qgemm(gb, gm, (m, n), col, True, xb, xm, (m, k), col, False, None, w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = gy.to(torch.float32).sum(0).to(w_dtype)
        if ctx.region is not None:
            update_registered(ctx.region.backward)
        return dx, dw, db, None, None, None, None, None, None, None, None


class Linear(QuantizedModule, torch.nn.Linear):
    """A linear layer whose GEMMs are quantized inside :func:`autocast`.

    It is an ``nn.Linear`` (same constructor, attributes, ``state_dict`` keys and
    initialisation), so code that looks for ``isinstance(m, nn.Linear)`` (Hugging Face's weight
    init, PEFT's target matching, module filters) treats it as one; only ``forward`` differs.
    Quantizing, ``forward`` refuses before any quantize or GEMM what ``nn.Linear`` refuses
    (operands on different devices; mixed dtypes outside ``torch.autocast``) and widths that a
    quantize of the step, backward's included, cannot take (:func:`check_step_shapes`).

    Roles: forward ``[("linear", "input", name), ("linear", "weight", name),
    output_quantizer_role]``, backward ``[("linear", "grad_output", name),
    grad_input_quantizer_role]`` (boundary roles default to ``None``).
    """

    #: Defaults for modules pickled before the two flags existed (the instance's own win).
    save_weight_copy = True
    save_input_copy = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device=None, dtype=None, name: str = "", save_weight_copy: bool = True,
                 save_input_copy: bool = True) -> None:
        # nn.Linear makes weight and bias and initialises them (reset_parameters, below)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype, name=name)
        #: Keep the weight's quantized columnwise copy from forward for the input-gradient GEMM
        #: (default), or save the weight itself and quantize it again in backward (False): less
        #: memory held through the step, one more weight quantize per backward, the same bytes.
        #: False suits FSDP2, which frees the gathered weight after forward.
        self.save_weight_copy = save_weight_copy
        #: Keep the input's quantized columnwise copy from forward for the weight-gradient GEMM
        #: (default), or save the input itself and quantize it again in backward (False), as
        #: torchao's float8 training does: the same bytes, one more input quantize per backward.
        #: Eagerly this holds the high-precision input (more bytes than the copy unless
        #: something else keeps it anyway); compiled, the partitioner may instead recompute the
        #: input from what its producer's backward keeps (a norm's input and reciprocal root),
        #: so the layer holds nothing of its own between forward and backward.
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
        w = self.weight
        if frame is None:
            return F.linear(x, _high_precision(w, x.dtype), self.bias)
        check_dense(x, "Linear")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise RuntimeError(
                f"Linear: the input's last dimension must be in_features={self.in_features}, "
                f"got input shape {tuple(x.shape)}"
            )
        quantized_w = isinstance(w, QuantizedStorage)
        b = self.bias
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
        wgrad = grad and w.requires_grad
        dgrad = grad and x.requires_grad
        group = frame.amax_reduction_group
        operands = operand_quantizers(self, qset, frame.recipe.backward_override, wgrad=wgrad,
                                      dgrad=dgrad, group=group, weight_quantized=quantized_w)
        # a 2-D input goes in and comes out as it is: a reshaped output would be a view, which a
        # compiled function regenerates on every call (aten._unsafe_view, host time)
        flat = x.dim() == 2
        lead = x.shape[:-1]
        x2 = x if flat else x.reshape(lead.numel(), self.in_features)
        if not compiling() or dynamo().DERIVES_IN_GRAPH:  # torch 2.10 runs no quantizer method
            backward = grad and (x.requires_grad or w.requires_grad
                                 or (b is not None and b.requires_grad))
            checked = [("input", q, x2) for q in (operands.input, operands.input_bwd)
                       if q is not None]
            if not quantized_w:  # a quantized weight was checked when it was quantized
                checked += [("weight", q, w) for q in (operands.weight, operands.weight_bwd)
                            if q is not None]
            if backward and frame.recipe.backward_override is None:
                checked.append(("grad_output", operands.grad, x2))
            check_step_shapes(self.name, self.in_features, self.out_features, frame.recipe,
                              checked)
        region = None
        if not compiling():
            fwd_ds, bwd_ds = self.delayed_states(qset)
            r = current_region()
            if r is not None and (fwd_ds or bwd_ds):
                if r.add(fwd_ds, bwd_ds, frame.recipe, group):
                    region = r
        y = _QLinearFn.apply(
            x2, w, b, operands.input, operands.weight, operands.grad, group,
            frame.recipe.backward_override, region, operands.weight_bwd, operands.input_bwd,
        )
        return y if flat else y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        extra = "" if self.save_weight_copy else ", save_weight_copy=False"
        extra += "" if self.save_input_copy else ", save_input_copy=False"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, name={self.name!r}{extra}")
