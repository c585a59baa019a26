"""Pieces shared by the block-scaled GEMM kernels (MXFP8, NVFP4): the tile order, the scale
index, the epilogue, and the host-side launch checks.

Operand convention: both operands are *row operands*, ``A [M, K]`` and ``B [N, K]`` with the
contraction along dim 1 of both, and the kernels compute ``A @ B.T``. A quantized tensor hands out
such a view of itself for either GEMM role (``quant_core.gemm_operand``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from quant_core.shapes import ceil_div

from ._common import interpreting
from ._layout import swizzle_offset
from ._rounding import to_out

#: The implementations of each block-scaled GEMM, and what each runs: ``"dequant"``
#: (:mod:`quant_kernels.dequant_gemm`) and ``"fused"`` (the GEMM kernels of ``mxfp8_gemm`` and
#: ``nvfp4_gemm``).
IMPLEMENTATIONS = {
    "dequant": "Triton dequantize to bf16 + cuBLAS bf16 GEMM",
    "fused": "Triton GEMM dequantizing in its mainloop",
}


def default_implementation() -> str:
    """The implementation the backend's GEMMs run: ``"dequant"`` on GPUs (the faster one,
    bench/RESULTS.md, section "GEMMs and the training step"), ``"fused"`` under the
    interpreter."""
    return "fused" if interpreting() else "dequant"


def check_implementation(implementation: str, name: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{name}: implementation must be one of {tuple(IMPLEMENTATIONS)}, "
                         f"got {implementation!r}")


@triton.jit
def tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of this program, grouped ``GROUP_M`` row tiles at a time so that
    consecutive programs share B tiles in L2 (the Triton matmul tutorial's ordering)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def tile_rows(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output rows ``rm`` and columns ``rn``, and the row indices to load from
    (rows past the edge read row 0, always valid, instead of masking every load; their results
    are never stored)."""
    pid_m, pid_n = tile_ids(M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rm_l = tl.where(rm < M, rm, 0).to(tl.int64)
    rn_l = tl.where(rn < N, rn, 0).to(tl.int64)
    return rm, rn, rm_l, rn_l


@triton.jit
def scale_index(row, kb, stride_row, stride_kb, C, SWIZZLED: tl.constexpr):
    """Offset of the scale of (operand row ``row``, K block ``kb``): strided, or the GEMM swizzle
    of a padded ``[R, C]`` matrix indexed (row, K block) (`numerics.md` §5)."""
    if SWIZZLED:
        return swizzle_offset(row, kb, C)
    else:
        return row.to(tl.int64) * stride_row + kb * stride_kb


@triton.jit
def store_tile(c_ptr, acc, rm, rn, M, N, s_cm, s_cn, bias_ptr, HAS_BIAS: tl.constexpr,
               OUT: tl.constexpr):
    """``out = cast(acc + float(bias))`` for the valid part of the tile (RNE cast, as the
    reference's ``(a @ b + bias.float()).to(out_dtype)``)."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
    tl.store(ptrs, to_out(acc, OUT), mask=mask)


@triton.jit
def alpha(amax_ptr, rows, PER_ROW: tl.constexpr):
    """The fp32 amax for each of ``rows``: its own (a row-scaled operand's, one per row) or the
    tensor's, broadcast."""
    if PER_ROW:
        return tl.load(amax_ptr + rows)
    else:
        return tl.zeros_like(rows).to(tl.float32) + tl.load(amax_ptr)


def amaxes(amax: torch.Tensor, rows: int, name: str) -> tuple[torch.Tensor, bool]:
    """An NVFP4 operand's fp32 amaxes as a kernel reads them, and whether there is one per row
    (a row-scaled operand) rather than one for the tensor; ``ValueError`` naming ``name`` for
    another count."""
    a = amax.to(torch.float32).reshape(-1).contiguous()
    if a.numel() == 1:
        return a, False
    if a.numel() != rows:
        raise ValueError(f"{name} must hold 1 value or one per row ({rows}), got "
                         f"{tuple(amax.shape)}")
    return a, True


def grid(m: int, n: int, cfg: Mapping[str, int]) -> tuple[int]:
    return (ceil_div(m, cfg["BM"]) * ceil_div(n, cfg["BN"]),)


def empty_k(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The result of an empty product (no rows, no columns or K = 0): the bias, or zeros."""
    if out.numel():
        out.copy_(bias.expand_as(out) if bias is not None else torch.zeros_like(out))
    return out


def check_operands(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype, name: str) -> None:
    """Clear errors for the host wrappers: uint8 row operands on one device with equal K."""
    for arg, t in (("a", a), ("b", b)):
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise TypeError(f"{name}: {arg} must be a 2D uint8 tensor, got {t.dtype} "
                            f"{tuple(t.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{name}: a and b must share dim 1 (K), got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{name}: a on {a.device}, b on {b.device}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: out_dtype must be float32, bfloat16 or float16, got "
                        f"{out_dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[0]):
        raise ValueError(f"{name}: bias must have shape ({b.shape[0]},), got "
                         f"{tuple(bias.shape)}")
