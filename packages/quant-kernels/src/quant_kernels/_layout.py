"""Index helpers for the GEMM scale swizzle (`numerics.md` §5), shared by MXFP8 and NVFP4."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def swizzle_offset(i, j, C):
    """Flat offset of element ``(i, j)`` of a padded ``[R, C]`` scale matrix in the swizzled
    layout: ``((i//128)*(C//4) + j//4)*512 + (i%32)*16 + ((i%128)//32)*4 + j%4``."""
    tile = (i // 128) * (C // 4) + j // 4
    return tile * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4


@triton.jit
def scale_offset(i, j, C, SWIZZLE: tl.constexpr):
    """Offset of ``(i, j)`` in a ``[R, C]`` scale buffer, plain row-major or swizzled."""
    if SWIZZLE:
        return swizzle_offset(i, j, C)
    else:
        return i * C + j
