"""``recipe(name, **options)``: a recipe from its name, for configs and command lines.

Integrators pass recipes as strings (a YAML file, a ``--converters`` flag, a launcher's
keyword arguments). A name is matched without regard to case, hyphens or underscores. It is one
of the short names (``fp8_current``, ``fp8_block``, ``mxfp8``, ``nvfp4``, ``delayed``) or a
recipe class name as TransformerEngine spells it (``Float8CurrentScaling``, ``DelayedScaling``,
...). The options are the recipe's own fields, given as keywords, with the values a config
holds: a format's name (``fp8_format="hybrid"``), a dict for a ``QParams``/``MMParams`` (the
recipe converts them when it is built).
"""

from __future__ import annotations

import dataclasses

from .recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

#: Short name -> recipe class.
RECIPE_NAMES: dict[str, type[Recipe]] = {
    "fp8_current": Float8CurrentScaling,
    "fp8_block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
    "delayed": DelayedScaling,
}


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


_BY_KEY = {_key(n): cls for n, cls in RECIPE_NAMES.items()} | {
    _key(cls.__name__): cls for cls in RECIPE_NAMES.values()}


def recipe(name: str, **options) -> Recipe:
    """The recipe called ``name`` (see the module docstring), built with ``options`` as its
    fields: ``recipe("nvfp4", disable_rht=True)``. ``ValueError`` lists the names when ``name``
    is unknown, and a recipe's fields when an option is not one of them."""
    return _named(name, "recipe", options)


def _named(name: str, who: str, options: dict) -> Recipe:
    """:func:`recipe`, its errors naming ``who``."""
    if not isinstance(name, str):
        raise TypeError(f"{who}: name must be a str, got {type(name).__name__}")
    cls = _BY_KEY.get(_key(name))
    if cls is None:
        known = ", ".join(f"{n!r} ({c.__name__})" for n, c in RECIPE_NAMES.items())
        raise ValueError(f"{who}: unknown name {name!r}; known: {known}")
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(f"{who}({name!r}): {cls.__name__} has no option "
                         f"{', '.join(map(repr, unknown))}; its options: {', '.join(fields)}")
    return cls(**options)


def as_recipe(value: Recipe | str, who: str, **options) -> Recipe:
    """``value`` when it is a recipe, else :func:`recipe` of the name with ``options``; the
    errors name ``who`` (the caller taking a recipe or its name)."""
    if isinstance(value, str):
        return _named(value, who, options)
    if options:
        raise TypeError(f"{who}: options {sorted(options)} are for a recipe name, not a recipe "
                        "object")
    if not isinstance(value, Recipe):
        raise TypeError(f"{who}: recipe must be a quant_recipes.Recipe or its name, got "
                        f"{value!r}")
    return value
