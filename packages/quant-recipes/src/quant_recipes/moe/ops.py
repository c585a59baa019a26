"""The grouped GEMMs as custom ops, for ``torch.compile``: ``quant_recipes::grouped_fprop`` and
``quant_recipes::grouped_bprop`` run :func:`~quant_recipes.moe.gemm.grouped_fprop` /
``grouped_bprop`` opaquely, and ``quant_recipes::grouped_fp8_fprop`` and
backward's ``grouped_fp8_grad_bytes`` / ``grouped_fp8_dgrad`` / ``grouped_fp8_wgrad`` the
quantize-once FP8 path (:mod:`.fp8_gemm`; the two GEMM ops also quantize a kept input or
weight again, just before the GEMM that reads it), and ``grouped_grad_operands`` /
``grouped_dgrad`` / ``grouped_wgrad`` the backward parts of the FP8 block, NVFP4 and decoded
``torch._grouped_mm`` routes (:mod:`.backward_parts`), so the groups'
data-dependent sizes never reach the graph: the outputs have static shapes (``[T, N]``,
``[T, K]``, ``[E, N, K]``, ``[E, N]``; the FP8 path's kept bytes ``[K, rows]`` and
``[E, K, N]``, ``rows`` the padded layout's ``roundup(T, align) + E * align``), and a step with
other group sizes runs the same graph. The groups' padded layout (:class:`~.fp8.Layout`) enters
each op as its list of tensors (``Tensor[] lay``), computed once by the layer in traced code.

Quantizers travel as strings, ``repr(q.value_key())`` (a value quantizer's class name and
fields, read on the real object at trace time: torch >= 2.11), and are rebuilt once per
distinct string. Eager code calls the functions directly, with the quantizer objects.
"""

from __future__ import annotations

import ast
import functools

import torch
from quant_core import value_classes

from ..compiling import dynamo
from ..module import intern
from . import fp8_gemm
from .bias import group_sums as bias_sums
from .fp8 import SCALE_PITCH, Layout
from .gemm import ROUTES, backward_route, grouped_bprop, grouped_fprop

#: Why a torch cannot trace :func:`quantizer_spec` (2.10 reads no member of a baked value).
NEEDS_MEMBERS = ("GroupedLinear under torch.compile reads its quantizers' value keys at trace "
                 "time, which needs torch >= 2.11 (opaque-value members); run it eagerly here")


def quantizer_spec(q) -> str:
    """The string a grouped op receives for value quantizer ``q`` (while tracing)."""
    if not dynamo().DERIVES_IN_GRAPH:
        raise RuntimeError(NEEDS_MEMBERS)
    return repr(q.value_key())


@functools.lru_cache(maxsize=1024)
def quantizer_of(spec: str):
    """The quantizer :func:`quantizer_spec` wrote (one object per distinct string)."""
    name, items = ast.literal_eval(spec)
    classes = [c for c in value_classes() if c.__qualname__ == name]
    if not classes:
        raise TypeError(f"GroupedLinear: no value quantizer class named {name!r}")
    return intern(dynamo().rebuild_quantizer(classes[-1], items))


_lib = torch.library.Library("quant_recipes", "FRAGMENT")


def _op(schema: str, impl, fake) -> None:
    """Define ``quant_recipes::<schema>`` with its eager body and its fake (shapes only)."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"quant_recipes::{name}", fake, lib=_lib)


def _layout(lay) -> Layout:
    return Layout(*lay)


def _fprop(x, lay, w, b, q, align, fast_accum=False, x_rows=None):
    return grouped_fprop(x, _layout(lay), w, b, *map(quantizer_of, q), align, fast_accum,
                         x_rows)


def _fprop_fake(x, lay, w, b, q, align, fast_accum=False, x_rows=None):
    return x.new_empty((_layout(lay).total, w.shape[1]))


def _bprop(gy, x, lay, w, q, col, align, dgrad, wgrad, bias, fast_dgrad=False,
           fast_wgrad=False, x_rows=None):
    return grouped_bprop(gy, x, _layout(lay), w, *map(quantizer_of, q), col, align, dgrad,
                         wgrad, bias, fast_dgrad, fast_wgrad, x_rows)


def _bprop_fake(gy, x, lay, w, q, col, align, dgrad, wgrad, bias, fast_dgrad=False,
                fast_wgrad=False, x_rows=None):
    (total, k), (experts, n) = (gy.shape[0], x.shape[1]), w.shape[:2]
    return (x.new_empty((total, k) if dgrad else (0,)),
            w.new_empty((experts, n, k) if wgrad else (0,)),
            w.new_empty((experts, n) if bias else (0,)))


_op("grouped_fprop(Tensor x, Tensor[] lay, Tensor w, Tensor? b, str[] q, int align, "
    "bool fast_accum=False, Tensor? x_rows=None) -> Tensor", _fprop, _fprop_fake)
_op("grouped_bprop(Tensor gy, Tensor x, Tensor[] lay, Tensor w, str[] q, bool col, int align, "
    "bool dgrad, bool wgrad, bool bias, bool fast_dgrad=False, bool fast_wgrad=False, "
    "Tensor? x_rows=None) -> (Tensor, Tensor, Tensor)", _bprop, _bprop_fake)


def _distinct(tensors) -> list[torch.Tensor]:
    """``tensors`` as an op's outputs: one that shares memory with an earlier one is copied
    (a high-precision gradient's two forms are one tensor; an op's outputs may not alias)."""
    out, seen = [], set()
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        out.append(t.clone() if ptr in seen and t.numel() else t)
        seen.add(ptr)
    return out


def _grad_operands(gy, lay, q, route, dgrad, wgrad, bias):
    g_dgrad, g_wgrad = ROUTES[route].gradient(gy, _layout(lay), quantizer_of(q[0]), dgrad,
                                              wgrad)
    db = [bias_sums(gy, _layout(lay).offs, gy.dtype)] if bias else []
    return _distinct([*g_dgrad, *g_wgrad, *db])


def _grad_operands_fake(gy, lay, q, route, dgrad, wgrad, bias):
    g_dgrad, g_wgrad = ROUTES[route].gradient_like(gy, _layout(lay), quantizer_of(q[0]),
                                                   dgrad, wgrad)
    db = [gy.new_empty((lay[5].shape[0], gy.shape[1]))] if bias else []
    return [*g_dgrad, *g_wgrad, *db]


def _dgrad(g, lay, w, q, route):
    qg, _, qw = map(quantizer_of, q)
    return ROUTES[route].input_gradient(tuple(g), _layout(lay), w, qg, qw)


def _dgrad_fake(g, lay, w, q, route):
    return w.new_empty((lay[0].shape[0], w.shape[2]))


def _wgrad(g, x, lay, q, route, n, x_rows=None):
    qg, qx, _ = map(quantizer_of, q)
    return ROUTES[route].weight_gradient(tuple(g), x, _layout(lay), qg, qx, x_rows)


def _wgrad_fake(g, x, lay, q, route, n, x_rows=None):
    return x.new_empty((lay[5].shape[0], n, x.shape[1]))


_op("grouped_grad_operands(Tensor gy, Tensor[] lay, str[] q, str route, bool dgrad, "
    "bool wgrad, bool bias) -> Tensor[]", _grad_operands, _grad_operands_fake)
_op("grouped_dgrad(Tensor[] g, Tensor[] lay, Tensor w, str[] q, str route) -> Tensor", _dgrad,
    _dgrad_fake)
_op("grouped_wgrad(Tensor[] g, Tensor x, Tensor[] lay, str[] q, str route, SymInt n, "
    "Tensor? x_rows=None) -> Tensor", _wgrad, _wgrad_fake)


def _input_t_fake(x, lay):
    k, (rows, experts) = x.shape[1], (lay[2].shape[0], lay[5].shape[0])
    return (x.new_empty((k, rows), dtype=torch.uint8),
            x.new_empty((experts, SCALE_PITCH), dtype=torch.float32))


def _weight_t_fake(w):
    experts, n, k = w.shape
    return (w.new_empty((experts, k, n), dtype=torch.uint8),
            w.new_empty((experts, SCALE_PITCH), dtype=torch.float32))


def _empty_for_none(t, like, dtype=torch.uint8):
    return like.new_empty((0,), dtype=dtype) if t is None else t


def _fp8_fprop(x, lay, w, b, q, keep_x_t, keep_w_t, fast_accum=False, x_row_amax=None,
               x_rows=None, w_data=None, w_scale_inv=None):
    w_bytes = None if w_data is None else (w_data, w_scale_inv)
    y, xt, sx, wt, sw = fp8_gemm.forward(x, _layout(lay), w, *map(quantizer_of, q), keep_x_t,
                                         keep_w_t, b, fast_accum, x_row_amax, x_rows, w_bytes)
    # an op's output may not be its input: the given scale-inverses come back as a copy
    return (y, _empty_for_none(xt, x), sx, _empty_for_none(wt, x),
            sw if w_bytes is None else sw.clone())


def _fp8_fprop_fake(x, lay, w, b, q, keep_x_t, keep_w_t, fast_accum=False, x_row_amax=None,
                    x_rows=None, w_data=None, w_scale_inv=None):
    xt, sx = _input_t_fake(x, lay)
    wt, sw = _weight_t_fake(w)
    return (x.new_empty((lay[0].shape[0], w.shape[1])),
            xt if keep_x_t else _empty_for_none(None, x),
            sx, wt if keep_w_t and w_data is None else _empty_for_none(None, x), sw)


def _fp8_grad_bytes(gy, lay, q, dgrad, wgrad, padded):
    gd, gt, sg = fp8_gemm.gradient_bytes(gy, _layout(lay), quantizer_of(q[0]), dgrad, wgrad,
                                         padded)
    return _empty_for_none(gd, gy), _empty_for_none(gt, gy), sg


def _fp8_grad_bytes_fake(gy, lay, q, dgrad, wgrad, padded):
    (total, n), (rows, experts) = gy.shape, (lay[2].shape[0], lay[5].shape[0])
    return (gy.new_empty(((rows if padded else total), n) if dgrad else (0,),
                         dtype=torch.uint8),
            gy.new_empty((n, rows) if wgrad else (0,), dtype=torch.uint8),
            gy.new_empty((experts, SCALE_PITCH), dtype=torch.float32))


def _fp8_dgrad(gd, sg, lay, wt, sw, q, padded, fast=False, requant_w=False):
    qg, _, qw = map(quantizer_of, q)
    return fp8_gemm.input_gradient(gd, sg, _layout(lay), wt, sw, qg, qw, padded, fast,
                                   requant_w)


def _fp8_dgrad_fake(gd, sg, lay, wt, sw, q, padded, fast=False, requant_w=False):
    # K of the weight [E, N, K] or of its bytes [E, K, N]
    return gd.new_empty((lay[0].shape[0], wt.shape[2 if requant_w else 1]),
                        dtype=torch.bfloat16)


def _fp8_wgrad(gt, sg, lay, xt, sx, q, fast=False, group_multiple=16, requant_x=False,
               x_rows=None):
    qg, qx, _ = map(quantizer_of, q)
    return fp8_gemm.weight_gradient(gt, sg, _layout(lay), xt, sx, qg, qx, fast, group_multiple,
                                    requant_x, x_rows)


def _fp8_wgrad_fake(gt, sg, lay, xt, sx, q, fast=False, group_multiple=16, requant_x=False,
                    x_rows=None):
    # K of the input [T, K] or of its bytes [K, rows]
    return gt.new_empty((lay[5].shape[0], gt.shape[0], xt.shape[1 if requant_x else 0]),
                        dtype=torch.bfloat16)


_op("grouped_fp8_fprop(Tensor x, Tensor[] lay, Tensor w, Tensor? b, str[] q, bool keep_x_t, "
    "bool keep_w_t, bool fast_accum=False, Tensor? x_row_amax=None, Tensor? x_rows=None, "
    "Tensor? w_data=None, Tensor? w_scale_inv=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fp8_fprop, _fp8_fprop_fake)
_op("grouped_fp8_grad_bytes(Tensor gy, Tensor[] lay, str[] q, bool dgrad, bool wgrad, "
    "bool padded) -> (Tensor, Tensor, Tensor)", _fp8_grad_bytes, _fp8_grad_bytes_fake)
_op("grouped_fp8_dgrad(Tensor gd, Tensor sg, Tensor[] lay, Tensor w_t, Tensor sw, str[] q, "
    "bool padded, bool fast=False, bool requant_w=False) -> Tensor", _fp8_dgrad,
    _fp8_dgrad_fake)
_op("grouped_fp8_wgrad(Tensor g_t, Tensor sg, Tensor[] lay, Tensor x_t, Tensor sx, str[] q, "
    "bool fast=False, int group_multiple=16, bool requant_x=False, Tensor? x_rows=None) "
    "-> Tensor", _fp8_wgrad, _fp8_wgrad_fake)


def fprop(x, lay: Layout, w, b, qx, qw, align: int, traced: bool, fast_accum: bool = False,
          x_rows=None):
    """:func:`grouped_fprop`, through its op when ``traced``."""
    if not traced:
        return grouped_fprop(x, lay, w, b, qx, qw, align, fast_accum, x_rows)
    return torch.ops.quant_recipes.grouped_fprop(
        x, lay.tensors(), w, b, [quantizer_spec(qx), quantizer_spec(qw)], align, fast_accum,
        x_rows)


def bprop(gy, x, lay: Layout, w, qg, qx, qw, col: bool, align: int, dgrad: bool, wgrad: bool,
          bias: bool, traced: bool, fast_dgrad: bool = False, fast_wgrad: bool = False,
          x_rows=None):
    """:func:`grouped_bprop`, through its op when ``traced``."""
    if not traced:
        return grouped_bprop(gy, x, lay, w, qg, qx, qw, col, align, dgrad, wgrad, bias,
                             fast_dgrad, fast_wgrad, x_rows)
    specs = [quantizer_spec(q) for q in (qg, qx, qw)]
    (k, n), dtypes = (x.shape[1], w.shape[1]), (gy.dtype, x.dtype, w.dtype)
    route = backward_route(qg, qx, qw, x.device, dtypes, (n, k), align, col)
    if route is not None:
        return _bprop_in_parts(route, gy, x, lay, w, specs, dgrad, wgrad, bias, x_rows)
    return torch.ops.quant_recipes.grouped_bprop(gy, x, lay.tensors(), w, specs, col, align,
                                                 dgrad, wgrad, bias, fast_dgrad, fast_wgrad,
                                                 x_rows)


def _bprop_in_parts(route, gy, x, lay: Layout, w, specs, dgrad: bool, wgrad: bool,
                    bias: bool, x_rows=None):
    """``(dx | None, dw | None, db | None)`` of ``route``'s backward parts
    (:mod:`.backward_parts`), each through its op: ``grouped_grad_operands`` quantizes ``gy``
    (and sums each group's bias gradient), ``grouped_dgrad`` and ``grouped_wgrad`` multiply,
    so that the graph releases ``gy`` once it is quantized: an op cannot release its own
    input."""
    ops, tensors = torch.ops.quant_recipes, lay.tensors()
    parts = ops.grouped_grad_operands(gy, tensors, specs, route.name, dgrad, wgrad, bias)
    nd = route.dgrad_operands if dgrad else 0
    nw = len(parts) - nd - bias
    dx = ops.grouped_dgrad(parts[:nd], tensors, w, specs, route.name) if dgrad else None
    dw = (ops.grouped_wgrad(parts[nd:nd + nw], x, tensors, specs, route.name, w.shape[1],
                            x_rows) if wgrad else None)
    return dx, dw, parts[-1] if bias else None


def fp8_fprop(x, lay: Layout, w, b, qx, qw, keep_x_t: bool, keep_w_t: bool, traced: bool,
              fast_accum: bool = False, x_row_amax=None, x_rows=None, w_bytes=None):
    """:func:`~quant_recipes.moe.fp8_gemm.forward`, through its op when ``traced`` (the
    bytes not kept are empty tensors there, ``None`` here)."""
    if not traced:
        return fp8_gemm.forward(x, lay, w, qx, qw, keep_x_t, keep_w_t, b, fast_accum,
                                x_row_amax, x_rows, w_bytes)
    w_data, w_scale_inv = (None, None) if w_bytes is None else w_bytes
    return torch.ops.quant_recipes.grouped_fp8_fprop(
        x, lay.tensors(), w, b, [quantizer_spec(qx), quantizer_spec(qw)], keep_x_t, keep_w_t,
        fast_accum, x_row_amax, x_rows, w_data, w_scale_inv)


def fp8_bprop(gy, lay: Layout, xt, sx, wt, sw, qg, qx, qw, dgrad: bool, wgrad: bool,
              traced: bool, fast_dgrad: bool = False, fast_wgrad: bool = False,
              group_multiple: int = 16, requant_x: bool = False, requant_w: bool = False,
              x_rows=None):
    """:func:`~quant_recipes.moe.fp8_gemm.backward`; when ``traced``, its three parts through
    ops (``grouped_fp8_grad_bytes`` quantizes ``gy``, ``grouped_fp8_dgrad`` and
    ``grouped_fp8_wgrad`` multiply the two gradients), so that the graph releases ``gy`` once
    it is quantized: an op cannot release its own input."""
    if not traced:
        return fp8_gemm.backward(gy, lay, xt, sx, wt, sw, qg, qx, qw, dgrad, wgrad, fast_dgrad,
                                 fast_wgrad, group_multiple, requant_x, requant_w, x_rows)
    ops, specs = torch.ops.quant_recipes, [quantizer_spec(q) for q in (qg, qx, qw)]
    empty = gy.new_empty((0,), dtype=torch.uint8)
    # a device probe: read here, at trace time, never in an op's fake
    padded = dgrad and fp8_gemm.reads_padded_rows(qg, qw, gy.device, lay.groups)
    gd, gt, sg = ops.grouped_fp8_grad_bytes(gy, lay.tensors(), specs, dgrad, wgrad, padded)
    dx = (ops.grouped_fp8_dgrad(gd, sg, lay.tensors(), empty if wt is None else wt, sw, specs,
                                padded, fast_dgrad, requant_w) if dgrad else None)
    dw = (ops.grouped_fp8_wgrad(gt, sg, lay.tensors(), empty if xt is None else xt, sx, specs,
                                fast_wgrad, group_multiple, requant_x, x_rows)
          if wgrad else None)
    return dx, dw
