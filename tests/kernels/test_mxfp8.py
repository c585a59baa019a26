"""MXFP8 (1x32, 32x1, 32x32; swizzled and plain scales) against the reference, bitwise."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, assert_all_same, assert_same, make_input
from quant_core import reference as ref
from quant_core.dtypes import DType
from quant_kernels.backend import BACKEND as B

NAMES = ("row_data", "row_scale", "col_data", "col_scale")


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("shape,dtype", [((70, 96), torch.float32), ((40, 64), torch.bfloat16),
                                         ((33, 160), torch.float16), ((0, 32), torch.bfloat16)])
@pytest.mark.parametrize("two_d,swizzle", [(False, False), (False, True), (True, True)])
def test_mxfp8_quantize_dequantize(fp8, shape, dtype, two_d, swizzle):
    x = make_input(*shape, dtype, seed=4)
    for rw, cw in ((True, True), (True, False), (False, True)):
        kw = dict(fp8_dtype=fp8, rowwise=rw, columnwise=cw, with_2d_quantization=two_d,
                  swizzle=swizzle)
        got = B.mxfp8_quantize(x.to(DEVICE), **kw)
        want = ref.mxfp8_quantize(x, **kw)
        assert_all_same(got, want, fp8, NAMES)
    got = B.mxfp8_quantize(x.to(DEVICE), fp8_dtype=fp8, rowwise=True, columnwise=True,
                           with_2d_quantization=two_d, swizzle=swizzle)
    for cw, (d, s) in ((False, got[:2]), (True, got[2:])):
        kw = dict(fp8_dtype=fp8, columnwise=cw, swizzled=swizzle, dtype=dtype)
        assert_same(B.mxfp8_dequantize(d, s, **kw), ref.mxfp8_dequantize(d.cpu(), s.cpu(), **kw))


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("shape,dtype", [((70, 96), torch.float32), ((40, 64), torch.bfloat16),
                                         ((33, 160), torch.float16), ((0, 32), torch.bfloat16)])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
def test_mxfp8_quantize_decoded(fp8, shape, dtype, two_d, out):
    """The values of each direction without its bytes: the reference's, which are its
    dequantize of its quantize (NaN, Inf, subnormals, saturation and partial 32-row blocks of
    ``make_input`` included)."""
    x = make_input(*shape, dtype, seed=5)
    for rw, cw in ((True, True), (True, False), (False, True), (False, False)):
        kw = dict(fp8_dtype=fp8, rowwise=rw, columnwise=cw, with_2d_quantization=two_d,
                  dtype=out)
        got = B.mxfp8_quantize_decoded(x.to(DEVICE), **kw)
        want = ref.mxfp8_quantize_decoded(x, **kw)
        for name, g, w in zip(("row_values", "col_values"), got, want, strict=True):
            assert_same(g, w, what=name)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("two_d", [False, True])
def test_mxfp8_quantize_decoded_through_a_row_index(index_dtype, two_d):
    """``rows``: the values of the tensor made of x's rows in that order, zero rows for -1
    (a padded layout: partial and whole 32-row blocks, repeated rows, an index longer than x)."""
    x = make_input(45, 96, torch.bfloat16, seed=6)
    rows = torch.tensor([3, 0, -1, 44, 7, 7, *range(10, 40), -1, -1, 2, *range(44, 10, -3)],
                        dtype=index_dtype)
    for rw, cw in ((True, True), (True, False), (False, True)):
        kw = dict(fp8_dtype=DType.E4M3, rowwise=rw, columnwise=cw, with_2d_quantization=two_d,
                  dtype=torch.bfloat16)
        got = B.mxfp8_quantize_decoded(x.to(DEVICE), rows=rows.to(DEVICE), **kw)
        want = ref.mxfp8_quantize_decoded(x, rows=rows, **kw)
        gathered = ref.mxfp8_quantize_decoded(
            torch.where((rows >= 0)[:, None], x[rows.clamp(min=0)], 0), **kw)
        for name, g, w, v in zip(("row_values", "col_values"), got, want, gathered, strict=True):
            assert_same(g, w, what=name)
            assert_same(w, v, what=name)


def test_mxfp8_quantize_decoded_refuses_a_bad_row_index():
    kw = dict(fp8_dtype=DType.E4M3, rowwise=True, columnwise=False, with_2d_quantization=False,
              dtype=torch.bfloat16)
    x = torch.zeros(4, 32, device=DEVICE)
    for impl in (ref, B):
        with pytest.raises(TypeError, match="rows must be a 1D int32/int64 tensor"):
            impl.mxfp8_quantize_decoded(x, rows=torch.zeros(4, device=DEVICE), **kw)


def test_mxfp8_rejects_bad_k():
    with pytest.raises(ValueError, match="32"):
        B.mxfp8_quantize(torch.zeros(4, 48, device=DEVICE), fp8_dtype=DType.E4M3, rowwise=True,
                         columnwise=False, with_2d_quantization=False, swizzle=False)
