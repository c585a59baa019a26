"""Delayed scaling: amax-history roll and scale update (`numerics.md` §4, TE's ``kernel_bulk``).

Eager only. States register themselves for the enclosing outermost autocast region; the
forward update runs when that region exits, the backward update in the backward of the module
that ran first in the region.
"""

from __future__ import annotations

import torch
from quant_core.constants import FLT_MAX

from .states import DelayedScalingRecipeState


def _reduce(rows: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return rows
    if dist.get_world_size(group) == 1:
        return rows
    out = rows.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def update_states(states: list[DelayedScalingRecipeState], group=None) -> None:
    """Reduce and update every state of one key (same recipe and group), in place.

    The ``amax_history[0]`` rows are concatenated and, with ``reduce_amax``, all-reduced (MAX)
    over ``group`` (the default group when ``None``) when more than one rank takes part.
    """
    if not states:
        return
    recipe = states[0].recipe
    rows = torch.cat([s.amax_history[0] for s in states])
    reduced = _reduce(rows, group) if recipe.reduce_amax else rows
    offset = 0
    for s in states:
        n = s.num_quantizers
        _update_one(s, reduced[offset:offset + n])
        offset += n


def _update_one(state: DelayedScalingRecipeState, reduced: torch.Tensor) -> None:
    recipe = state.recipe
    hist, scale = state.amax_history, state.scale
    fp8_max = state.fp8_max
    if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
        _update_unfused(state, reduced)
        return
    last = torch.where(reduced != 0, reduced, hist[0])
    roll = last != 0
    rolled = torch.cat([hist[1:], last[None]], dim=0)
    if recipe.amax_compute_algo == "max":
        # fmaxf from 0: NaN entries are ignored.
        amax = torch.where(torch.isnan(rolled), torch.zeros_like(rolled), rolled).amax(dim=0)
        amax = torch.clamp_min(amax, 0.0)
    else:
        amax = last
    new_hist = rolled.clone()
    new_hist[0] = 0
    hist.copy_(torch.where(roll[None], new_hist, hist))
    scaled_max = torch.tensor(fp8_max * 2.0 ** (-recipe.margin), dtype=torch.float32,
                              device=hist.device)
    ok = roll & torch.isfinite(amax) & (amax > 0)
    new_scale = scaled_max / torch.where(ok, amax, torch.ones_like(amax))
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLT_MAX), new_scale)
    scale.copy_(torch.where(ok, new_scale, scale))


def _update_unfused(state: DelayedScalingRecipeState, reduced: torch.Tensor) -> None:
    """TE's unfused path for user callables: always rolls; ``(fp8_max / amax) / 2^margin``."""
    recipe = state.recipe
    hist, scale = state.amax_history, state.scale
    hist[0].copy_(torch.where(reduced != 0, reduced, hist[0]))
    if callable(recipe.amax_compute_algo):
        amax = recipe.amax_compute_algo(hist)
    elif recipe.amax_compute_algo == "max":
        amax = hist.amax(dim=0)
    else:
        amax = hist[0].clone()
    hist.copy_(torch.roll(hist, -1, 0))
    hist[0].fill_(0.0)
    if recipe.scaling_factor_compute_algo is not None:
        new = recipe.scaling_factor_compute_algo(amax, scale, state.fp8_max, recipe)
    else:
        sf = (state.fp8_max / amax) / (2 ** recipe.margin)
        sf = torch.where(amax > 0.0, sf, scale)
        new = torch.where(torch.isfinite(amax), sf, scale)
    scale.copy_(new)


class Region:
    """Delayed states registered during one outermost autocast region."""

    __slots__ = ("forward", "backward", "first_claimed")

    def __init__(self) -> None:
        self.forward: list[tuple] = []
        self.backward: list[tuple] = []
        self.first_claimed = False

    def add(self, fwd_states, bwd_states, recipe, group) -> bool:
        """Register states; returns True for the first module of the region."""
        for s in fwd_states:
            if not any(s is t for t, _, _ in self.forward):
                self.forward.append((s, recipe, group))
        for s in bwd_states:
            if not any(s is t for t, _, _ in self.backward):
                self.backward.append((s, recipe, group))
        first = not self.first_claimed
        self.first_claimed = True
        return first


def update_registered(entries: list[tuple]) -> None:
    """Group ``(state, recipe, group)`` entries by key and update each key's states."""
    keys: list[tuple] = []
    for state, _recipe, group in entries:
        for key in keys:
            if key[0] == state.recipe and key[1] is group:
                key[2].append(state)
                break
        else:
            keys.append((state.recipe, group, [state]))
    for _, group, states in keys:
        update_states(states, group)
