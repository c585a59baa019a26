"""NVFP4 GEMM for GPUs without FP4 tensor-core instructions (Hopper): ``A @ B.T`` on the packed
E2M1 data and E4M3 block scales as the storages hold them (`numerics.md` §7, §8), with the
semantics of ``quant_core.reference.nvfp4_gemm``.

Two implementations (``_gemm.IMPLEMENTATIONS``): :func:`nvfp4_gemm`, the backend's, runs the
device's (``_gemm.default_implementation``), :func:`nvfp4_gemm_using` the one it is given.
``"dequant"`` (on GPUs, the fastest on the H200) decodes both operands into bf16 and multiplies
with cuBLAS (:mod:`quant_kernels.dequant_gemm`); ``"fused"`` (under the interpreter) decodes in
the mainloop of a Triton GEMM. Either way each element becomes ``e2m1 * e4m3`` (at most 2 x 4
significant bits, exact in bf16), products accumulate in fp32, and the per-tensor scales are
applied once to the result, ``(acc * (amax_a * R)) * (amax_b * R)`` with ``R = fp32(1/2688)``
(TE's GEMM alpha, §8; each factor is one fp32 product, as in the reference). A row-scaled
operand brings one amax per row: the factor of each output row (A) or column (B).
In the fused kernel the two nibbles of a byte are two K elements: the low nibbles of A
meet the low nibbles of B in one product and the high nibbles in another, so no interleaving is
needed (the contraction order is free). Columnwise operands in the RHT basis work as they are:
both wgrad operands carry the same orthogonal transform, which cancels in the product. Under
``TRITON_INTERPRET=1`` the decoded tiles stay fp32 (exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _gemm, dequant_gemm
from ._common import launch, out_code
from ._gemm import alpha, scale_index, store_tile, tile_rows
from ._rounding import NATIVE, RCP_2688, e2m1_decode, fp8_decode, mul_rn
from .configs import launch_config


@triton.jit
def _decode(packed, scale, ROWS: tl.constexpr, BK: tl.constexpr):
    """(low, high) nibbles of ``packed [ROWS, BK/2]`` times their block scales ``[ROWS, BK/16]``,
    exact, as bf16 on the GPU and fp32 under the interpreter."""
    s = tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, BK // 16, 8)), (ROWS, BK // 2))
    p = packed.to(tl.int32)
    lo = e2m1_decode(p & 0xF) * s
    hi = e2m1_decode(p >> 4) * s
    if NATIVE:
        return lo.to(tl.bfloat16), hi.to(tl.bfloat16)
    else:
        return lo, hi


@triton.jit
def _dot(x, y, acc):
    if NATIVE:
        return tl.dot(x, y, acc)
    else:
        return tl.dot(x, y, acc, input_precision="ieee")


@triton.jit
def _nvfp4_gemm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, amax_a_ptr, amax_b_ptr, bias_ptr, c_ptr, M, N, K,
    s_am, s_bn, SA_C, SB_C, s_cm, s_cn,
    A_SWZ: tl.constexpr, B_SWZ: tl.constexpr, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One ``[BM, BN]`` output tile of ``A @ B.T (+ bias)``, the ``"fused"`` implementation of
    :func:`nvfp4_gemm_using`.

    a_ptr: uint8 packed E2M1 row operand A ``[M, K/2]``, row stride ``s_am``, K-contiguous.
    b_ptr: uint8 packed E2M1 row operand B ``[N, K/2]``, row stride ``s_bn``, K-contiguous.
    sa_ptr: uint8 E4M3 scales of A ``[roundup(M, 128), SA_C]``, contiguous; swizzled when ``A_SWZ``.
    sb_ptr: uint8 E4M3 scales of B ``[roundup(N, 128), SB_C]``, contiguous; swizzled when ``B_SWZ``.
    amax_a_ptr: fp32 global amax of A ``(1,)``, or ``(M,)`` when ``A_ROWS``.
    amax_b_ptr: fp32 global amax of B ``(1,)``, or ``(N,)`` when ``B_ROWS``.
    bias_ptr: bias ``[N]`` when ``HAS_BIAS`` (else a dummy).
    c_ptr: output ``[M, N]`` of the dtype ``OUT`` codes, strides ``s_cm``, ``s_cn``.
    M: rows of A and of the output.
    N: rows of B, columns of the output.
    K: the contraction length in elements (two per byte).
    s_am: A's row stride in bytes.
    s_bn: B's row stride in bytes.
    SA_C: columns of A's scale matrix, ``roundup(K/16, 4)``.
    SB_C: columns of B's scale matrix, ``roundup(K/16, 4)``.
    s_cm: the output's stride over rows.
    s_cn: the output's stride over columns.
    A_SWZ: A's scales in the GEMM swizzle.
    B_SWZ: B's scales in the GEMM swizzle.
    A_ROWS: A is row-scaled: one amax per row of A (per output row).
    B_ROWS: B is row-scaled: one amax per row of B (per output column).
    HAS_BIAS: add ``bias`` after the per-tensor scales, before the cast.
    OUT: output dtype code (``out_code``: 0 fp32, 1 bf16, 2 fp16).
    BM: tile rows.
    BN: tile columns.
    BK: K elements per mainloop step (a multiple of 16).
    GROUP_M: row tiles per group of the tile order (``_gemm.tile_ids``).
    """
    rm, rn, rm_l, rn_l = tile_rows(M, N, BM, BN, GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rc = k0 // 2 + tl.arange(0, BK // 2)  # byte columns
        kb = k0 // 16 + tl.arange(0, BK // 16)
        cmask = rc < K // 2
        bmask = kb * 16 < K
        a = tl.load(a_ptr + rm_l[:, None] * s_am + rc[None, :], mask=cmask[None, :], other=0)
        b = tl.load(b_ptr + rn_l[:, None] * s_bn + rc[None, :], mask=cmask[None, :], other=0)
        ea = tl.load(sa_ptr + scale_index(rm_l[:, None], kb[None, :], SA_C, 1, SA_C, A_SWZ),
                     mask=bmask[None, :], other=0)
        eb = tl.load(sb_ptr + scale_index(rn_l[:, None], kb[None, :], SB_C, 1, SB_C, B_SWZ),
                     mask=bmask[None, :], other=0)
        a_lo, a_hi = _decode(a, fp8_decode(ea, True), BM, BK)
        b_lo, b_hi = _decode(b, fp8_decode(eb, True), BN, BK)
        acc = _dot(a_lo, tl.trans(b_lo), acc)
        acc = _dot(a_hi, tl.trans(b_hi), acc)
    alpha_a = alpha(amax_a_ptr, rm_l, A_ROWS) * RCP_2688
    alpha_b = alpha(amax_b_ptr, rn_l, B_ROWS) * RCP_2688
    acc = mul_rn(acc * alpha_a[:, None], alpha_b[None, :])  # no contraction
    store_tile(c_ptr, acc, rm, rn, M, N, s_cm, s_cn, bias_ptr, HAS_BIAS, OUT)


def nvfp4_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor, b: torch.Tensor,
    b_scale: torch.Tensor, b_amax: torch.Tensor, *, a_swizzled: bool, b_swizzled: bool,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``A @ B.T (+ bias)`` as ``out_dtype [M, N]``; the contract of
    ``quant_core.reference.nvfp4_gemm``: packed row operands ``a [M, K/2]``, ``b [N, K/2]``
    (K-contiguous here), padded E4M3 scale matrices (contiguous), fp32 amaxes ``(1,)`` (or one
    per row of a row-scaled operand); computed by the device's implementation
    (``_gemm.default_implementation``)."""
    return nvfp4_gemm_using(
        _gemm.default_implementation(), a, a_scale, a_amax, b, b_scale, b_amax,
        a_swizzled=a_swizzled, b_swizzled=b_swizzled, bias=bias, out_dtype=out_dtype)


def nvfp4_gemm_using(
    implementation: str, a: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
    b: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor, *, a_swizzled: bool,
    b_swizzled: bool, bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`nvfp4_gemm` computed by ``implementation`` (one of ``_gemm.IMPLEMENTATIONS``), so
    that either can be checked on any device."""
    _gemm.check_implementation(implementation, "nvfp4_gemm")
    _gemm.check_operands(a, b, bias, out_dtype, "nvfp4_gemm")
    m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
    for arg, t in (("a", a), ("b", b)):
        if t.stride(1) != 1:
            raise ValueError(f"nvfp4_gemm: {arg} must be contiguous along K (stride(1) == 1)")
    for arg, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        if s.dtype != torch.uint8 or not s.is_contiguous():
            raise TypeError(f"nvfp4_gemm: {arg} must be a contiguous uint8 scale matrix")
    if implementation == "dequant" and m and n and k:
        return dequant_gemm.nvfp4_gemm_dequant(
            a, a_scale, a_amax, b, b_scale, b_amax, a_swizzled=a_swizzled,
            b_swizzled=b_swizzled, bias=bias, out_dtype=out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if out.numel() == 0 or k == 0:
        return _gemm.empty_k(out, bias)
    cfg, kw = launch_config("nvfp4_gemm")
    amax_a, a_rows = _gemm.amaxes(a_amax, m, "a_amax")
    amax_b, b_rows = _gemm.amaxes(b_amax, n, "b_amax")
    launch(
        _nvfp4_gemm_kernel, _gemm.grid(m, n, cfg),
        a, b, a_scale, b_scale, amax_a, amax_b, bias if bias is not None else out, out, m, n, k,
        a.stride(0), b.stride(0), a_scale.shape[1], b_scale.shape[1], out.stride(0),
        out.stride(1), A_SWZ=bool(a_swizzled), B_SWZ=bool(b_swizzled), A_ROWS=a_rows,
        B_ROWS=b_rows, HAS_BIAS=bias is not None, OUT=out_code(out_dtype), **kw,
    )
    return out
