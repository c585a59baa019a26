"""The reference GEMMs of row operands (architecture.md contract 6) and the storages' GEMM operands.

The expected values are computed from the storages' own ``dequantize()`` (an independent path
through the §8 rules) or from the spec's formulas restated here, never from the code under test.
"""

from __future__ import annotations

import pytest
import torch
from quant_core import (
    DType,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    reference,
)

RCP_2688 = float(torch.tensor(1.0, dtype=torch.float32) / 2688.0)


def _x(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=g))


@pytest.mark.parametrize("swizzle", [False, True])
@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, True)])
def test_mxfp8_gemm_equals_dequantized_matmul(swizzle, ta, tb):
    """fprop (X, W), dgrad-like (X, Wᵀ) and wgrad (Xᵀ, Yᵀ): the reference GEMM of the operands the
    storages hand out equals the matmul of their dequantized values, bit for bit."""
    q = MXFP8Quantizer(DType.E4M3, optimize_for_gemm=swizzle)
    m, n, k = 64, 96, 128  # M and N multiples of 32: either may be the contraction
    x = q.quantize(_x(m, k, 1)) if not ta else q.quantize(_x(k, m, 1))
    w = q.quantize(_x(n, k, 2)) if not tb else q.quantize(_x(k, n, 2))
    ra, rb = x.gemm_operand(ta), w.gemm_operand(tb)
    assert (ra.rows, ra.k, rb.rows, rb.k) == (m, k, n, k)
    bias = torch.randn(n).bfloat16()
    got = reference.mxfp8_gemm(ra.data, ra.scale, rb.data, rb.scale, a_dtype=ra.fp_dtype,
                               b_dtype=rb.fp_dtype, a_swizzled=ra.swizzled,
                               b_swizzled=rb.swizzled, bias=bias, out_dtype=torch.float32)
    xq = MXFP8Quantizer(DType.E4M3, rowwise_usage=not ta, columnwise_usage=ta)
    wq = MXFP8Quantizer(DType.E4M3, rowwise_usage=not tb, columnwise_usage=tb)
    a = xq.quantize(_x(m, k, 1) if not ta else _x(k, m, 1)).dequantize(torch.float32)
    b = wq.quantize(_x(n, k, 2) if not tb else _x(k, n, 2)).dequantize(torch.float32)
    a, b = (a.t() if ta else a), (b.t() if tb else b)
    assert torch.equal(got, a @ b.t() + bias.float())


def _nvfp4_parts(x, amax, transposed):
    """(packed data, scale) of ``x`` (or ``xᵀ``) quantized against a chosen amax, no RHT."""
    rd, rs, cd, cs = reference.nvfp4_quantize(
        x, amax, amax, rowwise=not transposed, columnwise=transposed, with_rht=False,
        rht_sign_mask=0, with_2d_quantization=False, stochastic_rounding=False, rng_seed=None,
        swizzle=False)
    return (cd, cs) if transposed else (rd, rs)


def test_nvfp4_gemm_is_exact_decode_times_te_alpha():
    """Elements ``e2m1 * e4m3`` (exact), fp32 product, then ``(P * fp32(amax_a / 2688)) *
    fp32(amax_b / 2688)`` (§8 GEMM alpha): with amax 2688 the dequantizer's element scale is the
    bare E4M3 value, so ``dequantize`` gives the exact decoded elements to compare with."""
    m, n, k = 48, 32, 64
    x, w = _x(m, k, 3), _x(n, k, 4)
    unit = torch.tensor([2688.0])
    a, sa = _nvfp4_parts(x, unit, False)
    b, sb = _nvfp4_parts(w, unit, False)
    av = reference.nvfp4_dequantize(a, sa, unit, swizzled=False, dtype=torch.float32)
    bv = reference.nvfp4_dequantize(b, sb, unit, swizzled=False, dtype=torch.float32)
    amax_a, amax_b = torch.tensor([3.5]), torch.tensor([0.75])
    got = reference.nvfp4_gemm(a, sa, amax_a, b, sb, amax_b, a_swizzled=False, b_swizzled=False,
                               bias=None, out_dtype=torch.float32)
    alpha_a = torch.tensor(3.5 * RCP_2688, dtype=torch.float32)
    alpha_b = torch.tensor(0.75 * RCP_2688, dtype=torch.float32)
    assert torch.equal(got, ((av @ bv.t()) * alpha_a) * alpha_b)


def test_nvfp4_gemm_transposed_operand_and_swizzle():
    """A columnwise operand ``[K, M/2]`` serves ``Xᵀ``; swizzled scales read the same bytes."""
    q = NVFP4Quantizer(DType.E2M1)
    x, y = _x(64, 48, 5), _x(64, 32, 6)  # contraction over the 64 rows of both
    plain = [q.quantize(t) for t in (x, y)]
    swz = [q.replace(optimize_for_gemm=True).quantize(t) for t in (x, y)]
    outs = []
    for xs, ys in (plain, swz):
        ra, rb = xs.gemm_operand(True), ys.gemm_operand(True)
        assert (ra.rows, ra.k, rb.rows) == (48, 64, 32)
        outs.append(reference.nvfp4_gemm(ra.data, ra.scale, ra.amax, rb.data, rb.scale, rb.amax,
                                         a_swizzled=ra.swizzled, b_swizzled=rb.swizzled,
                                         bias=None, out_dtype=torch.float32))
    assert torch.equal(outs[0], outs[1])
    rel = (outs[0] - x.t() @ y).norm() / (x.t() @ y).norm()
    assert rel < 0.25  # 4-bit elements: a loose sanity bound, the bits are pinned above


def test_gemm_operand_views_and_missing_directions():
    x = _x(256, 128, 7)
    fp8 = Float8CurrentScalingQuantizer(DType.E4M3, columnwise_usage=False).quantize(x)
    op = fp8.gemm_operand(True)  # per-tensor scale: the rowwise bytes viewed transposed
    assert op.data.shape == (128, 256) and op.data.data_ptr() == fp8._data.data_ptr()
    blk = Float8BlockQuantizer(DType.E4M3, block_scaling_dim=1, columnwise_usage=False)
    assert blk.quantize(x).gemm_operand(True) is None  # 1x128 blocks run along k only
    st = Float8BlockQuantizer(DType.E4M3, block_scaling_dim=2).quantize(x)
    op = st.gemm_operand(True)
    assert op.data.shape == (128, 256) and op.block_scaling_dim == 2
    assert op.scale is st._columnwise_scale_inv
    mx = MXFP8Quantizer(DType.E5M2).quantize(x)
    op = mx.gemm_operand(True)
    assert op.data.shape == (128, 256) and op.data.stride() == (1, 128)  # a view, no copy
    assert op.fp_dtype == DType.E5M2 and op.scale.shape[0] >= 128


def test_nvfp4_dequantize_partial_last_block():
    """The columnwise form of a tensor with M % 16 != 0, read as a row operand
    ``[K, M]``, ends in a partial block; dequantizing it used to raise a reshape error (the
    emulated wgrad of a ragged NVFP4 Linear). The partial block's elements use its scale."""
    x = _x(20, 32, 8)
    q = NVFP4Quantizer(DType.E2M1, rowwise_usage=False)
    st = q.quantize(x)
    data, scale, amax = st._columnwise_data, st._columnwise_scale_inv, st._amax_columnwise
    got = reference.nvfp4_dequantize(data, scale, amax, swizzled=False, dtype=torch.float32)
    assert got.shape == (32, 20)
    e4m3 = scale[:32, :2].contiguous().view(torch.float8_e4m3fn).float()
    s = (e4m3 * amax) * torch.tensor(RCP_2688, dtype=torch.float32)
    codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(32, 20).long()
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    want = table[codes] * s.repeat_interleave(16, dim=1)[:, :20]
    assert torch.equal(got, want)
