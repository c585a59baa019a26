"""Reference GEMMs of block-scaled operands (architecture.md contract 6): the definition the
fast paths are held to, and the emulated path on every device.

Both operands are *row operands* (``quant_core.gemm_operand``): ``A [M, K]`` and ``B [N, K]``
with the contraction along dim 1 of both; the result is ``A @ B.T (+ bias)`` cast once (RNE) to
``out_dtype``. Elements are decoded exactly to fp32 and multiplied in fp32; a fast path may differ
only in the order of the fp32 accumulation.

- MXFP8: element ``float(fp8) * 2^(e - 127)`` (§8).
- NVFP4: element ``e2m1 * float(e4m3_block)`` (exact: at most 6 significant bits); the per-tensor
  scales are applied to the fp32 product, ``(P * (amax_a * R)) * (amax_b * R)`` with
  ``R = fp32(1/2688)`` (each factor one fp32 product, not a correctly rounded division),
  which is TransformerEngine's GEMM alpha (§8 "NVFP4 GEMM alpha") rather than a dequantization
  of each element (that would round every element's scale to fp32 first).
"""

from __future__ import annotations

import torch

from ..constants import RCP_NVFP4_GLOBAL_MAX
from ..dtypes import DType
from ._rounding import e2m1_decode, e8m0_to_scale, fp8_decode
from .nvfp4_common import unpack_e2m1
from .swizzle import unswizzle_scales


def _block_scales(scale: torch.Tensor, swizzled: bool, rows: int, blocks: int) -> torch.Tensor:
    """The ``[rows, blocks]`` scale bytes of (row, K block): a strided view, or unswizzled."""
    if swizzled:
        scale = unswizzle_scales(scale)
    return scale[:rows, :blocks]


def _finish(a: torch.Tensor, b: torch.Tensor, bias, out_dtype, alpha=None) -> torch.Tensor:
    out = a @ b.t()
    if alpha is not None:
        out = (out * alpha[0]) * alpha[1]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def _mxfp8_operand(data, scale, fp8_dtype: DType, swizzled: bool) -> torch.Tensor:
    rows, k = data.shape
    blocks = -(-k // 32)
    s = e8m0_to_scale(_block_scales(scale, swizzled, rows, blocks))
    return fp8_decode(data, fp8_dtype) * s.repeat_interleave(32, dim=1)[:, :k]


def mxfp8_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, *,
    a_dtype: DType, b_dtype: DType, a_swizzled: bool, b_swizzled: bool,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dequant(A) @ dequant(B).T (+ bias)`` of MXFP8 row operands, ``out_dtype [M, N]``.

    ``a [M, K]`` / ``b [N, K]``: uint8 FP8 data (any strides), blocks of 32 along K (the last one
    may be partial); the E8M0 byte of (row ``i``, block ``kb``) is ``a_scale[i, kb]`` (any
    strides), or, with ``a_swizzled``, at its GEMM-swizzle position in the padded matrix.
    """
    av = _mxfp8_operand(a, a_scale, a_dtype, a_swizzled)
    bv = _mxfp8_operand(b, b_scale, b_dtype, b_swizzled)
    return _finish(av, bv, bias, out_dtype)


def nvfp4_operand(data, scale, swizzled: bool) -> torch.Tensor:
    """fp32 ``[rows, K]`` of a packed NVFP4 row operand: each element ``e2m1 * e4m3`` of its
    block scale, exact (no per-tensor factor)."""
    rows, k = data.shape[0], data.shape[1] * 2
    blocks = -(-k // 16)
    s = fp8_decode(_block_scales(scale, swizzled, rows, blocks).contiguous(), DType.E4M3)
    return e2m1_decode(unpack_e2m1(data)) * s.repeat_interleave(16, dim=1)[:, :k]


def nvfp4_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, b: torch.Tensor,
    b_scale: torch.Tensor, b_amax: torch.Tensor, *, a_swizzled: bool, b_swizzled: bool,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``A @ B.T (+ bias)`` of NVFP4 row operands, ``out_dtype [M, N]`` (module docstring).

    ``a [M, K/2]`` / ``b [N, K/2]``: packed E2M1 codes along K (element ``2j`` in the low nibble;
    a last partial block zero-padded), ``a_scale`` / ``b_scale`` the padded E4M3 block-scale
    matrices (swizzled when ``*_swizzled``), ``a_amax`` / ``b_amax`` fp32 ``(1,)``, or one per
    row of a row-scaled operand (``(M,)`` / ``(N,)``: the factor of output row ``i`` / column
    ``j``).
    """
    av = nvfp4_operand(a, a_scale, a_swizzled)
    bv = nvfp4_operand(b, b_scale, b_swizzled)
    alpha = (a_amax.to(torch.float32).reshape(-1, 1) * RCP_NVFP4_GLOBAL_MAX,
             b_amax.to(torch.float32).reshape(1, -1) * RCP_NVFP4_GLOBAL_MAX)
    return _finish(av, bv, bias, out_dtype, alpha)
