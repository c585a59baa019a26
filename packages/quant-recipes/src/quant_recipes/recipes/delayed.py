"""Delayed scaling: per-tensor FP8 with scales from an amax history (stateful; eager only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from quant_core import Float8Quantizer, Quantizer

from ..recipe import (
    Format,
    Recipe,
    check_common,
    convert_config_values,
    env_backward_override,
)
from ..states import RecipeState, default_device, element_dtype


class DelayedScalingRecipeState(RecipeState):
    """``scale = ones(n)``, ``amax_history = zeros(L, n)``; slot i is a ``Float8Quantizer``
    viewing ``scale[i]`` and ``amax_history[0][i]``."""

    _persistent_state_buffers = ("scale", "amax_history")

    def __init__(self, recipe, **kwargs) -> None:
        super().__init__(recipe, **kwargs)
        dev = default_device(self.device)
        self.dtype = element_dtype(recipe.fp8_format, self.forward)
        self.scale = torch.ones(self.num_quantizers, dtype=torch.float32, device=dev)
        self.amax_history = torch.zeros(
            recipe.amax_history_len, self.num_quantizers, dtype=torch.float32, device=dev
        )

    @property
    def has_delayed_scaling(self) -> bool:
        return True

    def delayed_states(self) -> list[RecipeState]:
        return [self]

    @property
    def fp8_max(self) -> float:
        return self.dtype.max

    def _make(self, i: int) -> Quantizer:
        return Float8Quantizer(self.scale[i], self.amax_history[0][i].view(1), self.dtype,
                               internal=True)


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 with scales from an amax history (stateful; eager only).

    ``amax_compute_algo``: ``"max"``, ``"most_recent"`` or a callable ``(amax_history) -> amax``;
    ``scaling_factor_compute_algo``: ``None`` or a callable ``(amax, scale, fp8_max, recipe)``.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    #: Length of the per-slot amax history the scale is computed from.
    amax_history_len: int = 1024
    #: ``"max"`` over the history, ``"most_recent"``, or ``(amax_history) -> amax``.
    amax_compute_algo: str | Callable = "max"
    #: ``None`` (``fp8_max * 2^-margin / amax``) or ``(amax, scale, fp8_max, recipe) -> scale``.
    scaling_factor_compute_algo: Callable | None = None
    #: All-reduce (MAX) the amaxes over the default (or autocast's) group before updating.
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=env_backward_override)

    def __post_init__(self) -> None:
        check_common(self)
        if self.fp8_format is Format.E5M2:
            raise ValueError("DelayedScaling.fp8_format: pure E5M2 training is not supported")
        if self.fp8_format is Format.E2M1:
            raise ValueError("DelayedScaling.fp8_format must be E4M3 or HYBRID, got E2M1")
        if self.backward_override is not None:
            raise ValueError(
                "DelayedScaling.backward_override must be None, got "
                f"{self.backward_override!r} (unset NVTE_BACKWARD_OVERRIDE)"
            )
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(
                "DelayedScaling.amax_history_len must be an int >= 1, got "
                f"{self.amax_history_len!r}"
            )
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in (
            "max", "most_recent",
        ):
            raise ValueError(
                "DelayedScaling.amax_compute_algo must be 'max', 'most_recent' or a callable, "
                f"got {self.amax_compute_algo!r}"
            )

    state_class = DelayedScalingRecipeState

    def delayed(self) -> bool:
        return True

    def float8_per_tensor_scaling(self) -> bool:
        return True


@dataclass(frozen=True)
class DelayedScalingRequest:
    """A qfactory's request for a delayed-scaling quantizer in its slot (`behaviour.md` §9).

    Every request of one recipe state must carry identical parameters; one inner
    delayed-scaling state serves all of them.
    """

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable = "max"
    scaling_factor_compute_algo: Callable | None = None
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        convert_config_values(self)

    def to_recipe(self) -> DelayedScaling:
        """The :class:`DelayedScaling` recipe with these parameters."""
        return DelayedScaling(
            margin=self.margin, fp8_format=self.fp8_format,
            amax_history_len=self.amax_history_len, amax_compute_algo=self.amax_compute_algo,
            scaling_factor_compute_algo=self.scaling_factor_compute_algo,
            reduce_amax=self.reduce_amax, backward_override=None,
        )
