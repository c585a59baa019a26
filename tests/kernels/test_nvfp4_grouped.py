"""Per-group NVFP4 (``nvfp4_group_quantize``): the Triton kernels against the reference, bitwise
(data, scales and the groups' amaxes), every block mode, stochastic rounding and swizzle, and the
same refusals."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, assert_all_same, make_input
from quant_core import reference as ref
from quant_core.reference.rht import signs_to_mask
from quant_kernels.nvfp4_grouped import nvfp4_group_quantize

NAMES = ("row_data", "row_scale", "col_data", "col_scale", "amax_row", "amax_col")
#: Rows per group, padded to 16: one empty group, groups of 16 rows.
COUNTS = (32, 0, 16, 16, 16)
K = 48
MASK = signs_to_mask([1, -1, -1, 1] * 4)
SEED = torch.tensor([20240], dtype=torch.int64)
MODES = {"1x16": dict(with_rht=False, with_2d_quantization=False),
         "rht": dict(with_rht=True, with_2d_quantization=False),
         "2d": dict(with_rht=False, with_2d_quantization=True)}


def _groups(dtype: torch.dtype, counts=COUNTS, k=K, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` with NaN, ±Inf, -0.0, zero rows and subnormals planted in the first group, a group
    of fp32-subnormal-sized values (bf16 keeps them), an all-zero group and a NaN row in the
    last; ``grp`` int32."""
    x = make_input(sum(counts), k, torch.float32, seed=seed)
    x[32:48] *= 2.0**-135
    x[48:64] = 0.0
    x[70] = float("nan")
    grp = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return x.to(dtype), grp.to(torch.int32)


def _check(x, grp, groups, **kw):
    got = nvfp4_group_quantize(x.to(DEVICE), grp.to(DEVICE), groups=groups, **kw)
    want = ref.nvfp4_group_quantize(x, grp, groups=groups, **kw)
    assert_all_same(got, want, None, NAMES)


@pytest.mark.parametrize("swizzle", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize("mode,dtype", [(m, d) for m in MODES for d in (torch.bfloat16,
                                                                         torch.float32)
                                        if m != "rht" or d == torch.bfloat16], ids=str)
def test_group_quantize_equals_the_reference(mode, dtype, sr, swizzle):
    x, grp = _groups(dtype)
    _check(x, grp, len(COUNTS), rowwise=True, columnwise=True, rht_sign_mask=MASK,
           stochastic_rounding=sr, rng_seed=SEED if sr else None, swizzle=swizzle, **MODES[mode])


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)],
                         ids=["rowwise", "columnwise"])
@pytest.mark.parametrize("mode", ["1x16", "rht"], ids=str)
def test_one_direction(mode, rowwise, columnwise):
    """One direction alone (the other's buffers and amax ``None``); int64 groups, a trailing
    empty group, a second tile of rows and a ragged column tile."""
    x, grp = _groups(torch.bfloat16, counts=(16, 48, 16, 0), k=80, seed=3)
    _check(x, grp.to(torch.int64), 4, rowwise=rowwise, columnwise=columnwise, rht_sign_mask=MASK,
           stochastic_rounding=False, rng_seed=None, swizzle=False, **MODES[mode])


@pytest.mark.parametrize("shape", [(0, 32), (16, 0)], ids=str)
def test_empty(shape):
    x = torch.zeros(shape, dtype=torch.bfloat16)
    grp = torch.zeros(shape[0], dtype=torch.int32)
    _check(x, grp, 2, rowwise=True, columnwise=True, rht_sign_mask=MASK, stochastic_rounding=False,
           rng_seed=None, swizzle=True, **MODES["rht"])


@pytest.mark.parametrize("change", [
    dict(x=torch.zeros(24, 32, dtype=torch.bfloat16), grp=torch.zeros(24, dtype=torch.int32)),
    dict(grp=torch.zeros(16, dtype=torch.float32)),
    dict(grp=torch.zeros(32, dtype=torch.int32)),
    dict(groups=0),
    dict(x=torch.zeros(16, 24, dtype=torch.bfloat16)),
    dict(x=torch.zeros(16, 32, dtype=torch.float32), with_rht=True),
    dict(with_rht=True, with_2d_quantization=True),
    dict(stochastic_rounding=True),
    dict(x=torch.zeros(16, 32, dtype=torch.int32)),
], ids=["rows", "grp-dtype", "grp-length", "groups", "k", "rht-fp32", "rht-2d", "sr-seed",
        "x-dtype"])
def test_refuses_like_the_reference(change):
    kw = dict(x=torch.zeros(16, 32, dtype=torch.bfloat16), grp=torch.zeros(16, dtype=torch.int32),
              groups=1, rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=MASK,
              with_2d_quantization=False, stochastic_rounding=False, rng_seed=None,
              swizzle=False)
    kw.update(change)
    with pytest.raises((TypeError, ValueError)) as want:
        ref.nvfp4_group_quantize(**kw)
    with pytest.raises(want.type) as got:
        nvfp4_group_quantize(**kw)
    assert str(got.value) == str(want.value)
