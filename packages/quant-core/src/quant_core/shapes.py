"""Buffer shapes of every format: the one allocation path (quantize, make_empty, fake tracing).

All functions take the 2D view ``[M, K]`` of the input (``M`` = product of the leading dims) and
return plain tuples of ints. Formulas are `numerics.md` §5, §6, §7.5 with this project's
``ceil(M/b)`` rule for partial blocks along M (§0 Shapes).
"""

from __future__ import annotations

MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCK = 128


def m_k(shape) -> tuple[int, int]:
    """``(M, K)`` of the 2D view of ``shape``: M is the product of all dims but the last."""
    k = shape[-1]
    m = 1
    for d in shape[:-1]:
        m *= d
    return m, k


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def roundup(a: int, b: int) -> int:
    return ceil_div(a, b) * b


def mxfp8_rowwise_scale_shape(m: int, k: int) -> tuple[int, int]:
    return (roundup(m, 128), roundup(k // MXFP8_BLOCK, 4))


def mxfp8_columnwise_scale_shape(m: int, k: int) -> tuple[int, int]:
    return (roundup(ceil_div(m, MXFP8_BLOCK), 4), roundup(k, 128))


def fp8_block_rowwise_scale_shape(m: int, k: int, block_scaling_dim: int) -> tuple[int, int]:
    if block_scaling_dim == 1:
        return (ceil_div(k, FP8_BLOCK), roundup(m, 4))
    return (ceil_div(m, FP8_BLOCK), roundup(ceil_div(k, FP8_BLOCK), 4))


def fp8_block_columnwise_scale_shape(m: int, k: int, block_scaling_dim: int) -> tuple[int, int]:
    if block_scaling_dim == 1:
        return (ceil_div(m, FP8_BLOCK), roundup(k, 4))
    return (ceil_div(k, FP8_BLOCK), roundup(ceil_div(m, FP8_BLOCK), 4))


def nvfp4_rowwise_data_shape(m: int, k: int) -> tuple[int, int]:
    return (m, k // 2)


def nvfp4_rowwise_scale_shape(m: int, k: int) -> tuple[int, int]:
    return (roundup(m, 128), roundup(ceil_div(k, NVFP4_BLOCK), 4))


def nvfp4_columnwise_data_shape(m: int, k: int) -> tuple[int, int]:
    return (k, ceil_div(m, 2))


def nvfp4_columnwise_scale_shape(m: int, k: int) -> tuple[int, int]:
    return (roundup(k, 128), roundup(ceil_div(m, NVFP4_BLOCK), 4))
