"""Recipes: immutable, comparable descriptions of a quantization scheme (`behaviour.md` §4).

A recipe is a frozen dataclass. Equality is field equality, which is what modules cache on
(`behaviour.md` §8-§9). Every setting that changes numerics is a real field; defaults that
TransformerEngine reads from the environment (``NVTE_*``) are resolved when a recipe is
*constructed* (``default_factory``), never at import. QParams that TE keeps as class attributes
are fields here, derived from the recipe's switches in ``__post_init__`` unless given.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quant_core import DType

_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


class Format(enum.Enum):
    """Element format of a recipe, with the maxima for forward and backward tensors."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"
    E2M1 = "E2M1"

    @property
    def fwd_dtype(self) -> DType:
        return _FORMAT_DTYPES[self][0]

    @property
    def bwd_dtype(self) -> DType:
        return _FORMAT_DTYPES[self][1]

    @property
    def max_fwd(self) -> float:
        return self.fwd_dtype.max

    @property
    def max_bwd(self) -> float:
        return self.bwd_dtype.max


_FORMAT_DTYPES = {
    Format.E4M3: (DType.E4M3, DType.E4M3),
    Format.E5M2: (DType.E5M2, DType.E5M2),
    Format.HYBRID: (DType.E4M3, DType.E5M2),
    Format.E2M1: (DType.E2M1, DType.E2M1),
}


#: The largest DelayedScaling margin: scales are fp32, and ``fp8_max / amax / 2^margin`` of a
#: typical amax must stay a normal number (margin 200 made every scale 0 and every output NaN).
MAX_MARGIN = 32


def _check_field_types(obj) -> None:
    """``bool`` fields take only bools (``"no"`` would turn a switch on), ``int`` fields only
    ints, ``float`` fields finite non-negative numbers: checked at construction, by annotation."""
    cls = type(obj).__name__
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type == "bool" and not isinstance(value, bool):
            raise TypeError(f"{cls}.{f.name} must be a bool, got {value!r}")
        if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{cls}.{f.name} must be an int, got {value!r}")
        if f.type == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{cls}.{f.name} must be a float, got {value!r}")
            if not math.isfinite(value) or value < 0 or value > 3.4028234663852886e38:
                raise ValueError(f"{cls}.{f.name} must be a finite fp32 value >= 0, got {value!r}")


@dataclass(frozen=True)
class MMParams:
    """GEMM parameters (kept for TransformerEngine parity; emulated GEMMs accumulate in fp32)."""

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _check_field_types(self)


#: The default GEMM parameters, module-level so that a recipe built inside a compiled region
#: reads them through a global (Dynamo cannot wrap a dataclass default that has no source).
_SPLIT = MMParams(use_split_accumulator=True)
_NO_SPLIT = MMParams(use_split_accumulator=False)


@dataclass(frozen=True)
class QParams:
    """Quantization parameters for one class of tensors (inputs, weights or gradients)."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_field_types(self)


#: Spellings of an unset switch in ``NVTE_*`` variables (compared after strip + lower).
_FALSE_SPELLINGS = ("", "0", "false", "off", "no", "n", "f")


def _env_flag(name: str, default: str = "0") -> Callable[[], bool]:
    """A ``default_factory`` reading the boolean env var ``name`` at construction time:
    ``0``/``false``/``off``/``no`` in any case (or empty) is False, anything else True."""

    def read() -> bool:
        return os.environ.get(name, default).strip().lower() not in _FALSE_SPELLINGS

    read.__qualname__ = f"env[{name}]"
    return read


def _env_backward_override() -> str | None:
    return os.environ.get("NVTE_BACKWARD_OVERRIDE") or None


_FP8_QPARAM_FIELDS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


def _fill_unset(recipe: Recipe, defaults: dict[str, QParams]) -> None:
    """Give each field named in ``defaults`` that is still ``None`` its default (frozen-safe)."""
    for name, value in defaults.items():
        if getattr(recipe, name) is None:
            object.__setattr__(recipe, name, value)


def _check_common(recipe: Recipe) -> None:
    _check_field_types(recipe)
    margin = getattr(recipe, "margin", 0)
    if not 0 <= margin <= MAX_MARGIN:
        raise ValueError(
            f"{type(recipe).__name__}.margin must be an int in [0, {MAX_MARGIN}] (the power-of-two "
            f"headroom below the FP8 maximum), got {margin!r}"
        )
    if recipe.backward_override not in _BACKWARD_OVERRIDES:
        raise ValueError(
            f"{type(recipe).__name__}.backward_override must be one of {_BACKWARD_OVERRIDES}, "
            f"got {recipe.backward_override!r}"
        )
    fmt = getattr(recipe, "fp8_format", None)
    if fmt is not None and not isinstance(fmt, Format):
        raise TypeError(f"{type(recipe).__name__}.fp8_format must be a Format, got {fmt!r}")


@dataclass(frozen=True)
class Recipe:
    """Base of every recipe; the predicates tell the kind without ``isinstance`` chains.

    Recipes are frozen dataclasses, validated at construction (an error names the field and
    what is allowed), equal and hashable by value. Fields most recipes share:

    - ``fp8_format``: the FP8 element format, ``Format.E4M3`` everywhere or ``Format.HYBRID``
      (E4M3 forward, E5M2 for gradients);
    - ``margin``: delayed scaling divides its scales by ``2^margin`` (headroom against
      overflow); the other recipes accept it for TransformerEngine parity;
    - ``fp8_dpa`` / ``fp8_mha``: FP8 attention (accepted for TransformerEngine parity; no
      attention module here uses them);
    - ``backward_override``: ``None`` (backward GEMMs on the quantized columnwise copies),
      ``"high_precision"`` (backward GEMMs in the input dtype, on the saved originals) or
      ``"dequantized"`` (backward GEMMs on the forward's rowwise quantized operands, used
      transposed); default from ``NVTE_BACKWARD_OVERRIDE``;
    - ``fp8_quant_fwd_inp`` / ``fp8_quant_fwd_weight`` / ``fp8_quant_bwd_grad`` (and NVFP4's
      ``fp4_quant_*``): per-tensor-type :class:`QParams`, filled from the recipe's flags when
      left ``None``;
    - ``fp8_gemm_fprop`` / ``fp8_gemm_dgrad`` / ``fp8_gemm_wgrad``: per-GEMM :class:`MMParams`
      (split accumulator).
    """

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def custom(self) -> bool:
        return isinstance(self, CustomRecipe)


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
    backward_override: str | None = field(default_factory=_env_backward_override)

    def __post_init__(self) -> None:
        _check_common(self)
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


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 with the scale from each tensor's own amax.

    ``fp8_quant_fwd_inp`` / ``_fwd_weight`` / ``_bwd_grad`` default to
    ``QParams(power_2_scale=use_power_2_scales)``; their ``power_2_scale`` and ``amax_epsilon``
    are what the quantizers use (TE ignores ``amax_epsilon``; with the defaults both agree).
    """

    #: Round every scale down to a power of two (``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``).
    use_power_2_scales: bool = field(
        default_factory=_env_flag("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES")
    )
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: _NO_SPLIT)
    fp8_gemm_dgrad: MMParams = field(default_factory=lambda: _SPLIT)
    fp8_gemm_wgrad: MMParams = field(default_factory=lambda: _SPLIT)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=_env_backward_override)

    def __post_init__(self) -> None:
        _check_common(self)
        if self.fp8_format is Format.E2M1:
            raise ValueError("Float8CurrentScaling.fp8_format must be an FP8 format, got E2M1")
        pow2 = self.use_power_2_scales
        _fill_unset(self, {name: QParams(power_2_scale=pow2) for name in _FP8_QPARAM_FIELDS})


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: 1x32 blocks with E8M0 scales; 32x32 for linear weights with 2D quantization."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=_env_backward_override)
    #: 32x32 blocks for linear weights (one scale per tile, shared by both directions).
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_common(self)
        if self.fp8_format not in (Format.E4M3, Format.HYBRID):
            raise ValueError(
                f"MXFP8BlockScaling.fp8_format must be E4M3 or HYBRID, got {self.fp8_format}"
            )


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 1x128 (dim 1) or 128x128 (dim 2) blocks with fp32 scales.

    ``fp8_quant_*`` default to ``QParams(power_2_scale=not use_f32_scales)``.
    """

    #: Keep fp32 scales instead of powers of two (``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``).
    use_f32_scales: bool = field(default_factory=_env_flag("NVTE_FP8_BLOCK_SCALING_FP32_SCALES"))
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    #: Block shape per tensor type: 1 is 1x128, 2 is 128x128 (at most one of the three is 2).
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: _SPLIT)
    fp8_gemm_dgrad: MMParams = field(default_factory=lambda: _SPLIT)
    fp8_gemm_wgrad: MMParams = field(default_factory=lambda: _SPLIT)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=_env_backward_override)

    def __post_init__(self) -> None:
        _check_common(self)
        if self.fp8_format is Format.E2M1:
            raise ValueError("Float8BlockScaling.fp8_format must be an FP8 format, got E2M1")
        dims = {
            "x_block_scaling_dim": self.x_block_scaling_dim,
            "w_block_scaling_dim": self.w_block_scaling_dim,
            "grad_block_scaling_dim": self.grad_block_scaling_dim,
        }
        for name, dim in dims.items():
            if dim not in (1, 2):
                raise ValueError(f"Float8BlockScaling.{name} must be 1 or 2, got {dim!r}")
        names = list(dims)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if dims[a] == 2 and dims[b] == 2:
                    raise ValueError(
                        f"Float8BlockScaling: {a}=2 with {b}=2 is a 2D-by-2D block GEMM, "
                        "which is not supported"
                    )
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, name).use_split_accumulator:
                raise ValueError(f"Float8BlockScaling.{name}: split accumulator is required")
        if self.fp8_dpa or self.fp8_mha:
            raise ValueError("Float8BlockScaling does not support FP8 attention (fp8_dpa/fp8_mha)")
        pow2 = not self.use_f32_scales
        _fill_unset(self, {name: QParams(power_2_scale=pow2) for name in _FP8_QPARAM_FIELDS})


_4OVER6_SCOPES = ("none", "weights", "activations", "all")


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 elements with E4M3 1x16 block scales (16x16 for weights in 2D mode), RHT on
    the columnwise input and gradient, stochastic rounding of gradients.

    ``fp4_quant_*`` default to: input ``QParams(random_hadamard_transform=not disable_rht)``,
    weight ``QParams(fp4_2d_quantization=not disable_2d_quantization)``, gradient
    ``QParams(random_hadamard_transform=not disable_rht,
    stochastic_rounding=not disable_stochastic_rounding)``.
    """

    #: No Random Hadamard Transform on the columnwise input and gradient.
    disable_rht: bool = field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_RHT"))
    #: Round gradients to nearest instead of stochastically.
    disable_stochastic_rounding: bool = field(
        default_factory=_env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING")
    )
    #: 1x16 instead of 16x16 blocks for weights.
    disable_2d_quantization: bool = field(
        default_factory=_env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION")
    )
    #: TransformerEngine's row-scaled NVFP4 activations: not implemented (refused).
    row_scaled_activation: bool = False
    #: TransformerEngine's 4over6 variant, by scope: only ``"none"`` is implemented.
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp4_quant_fwd_inp: QParams | None = None
    fp4_quant_fwd_weight: QParams | None = None
    fp4_quant_bwd_grad: QParams | None = None
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=_env_backward_override)

    def __post_init__(self) -> None:
        _check_common(self)
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"NVFP4BlockScaling.fp4_format must be E2M1, got {self.fp4_format}")
        for name in ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256"):
            if getattr(self, name) not in _4OVER6_SCOPES:
                raise ValueError(
                    f"NVFP4BlockScaling.{name} must be one of {_4OVER6_SCOPES}, "
                    f"got {getattr(self, name)!r}"
                )
        if self.nvfp4_4over6_err_mode not in ("MAE", "MSE"):
            raise ValueError(
                "NVFP4BlockScaling.nvfp4_4over6_err_mode must be 'MAE' or 'MSE', "
                f"got {self.nvfp4_4over6_err_mode!r}"
            )
        if self.row_scaled_activation or self.nvfp4_4over6 != "none":
            raise NotImplementedError(  # here, not at the first forward (NVFP4Quantizer's rule)
                "NVFP4BlockScaling: row_scaled_activation=True and nvfp4_4over6 other than "
                "'none' are optional NVFP4 variants this project does not implement yet"
            )
        defaults = {
            "fp4_quant_fwd_inp": QParams(random_hadamard_transform=not self.disable_rht),
            "fp4_quant_fwd_weight": QParams(fp4_2d_quantization=not self.disable_2d_quantization),
            "fp4_quant_bwd_grad": QParams(
                random_hadamard_transform=not self.disable_rht,
                stochastic_rounding=not self.disable_stochastic_rounding,
            ),
        }
        _fill_unset(self, defaults)


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
    backward_override: str | None = field(default_factory=_env_backward_override)
    #: Padding multiple for grouped GEMMs (> 0).
    quantization_alignment: int = 128

    def __post_init__(self) -> None:
        _check_common(self)
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

    def to_recipe(self) -> DelayedScaling:
        """The :class:`DelayedScaling` recipe with these parameters."""
        return DelayedScaling(
            margin=self.margin, fp8_format=self.fp8_format,
            amax_history_len=self.amax_history_len, amax_compute_algo=self.amax_compute_algo,
            scaling_factor_compute_algo=self.scaling_factor_compute_algo,
            reduce_amax=self.reduce_amax, backward_override=None,
        )

