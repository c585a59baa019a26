"""quant_core.constants: each format constant defined once, reciprocals derived."""

from __future__ import annotations

import torch
from quant_core import constants as C
from quant_core.reference.rht import DEFAULT_SIGNS, signs_to_mask


def _fp32_rcp(v: float) -> float:
    return (torch.ones((), dtype=torch.float32) / v).item()  # one IEEE fp32 division (RNE)


def test_values_follow_the_formats():
    assert C.FLT_MAX == torch.finfo(torch.float32).max
    assert C.E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max
    assert C.E5M2_MAX == torch.finfo(torch.float8_e5m2).max
    assert C.NVFP4_GLOBAL_MAX == 6 * 448 == 2688
    assert C.DEFAULT_RHT_SIGN_MASK == signs_to_mask(DEFAULT_SIGNS) == 55272
    bits = torch.tensor([C.POW2_MINUS_127_BITS], dtype=torch.int32).view(torch.float32)
    assert bits.item() == 2.0**-127


def test_reciprocals_are_the_fp32_divisions():
    for value, rcp in ((448.0, C.RCP_E4M3), (57344.0, C.RCP_E5M2), (6.0, C.RCP_E2M1_MAX),
                       (2688.0, C.RCP_NVFP4_GLOBAL_MAX)):
        assert rcp == _fp32_rcp(value)
