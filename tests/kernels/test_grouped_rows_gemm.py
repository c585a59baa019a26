"""The grouped rows GEMM of high-precision operands (quant_kernels.grouped_gemm) against the
reference (quant_core.reference.grouped_rows_gemm): ragged, empty and one-row groups, rows read
in place and from a padded layout, bf16, fp16 and fp32 operands, bf16 and fp32 outputs.

Bitwise where the fp32 sums are exact in any order (small integers times one power of two);
elsewhere within the accumulation-order bound."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, GROUPED_LOAD_FORMS, GROUPED_LOAD_IDS, grouped_load_form
from quant_core import reference
from quant_kernels import grouped_gemm as kern

COUNTS = [0, 37, 1, 0, 20]


@pytest.fixture(autouse=True, params=GROUPED_LOAD_FORMS, ids=GROUPED_LOAD_IDS)
def loads(request):
    """Every test runs each form of the kernel (tiles by the tensor memory accelerator or by
    masked pointer loads, column tiles first or row tiles first)."""
    with grouped_load_form(("grouped_rows_gemm", "grouped_rows_gemm_fp32"), *request.param):
        yield


def _operands(counts, padded: bool, dtype, exact: bool, k: int = 64, n: int = 48, seed: int = 0):
    """``(a, b, offs, a_ends)``: the groups' rows of ``a`` (each group padded to a multiple of 16
    rows when ``padded``, else end to end) and 16 rows past them never read, one ``b [n, k]`` per
    group. ``exact``: integers in [-8, 8] times 2^-4, whose products and sums fp32 holds
    exactly; else normal values over a few binades."""
    g = torch.Generator().manual_seed(seed)
    held = [-(-c // 16) * 16 for c in counts] if padded else list(counts)

    def values(*shape):
        if exact:
            return torch.randint(-8, 9, shape, generator=g).float() * 2**-4
        return torch.randn(*shape, generator=g) * torch.exp2(
            torch.randint(-3, 4, shape[:-1] + (1,), generator=g).float())

    a = values(sum(held) + 16, k).to(dtype)
    b = values(len(counts), n, k).to(dtype)
    offs = torch.tensor(counts).cumsum(0)
    return a, b, offs, torch.tensor(held).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("padded", [False, True], ids=["in_place", "padded"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_matches_reference(padded, dtype, out_dtype):
    args = _operands(COUNTS, padded, dtype, True)
    kw = {"total": sum(COUNTS), "out_dtype": out_dtype}
    want = reference.grouped_rows_gemm(*args, **kw)
    got = kern.grouped_rows_gemm(*(t.to(DEVICE) for t in args), **kw)
    assert got.dtype == out_dtype and torch.equal(got.cpu(), want)
    assert want.float().abs().amax(1).gt(0).sum() >= 50  # few rows are all zero


def test_any_values_within_the_accumulation_bound():
    """fp32 sums of ``K`` exact products in another order: within ``K 2^-23`` of the sum of
    the products' magnitudes."""
    k = 128
    a, b, offs, a_ends = _operands([33, 0, 64], True, torch.bfloat16, False, k=k)
    kw = {"total": 97, "out_dtype": torch.float32}
    want = reference.grouped_rows_gemm(a, b, offs, a_ends, **kw)
    got = kern.grouped_rows_gemm(*(t.to(DEVICE) for t in (a, b, offs, a_ends)), **kw).cpu()
    mags = reference.grouped_rows_gemm(a.abs(), b.abs(), offs, a_ends, **kw)
    assert bool(((got - want).abs() <= k * 2.0**-23 * mags).all())


def test_empty_problems():
    b = torch.ones((3, 16, 32), dtype=torch.bfloat16).to(DEVICE)
    offs = torch.zeros(3, dtype=torch.int64).to(DEVICE)
    out = kern.grouped_rows_gemm(torch.zeros((0, 32), dtype=torch.bfloat16).to(DEVICE), b, offs,
                                 offs, total=0)
    assert out.shape == (0, 16)


def test_argument_errors():
    a, b = torch.zeros((4, 16)), torch.zeros((2, 8, 16))
    offs = torch.tensor([2, 4])
    with pytest.raises(TypeError, match="grouped_rows_gemm: input dtype must be one of"):
        kern.grouped_rows_gemm(a.to(torch.uint8), b, offs, offs, total=4)
    with pytest.raises(ValueError, match="with the same K"):
        kern.grouped_rows_gemm(a, b[:, :, :8], offs, offs, total=4)
    with pytest.raises(TypeError, match="offs must be a 1D int32/int64 tensor"):
        kern.grouped_rows_gemm(a, b, offs.float(), offs, total=4)
