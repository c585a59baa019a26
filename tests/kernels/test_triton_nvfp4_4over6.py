"""The Triton backend takes NVFP4's 4over6 (no kernel yet: it runs the reference's ops on the
tensor's device) and dequantizes under the 256 bound with the reference's bytes."""

from __future__ import annotations

import pytest
import torch
from quant_core import reference
from quant_kernels.backend import BACKEND

OPTS = dict(rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=0,
            stochastic_rounding=False, rng_seed=None, swizzle=False, four_over_six=True,
            err_mode="MSE")


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("bound", [256, 448])
def test_4over6_quantize_and_dequantize_equal_the_reference(two_d, bound):
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    amax = x.float().abs().amax().reshape(1)
    got = BACKEND.nvfp4_quantize(x, amax, amax, with_2d_quantization=two_d, e4m3_max=bound, **OPTS)
    want = reference.nvfp4_quantize(x, amax, amax, with_2d_quantization=two_d, e4m3_max=bound,
                                    **OPTS)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    rd, rs = got[0], got[1]
    out = BACKEND.nvfp4_dequantize(rd, rs, amax, swizzled=False, dtype=torch.float32,
                                   e4m3_max=bound)
    assert torch.equal(out, reference.nvfp4_dequantize(rd, rs, amax, swizzled=False,
                                                       dtype=torch.float32, e4m3_max=bound))
