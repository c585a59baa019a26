"""The formats the tests run over: one row per registered storage format
(``quant_core.storage_formats()``), so that adding a format means adding one row here.

Each row (:class:`Format`) holds

* ``quantizers``: variant id -> factory. ``factory(**overrides)`` builds a fresh quantizer, the
  overrides replacing the variant's own arguments (``make(columnwise_usage=False)``). The first
  entry is the format's default quantizer (the class's defaults). Variant ids are unique across
  the table and are the ids the tests' parameters carry ("current", "block1d", "nvfp4_rht").
* ``recipes``: recipe id -> factory, likewise; the first is the built-in recipe of the format.
  A factory imports ``quant_recipes`` only when it is called, so this module imports with
  quant-core alone (the ``core`` nox session has no other package).
* ``label`` / ``qualified``: the two ways the tests name a format. ``label`` is the short id of
  its default quantizer or recipe ("current", "block", "mxfp8", "nvfp4"); ``qualified`` names the
  format and its scaling ("fp8_current", "fp8_block", "mxfp8", "nvfp4"). A recipe id starting
  with the label is also reachable with the qualified prefix: "fp8_current", "mxfp8_2d".
* capabilities the tests select cases by, stated as data (not read from the code under test):
  ``reduces_amax``, ``transposes``, ``row_block``, ``k_multiple``, ``columnwise_dequantizes``,
  ``lowers_to_ops``, ``fsdp2_quantized``, ``fsdp2_row_multiple`` (see the fields' comments).

The helpers build a module's table from the rows:

    QUANTIZERS = {k: make() for k, make in formats.quantizers("block1d", defaults=True).items()}
    RECIPES = formats.default_recipes(qualified=True)           # fp8_current, fp8_block, ...
    @pytest.mark.parametrize("name", formats.select(QUANTIZERS, reduces_amax=True))

Left out of the rows, kept local to the modules that use them: delayed scaling
(``Float8Quantizer`` over scale/amax tensors the test chooses, and the ``DelayedScaling``
recipe) is stateful, not a value quantizer, so a shared factory would hide the state each test
sets up; ``CustomRecipe`` tables (a ``qfactory`` per test, often mixing formats) are per-test by
nature. Both are format "fp8" or a mix, and neither is a second way to build a row's format.

Importing: every test folder does ``import formats``. tests/ has no ``__init__.py``, so pytest
(its default "prepend" import mode) puts the folder of ``tests/conftest.py`` on ``sys.path``
when it loads that conftest, which it does for any run from the repository root
(``python -m pytest tests/...`` and every nox session).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from quant_core import (
    DType,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)

Factory = Callable[..., Any]


def _quantizer(cls: type[Quantizer], **fixed) -> Callable[..., Quantizer]:
    def make(**overrides) -> Quantizer:
        return cls(**{**fixed, **overrides})

    args = ", ".join(f"{k}={v!r}" for k, v in fixed.items())
    make.__qualname__ = make.__name__ = f"{cls.__name__}({args})"
    return make


def _recipe(cls_name: str, **fixed) -> Factory:
    """A factory of ``quant_recipes.<cls_name>``, imported when called (quant-core's tests run
    where quant_recipes is not installed)."""
    def make(**overrides):
        cls = getattr(importlib.import_module("quant_recipes"), cls_name)
        return cls(**{**fixed, **overrides})

    args = ", ".join(f"{k}={v!r}" for k, v in fixed.items())
    make.__qualname__ = make.__name__ = f"{cls_name}({args})"
    return make


@dataclasses.dataclass(frozen=True)
class Format:
    name: str  #: the registered storage format (``Quantizer.storage_format``)
    label: str  #: short id of the default quantizer/recipe in test ids
    qualified: str  #: the id naming format and scaling (``label`` where they coincide)
    quantizers: Mapping[str, Callable[..., Quantizer]]  #: variant id -> factory, default first
    recipes: Mapping[str, Factory]  #: recipe id -> factory, the built-in recipe first
    #: quantization splits around a tensor amax (``local_amax`` / ``quantize_with_amax``, the
    #: amax all-reduce of FSDP2 shards)
    reduces_amax: bool
    #: ``t.t()`` swaps the rowwise and columnwise copies (per-tensor scales); block formats
    #: refuse it
    transposes: bool
    #: the rows of dim 0 a piece (split, narrow, a shard) must start at: the scale blocks' height
    row_block: int
    #: the last dimension (K) must be a multiple of this
    k_multiple: int
    #: a storage holding only the columnwise copy dequantizes
    columnwise_dequantizes: bool
    #: the quantizer may be lowered to torch ops in compiled graphs ("ops" among its lowerings)
    lowers_to_ops: bool
    #: the built-in recipe's weights all-gather quantized under FSDP2
    fsdp2_quantized: bool
    #: rows per rank the quantized all-gather needs (1: any split, padding included)
    fsdp2_row_multiple: int

    @property
    def default_quantizer(self) -> str:
        return next(iter(self.quantizers))

    @property
    def default_recipe(self) -> str:
        return next(iter(self.recipes))

    def quantizer(self, **overrides) -> Quantizer:
        """The format's default quantizer."""
        return self.quantizers[self.default_quantizer](**overrides)

    def recipe(self, **overrides):
        """The format's built-in recipe (imports quant_recipes)."""
        return self.recipes[self.default_recipe](**overrides)

    def qualify(self, recipe_id: str) -> str:
        """``recipe_id`` with the row's qualified prefix instead of its label."""
        if recipe_id.startswith(self.label):
            return self.qualified + recipe_id[len(self.label):]
        return recipe_id


_ROWS = [
    Format(
        name="fp8",
        label="current",
        qualified="fp8_current",
        quantizers={
            "current": _quantizer(Float8CurrentScalingQuantizer),
            "current_pow2": _quantizer(Float8CurrentScalingQuantizer, force_pow_2_scales=True),
            "current_e5m2": _quantizer(Float8CurrentScalingQuantizer, dtype=DType.E5M2),
        },
        recipes={"current": _recipe("Float8CurrentScaling")},
        reduces_amax=True, transposes=True, row_block=1, k_multiple=1,
        columnwise_dequantizes=True, lowers_to_ops=True,
        fsdp2_quantized=True, fsdp2_row_multiple=1,
    ),
    Format(
        name="fp8_block",
        label="block",
        qualified="fp8_block",
        quantizers={
            "block2d": _quantizer(Float8BlockQuantizer),
            "block1d": _quantizer(Float8BlockQuantizer, block_scaling_dim=1),
        },
        recipes={"block": _recipe("Float8BlockScaling")},
        reduces_amax=False, transposes=False, row_block=128, k_multiple=1,
        columnwise_dequantizes=True, lowers_to_ops=False,
        fsdp2_quantized=True, fsdp2_row_multiple=128,
    ),
    Format(
        name="mxfp8",
        label="mxfp8",
        qualified="mxfp8",
        quantizers={
            "mxfp8": _quantizer(MXFP8Quantizer),
            "mxfp8_2d": _quantizer(MXFP8Quantizer, with_2d_quantization=True),
            "mxfp8_swizzled": _quantizer(MXFP8Quantizer, optimize_for_gemm=True),
            "mxfp8_2d_swizzled": _quantizer(MXFP8Quantizer, with_2d_quantization=True,
                                            optimize_for_gemm=True),
        },
        recipes={
            "mxfp8": _recipe("MXFP8BlockScaling"),
            "mxfp8_2d": _recipe("MXFP8BlockScaling", enable_2d_quantization=True),
        },
        reduces_amax=False, transposes=False, row_block=32, k_multiple=32,
        columnwise_dequantizes=True, lowers_to_ops=False,
        fsdp2_quantized=True, fsdp2_row_multiple=128,
    ),
    Format(
        name="nvfp4",
        label="nvfp4",
        qualified="nvfp4",
        quantizers={
            "nvfp4": _quantizer(NVFP4Quantizer),
            "nvfp4_rht": _quantizer(NVFP4Quantizer, with_rht=True, with_post_rht_amax=True),
            "nvfp4_2d": _quantizer(NVFP4Quantizer, with_2d_quantization=True),
            "nvfp4_2d_swizzled": _quantizer(NVFP4Quantizer, with_2d_quantization=True,
                                            optimize_for_gemm=True),
        },
        recipes={
            "nvfp4": _recipe("NVFP4BlockScaling"),
            "nvfp4_no_rht": _recipe("NVFP4BlockScaling", disable_rht=True),
            "nvfp4_no_sr": _recipe("NVFP4BlockScaling", disable_stochastic_rounding=True),
        },
        reduces_amax=True, transposes=False, row_block=16, k_multiple=16,
        columnwise_dequantizes=False, lowers_to_ops=False,
        fsdp2_quantized=True, fsdp2_row_multiple=128,
    ),
]

#: format name -> row, in the order of the rows above.
FORMATS: dict[str, Format] = {row.name: row for row in _ROWS}


def _index() -> dict[str, Format]:
    """Every name a test may use for a row: format, label, qualified label, quantizer and
    recipe ids (plain and qualified). A name naming two rows is a mistake in the table."""
    index: dict[str, Format] = {}
    for row in _ROWS:
        names = {row.name, row.label, row.qualified, *row.quantizers, *row.recipes,
                 *map(row.qualify, row.recipes)}
        for name in names:
            if index.setdefault(name, row) is not row:
                raise AssertionError(f"{name!r} names rows {index[name].name} and {row.name}")
    return index


_BY_NAME = _index()


def format_of(name: str) -> Format:
    """The row a format name, label, quantizer id or recipe id belongs to."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is no id of tests/formats.py; known: "
                       f"{', '.join(sorted(_BY_NAME))}") from None


def quantizers(*ids: str, defaults: bool = False) -> dict[str, Callable[..., Quantizer]]:
    """Variant id -> factory: every row's default first if ``defaults``, then ``ids`` in order;
    every variant of every row when neither is given."""
    if not ids and not defaults:
        return {k: f for row in _ROWS for k, f in row.quantizers.items()}
    out = {row.default_quantizer: row.quantizers[row.default_quantizer]
           for row in _ROWS} if defaults else {}
    for i in ids:
        out[i] = format_of(i).quantizers[i]
    return out


def quantizer(id: str, **overrides) -> Quantizer:
    """A fresh quantizer of variant ``id``."""
    return format_of(id).quantizers[id](**overrides)


def default_quantizers(key: str = "label") -> dict[str, Callable[..., Quantizer]]:
    """One factory per format, its default quantizer, keyed by the row's ``label`` ("current",
    "block", ...), ``name`` (the format: "fp8", "fp8_block", ...) or ``id`` ("block2d")."""
    keys = {"label": lambda r: r.label, "name": lambda r: r.name,
            "id": lambda r: r.default_quantizer}[key]
    return {keys(row): row.quantizers[row.default_quantizer] for row in _ROWS}


def recipes(*ids: str, defaults: bool = False, qualified: bool = False) -> dict[str, Factory]:
    """Recipe id -> factory: every row's built-in recipe first if ``defaults``, then ``ids``
    (plain or qualified); every recipe of every row when neither is given. Keys are the plain
    ids ("current", "block"), or the qualified ones ("fp8_current", "fp8_block") if
    ``qualified``."""
    if not ids and not defaults:
        pairs = [(row, k) for row in _ROWS for k in row.recipes]
    else:
        pairs = [(row, row.default_recipe) for row in _ROWS] if defaults else []
        for i in ids:
            row = format_of(i)
            plain = row.label + i[len(row.qualified):] if i.startswith(row.qualified) else i
            pairs.append((row, plain))
    return {(row.qualify(k) if qualified else k): row.recipes[k] for row, k in pairs}


def recipe(id: str, **overrides):
    """A fresh recipe ``id`` (plain or qualified; imports quant_recipes)."""
    return next(iter(recipes(id).values()))(**overrides)


def default_recipes(qualified: bool = False) -> dict[str, Factory]:
    """One factory per format, its built-in recipe."""
    return recipes(defaults=True, qualified=qualified)


def select(ids: Iterable[str], **capabilities) -> list[str]:
    """The ids, in order, whose row has every given capability value:
    ``select(QUANTIZERS, reduces_amax=True)``."""
    for name in capabilities:
        if name not in {f.name for f in dataclasses.fields(Format)}:
            raise TypeError(f"Format has no field {name!r}")
    return [i for i in ids
            if all(getattr(format_of(i), k) == v for k, v in capabilities.items())]


__all__ = ["FORMATS", "Format", "default_quantizers", "default_recipes", "format_of",
           "quantizer", "quantizers", "recipe", "recipes", "select"]
