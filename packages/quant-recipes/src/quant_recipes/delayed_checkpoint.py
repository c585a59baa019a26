"""Delayed-scaling state in a module's ``state_dict`` (issue: data loss on resume).

A module whose recipe is :class:`~quant_recipes.DelayedScaling` (or a ``CustomRecipe`` that asks
for delayed scaling) carries live ``scale`` and ``amax_history`` tensors per direction. They are
saved under ``<prefix>_delayed_scaling.<forward|backward>.<scale|amax_history>``, and only when the
module has such state: the keys of every other module are exactly ``nn.Linear``'s, so plain
checkpoints load strictly and ours load into plain modules with ``strict=False``.

Loading copies into the live state when the module already built it; otherwise the tensors wait
on the module and are copied into the state its next forward builds (a fresh module resumed from
a checkpoint gets the saved scales on its first step). A shape that does not match (another
``amax_history_len`` or number of GEMMs) is an error naming the key, as for a parameter.
"""

from __future__ import annotations

import torch

from .states import RecipeState, delayed_states

ROOT = "_delayed_scaling"
MODES = ("forward", "backward")
NAMES = ("scale", "amax_history")
#: Module attribute holding loaded tensors not yet copied into a state: {mode: {name: tensor}}.
PENDING = "_pending_delayed_state"


def _key(prefix: str, mode: str, name: str) -> str:
    return f"{prefix}{ROOT}.{mode}.{name}"


def _live_states(module) -> dict[str, RecipeState]:
    """``{mode: delayed state}`` of the module's current quantizer set."""
    qset = getattr(module, "_qset", None)
    if qset is None:
        return {}
    found = {}
    for mode, state in zip(MODES, (qset.fwd_state, qset.bwd_state), strict=True):
        inner = delayed_states(state)
        if inner:
            found[mode] = inner[0]
    return found


def save(module, destination: dict, prefix: str, keep_vars: bool) -> None:
    """Add the module's delayed-scaling tensors (live, else still pending) to ``destination``."""
    live = _live_states(module)
    pending = getattr(module, PENDING, None) or {}
    for mode in MODES:
        if mode in live:
            tensors = {name: getattr(live[mode], name) for name in NAMES}
        elif mode in pending:
            tensors = pending[mode]
        else:
            continue
        for name, t in tensors.items():
            destination[_key(prefix, mode, name)] = t if keep_vars else t.detach()


def _mismatch(key: str, saved: torch.Tensor, target: torch.Tensor) -> str | None:
    if saved.shape == target.shape:
        return None
    return (
        f"size mismatch for {key}: copying a delayed-scaling tensor with shape "
        f"{tuple(saved.shape)} from checkpoint, the shape in current model is "
        f"{tuple(target.shape)} (the recipe's amax_history_len or the number of GEMMs differs)"
    )


def _copy_into(state, tensors: dict[str, torch.Tensor], prefix: str, mode: str) -> list[str]:
    errors = [
        msg for name, t in tensors.items()
        if (msg := _mismatch(_key(prefix, mode, name), t, getattr(state, name))) is not None
    ]
    if not errors:
        with torch.no_grad():
            for name, t in tensors.items():
                getattr(state, name).copy_(t)
    return errors


def load(module, state_dict: dict, prefix: str, unexpected_keys: list, error_msgs: list) -> None:
    """Take this module's delayed-scaling keys out of ``unexpected_keys`` and load them."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for mode in MODES:
        for name in NAMES:
            key = _key(prefix, mode, name)
            if key in state_dict:
                found.setdefault(mode, {})[name] = state_dict[key]
                if key in unexpected_keys:
                    unexpected_keys.remove(key)
    if not found:
        return
    for mode, tensors in found.items():
        missing = [n for n in NAMES if n not in tensors]
        if missing:
            error_msgs.append(
                f"incomplete delayed-scaling state for {prefix}{ROOT}.{mode}: missing {missing}"
            )
            continue
        live = _live_states(module).get(mode)
        if live is not None:
            error_msgs.extend(_copy_into(live, tensors, prefix, mode))
        else:
            pending = getattr(module, PENDING, None) or {}
            pending[mode] = {name: t.detach().clone() for name, t in tensors.items()}
            setattr(module, PENDING, pending)


def apply_pending(module, mode: str, state: RecipeState) -> None:
    """Copy tensors loaded before ``state`` existed into it (once); RuntimeError on a mismatch."""
    pending = getattr(module, PENDING, None)
    if not pending or mode not in pending:
        return
    inner = delayed_states(state)
    if not inner:
        return  # this recipe has no delayed state; keep them for a later delayed one
    errors = _copy_into(inner[0], pending[mode], "", mode)
    if errors:
        raise RuntimeError(
            f"{type(module).__name__}: the delayed-scaling state loaded from the checkpoint does "
            f"not fit the recipe of this forward: {'; '.join(errors)}"
        )
    del pending[mode]
