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


def gathered_rows(x: torch.Tensor, rows: torch.Tensor,
                  zero_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[P, K]``: row ``p`` is ``x[rows[p]]``, a zero row where ``rows[p] < 0`` (a padding
    row); ``rows`` int32/int64 ``[P]``. ``zero_rows``, the indices of those negative entries
    when the caller has them, lets the zeros be written to those rows alone."""
    if x.shape[0] == 0:
        return x.new_zeros((rows.shape[0], x.shape[1]))
    out = x.index_select(0, rows.clamp(min=0))
    if zero_rows is not None:
        return out.index_fill_(0, zero_rows, 0)
    return out.masked_fill_((rows < 0)[:, None], 0)
