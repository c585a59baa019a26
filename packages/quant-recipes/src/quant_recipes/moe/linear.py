"""``GroupedLinear``: one linear layer per expert over rows sorted by expert (mixture of experts).

``forward(x, offs)``: ``x [T, in_features]`` holds the rows of expert 0, then expert 1, ...;
``offs`` (int32/int64 ``[num_experts]``) are the cumulative end offsets of the groups, as
``torch._grouped_mm`` takes them; ``forward(x, counts=...)`` takes the rows per expert instead.
It returns ``[T, out_features]``: group ``g`` times ``weight[g]ᵀ`` (plus ``bias[g]``).

Inside :func:`~quant_recipes.autocast` every group's GEMMs (fprop, dgrad, wgrad) are those of
the dense :class:`~quant_recipes.Linear` on that group's rows, padded with zero rows to the
recipe's token alignment (:func:`~quant_recipes.moe.gemm.token_alignment`): the same
quantizers (roles with ``module_type="grouped_linear"``), one quantize call per group (a
tensor-wide amax is the group's), the same GEMM paths. The padding changes no output and no
gradient. Backward quantizes the input and the weight again (their columnwise copies; the
rowwise forms under ``backward_override="dequantized"``), so the input and weight quantizers must
give the same bytes again: value quantizers without stochastic rounding (no ``DelayedScaling``).
FP8 current scaling on FP8 tensor cores takes the quantize-once path instead
(:mod:`quant_recipes.moe.fp8_gemm`): all groups quantized at once, forward keeping the
transposed FP8 bytes that backward's GEMMs read.
Outside autocast it is a high-precision grouped linear (fp32 products, one rounding;
groups padded to 16 rows for ``torch._grouped_mm``).

Under ``torch.compile`` the grouped GEMMs are custom ops with static output shapes
(:mod:`quant_recipes.moe.ops`): group sizes may change on every step without a recompile.
"""

from __future__ import annotations

import math

import torch
from quant_core.inputs import check_dense
from quant_core.reference.fp8_grouped import row_amaxes
from quant_core.storage import QuantizedStorage

from ..autocast import Frame
from ..compiling import compiling
from ..identity import IdentityQuantizer
from ..module import QuantizedModule, intern, kept_linear_slots, module_frame
from ..operands import (
    autocast_off,
    output_dtype,
    plan_operands,
    requantizable,
    requantizing_backward,
    without_autocast,
)
from ..reuse import contents_key
from ..role import QuantizerRole
from ..step_weights import KeptWeight, drop, kept_buffers
from . import fp8_gemm
from .bias import group_sums
from .fp8 import Layout, layout, quantize_experts
from .gemm import check_offsets, check_on_device, token_alignment
from .ops import bprop, fp8_bprop, fp8_fprop, fprop
from .routes import Routes, token_gradients

#: The quantizer of every high-precision slot.
_HIGH_PRECISION = intern(IdentityQuantizer())
#: The ``(fprop, dgrad, wgrad)`` accumulation flags of a high-precision step (fp32 sums).
_NO_FAST_ACCUM = (False, False, False)


#: Positions of the arguments of :class:`_GroupedFn` and :class:`_GroupedFP8Fn` that take
#: gradients: the input, the weight, the bias; the layout's tensors follow them.
_X, _W, _B, _LAY = 0, 1, 2, 3
_LAY_END = _LAY + Layout.FIELDS


def _grads(ctx, dx, dw, db, rest: int) -> tuple:
    """``backward``'s return: the three gradients where asked for, None for the layout's
    tensors and the ``rest`` other arguments."""
    need = ctx.needs_input_grad
    return (dx if need[_X] else None, dw if need[_W] else None, db if need[_B] else None,
            *(None,) * (_LAY_END - _LAY + rest))


class _GroupedFn(torch.autograd.Function):
    """Forward/backward of the grouped linear; quantizers are plain arguments. The groups'
    padded layout (:class:`~.fp8.Layout`) comes as its tensors. ``rows``, ``copies`` (a top-k
    routing's :class:`~.routes.Routes` fields, or None): the layer's rows are ``x[rows]``,
    which the grouped routes read where they lie; backward keeps ``x`` (not a gathered copy)
    and each row of ``x`` gets the sum of its routed rows' gradients
    (:func:`~.routes.token_gradients`)."""

    @staticmethod
    def forward(ctx, x, w, b, *args):
        lay = Layout(*args[:Layout.FIELDS])
        qx, qw, qg, qx_bwd, qw_bwd, col, align, traced, fast, rows, copies = \
            args[Layout.FIELDS:]
        y = fprop(x, lay, w, b, qx, qw, align, traced, fast[0], rows)
        dgrad, wgrad = ctx.needs_input_grad[_X], ctx.needs_input_grad[_W]
        ctx.save_for_backward(x if wgrad else None, w if dgrad else None, rows, copies,
                              *lay.tensors())
        ctx.shapes = (x.shape, x.dtype, w.shape, w.dtype)
        ctx.q = (qg, qx_bwd, qw_bwd)
        ctx.col, ctx.align, ctx.traced, ctx.has_bias = col, align, traced, b is not None
        ctx.fast_accum = fast
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, gy):
        x, w, rows, copies, *lay = ctx.saved_tensors
        (x_shape, x_dtype, w_shape, w_dtype) = ctx.shapes
        dgrad, wgrad = ctx.needs_input_grad[_X], ctx.needs_input_grad[_W]
        dbias = ctx.has_bias and ctx.needs_input_grad[_B]
        # a stand-in (no data read) for the operand whose gradient partner is not needed
        x = x if x is not None else gy.new_empty(x_shape, dtype=x_dtype)
        w = w if w is not None else gy.new_empty(w_shape, dtype=w_dtype)
        dx, dw, db = bprop(gy.contiguous(), x, Layout(*lay), w, *ctx.q, ctx.col, ctx.align,
                           dgrad, wgrad, dbias, ctx.traced, *ctx.fast_accum[1:], rows)
        if dgrad and copies is not None:
            dx = token_gradients(dx, copies)
        return _grads(ctx, dx, dw, db, 11)


class _GroupedFP8Fn(torch.autograd.Function):
    """The quantize-once FP8 current-scaling path (:mod:`.fp8_gemm`): forward keeps the
    transposed FP8 bytes of the input and the weight that backward's GEMMs read (or, without
    ``keep_x_t`` / ``keep_w_t``, the input or weight itself, quantized again in backward). The
    bias gradient is each group's sum of the output gradient (:func:`.bias.group_sums`).

    ``rows``, ``copies`` (a top-k routing's :class:`~.routes.Routes` fields, or None): the
    layer's rows are ``x[rows]``, which the grouped quantize reads where they lie (no gathered
    copy), with the groups' amaxes from each row of ``x``'s amax (read once, however many rows
    repeat it); the input gradient of each row of ``x`` is then the sum of its routed rows'
    (:func:`~.routes.token_gradients`).

    ``kept_w`` (or None): the weight's bytes ``(rowwise, scale_inv, transposed)`` quantized by
    ``qw`` after the last optimizer step (:mod:`~quant_recipes.step_weights`): forward
    multiplies the rowwise bytes and backward reads the transposed ones, and neither quantizes
    the weight."""

    @staticmethod
    def forward(ctx, x, w, b, *args):
        lay = Layout(*args[:Layout.FIELDS])
        qx, qw, qg, traced, keep_x_t, keep_w_t, fast, align, rows, copies, kept_w = \
            args[Layout.FIELDS:]
        dgrad, wgrad = ctx.needs_input_grad[_X], ctx.needs_input_grad[_W]
        # the kept weight's transposed bytes stand for a transposed copy made here
        keep_x_t, keep_w_t = wgrad and keep_x_t, dgrad and (keep_w_t or kept_w is not None)
        y, xt, sx, wt, sw = fp8_fprop(x, lay, w, b, qx, qw, keep_x_t,
                                      keep_w_t and kept_w is None, traced, fast[0],
                                      _row_amaxes(x, traced, rows), rows,
                                      None if kept_w is None else kept_w[:2])
        if kept_w is not None:
            _, sw, wt = kept_w
        ctx.requant = (wgrad and not keep_x_t, dgrad and not keep_w_t)
        ctx.save_for_backward(x if ctx.requant[0] else xt, sx, w if ctx.requant[1] else wt, sw,
                              rows, copies, *lay.tensors())
        ctx.q, ctx.traced, ctx.fast_accum, ctx.align = (qg, qx, qw), traced, fast, align
        ctx.bias_dtype = None if b is None else b.dtype
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, gy):
        xt, sx, wt, sw, rows, copies, *lay = ctx.saved_tensors
        lay = Layout(*lay)
        dgrad, wgrad = ctx.needs_input_grad[_X], ctx.needs_input_grad[_W]
        qg, qx, qw = ctx.q
        # the bias gradient first: compiled code releases gy once its last reader has run
        db = (group_sums(gy, lay.offs, ctx.bias_dtype) if ctx.needs_input_grad[_B] else None)
        # the input (weight) itself was kept (ctx.requant): backward quantizes its transposed
        # bytes again, from forward's amaxes (column 1 of its scale-inverses), so no amax
        # pass, each just before the GEMM that reads it, so that the weight's are released
        # before the weight gradient is made. The output gradient's amax is the quantize's
        # own pass: computed where the gradient is made (a SwiGLU's backward), the row
        # reduction turns Inductor's pointwise kernel into a looped reduction that costs more
        # than the pass it saves
        dx, dw = fp8_bprop(gy.contiguous(), lay, xt, sx, wt, sw, qg, qx, qw, dgrad, wgrad,
                           ctx.traced, *ctx.fast_accum[1:], ctx.align, *ctx.requant, rows)
        if dx is not None and copies is not None:
            dx = token_gradients(dx, copies)
        return _grads(ctx, dx, dw, db, 11)


def _row_amaxes(t: torch.Tensor, traced: bool, rows: torch.Tensor | None = None
                ) -> torch.Tensor | None:
    """Each layer row's amax, ``t``'s rows or those of ``t[rows]``, in traced code: torch ops
    that Inductor computes in the kernel that makes ``t`` (the grouped quantize then reads
    ``t`` once, for the cast); None in eager code, where the quantize finds them itself."""
    if not traced:
        return None
    amax = row_amaxes(t)
    return amax if rows is None else amax[rows]


def _route_args(routes: Routes | None) -> tuple:
    """``(rows, copies)`` of ``routes`` for the layer's autograd functions (Nones without)."""
    return (None, None) if routes is None else (routes.rows, routes.copies)


def _layout(offs: torch.Tensor, total: int, align: int, layouts: dict | None) -> Layout:
    """The padded layout of ``offs`` at ``align`` rows, from ``layouts`` where it is there (and
    added to it)."""
    if layouts is None:
        return layout(offs, total, align)
    if align not in layouts:
        layouts[align] = layout(offs, total, align)
    return layouts[align]


class GroupedProjection(QuantizedModule):
    """The quantized grouped GEMMs of ``num_experts`` projections ``in_features ->
    out_features`` whose weights another module owns (:class:`GroupedLinear` owns its own; a
    converted Hugging Face experts block owns two). It holds no parameters and no state: its
    name gives the roles, forward ``[("grouped_linear", "input", name), ("grouped_linear",
    "weight", name), output_quantizer_role]``, backward ``[("grouped_linear", "grad_output",
    name), grad_input_quantizer_role]``, one quantizer per slot, applied to every group.

    ``save_weight_copy`` / ``save_input_copy``: as :class:`~quant_recipes.Linear`'s, for the
    quantize-once FP8 path (:mod:`~quant_recipes.moe.fp8_gemm`), the only one that keeps
    quantized copies from forward to backward: keep the weight's (input's) transposed FP8 bytes
    for backward, or keep the weight (input) itself and quantize it again in backward, the same
    bytes for less memory held through the step. The weight's default is not to keep its copy:
    the experts' weights are most of a mixture-of-experts layer's bytes (at Qwen3-MoE widths
    the weights' FP8 copies take 604 MB a layer, the routed inputs' 184 MB at 8192 tokens), so
    keeping them would hold half the experts' bf16 bytes again through the step, to save one
    cast pass in backward; the input's copy is kept by default."""

    #: Defaults, also for modules pickled before the two flags existed (the instance's own win).
    save_weight_copy = False
    save_input_copy = True
    #: The weight quantized after the last optimizer step (:mod:`quant_recipes.step_weights`).
    _step_weight: KeptWeight | None = None

    def __init__(self, num_experts: int, in_features: int, out_features: int, *,
                 name: str = "", save_weight_copy: bool = False,
                 save_input_copy: bool = True) -> None:
        super().__init__(name=name)
        self.save_weight_copy, self.save_input_copy = save_weight_copy, save_input_copy
        for what, v in (("num_experts", num_experts), ("in_features", in_features),
                        ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{type(self).__name__}: {what} must be an int >= 1, got {v!r}")
        self.num_experts, self.in_features, self.out_features = (num_experts, in_features,
                                                                 out_features)
        self._roles_changed()

    def _roles_changed(self) -> None:
        name = self.name
        self._fwd_roles = (QuantizerRole("grouped_linear", "input", name),
                           QuantizerRole("grouped_linear", "weight", name),
                           self._output_quantizer_role)
        self._bwd_roles = (QuantizerRole("grouped_linear", "grad_output", name),
                           self._grad_input_quantizer_role)

    def _apply(self, fn, recurse: bool = True):
        drop(self)  # a conversion (.to, .half) changes the weight the kept copies were made of
        return super()._apply(fn, recurse)

    def _kept_slots(self, recipe, num_gemms: int):
        # a grouped layer's slots are a dense Linear's: no built-in recipe tells the two
        # module types apart (MXFP8's 2D weights take both)
        return kept_linear_slots(self, GroupedProjection, recipe, num_gemms)

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int):
        roles = self._fwd_roles if fwd else self._bwd_roles
        if num_quantizers != len(roles):
            raise ValueError(f"GroupedLinear has {len(roles)} {'forward' if fwd else 'backward'} "
                             f"slots, asked for {num_quantizers}")
        return roles

    def offsets(self, x: torch.Tensor, offs, counts) -> torch.Tensor:
        """``offs``, or the cumulative sum of ``counts``, checked against ``x``: on the CPU a
        ``ValueError``, on a GPU an asynchronous device assertion (no host read), while
        compiling not at all."""
        if (offs is None) == (counts is None):
            raise TypeError("GroupedLinear: pass exactly one of offs (cumulative end offsets of "
                            "the groups) and counts (rows per expert)")
        what, t = ("offs", offs) if offs is not None else ("counts", counts)
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"GroupedLinear: {what} must be an int32 or int64 tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != (self.num_experts,):
            raise ValueError(f"GroupedLinear: {what} must have shape ({self.num_experts},) (one "
                             f"entry per expert), got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"GroupedLinear: {what} is on {t.device} but x is on {x.device}")
        if compiling():
            return offs if counts is None else counts.cumsum(0)
        if counts is not None:
            check_on_device(counts >= 0, lambda: f"GroupedLinear: counts must be non-negative, "
                            f"got {counts.tolist()}")
            check_on_device(counts.sum() == x.shape[0], lambda: f"GroupedLinear: counts must "
                            f"sum to the rows of x ({x.shape[0]}), got {int(counts.sum())}")
            return counts.cumsum(0)
        if offs.device.type == "cpu":
            check_offsets([int(v) for v in offs.tolist()], x.shape[0])
        else:
            check_on_device(torch.cat([offs[:1] >= 0, offs[1:] >= offs[:-1],
                                       offs[-1:] == x.shape[0]]), lambda: "")
        return offs

    def check_input(self, x: torch.Tensor, w: torch.Tensor) -> None:
        """``TypeError``/``ValueError`` naming what is wrong with ``x`` or the weight ``w``."""
        if isinstance(w, QuantizedStorage):
            raise TypeError("GroupedLinear: the weight must be a high-precision tensor")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"GroupedLinear: x must be a tensor, got {type(x).__name__}")
        check_dense(x, "GroupedLinear")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"GroupedLinear: x must be [tokens, in_features={self.in_features}]"
                             f", got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"GroupedLinear: x must be a floating-point tensor, got {x.dtype}")
        if x.device != w.device:
            raise ValueError(f"GroupedLinear: x is on {x.device} but the weight on {w.device}")

    def project(self, x: torch.Tensor, offs: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None, layouts: dict | None = None,
                routes: Routes | None = None, param: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Group ``g`` of ``x`` (rows ``offs[g-1]:offs[g]``) times ``w[g]ᵀ`` (plus ``b[g]``):
        quantized as the innermost :func:`~quant_recipes.autocast` (or the bound recipe) says,
        else in high precision. ``w [num_experts, out_features, in_features]``; the inputs are
        assumed checked (:meth:`check_input`, :meth:`offsets`). ``layouts``: the padded
        layouts of ``offs`` already made, by alignment, which this call reuses and adds to
        (projections over the same rows share one). ``routes`` (:func:`~.routes.route`): the
        layer's rows are ``x[routes.rows]``, a mixture-of-experts block's tokens in expert
        order, each token as many times as it is routed; the grouped routes read them where
        they lie (no gathered copy, and backward keeps ``x`` itself), the per-group path
        gathers them first. Each token's input gradient is the fp32 sum of its routed rows'
        gradients in route order (deterministic). ``param``: the Parameter ``w`` views (``w``
        itself by default), whose kept quantized bytes (:mod:`~quant_recipes.step_weights`)
        the quantize-once FP8 path reads when they are ``w``'s under this step's quantizer."""
        traced = compiling()
        frame = module_frame(self)
        total = x.shape[0] if routes is None else routes.rows.shape[0]
        if frame is None or not frame.enabled:
            hp = _HIGH_PRECISION
            lay = _layout(offs, total, 16, layouts)
            return _GroupedFn.apply(x, w, b, *lay.tensors(), hp, hp, hp, hp, hp, False, 16,
                                    traced, _NO_FAST_ACCUM, *_route_args(routes))
        if frame.amax_reduction_group is not None:
            raise ValueError("GroupedLinear: autocast's amax_reduction_group is not supported "
                             "(each expert group has its own amax)")
        # under torch.autocast: quant's arithmetic in the operands' dtypes, the output rounded
        # once to autocast's dtype (operands.output_dtype)
        out_dtype = output_dtype(x)
        with autocast_off(x.device.type):
            y = self._quantized(frame, x, offs, w, b, total, traced, layouts, routes, param)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def _quantized(self, frame, x, offs, w, b, total, traced, layouts, routes, param):
        """:meth:`project`'s quantized GEMMs, in the operands' dtypes."""
        if frame.recipe.delayed():
            raise ValueError("GroupedLinear does not support DelayedScaling (its backward "
                             "quantizes the input and weight again, which needs stateless "
                             "quantizers); use Float8CurrentScaling")
        qset = self.quantizers(frame, device=w.device)
        for q, what in ((qset.fwd[0], "input"), (qset.fwd[1], "weight")):
            if not requantizable(q):
                raise ValueError(
                    f"GroupedLinear {self.name!r}: the {what} quantizer {q!r} does not give the "
                    "same bytes when it quantizes again, which the backward does; use a value "
                    "quantizer without stochastic rounding for the input and weight")
        grad = torch.is_grad_enabled()
        plan, qx, qw, align, once = self._plan(qset, frame.recipe, w.device, w.dtype, x.dtype,
                                               grad and w.requires_grad, grad and x.requires_grad)
        if once:
            align = fp8_gemm.layout_alignment(align, qset.bwd[0], qx, x.device,
                                              self.num_experts)
            lay = _layout(offs, total, align, layouts)
            kept = self._step_weight
            kept_w = None if kept is None else kept_buffers(
                kept, w if param is None else param, qw)
            return _GroupedFP8Fn.apply(x, w, b, *lay.tensors(), qx, qw, qset.bwd[0], traced,
                                       plan.input_bwd is None, plan.weight_bwd is None,
                                       plan.fast_accum, align, *_route_args(routes), kept_w)
        lay = _layout(offs, total, align, layouts)
        again = requantizing_backward(plan, qset, _HIGH_PRECISION)
        return _GroupedFn.apply(x, w, b, *lay.tensors(), qx, qw, *again, plan.columnwise, align,
                                traced, plan.fast_accum, *_route_args(routes))

    def _plan(self, qset, recipe, device: torch.device, w_dtype: torch.dtype,
              x_dtype: torch.dtype, wgrad: bool, dgrad: bool):
        """``(plan, qx, qw, align, once)``: the step's operand plan, the rowwise input and
        weight quantizers the grouped GEMMs take, the groups' token alignment, and whether the
        step runs the quantize-once FP8 path (:mod:`.fp8_gemm`)."""
        plan = plan_operands(qset, recipe.backward_override, wgrad=wgrad, dgrad=dgrad,
                             keep_weight=self.save_weight_copy, keep_input=self.save_input_copy)
        # the grouped GEMMs quantize the forward operands rowwise; what backward reads, each
        # path makes itself: the quantize-once FP8 path keeps transposed copies where the plan
        # keeps one, the per-group paths quantize both operands again
        qx, qw = (qset.variant(q, columnwise_usage=False) for q in (plan.input, plan.weight))
        align = token_alignment(recipe, (*qset.fwd[:2], qset.bwd[0]))
        once = (plan.columnwise and w_dtype == x_dtype and fp8_gemm.takes(
            (qx, qw, qset.bwd[0]), device, x_dtype, align, self.in_features, self.out_features))
        return plan, qx, qw, align, once

    def kept_weight(self, param: torch.nn.Parameter, w: torch.Tensor, recipe
                    ) -> KeptWeight | None:
        """``w`` (``param`` or the view of it this layer multiplies) quantized as a training
        step under ``recipe`` quantizes it on the quantize-once FP8 path (the rowwise bytes,
        their scale-inverses and the transposed bytes, from one amax per expert), for
        :func:`~quant_recipes.quantize_weights_per_step`; None where the step takes another
        path or quantizes again to other bytes."""
        if recipe.delayed():
            return None
        qset = self.quantizers(Frame(True, recipe, False, None), device=w.device)
        if not all(requantizable(q) for q in qset.fwd[:2]):
            return None
        _, _, qw, _, once = self._plan(qset, recipe, w.device, w.dtype, w.dtype,
                                       param.requires_grad, True)
        if not once:
            return None
        key = contents_key(param, None)
        with torch.no_grad():
            wd, wt, sw = quantize_experts(w, qw, True, True)
        return KeptWeight(param, qw, (wd, sw, wt), key)

    def forward(self, x: torch.Tensor, offs: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`project` after checking the arguments."""
        self.check_input(x, w)
        return self.project(x, self.offsets(x, offs, None), w, b)

    def _copies_repr(self) -> str:
        """The copy flags that differ from the defaults (the class attributes)."""
        return "".join(f", {flag}={getattr(self, flag)}"
                       for flag in ("save_weight_copy", "save_input_copy")
                       if getattr(self, flag) != getattr(GroupedProjection, flag))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, name={self.name!r}{self._copies_repr()}")


class GroupedLinear(GroupedProjection):
    """``num_experts`` linear layers ``in_features -> out_features`` in one module; one
    ``weight`` parameter ``[num_experts, out_features, in_features]`` (and ``bias``
    ``[num_experts, out_features]``), each expert initialised as ``nn.Linear`` initialises its
    layer.

    Roles: forward ``[("grouped_linear", "input", name), ("grouped_linear", "weight", name),
    output_quantizer_role]``, backward ``[("grouped_linear", "grad_output", name),
    grad_input_quantizer_role]``; one quantizer per slot, applied to every group.
    ``save_weight_copy`` / ``save_input_copy``: see :class:`GroupedProjection`.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 *, device=None, dtype=None, name: str = "", save_weight_copy: bool = False,
                 save_input_copy: bool = True) -> None:
        super().__init__(num_experts, in_features, out_features, name=name,
                         save_weight_copy=save_weight_copy, save_input_copy=save_input_copy)
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(
            torch.empty((num_experts, out_features, in_features), **factory))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty((num_experts, out_features), **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for e in range(self.num_experts):
                torch.nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features)
                torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, offs: torch.Tensor | None = None, *,
                counts: torch.Tensor | None = None) -> torch.Tensor:
        self.check_input(x, self.weight)
        return self.project(x, self.offsets(x, offs, counts), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"name={self.name!r}{self._copies_repr()}")
