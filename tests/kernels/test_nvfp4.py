"""NVFP4 (rowwise, columnwise, RHT, 2D, stochastic rounding) against the reference, bitwise."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, assert_all_same, assert_same, make_input
from quant_core import reference as ref
from quant_kernels.backend import BACKEND as B

NAMES = ("row_data", "row_scale", "col_data", "col_scale")
MASK = 0xD7E8


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """Plant NVFP4 cases: all-equal block, tiny blocks near the E4M3 subnormal scales."""
    x = x.clone()
    if x.shape[0] >= 8 and x.shape[1] >= 48:
        x[4, :16] = x[4, 0]
        x[5, 16:32] = 1e-6
        x[6, 32:48] *= 1e-5
        x[7, :16] = 1e-30
    return x


CASES = [((80, 96), torch.float32, False), ((77, 64), torch.float16, False),
         ((48, 64), torch.bfloat16, True), ((0, 32), torch.bfloat16, False)]


@pytest.mark.parametrize("shape,dtype,rht", CASES)
@pytest.mark.parametrize("two_d,sr,swizzle", [(False, False, False), (False, True, True),
                                             (True, False, True)])
def test_nvfp4(shape, dtype, rht, two_d, sr, swizzle):
    if rht and two_d:
        pytest.skip("RHT and 2D are exclusive")
    x = _blocks(make_input(*shape, torch.float32, seed=6)).to(dtype)
    xd = x.to(DEVICE)
    amax_kw = dict(rowwise=True, columnwise=True, with_rht=rht, rht_sign_mask=MASK)
    got_a = B.nvfp4_amax(xd, **amax_kw)
    want_a = ref.nvfp4_amax(x, **amax_kw)
    assert_all_same(got_a, want_a, None, ("amax_row", "amax_col"))
    seed = torch.tensor([20240607], dtype=torch.int64)
    for rw, cw in ((False, True), (True, True)):
        kw = dict(rowwise=rw, columnwise=cw, with_rht=rht, rht_sign_mask=MASK,
                  with_2d_quantization=two_d, stochastic_rounding=sr, rng_seed=seed,
                  swizzle=swizzle)
        got = B.nvfp4_quantize(xd, got_a[0], got_a[1], **kw)
        want = ref.nvfp4_quantize(x, want_a[0], want_a[1], **kw)
        assert_all_same(got, want, None, NAMES)
    assert_same(B.nvfp4_dequantize(got[0], got[1], got_a[0], swizzled=swizzle, dtype=dtype),
                ref.nvfp4_dequantize(want[0], want[1], want_a[0], swizzled=swizzle, dtype=dtype))


def test_nvfp4_special_amax():
    """Zero, Inf and NaN-containing tensors (global-scale edge cases)."""
    base = make_input(32, 32, torch.float32, seed=7, specials=False)
    for x in (torch.zeros(32, 32), base.masked_fill(base > 1, float("inf")),
              base.masked_fill(base > 1, float("nan"))):
        for kw_rht in (False,):
            a = ref.nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=kw_rht,
                               rht_sign_mask=MASK)
            kw = dict(rowwise=True, columnwise=True, with_rht=kw_rht, rht_sign_mask=MASK,
                      with_2d_quantization=False, stochastic_rounding=False, rng_seed=None,
                      swizzle=False)
            assert_all_same(B.nvfp4_quantize(x.to(DEVICE), a[0].to(DEVICE), a[1].to(DEVICE), **kw),
                            ref.nvfp4_quantize(x, a[0], a[1], **kw), None, NAMES)


def test_nvfp4_rht_requires_m16_and_bf16():
    with pytest.raises(ValueError, match="16"):
        B.nvfp4_amax(torch.zeros(8, 32, dtype=torch.bfloat16, device=DEVICE), rowwise=False,
                     columnwise=True, with_rht=True, rht_sign_mask=MASK)
    with pytest.raises(ValueError, match="bfloat16"):
        B.nvfp4_amax(torch.zeros(16, 32, device=DEVICE), rowwise=False, columnwise=True,
                     with_rht=True, rht_sign_mask=MASK)


#: Columns (in units of the largest bf16) whose 16 RHT outputs under MASK are all finite while a
#: sequential fp32 sum overflows partway (found by a search over such columns).
_NEAR_MAX_COLUMNS = (
    (-1, 0, 0, 0.5, 1, 0, -0.5, -0.5, 0.5, -1, 0.5, -1, 1, 0.5, 0.5, 0),
    (-1, 0, -0.5, 0, 0, -0.5, -0.5, -0.5, -1, 0, -0.5, 0.5, -0.5, 0.5, -0.5, 0),
)


def test_nvfp4_rht_is_the_exact_sum():
    """§7.6 (revised): the kernel's RHT is the exact sum rounded to fp32 then bf16, like the
    reference; a group of -0 gives +0 codes, and near the bf16 maximum no partial sum overflows
    (the columnwise amax stays finite)."""
    big = torch.finfo(torch.bfloat16).max
    x = make_input(32, 32, torch.float32, seed=8, specials=False).to(torch.bfloat16)
    for col, pattern in enumerate(_NEAR_MAX_COLUMNS):
        x[:16, col] = torch.tensor(pattern, dtype=torch.float32) * big
    x[:, 2] = -0.0
    x[16:, 3] = torch.tensor([0.0, -0.0] * 8)
    amax_kw = dict(rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=MASK)
    got_a = B.nvfp4_amax(x.to(DEVICE), **amax_kw)
    want_a = ref.nvfp4_amax(x, **amax_kw)
    assert_all_same(got_a, want_a, None, ("amax_row", "amax_col"))
    # the largest output, 0.875 * big (search above), rounded to bf16; sequential fp32 gave +Inf
    assert want_a[1].item() == torch.tensor(0.875 * big).bfloat16().item()
    kw = dict(rowwise=False, columnwise=True, with_rht=True, rht_sign_mask=MASK,
              with_2d_quantization=False, stochastic_rounding=False, rng_seed=None, swizzle=False)
    got = B.nvfp4_quantize(x.to(DEVICE), got_a[0], got_a[1], **kw)
    want = ref.nvfp4_quantize(x, want_a[0], want_a[1], **kw)
    assert_all_same(got, want, None, NAMES)
    assert want[2][2].tolist() == [0] * 16  # xᵀ row 2 (the -0 column): +0 codes, never 0x8
