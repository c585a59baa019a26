"""Expert biases on the grouped GEMM routes, with no group bound read on the host.

The dense :class:`~quant_recipes.Linear` adds its bias to the fp32 product and rounds once to
the output dtype (numerics.md, GEMM contract). A grouped route with a bias therefore asks its
GEMM for the fp32 product and :func:`added` adds each row's group bias and rounds once: the
per-group path's result up to the order of the fp32 sums. The bias gradient of group ``g`` is
the fp32 sum of its rows of the output gradient, rounded once (:func:`group_sums`), as the
per-group path sums each group, in another order.
"""

from __future__ import annotations

import torch


def added(y: torch.Tensor, b: torch.Tensor, gid: torch.Tensor, dtype: torch.dtype
          ) -> torch.Tensor:
    """``y [T, N]`` (fp32 products) plus row ``i``'s group bias ``b[gid[i]]`` (``b [E, N]``),
    summed in fp32 and rounded once to ``dtype``."""
    return (y + b.to(torch.float32).index_select(0, gid)).to(dtype)


def group_sums(gy: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[E, N]``: row ``g`` the fp32 sum of rows ``offs[g-1]:offs[g]`` of ``gy [T, N]`` (zeros
    for an empty group), rounded once to ``dtype``. One segmented reduction over the group
    bounds on the device (``unsafe``: the bounds were checked where the layer took them)."""
    starts = torch.cat([offs.new_zeros(1), offs]).to(torch.int64)
    return torch.segment_reduce(gy.to(torch.float32), "sum", offsets=starts, axis=0,
                                unsafe=True).to(dtype)
