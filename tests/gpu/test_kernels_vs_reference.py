"""Every Triton kernel against ``quant_core.reference`` on CUDA, bitwise, on large random
tensors with special values planted (4096x4096, and 1040x2080: ragged M for 32 / 128 blocks,
ragged K for 128 blocks; bf16 and fp32), and each elementwise encoder over all 2^32 fp32 bit
patterns: the software FP8 and bf16 encoders and the native-cast ones the kernels use on GPU, the
E2M1 encoder and its value, and the divisions (``div_rn`` and the FMA-corrected ones by constants).

FP8 bytes and floats compare NaN by NaN-ness. Each test asserts 0 mismatches for every check it
makes and names the checks that had some. ``-k "not exhaustive"`` leaves out the 2^32 sweep;
``-k mxfp8`` (``fp8_tensor``, ``fp8_block``, ``nvfp4``, ``nvfp4_4over6``, ``nvfp4_row_scaled``)
picks one format.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from quant_core import reference as ref  # noqa: E402
from quant_core.dtypes import DType  # noqa: E402
from quant_core.reference._rounding import (  # noqa: E402
    compute_scale_from_amax,
    e2m1_decode,
    e2m1_encode,
    e8m0_roundup,
    fp8_encode,
)
from quant_kernels.backend import BACKEND as B  # noqa: E402
from quant_kernels.testing import encode  # noqa: E402

DEV = "cuda"
FLT_MAX = 3.4028234663852886e38
RULES = ("e4m3", "e5m2", "e4m3_native", "e5m2_native", "e8m0", "e2m1", "e2m1_value", "bf16",
         "bf16_native", "pow2_scale_e4m3", "pow2_scale_e5m2", "div_rn", "div_1536", "div_2688")
SHAPES = [(4096, 4096), (1040, 2080)]
DTYPES = [torch.bfloat16, torch.float32]


def count(got, want, fp8: DType | None = None) -> int:
    """Mismatching elements; FP8 bytes and floats compare NaN by NaN-ness."""
    if want is None:
        return 0 if got is None else 1
    if got.shape != want.shape:
        return max(got.numel(), want.numel(), 1)
    if fp8 is not None and want.dtype == torch.uint8:
        gn = torch.isnan(got.view(fp8.torch_dtype).float())
        wn = torch.isnan(want.view(fp8.torch_dtype).float())
        return int(((got != want) & ~wn).sum() + (gn != wn).sum())
    if want.dtype.is_floating_point:
        iv = torch.int32 if want.dtype == torch.float32 else torch.int16
        gn, wn = torch.isnan(got), torch.isnan(want)
        return int(((got.view(iv) != want.view(iv)) & ~wn).sum() + (gn != wn).sum())
    return int((got != want).sum())


class Checks:
    """Mismatch counts of named checks; ``assert_clean`` fails naming those with any."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __setitem__(self, name: str, mismatches: int) -> None:
        self.counts[name] = mismatches

    def assert_clean(self) -> None:
        bad = {n: c for n, c in self.counts.items() if c}
        assert not bad, f"{len(bad)} of {len(self.counts)} checks mismatch: {bad}"


@pytest.fixture(scope="module")
def sweep() -> dict[str, int]:
    """Mismatches per encoder rule over all 2^32 fp32 patterns (chunks of 2^29), against the
    reference encoders; FP8 NaN bytes and bf16 NaNs compare by NaN-ness."""
    chunk = 1 << 29
    totals = dict.fromkeys(RULES, 0)
    for start in range(0, 1 << 32, chunk):
        bits = torch.arange(start, start + chunk, dtype=torch.int64, device=DEV)
        v = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
        del bits
        nan = torch.isnan(v)
        for fp8 in (DType.E4M3, DType.E5M2):
            want = fp8_encode(v, fp8).to(torch.int32)
            for rule in (fp8.name.lower(), fp8.name.lower() + "_native"):
                got = encode(v, rule)
                gnan = torch.isnan(got.to(torch.uint8).view(fp8.torch_dtype).float())
                totals[rule] += int(((got != want) & ~nan).sum() + (gnan != nan).sum())
                del got, gnan
            del want
        want = v.to(torch.bfloat16).float().view(torch.int32)
        for rule in ("bf16", "bf16_native"):
            got = encode(v, rule)
            gnan = torch.isnan(got.view(torch.float32))
            totals[rule] += int(((got != want) & ~nan).sum() + (gnan != nan).sum())
            del got, gnan
        del want
        a = v.abs()
        totals["e8m0"] += int((encode(a, "e8m0") != e8m0_roundup(a).to(torch.int32)).sum())
        codes = e2m1_encode(v)
        totals["e2m1"] += int((encode(v, "e2m1") != codes.to(torch.int32)).sum())
        want = e2m1_decode(codes).float().view(torch.int32)
        totals["e2m1_value"] += int((encode(v, "e2m1_value") != want).sum())
        del codes, want
        # fp64 then one rounding is the correctly rounded quotient (no fp32 midpoint is reached);
        # div_rn_by's domain: |v| >= 2^-100, 0, ±Inf and NaN
        totals["div_rn"] += count(encode(v, "div_rn").view(torch.float32),
                                  (1.0 / v.double()).float())
        domain = ~(v.abs() < 2.0**-100) | (v == 0)
        for d in (1536, 2688):
            got = encode(v, f"div_{d}").view(torch.float32)
            totals[f"div_{d}"] += count(got[domain], (v[domain].double() / d).float())
            del got
        del domain
        for fp8 in (DType.E4M3, DType.E5M2):
            want = compute_scale_from_amax(a, fp8.max, force_pow_2_scales=True,
                                           amax_epsilon=0.0, value_for_inf=FLT_MAX)
            rule = f"pow2_scale_{fp8.name.lower()}"
            totals[rule] += int((encode(a, rule) != want.view(torch.int32)).sum())
        del a, v, nan
        torch.cuda.empty_cache()
    return totals


@pytest.mark.parametrize("rule", RULES)
def test_exhaustive_encoder(sweep, rule):
    hint = {"e4m3_native": "NATIVE_FP8_CASTS", "e5m2_native": "NATIVE_FP8_CASTS",
            "bf16_native": "NATIVE_BF16_CASTS"}.get(rule)
    assert sweep[rule] == 0, (f"{sweep[rule]} of 2^32 patterns differ"
                              + (f": set quant_kernels._common.{hint} to False" if hint else ""))


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2], ids=lambda d: d.name)
def test_fp8_decode_all_bytes(fp8):
    """All 256 FP8 bytes through the dequantize kernel (scale 1, fp32 out): the kernels widen
    FP8 with the native cast on GPU."""
    b = torch.arange(256, dtype=torch.uint8, device=DEV).reshape(1, 256)
    one = torch.ones(1, device=DEV)
    kw = dict(fp8_dtype=fp8, dtype=torch.float32)
    assert count(B.fp8_dequantize(b, one, **kw), ref.fp8_dequantize(b, one, **kw)) == 0


def make(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEV)
    x *= torch.exp2(torch.randint(-10, 11, (m, 1), generator=g, device=DEV).float())
    x[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 500.0,
                             3e38, 2.0**-133], device=DEV)
    x[1] = 0.0
    return x.to(dtype)


def check_fp8_tensor(x: torch.Tensor, checks: Checks) -> None:
    checks["amax"] = count(B.amax(x), ref.amax(x))
    for fp8 in (DType.E4M3, DType.E5M2):
        a = ref.amax(x)
        s = ref.current_scale(a, fp8_dtype=fp8, force_pow_2_scales=False, amax_epsilon=0.0)
        n = 0
        for av in (a, torch.zeros_like(a), torch.full_like(a, float("inf")), a * 2.0**-140):
            for p2 in (False, True):
                kw = dict(fp8_dtype=fp8, force_pow_2_scales=p2, amax_epsilon=0.0)
                n += count(B.current_scale(av, **kw), ref.current_scale(av, **kw))
        checks[f"current_scale {fp8.name}"] = n
        ga, wa = torch.zeros(1, device=DEV), torch.zeros(1, device=DEV)
        got = B.fp8_quantize(x, s, fp8_dtype=fp8, rowwise=True, columnwise=True, amax_out=ga)
        want = ref.fp8_quantize(x, s, fp8_dtype=fp8, rowwise=True, columnwise=True, amax_out=wa)
        checks[f"fp8 per-tensor {fp8.name}"] = (
            sum(count(g, w, fp8) for g, w in zip(got, want, strict=True)) + count(ga, wa))
        checks[f"fp8 per-tensor dequant {fp8.name}"] = count(
            B.fp8_dequantize(got[0], got[2], fp8_dtype=fp8, dtype=x.dtype),
            ref.fp8_dequantize(want[0], want[2], fp8_dtype=fp8, dtype=x.dtype))


def _one_direction(x: torch.Tensor, checks: Checks, fn, kw: dict) -> None:
    for fp8 in (DType.E4M3, DType.E5M2):
        for rw, cw in ((True, False), (False, True)):
            k2 = dict(kw, fp8_dtype=fp8, rowwise=rw, columnwise=cw)
            rfn = getattr(ref, fn.__name__)
            checks[f"{fn.__name__} {fp8.name} row={rw} col={cw}"] = sum(
                count(g, w, fp8) for g, w in zip(fn(x, **k2), rfn(x, **k2), strict=True))


def _both_directions(x: torch.Tensor, fp8: DType, fmt: str, qkw: dict, dqkw: dict) -> int:
    """Mismatches of ``<fmt>_quantize(x)`` (rowwise and columnwise) against the reference, plus
    those of dequantizing each direction back."""
    kw = dict(qkw, fp8_dtype=fp8, rowwise=True, columnwise=True)
    got = getattr(B, f"{fmt}_quantize")(x, **kw)
    want = getattr(ref, f"{fmt}_quantize")(x, **kw)
    n = sum(count(g, w, fp8) for g, w in zip(got, want, strict=True))
    for cw, gd, wd in ((False, got[:2], want[:2]), (True, got[2:], want[2:])):
        kd = dict(dqkw, fp8_dtype=fp8, columnwise=cw, dtype=x.dtype)
        n += count(getattr(B, f"{fmt}_dequantize")(*gd, **kd),
                   getattr(ref, f"{fmt}_dequantize")(*wd, **kd))
    return n


def check_mxfp8(x: torch.Tensor, checks: Checks) -> None:
    _one_direction(x, checks, B.mxfp8_quantize, dict(with_2d_quantization=False, swizzle=True))
    for fp8 in (DType.E4M3, DType.E5M2):
        for two_d in (False, True):
            for sw in (False, True):
                checks[f"mxfp8 {fp8.name} 2d={two_d} swizzle={sw} (+dequant)"] = (
                    _both_directions(x, fp8, "mxfp8",
                                     dict(with_2d_quantization=two_d, swizzle=sw),
                                     dict(swizzled=sw)))


def check_fp8_block(x: torch.Tensor, checks: Checks) -> None:
    _one_direction(x, checks, B.fp8_block_quantize,
                   dict(block_scaling_dim=1, amax_epsilon=0.0, force_pow_2_scales=False))
    for fp8 in (DType.E4M3, DType.E5M2):
        for dim in (1, 2):
            checks[f"fp8 block dim={dim} {fp8.name} (+dequant)"] = _both_directions(
                x, fp8, "fp8_block",
                dict(block_scaling_dim=dim, force_pow_2_scales=True, amax_epsilon=0.0),
                dict(block_scaling_dim=dim))


def check_nvfp4(x: torch.Tensor, checks: Checks) -> None:
    seed = torch.tensor([987654321], dtype=torch.int64, device=DEV)
    for rht, two_d, sr in ((False, False, False), (False, True, False), (False, False, True),
                           (True, False, False), (True, False, True)):
        if rht and x.dtype != torch.bfloat16:
            continue
        ka = dict(rowwise=True, columnwise=True, with_rht=rht, rht_sign_mask=0xD7E8)
        ga, wa = B.nvfp4_amax(x, **ka), ref.nvfp4_amax(x, **ka)
        n = count(ga[0], wa[0]) + count(ga[1], wa[1])
        kw = dict(ka, with_2d_quantization=two_d, stochastic_rounding=sr, rng_seed=seed,
                  swizzle=sr)
        got = B.nvfp4_quantize(x, wa[0], wa[1], **kw)
        want = ref.nvfp4_quantize(x, wa[0], wa[1], **kw)
        n += sum(count(g, w) for g, w in zip(got, want, strict=True))
        n += count(B.nvfp4_dequantize(got[0], got[1], wa[0], swizzled=sr, dtype=x.dtype),
                   ref.nvfp4_dequantize(want[0], want[1], wa[0], swizzled=sr, dtype=x.dtype))
        checks[f"nvfp4 rht={rht} 2d={two_d} sr={sr} (+amax, dequant)"] = n


def _nvfp4_quantize_and_dequantize(x: torch.Tensor, amax: torch.Tensor, kw: dict) -> int:
    """Mismatches of ``nvfp4_quantize(x, amax, amax)`` and of dequantizing its rowwise data."""
    col = None if kw.get("row_scaled") else amax
    got, want = B.nvfp4_quantize(x, amax, col, **kw), ref.nvfp4_quantize(x, amax, col, **kw)
    dkw = dict(swizzled=kw["swizzle"], dtype=x.dtype, e4m3_max=kw["e4m3_max"])
    return (sum(count(g, w) for g, w in zip(got, want, strict=True))
            + count(B.nvfp4_dequantize(got[0], got[1], amax, **dkw),
                    ref.nvfp4_dequantize(want[0], want[1], amax, **dkw)))


#: A 4over6 tie block (amax 4, bound 256, MSE) scaled by ``1 + 188317 * 2^-23``: within rounding
#: of a tie, it takes the other candidate if the compiler fuses the squares into their sum (FMA
#: contraction); tests/kernels/test_triton_nvfp4_4over6.py has more such blocks.
_NEAR_TIE_MSE = (4.0, 3.75, 1.0, -2.0, -2.25, 1.25, 2.25, -2.75, 1.0, -3.0, 0.5, -2.25, 0.5,
                 -0.25, 1.75, -3.5)


#: (bound, metric, 2D, swizzle): each value of each once or twice, for few kernel variants (each
#: compiles in seconds).
_4OVER6_CASES = ((256, "MSE", False, True), (448, "MAE", False, False), (256, "MAE", True, False),
                 (448, "MSE", True, True))


def check_nvfp4_4over6(x: torch.Tensor, checks: Checks) -> None:
    """4over6 for both bounds, metrics and block shapes, with the amax of the finite elements
    and, once, the tensor amax (Inf here: every error is NaN, so map-to-6); plus the
    FMA-sensitive block."""
    xf = x.float()
    finite = xf.masked_fill(~torch.isfinite(xf), 0.0).abs().amax().reshape(1)
    base = dict(rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=0,
                stochastic_rounding=False, rng_seed=None, four_over_six=True)
    for i, (bound, mode, two_d, sw) in enumerate(_4OVER6_CASES):
        kw = dict(base, with_2d_quantization=two_d, swizzle=sw, e4m3_max=bound, err_mode=mode)
        name = f"nvfp4 4over6 {bound} {mode} 2d={two_d} swizzle={sw}"
        checks[f"{name} (+dequant)"] = _nvfp4_quantize_and_dequantize(x, finite, kw)
        if i == 0:
            amax = ref.nvfp4_amax(x, rowwise=True, columnwise=False, with_rht=False,
                                  rht_sign_mask=0)[0]
            checks[f"{name} tensor amax (+dequant)"] = _nvfp4_quantize_and_dequantize(x, amax,
                                                                                      kw)
    c = 1.0 + 188317 * 2.0**-23
    v = torch.tensor(_NEAR_TIE_MSE, device=DEV) * c
    y = torch.zeros(16, 16, device=DEV)
    y[0], y[:, 0] = v, v
    kw = dict(base, with_2d_quantization=False, swizzle=False, e4m3_max=256, err_mode="MSE")
    checks["nvfp4 4over6 near-tie MSE block"] = _nvfp4_quantize_and_dequantize(
        y, torch.tensor([4.0 * c], device=DEV), kw)
    # tiny amaxes: 2^-79 divides by FMAs at the edge of their range, 2^-81 and 2^-125 with
    # div_rn (dividends down to the subnormals); the rows after the planted specials
    rows = x[2:258].float()
    for i, target in enumerate((2.0**-79, 2.0**-81, 2.0**-125)):
        t = (rows * (target / rows.abs().amax())).to(x.dtype)
        amax = t.float().abs().amax().reshape(1)
        kw = dict(base, with_2d_quantization=i == 1, swizzle=False, e4m3_max=(448, 256, 448)[i],
                  err_mode="MSE")
        checks[f"nvfp4 4over6 amax {amax.item():.3g} (+dequant)"] = (
            _nvfp4_quantize_and_dequantize(t, amax, kw))


def check_nvfp4_row_scaled(x: torch.Tensor, checks: Checks) -> None:
    """Row-scaled NVFP4 (one amax per row; row 0 holds Inf), standard and 4over6."""
    ka = dict(rowwise=True, columnwise=False, with_rht=False, rht_sign_mask=0, row_scaled=True)
    ga, wa = B.nvfp4_amax(x, **ka), ref.nvfp4_amax(x, **ka)
    checks["nvfp4 row-scaled amax"] = count(ga[0], wa[0]) + count(ga[1], wa[1])
    base = dict(ka, with_2d_quantization=False, stochastic_rounding=False, rng_seed=None)
    for fos, bound, mode, sw in ((False, 448, "MAE", False), (False, 448, "MAE", True),
                                 (True, 256, "MSE", True), (True, 448, "MAE", False)):
        kw = dict(base, swizzle=sw, four_over_six=fos, e4m3_max=bound, err_mode=mode)
        checks[f"nvfp4 row-scaled 4over6={fos} {bound} {mode} swizzle={sw} (+dequant)"] = (
            _nvfp4_quantize_and_dequantize(x, wa[0], kw))
    # rows 32-63 and 100 scaled to amaxes near the subnormals: their tiles divide with div_rn
    t = x[:512].float()
    t[32:64] *= 2.0**-120
    t[100] *= 2.0**-120
    t = t.to(x.dtype)
    amax = ref.nvfp4_amax(t, **ka)[0]
    kw = dict(base, swizzle=False, four_over_six=True, e4m3_max=448, err_mode="MSE")
    checks["nvfp4 row-scaled 4over6 tiny rows (+dequant)"] = _nvfp4_quantize_and_dequantize(
        t, amax, kw)


FORMATS = {"fp8_tensor": check_fp8_tensor, "mxfp8": check_mxfp8, "fp8_block": check_fp8_block,
           "nvfp4": check_nvfp4, "nvfp4_4over6": check_nvfp4_4over6,
           "nvfp4_row_scaled": check_nvfp4_row_scaled}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_matches_reference(fmt, shape, dtype):
    m, k = shape
    x = make(m, k, dtype, seed=m + k)
    checks = Checks()
    FORMATS[fmt](x, checks)
    del x
    torch.cuda.empty_cache()
    checks.assert_clean()
