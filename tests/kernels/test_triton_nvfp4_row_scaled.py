"""Row-scaled NVFP4 (`numerics.md` §7.9: one amax, so one S_enc, per row; rowwise only): the
Triton amax, quantize (standard and 4over6) and dequantize kernels against the reference,
bitwise, and the same refusals."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, assert_all_same, assert_same, make_input
from quant_core import reference as ref
from quant_kernels.backend import BACKEND as B

NAMES = ("row_data", "row_scale", "col_data", "col_scale")
AMAX = dict(rowwise=True, columnwise=False, with_rht=False, rht_sign_mask=0, row_scaled=True)
BASE = dict(AMAX, with_2d_quantization=False, stochastic_rounding=False, rng_seed=None)
#: (four_over_six, e4m3_max, err_mode): the standard rule and 4over6 under both bounds.
VARIANTS = [(False, 448, "MAE"), (True, 256, "MSE"), (True, 448, "MAE")]
CASES = [((1, 16), torch.float32), ((17, 48), torch.float16), ((40, 64), torch.bfloat16)]


def _input(shape, dtype) -> torch.Tensor:
    """Rows over 16 binades with NaN, ±Inf, -0.0, subnormals, an all-zero and an all-NaN
    block planted; the last row all zero (amax 0)."""
    x = make_input(*shape, torch.float32, seed=shape[0] + 1)
    if shape[0] > 4:
        x[-1] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("shape,dtype", [*CASES, ((0, 32), torch.float32),
                                         ((5, 0), torch.float32)], ids=str)
def test_row_scaled_amax(shape, dtype):
    x = _input(shape, dtype)
    got = B.nvfp4_amax(x.to(DEVICE), **AMAX)
    want = ref.nvfp4_amax(x, **AMAX)
    assert want[0].shape == (shape[0],)
    assert_all_same(got, want, None, ("amax_row", "amax_col"))


def _check(x: torch.Tensor, amax: torch.Tensor, kw: dict) -> None:
    got = B.nvfp4_quantize(x.to(DEVICE), amax.to(DEVICE), None, **kw)
    want = ref.nvfp4_quantize(x, amax, None, **kw)
    assert_all_same(got, want, None, NAMES)
    dkw = dict(swizzled=kw["swizzle"], dtype=x.dtype, e4m3_max=kw["e4m3_max"])
    assert_same(B.nvfp4_dequantize(got[0], got[1], amax.to(DEVICE), **dkw),
                ref.nvfp4_dequantize(want[0], want[1], amax, **dkw))


@pytest.mark.parametrize("variant", VARIANTS,
                         ids=lambda v: f"4over6-{v[1]}-{v[2]}" if v[0] else "standard")
@pytest.mark.parametrize("shape,dtype", CASES, ids=str)
def test_row_scaled_quantize_equals_the_reference(shape, dtype, variant):
    """With the rows' own amaxes (Inf for a row holding Inf, 0 for the zero row), swizzled and
    not; then with the amaxes of the finite elements (so the Inf row's other blocks count)."""
    fos, bound, mode = variant
    x = _input(shape, dtype)
    amax = ref.nvfp4_amax(x, **AMAX)[0]
    for swizzle in (False, True):
        _check(x, amax, dict(BASE, swizzle=swizzle, four_over_six=fos, e4m3_max=bound,
                             err_mode=mode))
    xf = x.float()
    finite = xf.masked_fill(~torch.isfinite(xf), 0.0).abs().amax(dim=1)
    _check(x, finite, dict(BASE, swizzle=False, four_over_six=fos, e4m3_max=bound,
                           err_mode=mode))


def test_row_scaled_special_amaxes():
    """Row amaxes that are not the rows' own: 0, Inf, NaN, a subnormal and twice the amax, one
    per row, for every variant."""
    x = make_input(5, 32, torch.float32, seed=9, specials=False)
    amax = ref.nvfp4_amax(x, **AMAX)[0]
    amax = torch.tensor([0.0, float("inf"), float("nan"), 1e-40, 2 * amax[4].item()])
    for fos, bound, mode in VARIANTS:
        _check(x, amax, dict(BASE, swizzle=False, four_over_six=fos, e4m3_max=bound,
                             err_mode=mode))


@pytest.mark.parametrize("kwargs, message", [
    (dict(columnwise=True), "it takes no columnwise"),
    (dict(with_rht=True), "it takes no with_rht"),
    (dict(with_2d_quantization=True), "it takes no with_2d_quantization"),
    (dict(stochastic_rounding=True, rng_seed=torch.ones(1, dtype=torch.int64)),
     "it takes no stochastic_rounding"),
    (dict(amax=torch.ones(1)), r"must hold one value per row, shape \(16,\), got \(1,\)"),
])
def test_row_scaled_refuses_like_the_reference(kwargs, message):
    x = torch.zeros(16, 32, dtype=torch.bfloat16)
    kwargs = dict(kwargs)
    amax = kwargs.pop("amax", torch.ones(16))
    for impl in (ref, B):
        with pytest.raises(ValueError, match=message):
            impl.nvfp4_quantize(x, amax, None, **dict(BASE, swizzle=False, **kwargs))


@pytest.mark.parametrize("kwargs", [dict(columnwise=True), dict(with_rht=True)], ids=str)
def test_row_scaled_amax_refuses_like_the_reference(kwargs):
    x = torch.zeros(16, 32, dtype=torch.bfloat16)
    for impl in (ref, B):
        with pytest.raises(ValueError, match=f"it takes no {next(iter(kwargs))}"):
            impl.nvfp4_amax(x, **dict(AMAX, **kwargs))


def test_dequantize_refuses_an_amax_of_another_length():
    data = torch.zeros(4, 16, dtype=torch.uint8)
    scale = torch.zeros(128, 4, dtype=torch.uint8)
    for impl in (ref, B):
        with pytest.raises(ValueError, match="amax must have 1 or 4"):
            impl.nvfp4_dequantize(data, scale, torch.ones(3), swizzled=False,
                                  dtype=torch.float32)
