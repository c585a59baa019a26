"""NVFP4 Random Hadamard Transform (numerics.md §7.6, §7.1 RHT amax): hand-derived goldens."""

from __future__ import annotations

import pytest
import torch
from quant_core.constants import DEFAULT_RHT_SIGN_MASK
from quant_core.reference import nvfp4_amax, nvfp4_quantize, rht_matrix
from quant_core.reference.rht import (
    DEFAULT_SIGNS,
    mask_to_signs,
    rht_columnwise,
    signs_to_mask,
)

#: The sign vector printed in §7.6.
SPEC_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def test_mask_and_signs():
    # -1 at i = 3, 5, 6, 7, 8, 9, 10, 12, 14, 15:
    # 8 + 32 + 64 + 128 + 256 + 512 + 1024 + 4096 + 16384 + 32768 = 55272 = 0xD7E8
    assert DEFAULT_SIGNS == SPEC_SIGNS
    assert signs_to_mask(SPEC_SIGNS) == 55272 == DEFAULT_RHT_SIGN_MASK == 0xD7E8
    assert mask_to_signs(55272) == SPEC_SIGNS
    assert mask_to_signs(0) == (1,) * 16 and signs_to_mask((1,) * 16) == 0
    assert mask_to_signs(1) == (-1,) + (1,) * 15
    with pytest.raises(ValueError):
        mask_to_signs(1 << 16)
    with pytest.raises(ValueError):
        signs_to_mask((1, 0) * 8)


@pytest.mark.parametrize("mask", [55272, 0, 0x8001])
def test_matrix_entries(mask):
    r = rht_matrix(mask, torch.device("cpu"))
    assert r.dtype == torch.bfloat16 and r.shape == (16, 16)
    signs = mask_to_signs(mask)
    for i in range(16):
        for j in range(16):
            h = -1 if bin(i & j).count("1") % 2 else 1  # Sylvester: (-1)^popcount(i AND j)
            assert r[i, j].item() == signs[i] * h * 0.25
    # R R^T = diag(s) H H^T diag(s) / 16 = I: sums of 16 terms ±1/16, exact in fp32
    rf = r.float()
    assert torch.equal(rf @ rf.t(), torch.eye(16))


def test_matrix_spot_values_default_mask():
    r = rht_matrix(55272, torch.device("cpu")).float()
    assert r[0].tolist() == [0.25] * 16  # s_0 = 1, H_0j = 1
    assert r[1].tolist() == [0.25, -0.25] * 8  # s_1 = 1, H_1j = (-1)^(j & 1)
    assert r[3].tolist() == [-0.25, 0.25, 0.25, -0.25] * 4  # s_3 = -1, H_3j = (-1)^popcount(j & 3)
    assert r[15, 0].item() == -0.25 and r[15, 15].item() == -0.25  # s_15 = -1, popcount(15) = 4


def test_matrix_cached_per_mask_and_device():
    assert rht_matrix(55272, torch.device("cpu")) is rht_matrix(55272, torch.device("cpu"))
    assert rht_matrix(0, torch.device("cpu")) is not rht_matrix(55272, torch.device("cpu"))


def test_transform_rounds_to_bf16_and_amax_reads_rounded_output():
    # x [16, 16] bf16, column 0 = [1, 3 * 2^-9, 0...], other columns 0. With s_0 = s_1 = 1:
    # out_j = (1 + (-1)^(j & 1) * 3 * 2^-9) / 4.
    # j even: 1 + 3 * 2^-9 = 1 + 0.75 * 2^-7 -> bf16 (ulp 2^-7) rounds up to 1 + 2^-7
    #         -> out = (1 + 2^-7) / 4 = 0.251953125 (unrounded 0.25146484375).
    # j odd:  1 - 3 * 2^-9 = 1 - 1.5 * 2^-8 (ulp 2^-8 below 1): tie between 1 - 2^-8 (mantissa
    #         all ones, odd) and 1 - 2^-7 (even) -> 1 - 2^-7 -> out = (1 - 2^-7) / 4 = 0.248046875.
    x = torch.zeros(16, 16, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    x[1, 0] = 3 * 2.0**-9
    out = rht_columnwise(x, 55272)
    assert out.dtype == torch.bfloat16 and out.shape == (16, 16)
    assert out[0].float().tolist() == [0.251953125, 0.248046875] * 8
    assert not out[1:].float().any()
    a_row, a_col = nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=55272)
    assert a_row.tolist() == [1.0]
    assert a_col.tolist() == [0.251953125]  # over the bf16-rounded output, not 0.25146484375


def test_transform_groups_of_16_rows():
    # rows 16..31 form the second group: a unit impulse in row 16 + i of column k gives
    # out[k, 16 + j] = R[i, j]; the first group of that column stays 0.
    x = torch.zeros(32, 16, dtype=torch.bfloat16)
    x[16 + 3, 5] = 2.0
    out = rht_columnwise(x, 55272).float()
    r = rht_matrix(55272, torch.device("cpu")).float()
    assert torch.equal(out[5, 16:], 2 * r[3]) and not out[5, :16].any()
    assert not torch.cat([out[:5], out[6:]]).any()


def test_rht_requires_bf16_and_m_multiple_of_16():
    with pytest.raises(ValueError, match="float32"):
        rht_columnwise(torch.zeros(16, 16), 55272)
    with pytest.raises(ValueError, match="16"):
        rht_columnwise(torch.zeros(24, 16, dtype=torch.bfloat16), 55272)
    with pytest.raises(ValueError, match="float16"):
        nvfp4_amax(
            torch.zeros(16, 16, dtype=torch.float16),
            rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=55272,
        )
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(
            torch.zeros(17, 16, dtype=torch.bfloat16), torch.ones(1), torch.ones(1),
            rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=55272,
            with_2d_quantization=False, stochastic_rounding=False, rng_seed=None, swizzle=False,
        )


def test_rht_orthogonal_transform_preserves_norm():
    # (A R)(B R)^T = A B^T up to the bf16 rounding of the outputs (relative 2^-9 per element)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = rht_columnwise(x, 55272).float()
    xt = x.float().t()
    assert torch.allclose(y @ y.t(), xt @ xt.t(), rtol=2e-2, atol=0.5)


def _exact_rht_bf16(x: torch.Tensor, sign_mask: int) -> torch.Tensor:
    """An oracle independent of the reference: §7.6 with Python's exact rationals.

    The exact sum of each group's 16 products goes to a Python float (correctly rounded, and exact
    for these inputs, whose magnitudes span far less than 2^45), then to fp32 and bf16 by torch's
    RNE casts; an exact zero is +0.
    """
    from fractions import Fraction

    signs = mask_to_signs(sign_mask)
    m, k = x.shape
    out = torch.empty(k, m, dtype=torch.float64)
    for col in range(k):
        for g in range(m // 16):
            v = [Fraction(x[16 * g + i, col].item()) for i in range(16)]
            for j in range(16):
                terms = (
                    v[i] * signs[i] * (-1 if bin(i & j).count("1") % 2 else 1) / 4
                    for i in range(16)
                )
                out[col, 16 * g + j] = float(sum(terms, Fraction(0)))
    return out.to(torch.float32).to(torch.bfloat16)


#: Largest finite bf16, (2 - 2^-7) * 2^127.
BF16_MAX = torch.finfo(torch.bfloat16).max


def _near_max_columns() -> torch.Tensor:
    """Columns of 16 rows whose partial sums in a sequential fp32 order overflow while the exact
    sums are finite: with mask 0 output 0 is Σ x_i / 4, and 5 terms of
    BF16_MAX / 4 already pass FLT_MAX."""
    cols = [
        [BF16_MAX] * 8 + [-BF16_MAX] * 8,  # out_0 = 0 exactly, out_8 = 4 * BF16_MAX -> +Inf
        [BF16_MAX] * 5 + [-BF16_MAX] * 5 + [1.0] * 6,  # out_0 = 6 / 4
        [BF16_MAX, -BF16_MAX] * 8,  # out_0 = 0, out_1 = 4 * BF16_MAX -> +Inf
        [BF16_MAX] * 4 + [-BF16_MAX / 2] * 8 + [3.0, -2.0, 0.5, 2.0**-20],
        [2.0**100] * 16,
    ]
    return torch.tensor(cols, dtype=torch.float64).t().to(torch.bfloat16).contiguous()


@pytest.mark.parametrize("mask", [0, 55272])
def test_rht_is_the_exact_sum_near_the_bf16_maximum(mask):
    x = _near_max_columns()
    out = rht_columnwise(x, mask)
    expected = _exact_rht_bf16(x, mask)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    if mask == 0:
        # the hand-derived values of the docstring (sequential fp32 gives +Inf for both)
        assert out[0, 0].item() == 0.0 and out[1, 0].item() == 1.5
        assert out[0, 8].item() == float("inf") and out[2, 1].item() == float("inf")


@pytest.mark.parametrize("mask", [0, 55272])
def test_rht_of_a_group_of_zeros_is_positive_zero(mask):
    # -0.0 in every row: every product is ±0, so every output is +0 (sequential fp32 from the
    # first product gives -0.0 wherever that product is -0.0). Column 1 cancels exactly to 0.
    x = torch.full((16, 3), -0.0, dtype=torch.bfloat16)
    x[:, 1] = torch.tensor([1.0, 1.0] * 8)  # out_j = 0 for j != 0 by cancellation (mask 0)
    x[:, 2] = torch.tensor([0.0, -0.0] * 8)
    out = rht_columnwise(x, mask)
    zeros = out == 0
    assert not torch.signbit(out[zeros]).any()
    assert torch.equal(out.view(torch.int16), _exact_rht_bf16(x, mask).view(torch.int16))
    # the NVFP4 columnwise codes of the -0 group are 0x0 (+0), never 0x8 (-0)
    x2 = torch.cat([x, torch.ones(16, 13, dtype=torch.bfloat16)], dim=1)  # nonzero amax, K = 16
    a_row, a_col = nvfp4_amax(x2, rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=mask)
    _, _, col_data, _ = nvfp4_quantize(
        x2, a_row, a_col, rowwise=False, columnwise=True, with_rht=True, rht_sign_mask=mask,
        with_2d_quantization=False, stochastic_rounding=False, rng_seed=None, swizzle=False,
    )
    first_col = col_data[0]  # xᵀ row 0 = the -0 column, 16 codes packed in 8 bytes
    assert first_col.tolist() == [0] * 8


def test_rht_matches_the_exact_oracle_on_random_groups():
    g = torch.Generator().manual_seed(20)
    x = (torch.randn(32, 6, generator=g) * torch.logspace(-3, 3, 6)).to(torch.bfloat16)
    x[0:16, 0] = x[0:16, 0] * 2.0**-30  # a group far below the others
    for mask in (0, 55272, 0x8001):
        expected = _exact_rht_bf16(x, mask)
        assert torch.equal(rht_columnwise(x, mask).view(torch.int16), expected.view(torch.int16))
