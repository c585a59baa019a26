"""MXFP8 reference (numerics.md §5, §8, §10): hand-derived goldens and a scalar block oracle."""

from __future__ import annotations

import math

import pytest
import torch
from _oracles import assert_same_values, bits_to_f32, decoded, f32, fp8_value
from quant_core import shapes
from quant_core.dtypes import DType
from quant_core.reference import (
    mxfp8_dequantize,
    mxfp8_quantize,
    swizzle_scales,
    unswizzle_scales,
)
from quant_core.reference._rounding import e8m0_roundup

E4M3, E5M2 = DType.E4M3, DType.E5M2
NAN, INF = math.nan, math.inf
FP32_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max


# ------------------------------------------------------------------------------ scalar oracle


def e8m0_scalar(v: float) -> int:
    """§5 step 3 in its ``clamp(ceil(log2 v) + 127, 0, 254)`` form, with NaN 255 and Inf 254."""
    if math.isnan(v):
        return 255
    if math.isinf(v):
        return 254
    if v == 0:
        return 0
    mantissa, exponent = math.frexp(v)  # v = mantissa * 2^exponent, mantissa in [0.5, 1)
    ceil_log2 = exponent - 1 if mantissa == 0.5 else exponent
    return min(max(ceil_log2 + 127, 0), 254)


def block_oracle(values: list[float], fmt: DType) -> tuple[int, list[float]]:
    """Scale byte and quantized values of one block (NaN dropped from the amax)."""
    block_amax = max((abs(v) for v in values if not math.isnan(v)), default=0.0)
    e = e8m0_scalar(f32(block_amax * f32(1.0 / fmt.max)))  # multiply by fp32(1/fp8_max)
    multiplier = NAN if e == 255 else 2.0 ** (127 - e)
    return e, [fp8_value(f32(v * multiplier), fmt) for v in values]


def oracle(x: torch.Tensor, fmt: DType, block_rows: int, block_cols: int):
    """Per-element values ``[M, K]`` and per-block bytes ``[ceil(M/br), K/bc]`` by loops."""
    m, k = x.shape
    rows = x.float().tolist()
    values = [[0.0] * k for _ in range(m)]
    scale = [[0] * (k // block_cols) for _ in range(shapes.ceil_div(m, block_rows))]
    for bi in range(len(scale)):
        for bj in range(k // block_cols):
            cells = [(i, j) for i in range(bi * block_rows, min(m, (bi + 1) * block_rows))
                     for j in range(bj * block_cols, (bj + 1) * block_cols)]
            scale[bi][bj], quantized = block_oracle([rows[i][j] for i, j in cells], fmt)
            for (i, j), q in zip(cells, quantized, strict=True):
                values[i][j] = q
    return torch.tensor(values).reshape(m, k), torch.tensor(scale, dtype=torch.uint8)


def quantize(x, fmt=E4M3, rowwise=True, columnwise=False, two_d=False, swizzle=False):
    return mxfp8_quantize(x, fp8_dtype=fmt, rowwise=rowwise, columnwise=columnwise,
                          with_2d_quantization=two_d, swizzle=swizzle)


def padded(block_bytes: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.uint8)
    out[: block_bytes.shape[0], : block_bytes.shape[1]] = block_bytes
    return out


# ------------------------------------------------------------------------------- E8M0 encoder


# torchao's RCEIL boundary table, with this project's satfinite: above 2^127 and Inf give 254.
E8M0_CASES = [
    (0x00000000, 0),  # zero
    (0x00000001, 0),  # 2^-149 <= 2^-127
    (0x00400000, 0),  # 2^-127 exactly: byte 0 (E == 0, m == 0x400000)
    (0x00400001, 1),  # just above 2^-127 -> 2^-126
    (0x007FFFFF, 1),  # largest subnormal -> 2^-126
    (0x00800000, 1),  # 2^-126 exactly
    (0x1F800000, 63),  # 2^-64
    (0x1F800001, 64),  # just above 2^-64 rounds up
    (0x3F7FFFFF, 127),  # just below 1.0 -> 1.0
    (0x3F800000, 127),  # 1.0
    (0x3F800001, 128),  # just above 1.0 -> 2.0
    (0x5F800000, 191),  # 2^64
    (0x5F800001, 192),
    (0x7F000000, 254),  # 2^127
    (0x7F000001, 254),  # E == 254: satfinite keeps 254 (torchao's NOSAT: 255)
    (0x7F7FFFFF, 254),  # FLT_MAX: 254
    (0x7F800000, 254),  # Inf: 254
    (0x7FC00000, 255),  # NaN
]


def test_e8m0_roundup_boundaries():
    bits = torch.tensor([b for b, _ in E8M0_CASES], dtype=torch.int64)
    values = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    got = e8m0_roundup(values)
    assert got.dtype == torch.uint8
    assert got.tolist() == [e for _, e in E8M0_CASES]


# ------------------------------------------------------------- torchao's 18 semantic cases


def semantic_cases(dtype):
    """(name, 32 inputs, expected byte, expected data bytes or None for NaN), re-derived for the
    project's rule: RCEIL with amax * fp32(1/448), satfinite E8M0, NaN dropped from the amax."""
    dmax = torch.finfo(dtype).max
    sub = 2.0**-133 if dtype == torch.bfloat16 else 2.0**-149  # smallest subnormal
    # sub * 2^127 = 2^-6 (E4M3 0x08) for bf16; 2^-22 rounds to 0 in E4M3 for fp32.
    sub_byte = 0x08 if dtype == torch.bfloat16 else 0x00
    # 0x40600001 = 3.5 + 2^-22. In fp32: v = fp32((3.5+2^-22) * fp32(1/448)); fp32(1/448) is
    # 1/448 * (1 + 3*2^-26), so v = 2^-7 * (1 + ~1.9*2^-24) rounds up to 2^-7 + ulp -> byte 121,
    # data (3.5+2^-22) * 2^6 -> 224 (0x76). bf16 rounds the input to 3.5: v = 2^-7 exactly
    # (relative excess 0.75*2^-24 < half ulp) -> byte 120, data 3.5 * 2^7 = 448 (0x7E).
    premature_hi = bits_to_f32(0x40600001)
    premature = (121, 0x76) if dtype == torch.float32 else (120, 0x7E)
    one = [1.0] * 31
    return [
        ("zero", [0.0] * 32, 0, [0x00] * 32),
        # amax 2^-126: v = 2^-126 * 1.14 * 2^-9 < 2^-127 -> byte 0; 2^-126 * 2^127 = 2 (0x40)
        ("smallest_normal", [2.0**-126] * 32, 0, [0x40] * 32),
        # Inf: v = Inf -> 254, multiplier 2^-127; Inf -> 448, 1 * 2^-127 -> 0
        ("mixed_inf", [INF] + one, 254, [0x7E] + [0x00] * 31),
        # NaN dropped: amax 1, v = fp32(1/448) = 1.14 * 2^-9 -> 2^-8, byte 119; 1 * 2^8 = 256
        ("mixed_nan", [NAN] + one, 119, [None] + [0x78] * 31),
        ("positive_fp8_max", [448.0] * 32, 127, [0x7E] * 32),  # 448 * fp32(1/448) == 1.0
        ("negative_fp8_max", [-448.0] * 32, 127, [0xFE] * 32),
        # max = (2 - 2^-n) * 2^127: v ~ 1.14 * 2^119 -> byte 120 + 127 = 247; data
        # (2 - 2^-n) * 2^7 (255 or 256 - 2^-16) -> 256 (0x78)
        ("positive_dtype_max", [dmax] * 32, 247, [0x78] * 32),
        ("negative_dtype_max", [-dmax] * 32, 247, [0xF8] * 32),
        ("positive_smallest_subnormal", [sub] * 32, 0, [sub_byte] * 32),
        ("negative_smallest_subnormal", [-sub] * 32, 0, [sub_byte | 0x80] * 32),
        # amax 1 -> byte 119; sub * 2^8 -> ±0 with the sign kept
        ("mixed_positive_underflow", [sub] + one, 119, [0x00] + [0x78] * 31),
        ("mixed_negative_underflow", [-sub] + one, 119, [0x80] + [0x78] * 31),
        # max sets byte 247; 1 * 2^-120 -> 0
        ("mixed_saturation_and_underflow", [dmax] + one, 247, [0x78] + [0x00] * 31),
        ("rceil_premature_bf16_lowers_scale", [premature_hi] * 32, premature[0],
         [premature[1]] * 32),
        # 0x43FFFFFF = 512 - 2^-15 (bf16: 512): v ~ 1.14 -> 2^1, byte 128; data -> 256 (0x78)
        ("floor_premature_bf16_raises_scale", [bits_to_f32(0x43FFFFFF)] * 32, 128,
         [0x78] * 32),
        # all NaN: amax 0 -> byte 0, data NaN (torchao: 255)
        ("all_nan", [NAN] * 32, 0, [None] * 32),
        # 480: v = 480/448 ~ 1.07 -> 2^1, byte 128; 480 * 2^-1 = 240 = 0 1110 111 (0x77)
        ("positive_satfinite", [480.0] * 32, 128, [0x77] * 32),
        ("negative_satfinite", [-480.0] * 32, 128, [0xF7] * 32),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_semantic_cases_under_project_rule(dtype):
    cases = semantic_cases(dtype)
    x = torch.tensor([row for _, row, _, _ in cases], dtype=torch.float32).to(dtype)
    data, scale, _, _ = quantize(x)
    assert scale.shape == (128, 4)
    for i, (name, _, byte, expected) in enumerate(cases):
        assert scale[i, 0].item() == byte, name
        for j, b in enumerate(expected):
            if b is None:
                assert torch.isnan(decoded(data[i, j], E4M3)), name
            else:
                assert data[i, j].item() == b, (name, j)
    assert not scale[len(cases):].any() and not scale[:, 1:].any()  # padding is 0


# ---------------------------------------------------------------------------- other goldens


def test_spec_examples_e4m3():
    # §10: amax 448 -> 127, 448 -> 448; 449 -> 128, 449 -> 224.5 -> 224 (tie to even mantissa
    # 110); 480 -> 128, 240. Inf block: 254, Inf -> 0x7E, 2^120 * 2^-127 = 2^-7 = 4 * 2^-9
    # (subnormal 0x04), -1 * 2^-127 -> -0 (0x80).
    rows = [[448.0] + [0.0] * 31, [449.0] + [0.0] * 31, [480.0] + [0.0] * 31,
            [INF, 2.0**120, -1.0, -INF] + [0.0] * 28]
    data, scale, _, _ = quantize(torch.tensor(rows))
    assert scale[:4, 0].tolist() == [127, 128, 128, 254]
    assert data[:, 0].tolist() == [0x7E, 0x76, 0x77, 0x7E]
    assert data[3, :4].tolist() == [0x7E, 0x04, 0x80, 0xFE]


def test_e5m2_goldens():
    # 57344 * fp32(1/57344) == 1.0 -> 127, data 57344 = 0 11110 11 (0x7B).
    # amax 1: fp32(1/57344) = 1.14 * 2^-16 -> 2^-15, byte 112; 1 * 2^15 = 0 11110 00 (0x78).
    # Inf: 254, Inf -> 57344 (saturated, not Inf).
    rows = [[57344.0] * 32, [1.0] * 32, [INF] + [0.0] * 31]
    data, scale, _, _ = quantize(torch.tensor(rows), E5M2)
    assert scale[:3, 0].tolist() == [127, 112, 254]
    assert data[:, 0].tolist() == [0x7B, 0x78, 0x7B]


def test_fp16_input():
    # fp16 max 65504 = (2 - 2^-10) * 2^15: v = 65504 * 1.14 * 2^-9 ~ 1.14 * 2^7 -> byte 135;
    # data 65504 * 2^-8 = 255.875 -> 256 (0x78). fp16 smallest subnormal 2^-24 alone:
    # v = 2^-24 * 1.14 * 2^-9 -> 2^-32, byte 95; data 2^-24 * 2^32 = 256 (0x78).
    x = torch.tensor([[65504.0] * 32, [2.0**-24] * 32], dtype=torch.float16)
    data, scale, _, _ = quantize(x)
    assert scale[:2, 0].tolist() == [135, 95]
    assert data[:, 0].tolist() == [0x78, 0x78]


def test_columnwise_ragged_m_not_transposed():
    # M = 40: row block 0 = rows 0..31, row block 1 = rows 32..39 (8 valid rows only).
    x = torch.zeros(40, 64)
    x[:32, 0] = 1.0  # column 0, block 0: amax 1 -> byte 119, data 256 (0x78)
    x[32:, 0] = -448.0  # column 0, block 1: amax 448 -> byte 127, data -448 (0xFE)
    x[39, 1] = 480.0  # column 1, block 1: 128, 240 (0x77)
    _, _, col, scale = quantize(x, rowwise=False, columnwise=True)
    assert col.shape == (40, 64) and scale.shape == (4, 128)  # [roundup(2, 4), roundup(64, 128)]
    expected_scale = torch.zeros(4, 128, dtype=torch.uint8)
    expected_scale[:2, 0] = torch.tensor([119, 127])
    expected_scale[1, 1] = 128
    assert torch.equal(scale, expected_scale)
    assert col[0, 0] == 0x78 and col[31, 0] == 0x78 and col[32, 0] == 0xFE and col[39, 1] == 0x77
    assert int(col.count_nonzero()) == 32 + 8 + 1


def test_2d_tiles_serve_rows_and_columns():
    x = torch.ones(40, 64)  # tile (0, 0): amax 1 -> 119
    x[3, 40] = 448.0  # tile (0, 1): 127
    x[32:, :32] = 480.0  # tile (1, 0): 8 valid rows, amax 480 -> 128
    x[32:, 32:] = 0.0  # tile (1, 1): zeros -> 0
    row, row_scale, col, col_scale = quantize(x, columnwise=True, two_d=True)
    assert torch.equal(row, col)
    expected_row = torch.zeros(128, 4, dtype=torch.uint8)
    expected_row[:32, :2] = torch.tensor([119, 127], dtype=torch.uint8)
    expected_row[32:40, :2] = torch.tensor([128, 0], dtype=torch.uint8)
    expected_col = torch.zeros(4, 128, dtype=torch.uint8)
    expected_col[0, :64] = torch.tensor([119] * 32 + [127] * 32, dtype=torch.uint8)
    expected_col[1, :64] = torch.tensor([128] * 32 + [0] * 32, dtype=torch.uint8)
    assert torch.equal(row_scale, expected_row) and torch.equal(col_scale, expected_col)
    # 1 * 2^8 = 256 (0x78); 1 * 2^0 next to 448 = 0 0111 000 (0x38); 480 * 2^-1 = 240 (0x77)
    assert row[0, 0] == 0x78 and row[0, 32] == 0x38 and row[3, 40] == 0x7E
    assert row[39, 0] == 0x77 and row[39, 63] == 0x00


def test_empty_m():
    row, row_scale, col, col_scale = quantize(torch.empty(0, 64), columnwise=True, swizzle=True)
    assert row.shape == (0, 64) and row_scale.shape == (0, 4)
    assert col.shape == (0, 64) and col_scale.shape == (0, 128)


@pytest.mark.parametrize("k", [16, 33, 100])
def test_k_not_multiple_of_32_raises(k):
    with pytest.raises(ValueError, match="MXFP8.*32"):
        quantize(torch.zeros(4, k))
    with pytest.raises(ValueError, match="MXFP8.*32"):
        mxfp8_dequantize(torch.zeros(4, k, dtype=torch.uint8),
                         torch.zeros(128, 4, dtype=torch.uint8), fp8_dtype=E4M3,
                         columnwise=False, swizzled=False, dtype=torch.float32)


def test_directions_not_asked_for_are_none():
    out = quantize(torch.ones(32, 32), rowwise=False, columnwise=False)
    assert out == (None, None, None, None)


# ------------------------------------------------------------------------ oracle comparisons


def random_blocks(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values with a random binade per 8x8 patch, plus special values."""
    g = torch.Generator().manual_seed(seed)
    binade = torch.randint(-40, 40, (shapes.ceil_div(m, 8), k // 8), generator=g)
    binade = binade.repeat_interleave(8, 0).repeat_interleave(8, 1)[:m]
    x = torch.randn(m, k, generator=g) * torch.pow(2.0, binade.float())
    x[0, :6] = torch.tensor([NAN, -0.0, INF, 1e-41, -1e-44, 3e38])  # fp32 subnormals, big
    x[5, 33] = -INF
    x[36, 40:72 % k] = NAN
    return x.to(dtype)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_1d_against_scalar_oracle(fmt, dtype):
    x = random_blocks(37, 64, dtype, seed=fmt.value * 10 + dtype.itemsize)
    row, row_scale, col, col_scale = quantize(x, fmt, columnwise=True)
    values, blocks = oracle(x, fmt, 1, 32)
    assert_same_values(decoded(row, fmt), values)
    assert torch.equal(row_scale, padded(blocks, shapes.mxfp8_rowwise_scale_shape(37, 64)))
    values, blocks = oracle(x, fmt, 32, 1)
    assert_same_values(decoded(col, fmt), values)
    assert torch.equal(col_scale, padded(blocks, shapes.mxfp8_columnwise_scale_shape(37, 64)))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2d_against_scalar_oracle(fmt, dtype):
    x = random_blocks(45, 64, dtype, seed=7 + fmt.value)
    row, row_scale, col, col_scale = quantize(x, fmt, columnwise=True, two_d=True)
    values, blocks = oracle(x, fmt, 32, 32)
    assert_same_values(decoded(row, fmt), values)
    assert torch.equal(row, col)
    row_blocks = blocks.repeat_interleave(32, 0)[:45]
    assert torch.equal(row_scale, padded(row_blocks, shapes.mxfp8_rowwise_scale_shape(45, 64)))
    col_blocks = blocks.repeat_interleave(32, 1)
    assert torch.equal(col_scale, padded(col_blocks, shapes.mxfp8_columnwise_scale_shape(45, 64)))


# ----------------------------------------------------------------------- swizzle, dequantize


def test_swizzled_scales_and_dequantize():
    x = random_blocks(150, 96, torch.float32, seed=11)
    plain = quantize(x, columnwise=True)
    swz = quantize(x, columnwise=True, swizzle=True)
    assert torch.equal(plain[0], swz[0]) and torch.equal(plain[2], swz[2])
    assert torch.equal(swz[1], swizzle_scales(plain[1]))
    assert swz[3].shape == plain[3].shape == (8, 128)
    assert torch.equal(swz[3].reshape(128, 8), swizzle_scales(plain[3].t().contiguous()))
    assert torch.equal(unswizzle_scales(swz[3].reshape(128, 8)).t(), plain[3])
    for columnwise, (data, scale, swz_scale) in [(False, (plain[0], plain[1], swz[1])),
                                                  (True, (plain[2], plain[3], swz[3]))]:
        kwargs = dict(fp8_dtype=E4M3, columnwise=columnwise, dtype=torch.float32)
        a = mxfp8_dequantize(data, scale, swizzled=False, **kwargs)
        b = mxfp8_dequantize(data, swz_scale, swizzled=True, **kwargs)
        assert a.shape == (150, 96)
        assert_same_values(b, a)


def test_dequantize_goldens():
    # rowwise [1, 32]: byte 0 -> 2^-127, 0x40 (2.0) -> 2^-126; byte 120 -> 2^-7, 448 -> 3.5;
    # byte 255 -> NaN; -0 stays -0; bf16 output of 0x41 (2.25) * 2^0 is exact.
    data = torch.tensor([[0x40] + [0x80] * 31, [0x7E] * 32, [0x08] * 32, [0x41] * 32],
                        dtype=torch.uint8)
    scale = torch.zeros(128, 4, dtype=torch.uint8)
    scale[:4, 0] = torch.tensor([0, 120, 255, 127])
    out = mxfp8_dequantize(data, scale, fp8_dtype=E4M3, columnwise=False, swizzled=False,
                           dtype=torch.float32)
    assert out[0, 0].item() == 2.0**-126 and torch.signbit(out[0, 1]) and out[0, 1] == 0
    assert out[1, 0].item() == 3.5 and bool(torch.isnan(out[2]).all())
    assert out[3, 0].item() == 2.25
    bf = mxfp8_dequantize(data, scale, fp8_dtype=E4M3, columnwise=False, swizzled=False,
                          dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf[3, 0].item() == 2.25


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("columnwise", [False, True])
def test_round_trip_error_bound(fmt, columnwise):
    # The E8M0 scale rounds up, so |x| * 2^(127-e) <= fp8_max and nothing saturates; q differs
    # from x * 2^(127-e) by at most half an ulp: 2^-(m+1) relative in the normal range, half the
    # subnormal step 2^(emin-m-1) below it. Both scalings are exact powers of two.
    mant_bits, emin = {E4M3: (3, -6), E5M2: (2, -14)}[fmt]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 64, generator=g) * 2.0 ** torch.randint(-20, 20, (70, 1), generator=g)
    data, scale = _pick(x, fmt, columnwise)
    y = mxfp8_dequantize(data, scale, fp8_dtype=fmt, columnwise=columnwise, swizzled=False,
                         dtype=torch.float32)
    block_rows, block_cols = (32, 1) if columnwise else (1, 32)
    scale_bytes = scale[: shapes.ceil_div(70, block_rows), : 64 // block_cols].to(torch.int64)
    scale_bytes = scale_bytes.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    decode_scale = torch.pow(2.0, (scale_bytes[:70] - 127).double())
    bound = (2.0 ** -(mant_bits + 1) * x.double().abs()
             + 2.0 ** (emin - mant_bits - 1) * decode_scale)
    assert bool(((y.double() - x.double()).abs() <= bound).all())


def _pick(x, fmt, columnwise):
    row, row_scale, col, col_scale = quantize(x, fmt, columnwise=True)
    return (col, col_scale) if columnwise else (row, row_scale)


def test_traces_under_torch_compile():
    def run(x):
        return quantize(x, columnwise=True, two_d=False, swizzle=True)

    x = random_blocks(40, 64, torch.bfloat16, seed=3)
    compiled = torch.compile(run, backend="eager", fullgraph=True)
    for a, b in zip(compiled(x), run(x), strict=True):
        assert torch.equal(a, b)
