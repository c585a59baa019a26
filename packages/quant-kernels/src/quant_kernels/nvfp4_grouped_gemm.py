"""Grouped NVFP4 GEMMs with per-group amaxes (mixture-of-experts layers), the contract of
``quant_core.reference.nvfp4_grouped_rows_gemm`` / ``nvfp4_grouped_tokens_gemm``: the two shapes
of :mod:`.fp8_grouped_gemm` over packed NVFP4 row operands.

Each operand is decoded whole, group-agnostic, to its exact elements ``e2m1 * e4m3`` (bf16 on a
GPU, fp32 under the interpreter, whose bf16 casts are wrong; the rows GEMM's experts a slice of
output columns at a time where they are wide, ``quant_core.decoded_slices``), then one launch of
:mod:`.fp8_grouped_gemm`'s kernels multiplies them with fp32 accumulation and scales group
``g``'s product ``(P * (a_amax[g] * R)) * (b_amax[g] * R)``, ``R = fp32(1/2688)``, before one
cast. The group bounds stay on the device.
"""

from __future__ import annotations

import math

import torch
from quant_core.constants import NVFP4_GLOBAL_MAX, RCP_NVFP4_GLOBAL_MAX
from quant_core.decoded_slices import column_slices
from quant_core.shapes import NVFP4_BLOCK, ceil_div, nvfp4_rowwise_scale_shape

from . import nvfp4
from ._common import interpreting, out_code
from .configs import launch_config
from .fp8_grouped_gemm import (
    check_ends,
    check_rows_shapes,
    check_tokens_shapes,
    rows_gemm,
    tokens_gemm,
)

#: The operands' FP8 dtypes for the kernels: none, the operands are decoded.
_DECODED = (None, None)


def _decoded(data: torch.Tensor, scale: torch.Tensor, swizzled: bool) -> torch.Tensor:
    """``[rows, K]`` of the exact elements ``e2m1 * e4m3`` of a packed row operand: dequantized
    with the per-tensor factor ``fp32(2688 * fp32(1/2688))``, which leaves every E4M3 scale as
    it is (``dequant_gemm._UNIT_AMAX``)."""
    unit = torch.full((1,), NVFP4_GLOBAL_MAX, dtype=torch.float32, device=data.device)
    dtype = torch.float32 if interpreting() else torch.bfloat16
    return nvfp4.nvfp4_dequantize(data, scale, unit, swizzled=swizzled, dtype=dtype)


def _factor(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's GEMM factors ``amax * fp32(1/2688)`` of per-group amaxes, fp32."""
    return amax.to(torch.float32) * RCP_NVFP4_GLOBAL_MAX


def _check_operand(name: str, a: torch.Tensor, arg: str, data: torch.Tensor, scale: torch.Tensor,
                   swizzled: bool) -> None:
    """Clear errors unless ``data`` is packed uint8 NVFP4 data (``[..., K/2]``, its rows all but
    the last dimension) with uint8 E4M3 block scales ``scale`` of its ``[rows, K]`` tensor, both
    on ``a``'s device."""
    if data.dtype != torch.uint8:
        raise TypeError(f"{name}: {arg} must be packed uint8 NVFP4 data, got {data.dtype}")
    rows, k = math.prod(data.shape[:-1]), data.shape[-1] * 2
    need = nvfp4_rowwise_scale_shape(rows, k) if swizzled else (rows, ceil_div(k, NVFP4_BLOCK))
    if (scale.dtype != torch.uint8 or scale.dim() != 2 or scale.shape[0] < need[0]
            or scale.shape[1] < need[1] or (swizzled and tuple(scale.shape) != need)):
        raise TypeError(f"{name}: {arg}_scale must be {arg}'s uint8 E4M3 block scales, "
                        + (f"swizzled {need}" if swizzled else f"at least {need}")
                        + f", got {scale.dtype} {tuple(scale.shape)}")
    for what, t in ((arg, data), (f"{arg}_scale", scale)):
        if t.device != a.device:
            raise ValueError(f"{name}: {what} is on {t.device} but a on {a.device}")


def _check_amax(name: str, a: torch.Tensor, arg: str, amax: torch.Tensor, groups: int) -> None:
    """Clear errors unless ``amax`` is an fp32 ``[groups]`` tensor on ``a``'s device."""
    if amax.dtype != torch.float32 or tuple(amax.shape) != (groups,):
        raise TypeError(f"{name}: {arg} must be an fp32 [{groups}] tensor (one amax per group), "
                        f"got {amax.dtype} {tuple(amax.shape)}")
    if amax.device != a.device:
        raise ValueError(f"{name}: {arg} is on {amax.device} but a on {a.device}")


def _check(name: str, a: torch.Tensor, a_scale, a_amax, a_swizzled: bool, b: torch.Tensor,
           b_scale, b_amax, b_swizzled: bool, groups: int, out_dtype: torch.dtype) -> None:
    """:func:`_check_operand` of both operands, :func:`_check_amax` of both amaxes and a
    supported ``out_dtype``."""
    out_code(out_dtype)
    _check_operand(name, a, "a", a, a_scale, a_swizzled)
    _check_operand(name, a, "b", b, b_scale, b_swizzled)
    _check_amax(name, a, "a_amax", a_amax, groups)
    _check_amax(name, a, "b_amax", b_amax, groups)


def nvfp4_grouped_rows_gemm(a: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
                            b: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor,
                            offs: torch.Tensor, a_ends: torch.Tensor, *, total: int,
                            a_swizzled: bool, b_swizzled: bool,
                            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are ``((A_g @ B_gᵀ) * (a_amax[g] * R)) *
    (b_amax[g] * R)``, ``A_g`` group ``g``'s rows of the packed ``a [R, K/2]`` from row
    ``a_ends[g-1]`` on, ``B_g`` expert ``g`` of ``b [E, N, K/2]`` (``a_scale`` / ``b_scale``: the
    E4M3 block scales of the ``[R, K]`` / ``[E * N, K]`` tensors, GEMM-swizzled when
    ``*_swizzled``; ``a_amax``, ``b_amax`` fp32 ``[E]``; ``offs``, ``a_ends`` int32/int64
    ``[E]`` cumulative ends, ``offs[-1] == total``)."""
    name = "nvfp4_grouped_rows_gemm"
    check_ends(name, a, (("offs", offs), ("a_ends", a_ends)))
    check_rows_shapes(name, a, b, offs, a_ends, k="K/2")
    experts, n, kh = b.shape
    _check(name, a, a_scale, a_amax, a_swizzled, b, b_scale, b_amax, b_swizzled, experts,
           out_dtype)
    av, factors = _decoded(a, a_scale, a_swizzled), (_factor(a_amax), _factor(b_amax))
    config = launch_config("nvfp4_grouped_rows_gemm")
    column_bytes = experts * 2 * kh * av.element_size()  # one column of the decoded experts
    slices = [(0, n)] if b_swizzled else column_slices(n, column_bytes, column_bytes * n)
    if len(slices) == 1:
        bv = _decoded(b.reshape(experts * n, kh), b_scale, b_swizzled).view(experts, n, 2 * kh)
        return rows_gemm(av, factors[0], bv, factors[1], offs, a_ends, total, _DECODED,
                         out_dtype, config)
    out = torch.empty((total, n), dtype=out_dtype, device=a.device)
    scales = b_scale[:experts * n].reshape(experts, n, b_scale.shape[1])
    for n0, n1 in slices:
        bv = _decoded(b[:, n0:n1].reshape(-1, kh), scales[:, n0:n1].reshape(-1, scales.shape[2]),
                      False).view(experts, n1 - n0, 2 * kh)
        out[:, n0:n1] = rows_gemm(av, factors[0], bv, factors[1], offs, a_ends, total,
                                  _DECODED, out_dtype, config)
        del bv
    return out


def nvfp4_grouped_tokens_gemm(a: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
                              b: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor,
                              ends: torch.Tensor, *, a_swizzled: bool, b_swizzled: bool,
                              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out [E, M, N]``: group ``g``'s ``((A[:, s:e] @ B[:, s:e]ᵀ) * (a_amax[g] * R)) *
    (b_amax[g] * R)`` over its columns ``s:e = ends[g-1]:ends[g]`` of the packed row operands
    ``a [M, C/2]``, ``b [N, C/2]`` (columnwise NVFP4 data, blocks of 16 along the tokens; every
    group starting at a multiple of 16 columns), scales and amaxes as in
    :func:`nvfp4_grouped_rows_gemm`; zeros for a group without columns."""
    name = "nvfp4_grouped_tokens_gemm"
    check_ends(name, a, (("ends", ends),))
    check_tokens_shapes(name, a, b, r="C/2")
    _check(name, a, a_scale, a_amax, a_swizzled, b, b_scale, b_amax, b_swizzled, ends.shape[0],
           out_dtype)
    return tokens_gemm(_decoded(a, a_scale, a_swizzled), _factor(a_amax),
                       _decoded(b, b_scale, b_swizzled), _factor(b_amax), ends, _DECODED,
                       out_dtype, launch_config("nvfp4_grouped_tokens_gemm"))
