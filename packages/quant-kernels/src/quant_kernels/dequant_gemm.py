"""Block-scaled GEMMs as exact bf16 dequantization plus the bf16 tensor-core GEMM of cuBLAS: the
fastest MXFP8 / NVFP4 path measured on Hopper, which has no block-scaled tensor cores
(bench/RESULTS.md, section "GEMMs and the training step").

Every MXFP8 element ``fp8 * 2^(e - 127)`` and every NVFP4 element ``e2m1 * e4m3`` is a bf16 value
(MXFP8: unless it falls below 2^-130, where bf16 runs out of subnormal bits), so one memory-bound
pass writes both operands in bf16, ``torch.mm`` multiplies them with fp32 accumulation and fp32
output (``aten::mm.dtype``, so no reduced-precision split-K reduction can round a partial sum), and
one fused epilogue applies NVFP4's per-tensor scales, adds the bias and casts once. Each operand is
dequantized in its stored memory order; a transposed row operand is handed to cuBLAS as a
transposed view, never copied. When the output needs an epilogue, the fp32 product is never held
whole: it is computed and finished in blocks of output rows of at most
:data:`MAX_FP32_PRODUCT_BYTES`, and a contiguous first operand is dequantized block by block too.
Each output element is still one fp32 accumulation of the same exact products, so the blocks
change nothing but cuBLAS's choice of order. In a compiled graph an NVFP4 GEMM that needs blocks is
not recorded: it stays an opaque op whose eager body runs the blocks (:func:`_rows_per_block`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.constants import NVFP4_GLOBAL_MAX
from quant_core.dtypes import DType
from quant_core.kernel_capture import NotCapturable, capturing
from quant_core.shapes import ceil_div

from . import _gemm, mxfp8, nvfp4
from ._common import launch, out_code
from ._gemm import alpha
from ._rounding import RCP_2688, mul_rn, to_out
from .configs import launch_config

#: E4M3 block scales decode exactly when the NVFP4 dequantizer's per-tensor factor is
#: ``fp32(2688 * fp32(1/2688))``: ``e4m3 * 2688`` is exact and the product rounds back to
#: ``e4m3`` for all 256 codes (checked exhaustively in tests/kernels/test_gemm.py).
_UNIT_AMAX = NVFP4_GLOBAL_MAX


def _mxfp8_bf16(data: torch.Tensor, scale: torch.Tensor, fp8_dtype: DType, swizzled: bool):
    """bf16 ``[rows, K]`` of an MXFP8 row operand: the rowwise data as it is, or the columnwise
    data viewed transposed (dequantized in its stored ``[K, rows]`` order, returned transposed)."""
    if data.stride(1) == 1 and data.is_contiguous():
        return mxfp8.mxfp8_dequantize(data, scale, fp8_dtype=fp8_dtype, columnwise=False,
                                      swizzled=swizzled, dtype=torch.bfloat16)
    stored = data.t()
    if not stored.is_contiguous():
        raise ValueError("mxfp8 dequant GEMM: operand data must be contiguous in either order")
    stored_scale = scale.reshape(scale.shape[1], scale.shape[0]) if swizzled else scale.t()
    out = mxfp8.mxfp8_dequantize(stored, stored_scale, fp8_dtype=fp8_dtype, columnwise=True,
                                 swizzled=swizzled, dtype=torch.bfloat16)
    return out.t()


def _nvfp4_bf16(data: torch.Tensor, scale: torch.Tensor, swizzled: bool):
    """bf16 ``[rows, K]`` of ``e2m1 * e4m3`` (no per-tensor factor) of a packed row operand."""
    unit = torch.full((1,), _UNIT_AMAX, dtype=torch.float32, device=data.device)
    return nvfp4.nvfp4_dequantize(data.contiguous(), scale, unit, swizzled=swizzled,
                                  dtype=torch.bfloat16)


#: ``aten::mm.dtype`` (bf16 operands, fp32 output in one cuBLAS call) exists in this torch.
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` of bf16 operands with fp32 accumulation and fp32 output. Without
    ``aten::mm.dtype`` (and on the CPU) the operands are widened: an fp32 matmul of bf16 values is
    exact per product even in TF32 (10 mantissa bits hold bf16's 8)."""
    if a.device.type == "cuda" and _MM_OUT_DTYPE:
        return torch.mm(a, b.t(), out_dtype=torch.float32)
    return a.float() @ b.float().t()


@triton.jit
def _epilogue_kernel(acc_ptr, out_ptr, bias_ptr, amax_a_ptr, amax_b_ptr, total, N,
                     HAS_ALPHA: tl.constexpr, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
    """``BLOCK`` elements of ``cast((acc * alpha_a) * alpha_b + bias)`` (:func:`_finish`).

    acc_ptr: fp32 GEMM result ``[M, N]``, contiguous.
    out_ptr: output ``[M, N]`` of the dtype ``OUT`` codes, contiguous.
    bias_ptr: bias ``[N]`` when ``HAS_BIAS`` (else a dummy).
    amax_a_ptr: fp32 NVFP4 global amax of A ``(1,)`` (``(M,)`` when ``A_ROWS``) when
        ``HAS_ALPHA`` (else a dummy).
    amax_b_ptr: fp32 NVFP4 global amax of B ``(1,)`` (``(N,)`` when ``B_ROWS``) when
        ``HAS_ALPHA`` (else a dummy).
    total: element count ``M * N``.
    N: columns (the bias index of element i is ``i % N``).
    HAS_ALPHA: multiply by NVFP4's per-tensor factors ``amax * fp32(1/2688)`` of A, then B.
    A_ROWS: A is row-scaled (the amax of element i's row, ``i // N``).
    B_ROWS: B is row-scaled (the amax of element i's column, ``i % N``).
    HAS_BIAS: add ``bias`` before the cast.
    OUT: output dtype code (``out_code``: 0 fp32, 1 bf16, 2 fp16).
    BLOCK: elements per program.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    v = tl.load(acc_ptr + offs, mask=mask, other=0.0)
    if HAS_ALPHA:
        alpha_a = alpha(amax_a_ptr, offs // N, A_ROWS) * RCP_2688
        alpha_b = alpha(amax_b_ptr, offs % N, B_ROWS) * RCP_2688
        v = mul_rn(v * alpha_a, alpha_b)
    if HAS_BIAS:
        v = v + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, to_out(v, OUT), mask=mask)


def _finish(acc: torch.Tensor, bias, out_dtype, amax_a=None, amax_b=None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``cast((acc * alpha_a) * alpha_b + bias)`` in one pass (alphas only for NVFP4), into
    ``out`` (contiguous, ``acc``'s shape) when given."""
    has_alpha = amax_a is not None
    if out is None and out_dtype == torch.float32 and bias is None and not has_alpha:
        return acc
    if out is None:
        out = torch.empty_like(acc, dtype=out_dtype)
    if acc.numel() == 0:
        return out
    a_rows = b_rows = False
    if has_alpha:
        amax_a, a_rows = _gemm.amaxes(amax_a, acc.shape[0], "a_amax")
        amax_b, b_rows = _gemm.amaxes(amax_b, acc.shape[1], "b_amax")
    cfg, kw = launch_config("gemm_epilogue")
    launch(
        _epilogue_kernel, (ceil_div(acc.numel(), cfg["BLOCK"]),),
        acc, out, bias if bias is not None else acc, amax_a if has_alpha else acc,
        amax_b if has_alpha else acc, acc.numel(), acc.shape[1], HAS_ALPHA=has_alpha,
        A_ROWS=a_rows, B_ROWS=b_rows, HAS_BIAS=bias is not None, OUT=out_code(out_dtype),
        **kw,
    )
    return out


#: The most bytes of fp32 product a dequantized GEMM with a non-fp32 (or biased, or NVFP4-scaled)
#: output holds at once; a larger product is computed and finished in blocks of output rows.
MAX_FP32_PRODUCT_BYTES = 64 * 2**20
#: Swizzled scales come in tiles of 128 rows, so a block of rows starts at a multiple of 128.
_ROW_TILE = 128


def _rows_per_block(m, n, direct: bool, recorded_blocks: bool = True) -> int | None:
    """Output rows per block of the product (``None``: one block): one block when the output is
    the fp32 product itself (``direct``), fits :data:`MAX_FP32_PRODUCT_BYTES`, or has symbolic
    shapes (a Python loop over the rows would specialise the graph on ``m``).

    While launches are recorded into a compiled graph, recorded blocks are never used: they hit
    an illegal memory access in an Inductor copy kernel on the GPU (bench/RESULTS.md, section
    "Step ratios with the direct launcher, and memory with the weight requantized"). With
    ``recorded_blocks`` (NVFP4) a product that needs blocks raises ``NotCapturable`` before
    anything is recorded, so the GEMM stays an opaque op whose eager body runs the blocks, which
    lowers the compiled step's peak memory below that of the whole product recorded. Without it
    (MXFP8) the whole product is recorded: there the opaque blocks peaked higher, because the
    step's other eager allocations cost more than the product saves (bench/RESULTS.md, section
    "Host cost of the compiled step, interleaved timing rounds", its compiled NVFP4 GEMMs in row
    blocks)."""
    if (direct or not (isinstance(m, int) and isinstance(n, int))
            or m * n * 4 <= MAX_FP32_PRODUCT_BYTES):
        return None
    if capturing():
        if not recorded_blocks:
            return None
        raise NotCapturable(f"a dequantized GEMM of {m}x{n} outputs runs in row blocks, "
                            "which stay eager")
    return max(_ROW_TILE, MAX_FP32_PRODUCT_BYTES // (4 * n) // _ROW_TILE * _ROW_TILE)


def _product(a_rows, m: int, bv, rows: int | None, bias, out_dtype, amax_a=None,
             amax_b=None) -> torch.Tensor:
    """``cast(alpha * (A @ bvᵀ) + bias)`` with fp32 accumulation, where ``a_rows(r0, r1)`` is
    bf16 ``A[r0:r1]``; in blocks of ``rows`` output rows (:func:`_rows_per_block`), so that
    neither the fp32 product nor (for a contiguous A) A's bf16 copy is held whole."""
    if rows is None:
        return _finish(_mm_fp32(a_rows(0, m), bv), bias, out_dtype, amax_a, amax_b)
    out = torch.empty((m, bv.shape[0]), dtype=out_dtype, device=bv.device)
    per_row = amax_a is not None and amax_a.numel() > 1  # a row-scaled A: its rows' amaxes
    for r0 in range(0, m, rows):
        r1 = min(r0 + rows, m)
        _finish(_mm_fp32(a_rows(r0, r1), bv), bias, out_dtype,
                amax_a.reshape(-1)[r0:r1] if per_row else amax_a, amax_b, out=out[r0:r1])
    return out


def _whole(av: torch.Tensor):
    """``a_rows`` of an operand dequantized whole (a row slice of a transposed view is a view)."""
    return lambda r0, r1: av[r0:r1]


def _mxfp8_rows(data, scale, fp8_dtype: DType, swizzled: bool):
    """``a_rows`` of an MXFP8 row operand: contiguous rowwise data is dequantized per block of
    rows (its scales from the block's first row on: ``r0`` is a multiple of 128, where a swizzled
    tile starts, so the slice is that block's swizzled scales), other data whole."""
    if not data.is_contiguous():
        return _whole(_mxfp8_bf16(data, scale, fp8_dtype, swizzled))
    return lambda r0, r1: mxfp8.mxfp8_dequantize(
        data[r0:r1], scale[r0:], fp8_dtype=fp8_dtype, columnwise=False, swizzled=swizzled,
        dtype=torch.bfloat16)


def _nvfp4_rows(data, scale, swizzled: bool):
    """``a_rows`` of a packed NVFP4 row operand (rowwise or stored-transposed columnwise data are
    both ``[rows, K/2]``), dequantized per block of rows as :func:`_mxfp8_rows` does."""
    data = data.contiguous()
    return lambda r0, r1: _nvfp4_bf16(data[r0:r1], scale[r0:], swizzled)


def mxfp8_gemm_dequant(a, a_scale, b, b_scale, *, a_dtype, b_dtype, a_swizzled, b_swizzled,
                       bias, out_dtype) -> torch.Tensor:
    """``quant_core.reference.mxfp8_gemm`` through bf16 dequantization and cuBLAS."""
    direct = out_dtype == torch.float32 and bias is None  # the fp32 product is the output
    rows = _rows_per_block(a.shape[0], b.shape[0], direct, recorded_blocks=False)
    bv = _mxfp8_bf16(b, b_scale, b_dtype, b_swizzled)
    return _product(_mxfp8_rows(a, a_scale, a_dtype, a_swizzled), a.shape[0], bv, rows, bias,
                    out_dtype)


def nvfp4_gemm_dequant(a, a_scale, a_amax, b, b_scale, b_amax, *, a_swizzled, b_swizzled, bias,
                       out_dtype) -> torch.Tensor:
    """``quant_core.reference.nvfp4_gemm`` through bf16 dequantization and cuBLAS."""
    rows = _rows_per_block(a.shape[0], b.shape[0], False)  # before the first launch
    bv = _nvfp4_bf16(b, b_scale, b_swizzled)
    return _product(_nvfp4_rows(a, a_scale, a_swizzled), a.shape[0], bv, rows, bias, out_dtype,
                    a_amax, b_amax)
