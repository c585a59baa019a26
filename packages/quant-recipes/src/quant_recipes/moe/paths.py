"""How many grouped GEMMs of :class:`~quant_recipes.GroupedLinear` took each path (the path
names: :mod:`.gemm`, :mod:`.fp8_gemm`)."""

from __future__ import annotations

import collections

_PATHS: collections.Counter = collections.Counter()


def grouped_gemm_paths() -> dict[str, int]:
    """How many grouped GEMMs took each path since :func:`reset_grouped_gemm_paths` (counted
    when the GEMM runs, eagerly and inside compiled graphs, where it is an opaque op)."""
    return dict(_PATHS)


def reset_grouped_gemm_paths() -> None:
    _PATHS.clear()


def count_path(name: str) -> None:
    """One grouped GEMM took path ``name``."""
    _PATHS[name] += 1
