"""NVFP4 Random Hadamard Transform (numerics.md §7.6, §7.1 RHT amax): hand-derived goldens."""

from __future__ import annotations

import pytest
import torch
from quant_core.reference import nvfp4_amax, nvfp4_quantize, rht_matrix
from quant_core.reference.rht import (
    DEFAULT_SIGN_MASK,
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
    assert signs_to_mask(SPEC_SIGNS) == 55272 == DEFAULT_SIGN_MASK == 0xD7E8
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
