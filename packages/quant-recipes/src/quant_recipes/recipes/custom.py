"""CustomRecipe: quantizers from a user factory called per slot role (`behaviour.md` §9)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from quant_core import Quantizer

from ..compiling import compiling, dynamo, is_compiled_value, raise_error
from ..recipe import Format, Recipe, check_common, env_backward_override
from ..role import QuantizerRole
from ..states import RecipeState
from .delayed import DelayedScalingRecipeState, DelayedScalingRequest


def _is_quantizer(q) -> bool:
    """``isinstance(q, Quantizer)``, also for the opaque wrapper torch 2.11 traces a prebuilt
    value quantizer as (``isinstance`` is False there; quant-dynamo's registry knows it)."""
    if isinstance(q, Quantizer):
        return True
    if compiling():
        return is_compiled_value(q)
    return False


def _check_compilable(q: Quantizer, slot: str) -> None:
    """Under torch.compile: a factory's quantizer must be a registered value quantizer; say why
    not (stateful delayed scaling, or a subclass that did not opt in) before tracing trips."""
    if not is_compiled_value(q):
        why = dynamo().registration.identity_quantizer_message(type(q))
        raise_error(
            TypeError,
            f"CustomRecipe.qfactory returned {type(q).__name__} for {slot} under "
            f"torch.compile: {why}",
        )


class CustomRecipeState(RecipeState):
    """Quantizers from ``recipe.qfactory(role)``, called once per slot with that slot's role
    (``None`` for a slot without one). Delayed-scaling requests share one inner
    :class:`DelayedScalingRecipeState`."""

    def __init__(self, recipe, **kwargs) -> None:
        super().__init__(recipe, **kwargs)
        self._inherited_inner: DelayedScalingRecipeState | None = None
        self._inner: DelayedScalingRecipeState | None = None

    def make_quantizers(self) -> list[Quantizer]:
        roles = self.roles if self.roles is not None else (QuantizerRole(),) * self.num_quantizers
        raw = [self.recipe.qfactory(roles[i]) for i in range(self.num_quantizers)]
        for i, q in enumerate(raw):
            # the role as its str(): a dataclass repr cannot be traced by Dynamo, and the
            # message must survive tracing intact (it is what a compiled caller sees)
            slot = f"slot {i} (role {str(roles[i])!r})"
            if q is None:
                raise_error(
                    ValueError,
                    f"CustomRecipe.qfactory returned None for {slot}; "
                    "return quant_recipes.IdentityQuantizer() to keep a tensor in high precision",
                )
            if not (isinstance(q, DelayedScalingRequest) or _is_quantizer(q)):
                raise_error(
                    TypeError,
                    f"CustomRecipe.qfactory must return a Quantizer or a DelayedScalingRequest, "
                    f"got {type(q).__name__} for {slot}",
                )
            if compiling() and isinstance(q, Quantizer):
                _check_compilable(q, slot)
        requests = [i for i, q in enumerate(raw) if isinstance(q, DelayedScalingRequest)]
        if not requests:
            return raw
        if compiling():
            raise_error(
                RuntimeError,
                "a CustomRecipe qfactory returned a DelayedScalingRequest under torch.compile: "
                "delayed scaling holds live tensor state and runs in eager mode only",
            )
        first = raw[requests[0]]
        for i in requests[1:]:
            if raw[i] != first:
                raise ValueError(
                    "every DelayedScalingRequest of one recipe state must have identical "
                    f"parameters; slot {requests[0]} has {first}, slot {i} has {raw[i]}"
                )
        inner_recipe = first.to_recipe()
        old = self._inherited_inner
        if (
            old is not None
            and old.num_quantizers == len(requests)
            and old.recipe == inner_recipe
            and old.mode == self.mode
        ):
            inner = old
        else:
            inner = DelayedScalingRecipeState(
                inner_recipe, mode=self.mode, num_quantizers=len(requests), device=self.device
            )
            inner.inherit_state_from(old)
        self._inner = inner
        delayed = inner.make_quantizers()
        for j, i in enumerate(requests):
            raw[i] = delayed[j]
        return raw

    def inherit_state_from(self, old: RecipeState | None) -> None:
        """Keep the predecessor's inner delayed-scaling state for :meth:`make_quantizers`."""
        if isinstance(old, CustomRecipeState):
            self._inherited_inner = old._inner or old._inherited_inner
        elif isinstance(old, DelayedScalingRecipeState):
            self._inherited_inner = old

    @property
    def has_delayed_scaling(self) -> bool:
        return self._inner is not None

    def delayed_states(self) -> list[RecipeState]:
        return [] if self._inner is None else [self._inner]

    _has_delayed_scaling = has_delayed_scaling

    @property
    def inner_delayed_scaling_state(self) -> DelayedScalingRecipeState | None:
        return self._inner

    @property
    def _inner_delayed_scaling_recipe(self):
        return None if self._inner is None else self._inner.recipe

    @property
    def scale(self) -> torch.Tensor | None:
        return None if self._inner is None else self._inner.scale

    @property
    def amax_history(self) -> torch.Tensor | None:
        return None if self._inner is None else self._inner.amax_history

    @property
    def quantization_alignment(self) -> int:
        return self.recipe.quantization_alignment


@dataclass(frozen=True)
class CustomRecipe(Recipe):
    """A recipe whose quantizers come from ``qfactory(role)`` (`behaviour.md` §9).

    ``qfactory`` maps a :class:`QuantizerRole` (or ``None`` for a boundary slot) to a quantizer
    or a :class:`DelayedScalingRequest`. ``fp8_format`` only informs internals.
    ``quantization_alignment`` (> 0) is the padding multiple for grouped GEMMs. Two
    CustomRecipes are the same cache key only if they are the same object, or if their factories
    carry the same semantic key (:func:`quantizer_factory`).
    """

    #: ``role -> quantizer`` (or a :class:`DelayedScalingRequest`); ``None`` for boundary slots.
    qfactory: Callable[[Any], Any]
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=env_backward_override)
    #: Padding multiple for grouped GEMMs (> 0).
    quantization_alignment: int = 128

    def __post_init__(self) -> None:
        check_common(self)
        if not callable(self.qfactory):
            raise TypeError(
                f"CustomRecipe.qfactory must be a callable role -> quantizer, got {self.qfactory!r}"
            )
        if (
            isinstance(self.quantization_alignment, bool)
            or not isinstance(self.quantization_alignment, int)
            or self.quantization_alignment <= 0
        ):
            raise ValueError(
                "quantization_alignment must be positive, got "
                f"{self.quantization_alignment!r}"
            )

    @property
    def qfactory_key(self) -> tuple[str, int] | None:
        """The factory's semantic key from :func:`quantizer_factory`, else ``None``."""
        return getattr(self.qfactory, "qfactory_key", None)

    state_class = CustomRecipeState

    def custom(self) -> bool:
        return True


def quantizer_factory(*, key: tuple[str, int]) -> Callable[[Callable], Callable]:
    """Decorator giving a qfactory a semantic key ``(name, version)``.

    CustomRecipes whose factories share a key are one cache key, so a module does not rebuild
    its quantizers when a fresh CustomRecipe wraps the same factory; bump the version whenever
    the factory's output changes.
    """
    if not (
        isinstance(key, tuple)
        and len(key) == 2
        and isinstance(key[0], str)
        and key[0]
        and isinstance(key[1], int)
        and not isinstance(key[1], bool)
        and key[1] > 0
    ):
        raise ValueError(
            f"quantizer_factory key must be (non-empty str, int > 0), got {key!r}"
        )

    def mark(fn: Callable) -> Callable:
        fn.qfactory_key = key
        return fn

    return mark
