"""The FP8 block-scaled grouped GEMM kernels (quant_kernels.fp8_block_grouped_gemm) against the
reference (quant_core.reference.grouped_gemm): ragged and empty groups, rows read from a padded
layout, strided scale views, every pair of FP8 dtypes.

Bitwise where every sum is exact in any order (small integer elements, power-of-2 scales);
elsewhere within the accumulation-order bound."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE
from quant_core import reference
from quant_core.dtypes import DType
from quant_kernels import fp8_block_grouped_gemm as kern
from test_fp8_grouped_gemm import _bytes

PAIRS = [(DType.E4M3, DType.E4M3), (DType.E5M2, DType.E4M3), (DType.E4M3, DType.E5M2)]

#: ``|got - want| / sum |a_i b_i|`` at most (see test_fp8_grouped_gemm.py): fp32 sums in another
#: order, on Hopper each 128-element slice summed in the tensor core's narrower accumulator.
SUM_BOUND = 128 * 2.0**-14 if DEVICE == "cuda" else 256 * 2.0**-23


def _pow2_scales(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-4, 5, shape, generator=g).float())


def _rows_case(a_dtype, b_dtype, integers: bool, counts=(0, 130, 1, 0, 200)):
    """Groups of ``counts`` rows in a layout padded to 128 rows a group, K 256, N 256 (two
    weight blocks each way); the scales as strided views, as the layer passes them (transposed
    storage layouts)."""
    e, k, n = len(counts), 256, 256
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a_ends = torch.tensor([max(-(-c // 128), 1) * 128 for c in counts]).cumsum(0)
    rows = int(a_ends[-1])
    a = _bytes((rows, k), a_dtype, 1, integers)
    b = _bytes((e, n, k), b_dtype, 2, integers)
    sa = _pow2_scales((k // 128, rows + 4), 3)[:, :rows].t()  # [rows, K/128], stride (1, rows+4)
    sb = _pow2_scales((e, k // 128, n // 128), 4).transpose(1, 2)  # [E, N/128, K/128]
    return (a, sa, b, sb, offs, a_ends), {"total": sum(counts), "a_dtype": a_dtype,
                                          "b_dtype": b_dtype}


def _tokens_case(a_dtype, b_dtype, integers: bool, counts=(256, 0, 128)):
    m, n = 96, 80
    ends = torch.tensor([max(c, 128) for c in counts]).cumsum(0)
    r = int(ends[-1])
    a = _bytes((m, r), a_dtype, 5, integers)
    b = _bytes((n, r), b_dtype, 6, integers)
    sa = _pow2_scales((r // 128, m + 4), 7)[:, :m].t()
    sb = _pow2_scales((r // 128, n), 8).t()
    return (a, sa, b, sb, ends), {"a_dtype": a_dtype, "b_dtype": b_dtype}


def _magnitudes(case, rows: bool) -> torch.Tensor:
    """``sum |a_i b_i|`` of every output (the bound's scale), from the reference itself applied
    to the absolute values."""
    args, kw = case
    a, sa, b, sb, *rest = args
    dt = (kw["a_dtype"], kw["b_dtype"])

    def absolute(t, d):
        return t.view(d.torch_dtype).float().abs().to(d.torch_dtype).view(torch.uint8)

    fn = reference.fp8_block_grouped_rows_gemm if rows else reference.fp8_block_grouped_tokens_gemm
    return fn(absolute(a, dt[0]), sa, absolute(b, dt[1]), sb, *rest,
              **{**kw, "out_dtype": torch.float32})


@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS)
def test_rows_gemm_equals_reference_on_exact_sums(a_dtype, b_dtype):
    args, kw = _rows_case(a_dtype, b_dtype, integers=True)
    want = reference.fp8_block_grouped_rows_gemm(*args, **kw)
    got = kern.fp8_block_grouped_rows_gemm(*(t.to(DEVICE) for t in args), **kw)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS)
def test_tokens_gemm_equals_reference_on_exact_sums(a_dtype, b_dtype):
    args, kw = _tokens_case(a_dtype, b_dtype, integers=True)
    want = reference.fp8_block_grouped_tokens_gemm(*args, **kw)
    got = kern.fp8_block_grouped_tokens_gemm(*(t.to(DEVICE) for t in args), **kw)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "tokens"])
def test_any_finite_values_within_the_accumulation_bound(rows):
    case = (_rows_case if rows else _tokens_case)(DType.E4M3, DType.E4M3, integers=False)
    args, kw = case
    fns = ((reference.fp8_block_grouped_rows_gemm, kern.fp8_block_grouped_rows_gemm) if rows
           else (reference.fp8_block_grouped_tokens_gemm, kern.fp8_block_grouped_tokens_gemm))
    f32 = {**kw, "out_dtype": torch.float32}
    want = fns[0](*args, **f32)
    got = fns[1](*(t.to(DEVICE) for t in args), **f32).cpu()
    assert (got - want).abs().le(SUM_BOUND * _magnitudes(case, rows)).all()


def test_clear_errors():
    args, kw = _rows_case(DType.E4M3, DType.E4M3, integers=True)
    a, sa, b, sb, offs, a_ends = (t.to(DEVICE) for t in args)
    with pytest.raises(TypeError, match="a_scale_inv must be fp32"):
        kern.fp8_block_grouped_rows_gemm(a, sa[:, :1], b, sb, offs, a_ends, **kw)
    with pytest.raises(TypeError, match="contiguous uint8"):
        kern.fp8_block_grouped_rows_gemm(a.float(), sa, b, sb, offs, a_ends, **kw)
