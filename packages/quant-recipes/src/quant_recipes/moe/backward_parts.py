"""A grouped route's backward in three parts: the output gradient quantized once, then the input
gradient, then the weight gradient.

Each grouped route of :mod:`.gemm` that quantizes the output gradient once for both backward
GEMMs (FP8 blocks, NVFP4, the decoded ``torch._grouped_mm`` route) states its backward as a
:class:`Route`. Eager code runs the parts in order (:func:`backward`); compiled code runs each as
its own op (:mod:`.ops`), so the graph releases the bf16 output gradient once it is quantized.
A single op could not: an op holds its inputs until it returns, and the output gradient is as
large as the gradient's bytes and the weight gradient's output together at an expert block's
widths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .fp8 import Layout


@dataclass(frozen=True)
class Route:
    """A grouped route's backward parts (every tensor list a tuple, empty where not asked for).

    - ``gradient(gy, lay, qg, dgrad, wgrad) -> (dgrad operands, wgrad operands)``: the output
      gradient ``gy [T, N]`` quantized once, in the layouts each GEMM reads;
    - ``gradient_like(gy, lay, qg, dgrad, wgrad)``: the same tensors, empty (their shapes and
      dtypes: a compiled graph's fake);
    - ``input_gradient(operands, lay, w, qg, qw) -> dx [T, K]``;
    - ``weight_gradient(operands, x, lay, qg, qx, x_rows) -> dw [E, N, K]``, ``x [T, K]`` (or
      the rows ``x[x_rows]``) quantized here;
    - ``dgrad_operands``: how many tensors ``gradient`` gives the input gradient.
    """

    name: str
    gradient: Callable
    gradient_like: Callable
    input_gradient: Callable
    weight_gradient: Callable
    dgrad_operands: int


def backward(route: Route, gy: torch.Tensor, x: torch.Tensor, lay: Layout, w: torch.Tensor,
             qg, qx, qw, dgrad: bool, wgrad: bool, x_rows: torch.Tensor | None = None):
    """``(dx [T, K] | None, dw [E, N, K] | None)`` through ``route``'s parts. The input
    gradient's operands (the gradient's rowwise form and the weight's) are released before the
    weight gradient quantizes the input and makes its output."""
    g_dgrad, g_wgrad = route.gradient(gy, lay, qg, dgrad, wgrad)
    dx = route.input_gradient(g_dgrad, lay, w, qg, qw) if dgrad else None
    del g_dgrad
    dw = route.weight_gradient(g_wgrad, x, lay, qg, qx, x_rows) if wgrad else None
    return dx, dw
