"""Block tiling shared by FP8 block scaling and MXFP8: per-block amax, per-element broadcast."""

from __future__ import annotations

import torch

from .. import shapes
from ._rounding import nan_to_zero_abs
from .pad import zero_pad


def block_amax(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """NaN-dropping ``max|x|`` per ``block_rows x block_cols`` block of ``x [M, K]``, fp32
    ``[ceil(M/block_rows), ceil(K/block_cols)]``; partial edge blocks see only valid elements."""
    m, k = x.shape
    a = nan_to_zero_abs(x)  # >= 0, so zero padding never wins the max
    a = zero_pad(a, shapes.roundup(m, block_rows), shapes.roundup(k, block_cols))
    n_rows, n_cols = a.shape[0] // block_rows, a.shape[1] // block_cols
    return a.reshape(n_rows, block_rows, n_cols, block_cols).amax(dim=(1, 3))


def expand_blocks(
    per_block: torch.Tensor, block_rows: int, block_cols: int, m: int, k: int
) -> torch.Tensor:
    """Broadcast ``per_block [ceil(M/br), ceil(K/bc)]`` to one value per element, ``[m, k]``."""
    full = per_block.repeat_interleave(block_rows, dim=0).repeat_interleave(block_cols, dim=1)
    return full[:m, :k]
