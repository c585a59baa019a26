"""Delayed scaling under an activation-checkpoint recompute (`behaviour.md` §7).

A recompute runs a layer's forward again during backward, after the autocast region has
exited and updated the delayed-scaling scales. To give the gradients and the amax histories of
the uncheckpointed run, as TransformerEngine's checkpoint does with its FP8 metadata, the
recompute quantizes with the scales its forward used and records no amax, and its backward
updates the backward states through the forward's region. Each eager forward outside backward
therefore copies its forward quantizers' scales into a shadow kept beside the layer (one small
device copy per delayed quantizer, no host read); a recompute takes the shadow's quantizers,
which view those copies and a scratch amax, and the forward's region.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from quant_core import Float8Quantizer

from .module import QuantizerSet

#: Per layer: the shadow of its last eager forward outside backward.
_SHADOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Shadow:
    """The forward quantizers of ``qset`` over copies of their scales, and the region."""

    __slots__ = ("qset", "recompute_set", "copies", "region")

    def __init__(self, qset: QuantizerSet) -> None:
        self.qset = qset
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        fwd = []
        for q in qset.fwd:
            if type(q) is Float8Quantizer:
                scale = q.scale.detach().clone()
                self.copies.append((scale, q.scale))
                q = Float8Quantizer(scale, torch.zeros_like(q.amax), q.dtype,
                                    rowwise_usage=q.rowwise_usage,
                                    columnwise_usage=q.columnwise_usage, internal=q.internal)
            fwd.append(q)
        # one set per shadow: its usage variants are made once (a Float8Quantizer reads its
        # scale on the host when it is made)
        self.recompute_set = QuantizerSet(qset.key, qset.recipe, None, qset.bwd_state, fwd,
                                          qset.bwd)
        self.region = None


def record_forward(module: torch.nn.Module, qset: QuantizerSet, region: Any) -> None:
    """After ``module``'s eager forward outside backward with delayed-scaling quantizers: keep
    the scales it quantized with and its region for a recompute."""
    shadow = _SHADOWS.get(module)
    if shadow is None or shadow.qset is not qset:
        shadow = _SHADOWS[module] = _Shadow(qset)
    else:
        with torch.no_grad():
            for copy, live in shadow.copies:
                copy.copy_(live)
    shadow.region = region


def for_recompute(module: torch.nn.Module, qset: QuantizerSet
                  ) -> tuple[QuantizerSet, Any] | None:
    """For a forward the autograd engine runs in backward (a recompute): ``(quantizer set,
    region)`` of ``module``'s last forward, its forward quantizers on the scales that forward
    used, writing their amaxes to scratch; None when no forward of this set was recorded."""
    shadow = _SHADOWS.get(module)
    if shadow is None or shadow.qset is not qset:
        return None
    return shadow.recompute_set, shadow.region
