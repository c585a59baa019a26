"""Reference grouped GEMMs (mixture-of-experts layers): high-precision operands
(``grouped_rows_gemm``), FP8 with per-group tensor scales, FP8 with block scales
(``fp8_block_grouped_*``) and NVFP4 with per-group amaxes (``nvfp4_grouped_*``): the definition
the grouped kernels are held to, and the emulated path on every device.

Elements are decoded exactly to fp32 and multiplied in fp32; each group's scale-inverses are
applied to its fp32 product, ``(P * a_scale_inv[g]) * b_scale_inv[g]``, as NVFP4's per-tensor
factors are (:mod:`.gemm`), then one RNE cast. A fast path may differ only in the order of the
fp32 accumulation. The group bounds are read on the host: this is the definition, not a fast
path.
"""

from __future__ import annotations

import torch

from ..constants import RCP_NVFP4_GLOBAL_MAX
from ..dtypes import DType
from ..inputs import check_input_dtype
from ..shapes import FP8_BLOCK as BLOCK
from ._rounding import fp8_decode
from .gemm import nvfp4_operand


def _bounds(ends: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each group of cumulative ``ends``."""
    stops = [int(v) for v in ends.tolist()]
    return list(zip([0, *stops[:-1]], stops, strict=True))


def _scaled(p: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype) -> torch.Tensor:
    return ((p * sa) * sb).to(out_dtype)


def grouped_rows_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, a_ends: torch.Tensor,
                      *, total: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are group ``g``'s rows of ``a [R, K]``
    (from row ``a_ends[g-1]`` on) times ``b[g]ᵀ`` (``b [E, N, K]``): high-precision values,
    products and sums in fp32, one RNE cast."""
    check_input_dtype(a, "grouped_rows_gemm")
    check_input_dtype(b, "grouped_rows_gemm")
    out = torch.zeros((total, b.shape[1]), dtype=out_dtype, device=a.device)
    for g, ((s, e), (a0, _)) in enumerate(zip(_bounds(offs), _bounds(a_ends), strict=True)):
        if e > s:
            p = a[a0:a0 + e - s].to(torch.float32) @ b[g].to(torch.float32).t()
            out[s:e] = p.to(out_dtype)
    return out


def fp8_grouped_rows_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                          b_scale_inv: torch.Tensor, offs: torch.Tensor, a_ends: torch.Tensor,
                          *, total: int, a_dtype: DType, b_dtype: DType,
                          out_dtype: torch.dtype = torch.bfloat16,
                          fast_accum: bool = False) -> torch.Tensor:
    """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are group ``g``'s rows of ``a [R, K]``
    (from row ``a_ends[g-1]`` on) times ``b[g]ᵀ`` (``b [E, N, K]``), scaled by the group's
    scale-inverses. Sums in fp32 whatever ``fast_accum`` says (no FP8 tensor cores here)."""
    out = torch.zeros((total, b.shape[1]), dtype=out_dtype, device=a.device)
    for g, ((s, e), (a0, _)) in enumerate(zip(_bounds(offs), _bounds(a_ends), strict=True)):
        if e > s:
            p = fp8_decode(a[a0:a0 + e - s], a_dtype) @ fp8_decode(b[g], b_dtype).t()
            out[s:e] = _scaled(p, a_scale_inv[g], b_scale_inv[g], out_dtype)
    return out


def fp8_grouped_tokens_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                            b_scale_inv: torch.Tensor, ends: torch.Tensor, *, a_dtype: DType,
                            b_dtype: DType, out_dtype: torch.dtype = torch.bfloat16,
                            fast_accum: bool = False, group_multiple: int = 16) -> torch.Tensor:
    """``out [E, M, N]``: group ``g``'s ``a[:, s:e] @ b[:, s:e]ᵀ`` over its columns
    ``ends[g-1]:ends[g]`` of ``a [M, R]`` and ``b [N, R]``, scaled by the group's
    scale-inverses (zeros for a group without columns); sums in fp32 whatever ``fast_accum``
    says. ``group_multiple`` (the columns every group starts and ends on) only lets fast
    backends load whole chunks; the result does not depend on it."""
    out = torch.zeros((ends.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    for g, (s, e) in enumerate(_bounds(ends)):
        p = fp8_decode(a[:, s:e], a_dtype) @ fp8_decode(b[:, s:e], b_dtype).t()
        out[g] = _scaled(p, a_scale_inv[g], b_scale_inv[g], out_dtype)
    return out


def _block_values(data: torch.Tensor, dtype: DType, scale_inv: torch.Tensor, rows_per_block: int
                  ) -> torch.Tensor:
    """fp32 values of FP8 ``data [rows, K]``: each element times its block's scale-inverse,
    ``scale_inv [ceil(rows / rows_per_block), ceil(K / 128)]`` (blocks of 128 along K)."""
    rows, k = data.shape
    per_element = scale_inv.to(torch.float32).repeat_interleave(rows_per_block, 0)[:rows]
    return fp8_decode(data, dtype) * per_element.repeat_interleave(BLOCK, 1)[:, :k]


def fp8_block_grouped_rows_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                                b_scale_inv: torch.Tensor, offs: torch.Tensor,
                                a_ends: torch.Tensor, *, total: int, a_dtype: DType,
                                b_dtype: DType, out_dtype: torch.dtype = torch.bfloat16
                                ) -> torch.Tensor:
    """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are group ``g``'s rows of ``a [R, K]``
    (from row ``a_ends[g-1]`` on) times ``b[g]ᵀ`` (``b [E, N, K]``), FP8 blocks of 128 along K:
    ``a_scale_inv [R, ceil(K/128)]`` per row (1x128), ``b_scale_inv [E, ceil(N/128),
    ceil(K/128)]`` per 128x128 block. Both operands decoded to fp32, multiplied in fp32, one RNE
    cast (the dense FP8 block GEMM's definition, `numerics.md` GEMM contract)."""
    out = torch.zeros((total, b.shape[1]), dtype=out_dtype, device=a.device)
    for g, ((s, e), (a0, _)) in enumerate(zip(_bounds(offs), _bounds(a_ends), strict=True)):
        if e > s:
            av = _block_values(a[a0:a0 + e - s], a_dtype, a_scale_inv[a0:a0 + e - s], 1)
            bv = _block_values(b[g], b_dtype, b_scale_inv[g], BLOCK)
            out[s:e] = (av @ bv.t()).to(out_dtype)
    return out


def fp8_block_grouped_tokens_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                                  b_scale_inv: torch.Tensor, ends: torch.Tensor, *,
                                  a_dtype: DType, b_dtype: DType,
                                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out [E, M, N]``: group ``g``'s ``a[:, s:e] @ b[:, s:e]ᵀ`` over its columns
    ``s:e = ends[g-1]:ends[g]`` of ``a [M, R]`` and ``b [N, R]`` (zeros for a group without
    columns), FP8 blocks of 128 columns: ``a_scale_inv [M, ceil(R/128)]``, ``b_scale_inv [N,
    ceil(R/128)]`` (the 128x1 columnwise blocks of the tokens, each group starting at a
    multiple of 128). Decoded to fp32, multiplied in fp32, one RNE cast."""
    av = _block_values(a, a_dtype, a_scale_inv, 1)
    bv = _block_values(b, b_dtype, b_scale_inv, 1)
    out = torch.zeros((ends.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    for g, (s, e) in enumerate(_bounds(ends)):
        out[g] = (av[:, s:e] @ bv[:, s:e].t()).to(out_dtype)
    return out


def _nvfp4_factor(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor GEMM factors ``amax * fp32(1/2688)`` of per-group amaxes (§8)."""
    return amax.to(torch.float32) * RCP_NVFP4_GLOBAL_MAX


def nvfp4_grouped_rows_gemm(a: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
                            b: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor,
                            offs: torch.Tensor, a_ends: torch.Tensor, *, total: int,
                            a_swizzled: bool, b_swizzled: bool,
                            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are ``((A_g @ B_gᵀ) * (a_amax[g] * R)) *
    (b_amax[g] * R)``, ``R = fp32(1/2688)`` (NVFP4's GEMM alpha, :mod:`.gemm`): ``A_g`` group
    ``g``'s rows of the packed row operand ``a [R, K/2]`` from row ``a_ends[g-1]`` on, ``B_g``
    expert ``g`` of ``b [E, N, K/2]``; each element ``e2m1 * e4m3`` of its block scale
    (``a_scale``: the E4M3 scales of the ``[R, K]`` tensor, ``b_scale``: of the ``[E * N, K]``
    one, GEMM-swizzled when ``*_swizzled``), decoded exactly, multiplied and summed in fp32,
    one RNE cast; ``a_amax``, ``b_amax`` fp32 ``[E]``."""
    experts, n, kh = b.shape
    av = nvfp4_operand(a, a_scale, a_swizzled)
    bv = nvfp4_operand(b.reshape(experts * n, kh), b_scale, b_swizzled).view(experts, n, 2 * kh)
    sa, sb = _nvfp4_factor(a_amax), _nvfp4_factor(b_amax)
    out = torch.zeros((total, n), dtype=out_dtype, device=a.device)
    for g, ((s, e), (a0, _)) in enumerate(zip(_bounds(offs), _bounds(a_ends), strict=True)):
        if e > s:
            out[s:e] = _scaled(av[a0:a0 + e - s] @ bv[g].t(), sa[g], sb[g], out_dtype)
    return out


def nvfp4_grouped_tokens_gemm(a: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
                              b: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor,
                              ends: torch.Tensor, *, a_swizzled: bool, b_swizzled: bool,
                              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out [E, M, N]``: group ``g``'s ``((A[:, s:e] @ B[:, s:e]ᵀ) * (a_amax[g] * R)) *
    (b_amax[g] * R)`` over its columns ``s:e = ends[g-1]:ends[g]`` of the packed row operands
    ``a [M, C/2]``, ``b [N, C/2]`` (a tensor's columnwise NVFP4 data, blocks of 16 along the
    tokens; every group starting at a multiple of 16 columns), decoded as in
    :func:`nvfp4_grouped_rows_gemm`; zeros for a group without columns."""
    av = nvfp4_operand(a, a_scale, a_swizzled)
    bv = nvfp4_operand(b, b_scale, b_swizzled)
    sa, sb = _nvfp4_factor(a_amax), _nvfp4_factor(b_amax)
    out = torch.zeros((ends.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    for g, (s, e) in enumerate(_bounds(ends)):
        out[g] = _scaled(av[:, s:e] @ bv[:, s:e].t(), sa[g], sb[g], out_dtype)
    return out
