"""Reference grouped FP8 GEMMs with per-group tensor scales (mixture-of-experts layers): the
definition the grouped kernels are held to, and the emulated path on every device.

Elements are decoded exactly to fp32 and multiplied in fp32; each group's scale-inverses are
applied to its fp32 product, ``(P * a_scale_inv[g]) * b_scale_inv[g]``, as NVFP4's per-tensor
factors are (:mod:`.gemm`), then one RNE cast. A fast path may differ only in the order of the
fp32 accumulation. The group bounds are read on the host: this is the definition, not a fast
path.
"""

from __future__ import annotations

import torch

from ..dtypes import DType
from ._rounding import fp8_decode


def _bounds(ends: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each group of cumulative ``ends``."""
    stops = [int(v) for v in ends.tolist()]
    return list(zip([0, *stops[:-1]], stops, strict=True))


def _scaled(p: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype) -> torch.Tensor:
    return ((p * sa) * sb).to(out_dtype)


def fp8_grouped_rows_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                          b_scale_inv: torch.Tensor, offs: torch.Tensor, a_ends: torch.Tensor,
                          *, total: int, a_dtype: DType, b_dtype: DType,
                          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are group ``g``'s rows of ``a [R, K]``
    (from row ``a_ends[g-1]`` on) times ``b[g]ᵀ`` (``b [E, N, K]``), scaled by the group's
    scale-inverses."""
    out = torch.zeros((total, b.shape[1]), dtype=out_dtype, device=a.device)
    for g, ((s, e), (a0, _)) in enumerate(zip(_bounds(offs), _bounds(a_ends), strict=True)):
        if e > s:
            p = fp8_decode(a[a0:a0 + e - s], a_dtype) @ fp8_decode(b[g], b_dtype).t()
            out[s:e] = _scaled(p, a_scale_inv[g], b_scale_inv[g], out_dtype)
    return out


def fp8_grouped_tokens_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                            b_scale_inv: torch.Tensor, ends: torch.Tensor, *, a_dtype: DType,
                            b_dtype: DType, out_dtype: torch.dtype = torch.bfloat16
                            ) -> torch.Tensor:
    """``out [E, M, N]``: group ``g``'s ``a[:, s:e] @ b[:, s:e]ᵀ`` over its columns
    ``ends[g-1]:ends[g]`` of ``a [M, R]`` and ``b [N, R]``, scaled by the group's
    scale-inverses (zeros for a group without columns)."""
    out = torch.zeros((ends.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    for g, (s, e) in enumerate(_bounds(ends)):
        p = fp8_decode(a[:, s:e], a_dtype) @ fp8_decode(b[:, s:e], b_dtype).t()
        out[g] = _scaled(p, a_scale_inv[g], b_scale_inv[g], out_dtype)
    return out
