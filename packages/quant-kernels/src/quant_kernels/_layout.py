"""Index helpers: the GEMM scale swizzle (`numerics.md` §5), shared by MXFP8 and NVFP4, the
rows of a quantize read through a row index (a grouped operand's padded layout), and the
transposed layout of groups of rows (every expert's transposed weight)."""

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


@triton.jit
def group_transposed_offsets(e, rk, r, K, G):
    """``[BK, BM]`` offsets of columns ``rk`` of rows ``r`` (within their group) of groups
    ``e`` (one, or one per row) in a transposed layout of groups of ``G`` rows laid end to end,
    each group's ``[K, G]``: ``e·K·G + k·G + r``."""
    return rk[:, None].to(tl.int64) * G + (e.to(tl.int64) * K * G + r)[None, :]


@triton.jit
def load_rows(x_ptr, src_ptr, rm, rk, M, K, GATHER: tl.constexpr):
    """Rows ``rm``, columns ``rk`` of a row-major x with K columns (0 outside ``M`` rows and
    ``K`` columns); with ``GATHER`` the rows ``src[rm]`` of x (``src_ptr``: int32/int64, -1 a
    zero row). Only loads: what it returns feeds stored values, never a store's address, so
    torch's write analysis of a recorded launch reads neither pointer as written."""
    if GATHER:
        src = tl.load(src_ptr + rm, mask=rm < M, other=-1).to(tl.int64)
        offs = tl.maximum(src, 0)[:, None] * K + rk[None, :]
        mask = (src[:, None] >= 0) & (rk[None, :] < K)
    else:
        offs = rm[:, None].to(tl.int64) * K + rk[None, :]
        mask = (rm[:, None] < M) & (rk[None, :] < K)
    return tl.load(x_ptr + offs, mask=mask, other=0.0)
