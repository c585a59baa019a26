"""GEMM scale swizzle (`numerics.md` §5; TE ``common/cast/mxfp8/swizzle.cuh``).

A padded scale matrix ``[R, C]`` (``R % 128 == 0``, ``C % 4 == 0``) is stored as 128x4 tiles in
tile-row-major order; element ``(i, j)`` goes to flat offset
``((i // 128) * (C // 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4``.
The swizzled bytes are returned in the same ``[R, C]`` shape (a flat buffer viewed as ``[R, C]``).
"""

from __future__ import annotations

import torch

#: The permutation of the ``[R/128, 4, 32, C/4, 4]`` view; it is its own inverse.
_TILE_PERMUTATION = (0, 3, 2, 1, 4)


def _check_padded(s: torch.Tensor, what: str) -> tuple[int, int]:
    if s.dim() != 2:
        raise ValueError(f"{what} expects a 2D scale matrix, got shape {tuple(s.shape)}")
    rows, cols = s.shape
    if rows % 128 or cols % 4:
        raise ValueError(
            f"{what} needs rows a multiple of 128 and columns a multiple of 4, got {rows}x{cols}"
        )
    return rows, cols


def swizzle_scales(s: torch.Tensor) -> torch.Tensor:
    """GEMM-swizzled copy of the padded scale matrix ``s [R, C]``, shape ``[R, C]``."""
    rows, cols = _check_padded(s, "swizzle_scales")
    tiles = s.reshape(rows // 128, 4, 32, cols // 4, 4)
    return tiles.permute(_TILE_PERMUTATION).reshape(rows, cols)


def unswizzle_scales(s: torch.Tensor) -> torch.Tensor:
    """Inverse of ``swizzle_scales``: the plain ``[R, C]`` matrix of swizzled bytes ``s [R, C]``."""
    rows, cols = _check_padded(s, "unswizzle_scales")
    tiles = s.reshape(rows // 128, cols // 4, 32, 4, 4)
    return tiles.permute(_TILE_PERMUTATION).reshape(rows, cols)
