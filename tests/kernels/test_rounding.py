"""Each shared rounding helper against the reference encoder on special and random fp32 bits."""

from __future__ import annotations

import pytest
import torch
from _exact_fma import gpu_fma_paths
from _kernels_util import DEVICE, INTERPRET
from quant_core.dtypes import DType
from quant_core.reference._rounding import (
    compute_scale_from_amax,
    e2m1_decode,
    e2m1_encode,
    e8m0_roundup,
    fp8_encode,
)
from quant_kernels.testing import encode


def _probe_values() -> torch.Tensor:
    """Specials, every FP8/E2M1 grid point and midpoint with ±1 ulp, and random bit patterns."""
    g = torch.Generator().manual_seed(0)
    rand_bits = torch.randint(-(2**31), 2**31, (1 << 14,), generator=g, dtype=torch.int64)
    grid = torch.cat([
        torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float(),
        torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).float(),
        torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0,
                      6.0, 7.0, 448.0, 464.0, 480.0, 57344.0, 61440.0, 2.0**-127, 2.0**-149,
                      1.5 * 2.0**-127, 2.0**127, 3.4028234663852886e38]),
    ])
    grid = grid[torch.isfinite(grid)]
    mids = (grid[:-1] + grid[1:]) / 2
    base = torch.cat([grid, mids, torch.tensor([float("inf"), float("nan"), -0.0])])
    base = torch.cat([base, -base])
    bits = base.view(torch.int32).to(torch.int64)
    near = torch.cat([bits - 1, bits, bits + 1, rand_bits])
    near = torch.where(near >= 2**31, near - 2**32, near).clamp(-(2**31), 2**31 - 1)
    return near.to(torch.int32).view(torch.float32)


V = _probe_values()


NATIVE_ONLY_GPU = pytest.mark.skipif(INTERPRET, reason="native casts: GPU only (interpreter wrong)")


@pytest.mark.parametrize("rule", ["e4m3", "e5m2",
                                  pytest.param("e4m3_native", marks=NATIVE_ONLY_GPU),
                                  pytest.param("e5m2_native", marks=NATIVE_ONLY_GPU)])
def test_fp8_rne_satfinite(rule):
    fp8 = DType.E4M3 if rule.startswith("e4m3") else DType.E5M2
    got = encode(V.to(DEVICE), rule).cpu()
    want = fp8_encode(V, fp8).to(torch.int32)
    nan = torch.isnan(V)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.isnan(got[nan].to(torch.uint8).view(fp8.torch_dtype).float()).all()


def test_e8m0_roundup():
    a = V.abs()
    assert torch.equal(encode(a.to(DEVICE), "e8m0").cpu(), e8m0_roundup(a).to(torch.int32))


def test_e2m1_rne():
    assert torch.equal(encode(V.to(DEVICE), "e2m1").cpu(), e2m1_encode(V).to(torch.int32))


def test_e2m1_value_is_the_codes_value():
    want = e2m1_decode(e2m1_encode(V)).float().view(torch.int32)
    assert torch.equal(encode(V.to(DEVICE), "e2m1_value").cpu(), want)


def _division_inputs(divisor: int) -> torch.Tensor:
    """The probe values, every mantissa pattern's neighbourhood at random exponents from
    ``DIV_BY_MIN`` up, and exact quotients (and their neighbours) near the smallest normal."""
    g = torch.Generator().manual_seed(divisor)
    n = 1 << 16
    bits = (torch.randint(0, 1 << 23, (n,), generator=g)
            | (torch.randint(27, 255, (n,), generator=g) << 23)
            | (torch.randint(0, 2, (n,), generator=g) << 31))
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    exact = torch.arange(1, 1 << 12, dtype=torch.int32).view(torch.float32) * divisor
    near = (exact.view(torch.int32) + 1).view(torch.float32)
    return torch.cat([V, bits.view(torch.float32), exact, near, -near])


@pytest.mark.parametrize("fma_path", [False, True], ids=["divide", "fma"])
@pytest.mark.parametrize("divisor", [1536, 2688])
def test_division_by_a_constant_is_correctly_rounded(monkeypatch, divisor, fma_path):
    """``div_rn_by`` on its domain (``|v| >= 2^-100``, ±0, ±Inf, NaN), the GPU's FMA path too
    (under the interpreter with a fused fma): fp64 then one rounding is the correctly rounded
    quotient (a quotient by 3 or 21 that is not exact never lands on an fp32 midpoint); -0
    keeps its sign, NaN stays NaN."""
    if fma_path and INTERPRET:
        gpu_fma_paths(monkeypatch)
    elif INTERPRET == fma_path:
        pytest.skip("a GPU takes the FMA path itself")
    v = _division_inputs(divisor)
    v = v[~(v.abs() < 2.0**-100) | (v == 0)]
    want = (v.double() / divisor).float()
    got = encode(v.to(DEVICE), f"div_{divisor}").cpu().view(torch.float32)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_div_rn_is_correctly_rounded():
    v = V[torch.isfinite(V) & (V != 0)]
    want = (1.0 / v.double()).float().view(torch.int32)
    assert torch.equal(encode(v.to(DEVICE), "div_rn").cpu(), want)


@pytest.mark.parametrize("rule", ["bf16", pytest.param("bf16_native", marks=NATIVE_ONLY_GPU)])
def test_bf16_rne(rule):
    v = V[~torch.isnan(V)]
    want = v.to(torch.bfloat16).float().view(torch.int32)
    assert torch.equal(encode(v.to(DEVICE), rule).cpu(), want)


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
def test_pow2_scale_without_division(fp8):
    """The division-free power-of-two scale equals ``div_rn`` then the mask, on amaxes around
    every mantissa 1.75 boundary, subnormals, the overflow edge, 0, Inf and NaN."""
    a = V.abs()
    m175 = torch.tensor([1.75 * 2.0**e for e in range(-126, 128)]).view(torch.int32)
    edge = torch.cat([m175 - 1, m175, m175 + 1]).view(torch.float32)
    a = torch.cat([a, edge, torch.tensor([2.0**-126, 2.0**-127, 1e-45, 448.0 * 2.0**-128])])
    want = compute_scale_from_amax(a, fp8.max, force_pow_2_scales=True, amax_epsilon=0.0,
                                   value_for_inf=3.4028234663852886e38).view(torch.int32)
    got = encode(a.to(DEVICE), f"pow2_scale_{fp8.name.lower()}").cpu()
    assert torch.equal(got, want)


def test_pow2_inverse():
    s = torch.tensor([2.0**e for e in range(-126, 128)])
    assert torch.equal(encode(s.to(DEVICE), "pow2_inverse").cpu(),
                       (1.0 / s.double()).float().view(torch.int32))


def test_native_rules_refused_by_interpreter():
    if not INTERPRET:
        pytest.skip("interpreter only")
    with pytest.raises(ValueError, match="GPU"):
        encode(V[:4], "e4m3_native")


def test_kernel_constants_are_quant_core_constants():
    """The kernels' constexprs come from quant_core.constants (one definition)."""
    from quant_core import constants as C
    from quant_kernels import _rounding as R

    for name, value in (("FLT_MAX", C.FLT_MAX), ("E4M3_MAX", C.E4M3_MAX),
                        ("E5M2_MAX", C.E5M2_MAX), ("RCP_E4M3", C.RCP_E4M3),
                        ("RCP_E5M2", C.RCP_E5M2), ("RCP_6", C.RCP_E2M1_MAX),
                        ("RCP_2688", C.RCP_NVFP4_GLOBAL_MAX),
                        ("NVFP4_GLOBAL_MAX", C.NVFP4_GLOBAL_MAX),
                        ("POW2_MINUS_127_BITS", C.POW2_MINUS_127_BITS)):
        assert getattr(R, name).value == value, name
