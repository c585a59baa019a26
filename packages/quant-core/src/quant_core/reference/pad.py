"""Zero padding of 2D tensors that also works on empty dimensions on every supported torch
(``F.pad`` on torch 2.9 rejects an input with a zero-size dim: "negative output size")."""

from __future__ import annotations

import torch


def zero_pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t [r, c]`` in the top-left corner of a zero ``[rows, cols]`` tensor (``rows >= r``,
    ``cols >= c``); a new contiguous tensor."""
    out = t.new_zeros((rows, cols))
    out[: t.shape[0], : t.shape[1]] = t
    return out


def gathered_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[P, K]``: row ``p`` is ``x[rows[p]]``, a zero row where ``rows[p] < 0`` (a padding
    row); ``rows`` int32/int64 ``[P]``."""
    out = x.new_zeros((rows.shape[0], x.shape[1]))
    keep = rows >= 0
    if x.shape[0]:
        out = torch.where(keep[:, None], x.index_select(0, rows.clamp(min=0).long()), out)
    return out
