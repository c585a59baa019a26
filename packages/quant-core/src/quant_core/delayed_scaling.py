"""Delayed scaling's amax-history roll and scale update (`numerics.md` §4, TE's ``kernel_bulk``):
numerics on plain tensors, in place. Which states update when, and the reduction of their amaxes
across ranks, are quant-recipes' bookkeeping (``quant_recipes.delayed``).

``hist`` is a state's ``amax_history [H, n]`` (row 0: the amaxes recorded since the last
update), ``scale`` its ``(n,)`` scales, ``reduced`` the ``(n,)`` row 0 after the cross-rank
reduction (or row 0 itself).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .constants import FLT_MAX


def update(hist: torch.Tensor, scale: torch.Tensor, reduced: torch.Tensor, *, fp8_max: float,
           margin: int, amax_compute_algo: str) -> None:
    """TE's fused update: a slot with a new amax rolls its history, takes the max over it
    (``"max"``, NaN ignored) or the newest value (``"most_recent"``), and gets
    ``fp8_max * 2^-margin / amax`` (Inf -> FLT_MAX); other slots keep history and scale."""
    last = torch.where(reduced != 0, reduced, hist[0])
    roll = last != 0
    rolled = torch.cat([hist[1:], last[None]], dim=0)
    if amax_compute_algo == "max":
        # fmaxf from 0: NaN entries are ignored.
        amax = torch.where(torch.isnan(rolled), torch.zeros_like(rolled), rolled).amax(dim=0)
        amax = torch.clamp_min(amax, 0.0)
    else:
        amax = last
    new_hist = rolled.clone()
    new_hist[0] = 0
    hist.copy_(torch.where(roll[None], new_hist, hist))
    scaled_max = torch.tensor(fp8_max * 2.0 ** (-margin), dtype=torch.float32,
                              device=hist.device)
    ok = roll & torch.isfinite(amax) & (amax > 0)
    new_scale = scaled_max / torch.where(ok, amax, torch.ones_like(amax))
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLT_MAX), new_scale)
    scale.copy_(torch.where(ok, new_scale, scale))


def update_unfused(hist: torch.Tensor, scale: torch.Tensor, reduced: torch.Tensor, *,
                   fp8_max: float, margin: int, amax_compute_algo: str | Callable,
                   scaling_factor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
                   ) -> None:
    """TE's unfused path, for user callables: always rolls; ``amax_compute_algo(hist)`` (or
    ``"max"`` / ``"most_recent"``), then ``scaling_factor(amax, scale)`` or
    ``(fp8_max / amax) / 2^margin`` where the amax is finite and > 0."""
    hist[0].copy_(torch.where(reduced != 0, reduced, hist[0]))
    if callable(amax_compute_algo):
        amax = amax_compute_algo(hist)
    elif amax_compute_algo == "max":
        amax = hist.amax(dim=0)
    else:
        amax = hist[0].clone()
    hist.copy_(torch.roll(hist, -1, 0))
    hist[0].fill_(0.0)
    if scaling_factor is not None:
        new = scaling_factor(amax, scale)
    else:
        sf = (fp8_max / amax) / (2 ** margin)
        sf = torch.where(amax > 0.0, sf, scale)
        new = torch.where(torch.isfinite(amax), sf, scale)
    scale.copy_(new)
