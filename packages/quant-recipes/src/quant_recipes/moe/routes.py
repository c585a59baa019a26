"""A top-k routing's rows in expert order: the tokens gathered into them, and each token's ``k``
rows weighted and summed back (the un-permute of a mixture-of-experts block).

:func:`route` sorts the ``T * k`` (token, route) pairs by expert, stably. Row ``p`` of the
experts' layers holds pair ``perm[p] = t * k + j``: token ``rows[p] = t``; token ``t``'s route
``j`` is row ``copies[t, j]``. Every token has exactly ``k`` rows, so both directions are
gathers:

- :func:`gather_tokens` gives ``x[rows]``; its gradient for token ``t`` is the sum of its ``k``
  rows' gradients (:func:`sum_routes`), not autograd's scatter of an index (a zero fill and an
  atomic add per element on a GPU, in no fixed order);
- :func:`combine_routes` gives ``sum_j y[copies[t, j]] * w[t, j]``; the gradient of row ``p``
  is ``dout[rows[p]] * w`` of its pair.

Every sum over a token's routes is taken in fp32 (fp64 for fp64 operands) in route order
(``j = 0, 1, ...``), with products in that precision, and rounded once. For bf16 and fp16
operands the products are exact, so eager code and compiled code give the same bits whether or
not a device fuses a multiply with its add; fp32 operands may differ by that fusion's rounding.
Under Inductor each sum is one pointwise kernel of ``k`` gathered loads (a sum over a middle
dimension of size ``k``, ``y.view(T, k, H).sum(1)``, runs far below copy bandwidth).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routes(NamedTuple):
    """A top-k routing's rows in expert order (see the module docstring)."""

    #: int64 ``[T * k]``: the (token, route) pair ``t * k + j`` of each row.
    perm: torch.Tensor
    #: int64 ``[T * k]``: the token of each row (``perm // k``).
    rows: torch.Tensor
    #: int64 ``[T, k]``: the row of each (token, route) pair (``perm``'s inverse).
    copies: torch.Tensor


def route(top_k_index: torch.Tensor) -> tuple[torch.Tensor, Routes]:
    """The expert of each row, ascending (``[T * k]``), and the :class:`Routes` of
    ``top_k_index [T, k]`` sorted by expert, stably (token order within an expert)."""
    k = top_k_index.shape[1]
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return sorted_ids, Routes(perm, perm // k, inverse.view(top_k_index.shape))


def sum_routes(d: torch.Tensor, copies: torch.Tensor, weights: torch.Tensor | None = None,
               k: int | None = None) -> torch.Tensor:
    """``out[t] = sum_j d[copies[t, j]] (* weights[t, j])``, ``[T, H]`` in fp32 (fp64 for fp64
    ``d``): the products and the sum in that precision, ``j`` ascending. ``k``:
    ``copies.shape[1]``, read by the caller where the sum runs in an autograd function's forward
    (Dynamo of torch 2.11 fails on a loop bound read from a shape there, with dynamic shapes)."""
    k = copies.shape[1] if k is None else k
    acc_dtype = torch.promote_types(d.dtype, torch.float32)
    g = d[copies]  # [T, k, H]; under Inductor, loads inside the sum's kernel
    if weights is None:
        acc = g[:, 0].to(acc_dtype)
        for j in range(1, k):
            acc = acc.add_(g[:, j])  # in place: one kernel a route eagerly
        return acc
    w = weights.to(acc_dtype).unsqueeze(-1)
    acc = g[:, 0].to(acc_dtype) * w[:, 0]
    for j in range(1, k):
        acc = acc.addcmul_(g[:, j], w[:, j])
    return acc


def token_gradients(d: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """Each token's gradient from its routed rows' gradients ``d [T * k, H]``: their sum
    (:func:`sum_routes`) in ``d``'s dtype, ``[T, H]``."""
    return sum_routes(d, copies).to(d.dtype)


def gather_tokens(x: torch.Tensor, routes: Routes) -> torch.Tensor:
    """``x[routes.rows]``: the routed rows in expert order, ``[T * k, H]``; differentiable, the
    gradient of token ``t`` the fp32 sum of its rows' gradients in route order."""
    return _GatherTokens.apply(x, routes.rows, routes.copies)


def combine_routes(y: torch.Tensor, weights: torch.Tensor, routes: Routes) -> torch.Tensor:
    """``out[t] = sum_j y[copies[t, j]] * weights[t, j]`` in ``y``'s dtype, ``[T, H]``: ``y``
    ``[T * k, H]`` the rows in expert order, ``weights [T, k]`` in token order. Differentiable
    in ``y`` and ``weights``."""
    return _CombineRoutes.apply(y, weights, weights.shape[1], *routes)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, copies):
        ctx.save_for_backward(copies)
        return x[rows]

    @staticmethod
    def backward(ctx, dy):
        (copies,) = ctx.saved_tensors
        return token_gradients(dy, copies), None, None


class _CombineRoutes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, k, perm, rows, copies):
        ctx.save_for_backward(y, weights, perm, rows, copies)
        return sum_routes(y, copies, weights, k).to(y.dtype)

    @staticmethod
    def backward(ctx, dout):
        y, weights, perm, rows, copies = ctx.saved_tensors
        acc_dtype = torch.promote_types(y.dtype, torch.float32)
        dacc = dout.to(acc_dtype)
        dy = dweights = None
        if ctx.needs_input_grad[0]:
            w_rows = weights.reshape(-1)[perm].to(acc_dtype).unsqueeze(-1)
            dy = (dacc[rows] * w_rows).to(y.dtype)
        if ctx.needs_input_grad[1]:
            dweights = (dacc.unsqueeze(1) * y[copies].to(acc_dtype)).sum(-1).to(weights.dtype)
        return dy, dweights, None, None, None, None
