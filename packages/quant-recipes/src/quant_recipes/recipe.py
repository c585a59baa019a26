"""The recipe base: immutable, comparable descriptions of a quantization scheme
(`behaviour.md` §4), and what every recipe shares (formats, QParams, MMParams, validation).

A recipe is a frozen dataclass. Equality is field equality, which is what modules cache on
(`behaviour.md` §8-§9). Every setting that changes numerics is a real field; defaults that
TransformerEngine reads from the environment (``NVTE_*``) are resolved when a recipe is
*constructed* (``default_factory``), never at import. QParams that TE keeps as class attributes
are fields here, derived from the recipe's switches in ``__post_init__`` unless given.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
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
    """Parameters of one GEMM of a step. ``use_split_accumulator=False`` lets an FP8 per-tensor
    GEMM on FP8 tensor cores accumulate the whole contraction at the tensor cores' own width
    (cuBLAS's fast accumulation), as TransformerEngine does; ``True`` adds their partial sums to
    an fp32 accumulator. Emulated GEMMs, and GEMMs on other formats, accumulate in fp32 either
    way (:func:`fast_accumulation`)."""

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _check_field_types(self)


#: The default GEMM parameters, module-level so that a recipe built inside a compiled region
#: reads them through a global (Dynamo cannot wrap a dataclass default that has no source).
SPLIT = MMParams(use_split_accumulator=True)
NO_SPLIT = MMParams(use_split_accumulator=False)

#: The recipe fields of a step's three GEMMs, and TransformerEngine's split-accumulator choice
#: for a recipe without them: the forward GEMM accumulates fast, the two backward ones split.
_GEMM_PARAMS = (("fp8_gemm_fprop", False), ("fp8_gemm_dgrad", True), ("fp8_gemm_wgrad", True))


def fast_accumulation(recipe: Recipe) -> tuple[bool, bool, bool]:
    """``(fprop, dgrad, wgrad)``: whether each GEMM of a step under ``recipe`` may use the FP8
    tensor cores' fast accumulation: ``not use_split_accumulator`` of the recipe's
    ``fp8_gemm_*`` field, and where the recipe has none TransformerEngine's module default
    (fprop fast, dgrad and wgrad split). Only FP8 per-tensor GEMMs on FP8 tensor cores read it
    (numerics.md, GEMM contract).

    Read from the plain tuple the recipe keeps since construction (:func:`check_common`), so
    that compiled code guards on three booleans, not on the ``MMParams`` objects: two equal
    recipes whose fields are distinct but equal objects share their graphs."""
    flags = getattr(recipe, "_fast_accumulation", None)
    return flags if flags is not None else _fast_accumulation_of(recipe)


def _fast_accumulation_of(recipe: Recipe) -> tuple[bool, bool, bool]:
    out = []
    for name, split in _GEMM_PARAMS:
        params = getattr(recipe, name, None)
        out.append(not (split if params is None else params.use_split_accumulator))
    return out[0], out[1], out[2]


#: Called with every recipe once it is complete (constructed and validated, unpickled or
#: copied), outside compiled code: ``quant_recipes.module`` keeps there the quantizers that
#: compiled Linear layers read (``keep_linear_slots``).
BUILT_HOOKS: list[Callable[[Recipe], None]] = []
#: The attribute where a recipe keeps those quantizers (interned in this process: not pickled).
LINEAR_SLOTS = "_linear_slots"


def built(recipe: Recipe) -> None:
    """Run :data:`BUILT_HOOKS` on ``recipe``, unless Dynamo is tracing (a recipe made in traced
    code is a new object of that trace)."""
    if not torch.compiler.is_compiling():
        for hook in BUILT_HOOKS:
            hook(recipe)


def _then_built(post_init: Callable) -> Callable:
    """``post_init`` (a recipe class's ``__post_init__``), then :func:`built` where it is the
    outermost one: a subclass's ``__post_init__`` that calls its parent's validates more after
    it."""
    @functools.wraps(post_init)
    def __post_init__(self) -> None:
        post_init(self)
        if type(self).__post_init__ is __post_init__:
            built(self)

    return __post_init__


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


def env_flag(name: str, default: str = "0") -> Callable[[], bool]:
    """A ``default_factory`` reading the boolean env var ``name`` at construction time:
    ``0``/``false``/``off``/``no`` in any case (or empty) is False, anything else True."""

    def read() -> bool:
        return os.environ.get(name, default).strip().lower() not in _FALSE_SPELLINGS

    read.__qualname__ = f"env[{name}]"
    return read


def env_backward_override() -> str | None:
    return os.environ.get("NVTE_BACKWARD_OVERRIDE") or None


FP8_QPARAM_FIELDS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


def fill_unset(recipe: Recipe, defaults: dict[str, QParams]) -> None:
    """Give each field named in ``defaults`` that is still ``None`` its default (frozen-safe)."""
    for name, value in defaults.items():
        if getattr(recipe, name) is None:
            object.__setattr__(recipe, name, value)


#: Per class: ``(field, target, optional)`` for each field whose type is an Enum or a dataclass
#: (a config gives those as a member's name or as a dict); filled once per class.
_CONVERTIBLE: dict[type, tuple[tuple[str, type, bool], ...]] = {}


def _convertible_fields(cls: type) -> tuple[tuple[str, type, bool], ...]:
    found = _CONVERTIBLE.get(cls)
    if found is None:
        rows = []
        for name, hint in typing.get_type_hints(cls).items():
            if typing.get_origin(hint) is ClassVar:
                continue
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            options = typing.get_args(hint) if union else (hint,)
            for target in options:
                if isinstance(target, type) and (
                    issubclass(target, enum.Enum) or dataclasses.is_dataclass(target)
                ):
                    rows.append((name, target, type(None) in options))
                    break
        found = _CONVERTIBLE[cls] = tuple(rows)
    return found


def convert_config_values(obj: Any) -> None:
    """Turn the values a config file or command line gives into the field types, in place
    (frozen-safe): an Enum field takes a member's name in any case (``"hybrid"``), a dataclass
    field (:class:`QParams`, :class:`MMParams`) a dict of its fields. Anything else that is not
    of the field's type is refused, naming the field and what it takes."""
    cls = type(obj).__name__
    for name, target, optional in _convertible_fields(type(obj)):
        value = getattr(obj, name)
        if isinstance(value, target) or (value is None and optional):
            continue
        if issubclass(target, enum.Enum):
            allowed = ", ".join(repr(m.name) for m in target)
            if isinstance(value, str):
                member = {m.name.lower(): m for m in target}.get(value.strip().lower())
                if member is None:
                    raise ValueError(f"{cls}.{name}: unknown {target.__name__} {value!r}; "
                                     f"allowed: {allowed} (any case)")
                object.__setattr__(obj, name, member)
                continue
            raise TypeError(f"{cls}.{name} must be a {target.__name__} or one of its names "
                            f"({allowed}; any case), got {value!r}")
        keys = [f.name for f in dataclasses.fields(target)]
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(keys), key=str)
            if unknown:
                raise ValueError(f"{cls}.{name}: {target.__name__} has no field "
                                 f"{', '.join(map(repr, unknown))}; its fields: {', '.join(keys)}")
            object.__setattr__(obj, name, target(**value))
            continue
        none = " or None" if optional else ""
        raise TypeError(f"{cls}.{name} must be a {target.__name__} or a dict of its fields "
                        f"({', '.join(keys)}){none}, got {value!r}")


def check_common(recipe: Recipe) -> None:
    convert_config_values(recipe)
    _check_field_types(recipe)
    # derived, not a field: equality, hashing and repr stay the fields'
    object.__setattr__(recipe, "_fast_accumulation", _fast_accumulation_of(recipe))
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
    _refuse_fp8_attention(recipe)


def _refuse_fp8_attention(recipe: Recipe) -> None:
    """``fp8_dpa`` / ``fp8_mha`` exist for TransformerEngine parity and must stay False: quant
    quantizes the GEMMs of its linear modules only, and attention runs in high precision."""
    for name in ("fp8_dpa", "fp8_mha"):
        if getattr(recipe, name, False):
            raise ValueError(
                f"{type(recipe).__name__}({name}=True): quant has no FP8 attention; it quantizes "
                "Linear layers only (quant_recipes.Linear, GroupedLinear), and attention runs in "
                f"the model's precision. Leave {name} False."
            )


@dataclass(frozen=True)
class Recipe:
    """Base of every recipe; the predicates tell the kind without ``isinstance`` chains.

    Recipes are frozen dataclasses, validated at construction (an error names the field and
    what is allowed), equal and hashable by value. Options may be given as a config file gives
    them: a :class:`Format` as a member's name in any case (``fp8_format="hybrid"``), a
    :class:`QParams` or :class:`MMParams` as a dict of its fields; they are converted when the
    recipe is built. Fields most recipes share:

    - ``fp8_format``: the FP8 element format, ``Format.E4M3`` everywhere or ``Format.HYBRID``
      (E4M3 forward, E5M2 for gradients);
    - ``margin``: delayed scaling divides its scales by ``2^margin`` (headroom against
      overflow); the other recipes accept it for TransformerEngine parity;
    - ``fp8_dpa`` / ``fp8_mha``: TransformerEngine's FP8 attention switches, kept so that its
      configs load; quant quantizes Linear layers only, so ``True`` raises ``ValueError``;
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

    #: The :class:`~quant_recipes.states.RecipeState` subclass that turns this recipe into
    #: quantizers (``RecipeState.create``); each recipe module sets its own.
    state_class: ClassVar[type | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        try:  # resolved now, so that a recipe built while Dynamo traces finds them ready
            _convertible_fields(cls)
        except NameError:  # a forward reference: resolved at the first construction
            pass
        post = cls.__dict__.get("__post_init__")
        if post is not None:
            cls.__post_init__ = _then_built(post)

    def __getstate__(self) -> dict:
        """The fields and the derived data, less what :data:`BUILT_HOOKS` keep on the object
        (:data:`LINEAR_SLOTS`: quantizers interned in this process), which an unpickled or
        copied recipe makes again (:meth:`__setstate__`)."""
        state = dict(self.__dict__)
        state.pop(LINEAR_SLOTS, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)  # a frozen dataclass: not through __setattr__
        built(self)

    # The kind predicates (TransformerEngine's API): each recipe class answers its own.
    def delayed(self) -> bool:
        return False

    def float8_current_scaling(self) -> bool:
        return False

    def float8_per_tensor_scaling(self) -> bool:
        return False

    def mxfp8(self) -> bool:
        return False

    def float8_block_scaling(self) -> bool:
        return False

    def nvfp4(self) -> bool:
        return False

    def custom(self) -> bool:
        return False
