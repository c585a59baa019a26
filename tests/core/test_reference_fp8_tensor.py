"""Per-tensor FP8 reference (numerics.md §2-§4, §8, §10): hand-derived goldens, scalar oracle."""

from __future__ import annotations

import math

import pytest
import torch
from _oracles import assert_same_values, bits_to_f32, decoded, f32, fp8_value
from quant_core.dtypes import DType
from quant_core.reference import amax, current_scale, fp8_dequantize, fp8_quantize

E4M3, E5M2 = DType.E4M3, DType.E5M2
NAN, INF = math.nan, math.inf
FLT_MAX_BITS = 0x7F7FFFFF


def scale_of(amax_value: float, fmt=E4M3, pow2=False, eps=0.0) -> float:
    s = current_scale(
        torch.tensor([amax_value]), fp8_dtype=fmt, force_pow_2_scales=pow2, amax_epsilon=eps
    )
    assert s.shape == (1,) and s.dtype == torch.float32
    return s.item()


def quantize(x, scale, fmt=E4M3, rowwise=True, columnwise=False, amax_out=None):
    return fp8_quantize(
        x, torch.tensor([scale], dtype=torch.float32), fp8_dtype=fmt, rowwise=rowwise,
        columnwise=columnwise, amax_out=amax_out,
    )


# ---------------------------------------------------------------------------------------- amax


def test_amax_drops_nan_and_widens():
    x = torch.tensor([[1.0, -3.0], [NAN, 2.0]])
    assert torch.equal(amax(x), torch.tensor([3.0]))
    assert amax(x).dtype == torch.float32 and amax(x).shape == (1,)
    assert amax(torch.tensor([[-65504.0, 1.0]], dtype=torch.float16)).item() == 65504.0
    assert amax(torch.tensor([[-INF, NAN]], dtype=torch.bfloat16)).item() == INF
    assert amax(torch.full((2, 2), NAN)).item() == 0.0  # all-NaN: nothing takes part


def test_amax_of_empty_is_zero():
    assert torch.equal(amax(torch.empty(0, 7)), torch.zeros(1))


# ------------------------------------------------------------------------------- current_scale


@pytest.mark.parametrize(
    "amax_value,fmt,pow2,eps,expected_bits",
    [
        (0.0, E4M3, False, 0.0, 0x3F800000),  # all zeros -> 1.0
        (INF, E4M3, False, 0.0, 0x3F800000),  # amax Inf -> 1.0 (the TE kernel, not TE's ref)
        (NAN, E4M3, True, 1.0, 0x3F800000),  # NaN fails `amax < eps` and gives 1.0
        (448.0, E4M3, False, 0.0, 0x3F800000),  # 448/448 = 1.0
        (1.0, E4M3, False, 0.0, 0x43E00000),  # 448 = 1.75*2^8: (8+127)<<23 | 0x600000
        (1.0, E4M3, True, 0.0, 0x43800000),  # 448 floored to 256
        (3.0, E4M3, False, 0.0, 0x43155555),  # 448/3 = 1.0101..b*2^7; mantissa 0x155555.33 -> down
        (3.0, E4M3, True, 0.0, 0x43000000),  # floored to 128
        (1.0, E5M2, False, 0.0, 0x47600000),  # 57344 = 1.75*2^15
        (1.0, E5M2, True, 0.0, 0x47000000),  # 2^15
        (2.0**-140, E4M3, False, 0.0, FLT_MAX_BITS),  # 448*2^140 overflows -> FLT_MAX
        (2.0**-140, E4M3, True, 0.0, 0x7F000000),  # FLT_MAX floored to 2^127
        (0.0, E4M3, False, 2.0**-10, 0x48E00000),  # amax -> eps: 448*2^10 = 1.75*2^18
        (0.0, E4M3, False, 1e-45, FLT_MAX_BITS),  # eps = fp32 2^-149: 448/eps overflows
        (0.0, E4M3, True, 1e-45, 0x7F000000),
        (1.0, E4M3, False, 0.5, 0x43E00000),  # amax above eps: unchanged
    ],
)
def test_current_scale_goldens(amax_value, fmt, pow2, eps, expected_bits):
    assert scale_of(amax_value, fmt, pow2, eps) == bits_to_f32(expected_bits)


def test_current_scale_divides_correctly_rounded():
    # 448 / 3 in fp32 is 0x43155555; reciprocal-then-multiply would give 0x43155556
    # (fp32(1/3) = 0x3EAAAAAB rounds up, times 448 = 1.75*2^8 stays above the midpoint).
    assert scale_of(3.0) == bits_to_f32(0x43155555)
    assert f32(f32(1 / 3) * 448) == bits_to_f32(0x43155556)  # the two-rounding result
    for a in [0.1, 3.0, 7.0, 1e-20, 123.456, 2.0**-126 * 400]:
        a32 = f32(a)
        assert scale_of(a32) == f32(448.0 / a32)  # one rounding of the exact quotient


# -------------------------------------------------------------------------------- fp8_quantize


SPECIAL = [448.0, 449.0, 464.0, 480.0, 500.0, -1000.0, INF, -INF, NAN, -0.0, 0.0,
           2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-6, 5 * 2.0**-10]
# E4M3 bytes with scale 1 (bias 7, 3 mantissa bits; satfinite; subnormal step 2^-9):
SPECIAL_E4M3 = [
    0x7E, 0x7E, 0x7E, 0x7E, 0x7E,  # 448 and above saturate to 448 = 0 1111 110
    0xFE,  # -1000 -> -448
    0x7E, 0xFE,  # ±Inf -> ±448
    None,  # NaN stays NaN (0x7F or 0xFF)
    0x80, 0x00,  # -0.0 kept
    0x01,  # 2^-9: smallest subnormal
    0x00,  # 2^-10: tie between 0 and 2^-9 -> even (0)
    0x01,  # 0.75 * 2^-9 -> 2^-9
    0x08,  # 2^-6: smallest normal 0 0001 000
    0x02,  # 2.5 * 2^-9: tie between 2 and 3 steps -> even (2)
]


def test_e4m3_special_values_scale_one():
    data, transpose, scale_inv = quantize(torch.tensor([SPECIAL]), 1.0)
    assert transpose is None and data.dtype == torch.uint8
    assert torch.isnan(decoded(data, E4M3)[0, 8])
    got = [b for i, b in enumerate(data[0].tolist()) if i != 8]
    assert got == [b for b in SPECIAL_E4M3 if b is not None]
    assert scale_inv.item() == 1.0


def test_e5m2_saturates_instead_of_inf():
    x = torch.tensor([[57344.0, 60000.0, 1e9, INF, -INF, 2.0**-16, 2.0**-17, 3 * 2.0**-17]])
    data, _, _ = quantize(x, 1.0, E5M2)
    # 57344 = 0 11110 11; ±Inf -> ±57344; 2^-16 = 0x01; 2^-17 ties to 0; 1.5*2^-16 ties to 2*2^-16
    assert data[0].tolist() == [0x7B, 0x7B, 0x7B, 0x7B, 0xFB, 0x01, 0x00, 0x02]


def test_scaling_is_one_fp32_multiply():
    # scale = fp32(448/3) = 9786709 * 2^-16. 3 * 9786709 = 29360127 (25 bits) is a tie between
    # 14680063 and 14680064 (x 2^-15); even wins: 14680064 * 2^-15 = 448 exactly -> 0x7E.
    data, _, scale_inv = quantize(torch.tensor([[3.0, -3.0, 1.0]]), bits_to_f32(0x43155555))
    assert data[0, :2].tolist() == [0x7E, 0xFE]
    # 1 * 149.33333 -> E4M3 step 16 in [128, 256): 149.33 -> 144 = 0 1110 001
    assert data[0, 2].item() == 0x71
    assert scale_inv.item() == f32(1.0 / bits_to_f32(0x43155555))


def test_scale_inv_is_correctly_rounded_reciprocal():
    # 1/448 = 1.001001..b * 2^-9; the 24th and later bits 1001... round the mantissa up to
    # 0x124925: bits (118 << 23) | 0x124925.
    _, _, scale_inv = quantize(torch.ones(1, 1), 448.0)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (1,)
    assert scale_inv.item() == bits_to_f32(0x3B124925)


def test_widens_bf16_and_fp16():
    # bf16 0.5 * 448 = 224 = 0 1110 110; fp16 -65504 * 2^-8 = -255.875 -> -256 = 1 1111 000
    bf, _, _ = quantize(torch.tensor([[0.5]], dtype=torch.bfloat16), 448.0)
    fp, _, _ = quantize(torch.tensor([[-65504.0]], dtype=torch.float16), 2.0**-8)
    assert bf.item() == 0x76 and fp.item() == 0xF8


def test_transpose_and_directions():
    x = torch.randn(5, 3)
    data, transpose, _ = quantize(x, 10.0, columnwise=True)
    assert transpose.shape == (3, 5) and torch.equal(transpose, data.t())
    none, only_t, _ = quantize(x, 10.0, rowwise=False, columnwise=True)
    assert none is None and torch.equal(only_t, transpose)


def test_empty_tensor():
    amax_out = torch.zeros(1)
    data, transpose, scale_inv = quantize(torch.empty(0, 4), 2.0, columnwise=True,
                                          amax_out=amax_out)
    assert data.shape == (0, 4) and transpose.shape == (4, 0)
    assert amax_out.item() == 0.0 and scale_inv.item() == 0.5


def test_amax_out_accumulates_in_place():
    amax_out = torch.tensor([2.0])
    quantize(torch.tensor([[1.0, -3.0, NAN]]), 1.0, amax_out=amax_out)
    assert amax_out.item() == 3.0
    quantize(torch.tensor([[1.0]]), 1.0, amax_out=amax_out)
    assert amax_out.item() == 3.0


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_random_against_scalar_oracle(fmt, dtype, pow2):
    g = torch.Generator().manual_seed(hash((fmt.value, str(dtype), pow2)) % 2**31)
    x = (torch.randn(7, 13, generator=g) * 2.0 ** torch.randint(-12, 12, (7, 13), generator=g))
    x[0, :4] = torch.tensor([NAN, -0.0, INF, -INF])
    x = x.to(dtype)
    finite = x.float()[torch.isfinite(x)]
    scale = scale_of(finite.abs().max().item(), fmt, pow2)
    data, transpose, scale_inv = quantize(x, scale, fmt, columnwise=True)
    expected = [fp8_value(f32(v * scale), fmt) for v in x.float().reshape(-1).tolist()]
    assert_same_values(decoded(data, fmt), torch.tensor(expected).reshape(7, 13))
    assert torch.equal(transpose, data.t())
    assert scale_inv.item() == f32(1.0 / scale)


# ------------------------------------------------------------------------------ fp8_dequantize


def test_dequantize_goldens():
    data = torch.tensor([[0x7E, 0x80, 0x7F, 0x01]], dtype=torch.uint8)
    out = fp8_dequantize(data, torch.tensor([0.5]), fp8_dtype=E4M3, dtype=torch.float32)
    assert_same_values(out, torch.tensor([[224.0, -0.0, NAN, 2.0**-10]]))
    # 448 * (1 + 2^-8) = 449.75 in fp32; bf16 has step 2 in [256, 512): RNE -> 450
    bf = fp8_dequantize(data[:, :1], torch.tensor([1.0 + 2.0**-8]), fp8_dtype=E4M3,
                        dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf.item() == 450.0
    e5 = fp8_dequantize(torch.tensor([0x7B, 0xFC], dtype=torch.uint8), torch.tensor([2.0]),
                        fp8_dtype=E5M2, dtype=torch.float32)
    assert e5.tolist() == [114688.0, -INF]  # E5M2 0xFC is -Inf


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_round_trip_error_bound(fmt):
    # For x*s below fp8_max, |q - x*s| <= half an ulp: 2^-(m+1)*|x*s| in the normal range, at
    # most half the subnormal step 2^(emin-m-1) below it. The fp32 roundings of x*s and of
    # 1/s add relative 2^-24 each, covered by the 2^-20 slack.
    mant_bits, emin = {E4M3: (3, -6), E5M2: (2, -14)}[fmt]
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    s = current_scale(amax(x), fp8_dtype=fmt, force_pow_2_scales=False, amax_epsilon=0.0)
    data, _, scale_inv = fp8_quantize(x, s, fp8_dtype=fmt, rowwise=True, columnwise=False)
    y = fp8_dequantize(data, scale_inv, fp8_dtype=fmt, dtype=torch.float32)
    bound = ((2.0 ** -(mant_bits + 1) + 2.0**-20) * x.abs()
             + 2.0 ** (emin - mant_bits - 1) * scale_inv * (1 + 2.0**-20))
    assert bool(((y - x).abs() <= bound).all())


def test_traces_under_torch_compile():
    def run(x):
        s = current_scale(amax(x), fp8_dtype=E4M3, force_pow_2_scales=True, amax_epsilon=0.0)
        return fp8_quantize(x, s, fp8_dtype=E4M3, rowwise=True, columnwise=True)

    x = torch.randn(8, 16)
    compiled = torch.compile(run, backend="eager", fullgraph=True)
    for a, b in zip(compiled(x), run(x), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["quantize", "calibrate"])
def test_threads_recording_into_one_delayed_amax_lose_no_update(method):
    """Four threads quantize (or calibrate) with one delayed-scaling quantizer at once: the
    recorded amax is the largest of theirs in every trial (the update is one atomic step)."""
    import threading

    from quant_core import Float8Quantizer

    amax = torch.zeros(1)
    q = Float8Quantizer(torch.ones(1), amax)
    xs = [torch.full((64, 64), float(i + 1)) for i in range(4)]
    lost = 0
    for _ in range(300):
        amax.zero_()
        barrier = threading.Barrier(4)

        def work(i, barrier=barrier):
            barrier.wait()
            getattr(q, method)(xs[i])

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        lost += amax.item() != 4.0
    assert lost == 0
