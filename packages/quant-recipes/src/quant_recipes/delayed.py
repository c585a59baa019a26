"""Delayed scaling's bookkeeping: which states update when, and their amax reduction; the
numerics (history roll, scale update) are ``quant_core.delayed_scaling``'s (`numerics.md` §4).

Eager only. States register themselves for the enclosing outermost autocast region; the
forward update runs when that region exits, the backward update in the backward of the module
that ran first in the region.
"""

from __future__ import annotations

import torch
from quant_core import delayed_scaling
from quant_core.distributed import reduce_amax

from .recipes.delayed import DelayedScalingRecipeState


def _reduce(rows: torch.Tensor, group) -> torch.Tensor:
    """MAX over ``group``, the default group when None, once torch.distributed is initialized."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return rows
    return reduce_amax(rows, group if group is not None else dist.group.WORLD)


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
    common = {"fp8_max": state.fp8_max, "margin": recipe.margin,
              "amax_compute_algo": recipe.amax_compute_algo}
    if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
        algo = recipe.scaling_factor_compute_algo
        scaling = None if algo is None else (
            lambda amax, scale: algo(amax, scale, state.fp8_max, recipe))
        delayed_scaling.update_unfused(state.amax_history, state.scale, reduced,
                                       scaling_factor=scaling, **common)
    else:
        delayed_scaling.update(state.amax_history, state.scale, reduced, **common)


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
