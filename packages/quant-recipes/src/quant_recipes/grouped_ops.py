"""The grouped GEMMs as custom ops, for ``torch.compile``: ``quant_recipes::grouped_fprop`` and
``quant_recipes::grouped_bprop`` run :func:`~quant_recipes.grouped_gemm.grouped_fprop` /
``grouped_bprop`` opaquely, so the groups' data-dependent sizes never reach the graph: the
outputs have the static shapes ``[T, N]``, ``[T, K]``, ``[E, N, K]``, ``[E, N]``, and a step with
other group sizes runs the same graph.

Quantizers travel as strings, ``repr(q.value_key())`` (a value quantizer's class name and
fields, read on the real object at trace time: torch >= 2.11), and are rebuilt once per
distinct string. Eager code calls the functions directly, with the quantizer objects.
"""

from __future__ import annotations

import ast
import functools

import torch
from quant_core import value_classes

from .compiling import dynamo
from .grouped_gemm import grouped_bprop, grouped_fprop
from .module import intern

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
_lib.define("grouped_fprop(Tensor x, Tensor offs, Tensor w, Tensor? b, str[] q, int align) "
            "-> Tensor")
_lib.define("grouped_bprop(Tensor gy, Tensor x, Tensor offs, Tensor w, str[] q, bool col, "
            "int align, bool dgrad, bool wgrad, bool bias) -> (Tensor, Tensor, Tensor)")


def _fprop(x, offs, w, b, q, align):
    return grouped_fprop(x, offs, w, b, *map(quantizer_of, q), align)


def _fprop_fake(x, offs, w, b, q, align):
    return x.new_empty((x.shape[0], w.shape[1]))


def _bprop(gy, x, offs, w, q, col, align, dgrad, wgrad, bias):
    return grouped_bprop(gy, x, offs, w, *map(quantizer_of, q), col, align, dgrad, wgrad, bias)


def _bprop_fake(gy, x, offs, w, q, col, align, dgrad, wgrad, bias):
    (total, k), (experts, n) = x.shape, w.shape[:2]
    return (x.new_empty((total, k) if dgrad else (0,)),
            w.new_empty((experts, n, k) if wgrad else (0,)),
            w.new_empty((experts, n) if bias else (0,)))


_lib.impl("grouped_fprop", _fprop, "CompositeExplicitAutograd")
_lib.impl("grouped_bprop", _bprop, "CompositeExplicitAutograd")
torch.library.register_fake("quant_recipes::grouped_fprop", _fprop_fake, lib=_lib)
torch.library.register_fake("quant_recipes::grouped_bprop", _bprop_fake, lib=_lib)


def fprop(x, offs, w, b, qx, qw, align: int, traced: bool):
    """:func:`grouped_fprop`, through its op when ``traced``."""
    if not traced:
        return grouped_fprop(x, offs, w, b, qx, qw, align)
    return torch.ops.quant_recipes.grouped_fprop(
        x, offs, w, b, [quantizer_spec(qx), quantizer_spec(qw)], align)


def bprop(gy, x, offs, w, qg, qx, qw, col: bool, align: int, dgrad: bool, wgrad: bool,
          bias: bool, traced: bool):
    """:func:`grouped_bprop`, through its op when ``traced``."""
    if not traced:
        return grouped_bprop(gy, x, offs, w, qg, qx, qw, col, align, dgrad, wgrad, bias)
    specs = [quantizer_spec(q) for q in (qg, qx, qw)]
    return torch.ops.quant_recipes.grouped_bprop(gy, x, offs, w, specs, col, align, dgrad,
                                                 wgrad, bias)
