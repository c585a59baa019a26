"""MXFP8 GEMM for GPUs without MX tensor-core instructions (Hopper): ``A @ B.T`` on the FP8 data
and E8M0 block scales as the storages hold them (`numerics.md` §5, §8).

Two implementations (``_gemm.IMPLEMENTATIONS``): :func:`mxfp8_gemm`, the backend's, runs the
device's (``_gemm.default_implementation``), :func:`mxfp8_gemm_using` the one it is given:

- ``"dequant"`` (on GPUs): exact bf16 dequantization, then cuBLAS
  (:mod:`quant_kernels.dequant_gemm`), the faster of the two for every operand layout
  (bench/RESULTS.md, section "GEMMs and the training step");
- ``"fused"`` (under ``TRITON_INTERPRET=1``): a Triton mainloop dequantizes each tile exactly into
  bf16 (an FP8 value times ``2^e`` is a bf16 value unless it falls below 2^-133 or the scale is
  255/NaN) and multiplies on the bf16 tensor cores with fp32 accumulation; under the interpreter
  the tiles are fp32 and the product is fp32.

Either way the result is the reference GEMM (dequantize both to fp32, matmul, + bias, cast) up to
the accumulation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.dtypes import DType, check_fp8
from quant_core.shapes import ceil_div

from . import _gemm, dequant_gemm
from ._common import launch, out_code
from ._gemm import scale_index, store_tile, tile_rows
from ._rounding import NATIVE_FP8, e8m0_decode, fp8_decode
from .configs import launch_config


@triton.jit
def _expand(s, ROWS: tl.constexpr, BK: tl.constexpr):
    """``[ROWS, BK/32]`` block scales repeated 32 times along K: ``[ROWS, BK]``."""
    s3 = tl.broadcast_to(s[:, :, None], (ROWS, BK // 32, 32))
    return tl.reshape(s3, (ROWS, BK))


@triton.jit
def _mxfp8_gemm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, c_ptr, M, N, K,
    s_am, s_ak, s_bn, s_bk, t_am, t_ak, t_bn, t_bk, SA_C, SB_C, s_cm, s_cn,
    A_SWZ: tl.constexpr, B_SWZ: tl.constexpr, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One ``[BM, BN]`` output tile of ``dequant(A) @ dequant(B).T (+ bias)``, the ``"fused"``
    implementation of :func:`mxfp8_gemm_using`.

    a_ptr: uint8 FP8 row operand A ``[M, K]``, strides ``s_am``, ``s_ak``.
    b_ptr: uint8 FP8 row operand B ``[N, K]``, strides ``s_bn``, ``s_bk``.
    sa_ptr: uint8 E8M0 scales of A, (row, K block): strided, or swizzled when ``A_SWZ``.
    sb_ptr: uint8 E8M0 scales of B, (row, K block): strided, or swizzled when ``B_SWZ``.
    bias_ptr: bias ``[N]`` when ``HAS_BIAS`` (else a dummy).
    c_ptr: output ``[M, N]`` of the dtype ``OUT`` codes, strides ``s_cm``, ``s_cn``.
    M: rows of A and of the output.
    N: rows of B, columns of the output.
    K: the contraction length (a multiple of 32).
    s_am: A's stride over rows (elements).
    s_ak: A's stride over K.
    s_bn: B's stride over rows.
    s_bk: B's stride over K.
    t_am: stride of A's scales over rows (0 when swizzled).
    t_ak: stride of A's scales over K blocks (0 when swizzled).
    t_bn: stride of B's scales over rows (0 when swizzled).
    t_bk: stride of B's scales over K blocks (0 when swizzled).
    SA_C: columns of A's swizzled scale matrix, ``roundup(K/32, 4)`` (0 unswizzled).
    SB_C: columns of B's swizzled scale matrix, ``roundup(K/32, 4)`` (0 unswizzled).
    s_cm: the output's stride over rows.
    s_cn: the output's stride over columns.
    A_SWZ: A's scales in the GEMM swizzle.
    B_SWZ: B's scales in the GEMM swizzle.
    A_E4M3: A is E4M3, else E5M2.
    B_E4M3: B is E4M3, else E5M2.
    HAS_BIAS: add ``bias`` before the cast.
    OUT: output dtype code (``out_code``: 0 fp32, 1 bf16, 2 fp16).
    BM: tile rows.
    BN: tile columns.
    BK: K elements per mainloop step (a multiple of 32).
    GROUP_M: row tiles per group of the tile order (``_gemm.tile_ids``).
    """
    rm, rn, rm_l, rn_l = tile_rows(M, N, BM, BN, GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        kb = k0 // 32 + tl.arange(0, BK // 32)
        kmask = rk < K
        a = tl.load(a_ptr + rm_l[:, None] * s_am + rk[None, :] * s_ak, mask=kmask[None, :],
                    other=0)
        b = tl.load(b_ptr + rn_l[None, :] * s_bn + rk[:, None] * s_bk, mask=kmask[:, None],
                    other=0)
        ea = tl.load(sa_ptr + scale_index(rm_l[:, None], kb[None, :], t_am, t_ak, SA_C,
                                                A_SWZ))
        eb = tl.load(sb_ptr + scale_index(rn_l[None, :], kb[:, None], t_bn, t_bk, SB_C,
                                                B_SWZ))
        av = fp8_decode(a, A_E4M3) * _expand(e8m0_decode(ea), BM, BK)
        bv = fp8_decode(b, B_E4M3) * tl.trans(_expand(tl.trans(e8m0_decode(eb)), BN, BK))
        if NATIVE_FP8:
            acc = tl.dot(av.to(tl.bfloat16), bv.to(tl.bfloat16), acc)
        else:  # interpreter: exact fp32 operands, fp32 product
            acc = tl.dot(av, bv, acc, input_precision="ieee")
    store_tile(c_ptr, acc, rm, rn, M, N, s_cm, s_cn, bias_ptr, HAS_BIAS, OUT)


def _scale_args(scale: torch.Tensor, swizzled: bool, k: int) -> tuple[int, int, int]:
    """(stride over rows, stride over K blocks, padded K-block count for the swizzle)."""
    if swizzled:
        return 0, 0, ceil_div(ceil_div(k, 32), 4) * 4
    return scale.stride(0), scale.stride(1), 0


def mxfp8_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, *,
    a_dtype: DType, b_dtype: DType, a_swizzled: bool, b_swizzled: bool,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dequant(A) @ dequant(B).T (+ bias)`` as ``out_dtype [M, N]``; the contract of
    ``quant_core.reference.mxfp8_gemm`` (row operands ``a [M, K]``, ``b [N, K]``, scales indexed
    (row, K block) or swizzled), computed by the device's implementation
    (``_gemm.default_implementation``)."""
    return mxfp8_gemm_using(
        _gemm.default_implementation(), a, a_scale, b, b_scale, a_dtype=a_dtype,
        b_dtype=b_dtype, a_swizzled=a_swizzled, b_swizzled=b_swizzled, bias=bias,
        out_dtype=out_dtype)


def mxfp8_gemm_using(
    implementation: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
    b_scale: torch.Tensor, *, a_dtype: DType, b_dtype: DType, a_swizzled: bool,
    b_swizzled: bool, bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`mxfp8_gemm` computed by ``implementation`` (one of ``_gemm.IMPLEMENTATIONS``), so
    that either can be checked on any device."""
    _gemm.check_implementation(implementation, "mxfp8_gemm")
    _gemm.check_operands(a, b, bias, out_dtype, "mxfp8_gemm")
    check_fp8(a_dtype, "a_dtype")
    check_fp8(b_dtype, "b_dtype")
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if out.numel() == 0 or k == 0:
        return _gemm.empty_k(out, bias)
    if implementation == "dequant":
        return dequant_gemm.mxfp8_gemm_dequant(
            a, a_scale, b, b_scale, a_dtype=a_dtype, b_dtype=b_dtype, a_swizzled=a_swizzled,
            b_swizzled=b_swizzled, bias=bias, out_dtype=out_dtype)
    cfg, kw = launch_config("mxfp8_gemm")
    t_am, t_ak, sa_c = _scale_args(a_scale, a_swizzled, k)
    t_bn, t_bk, sb_c = _scale_args(b_scale, b_swizzled, k)
    launch(
        _mxfp8_gemm_kernel, _gemm.grid(m, n, cfg),
        a, b, a_scale, b_scale, bias if bias is not None else out, out, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), t_am, t_ak, t_bn, t_bk, sa_c, sb_c,
        out.stride(0), out.stride(1), A_SWZ=bool(a_swizzled), B_SWZ=bool(b_swizzled),
        A_E4M3=a_dtype == DType.E4M3, B_E4M3=b_dtype == DType.E4M3,
        HAS_BIAS=bias is not None, OUT=out_code(out_dtype), **kw,
    )
    return out
