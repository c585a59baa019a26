"""FP8 block scaling reference (numerics.md §6, §8, §10): hand-derived goldens, scalar oracle."""

from __future__ import annotations

import math

import pytest
import torch
from _oracles import assert_same_values, bits_to_f32, decoded, f32, fp8_value
from quant_core import shapes
from quant_core.dtypes import DType
from quant_core.reference import fp8_block_dequantize, fp8_block_quantize

E4M3, E5M2 = DType.E4M3, DType.E5M2
NAN, INF = math.nan, math.inf
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ------------------------------------------------------------------------------ scalar oracle


def scale_oracle(block_amax: float, fmt: DType, pow2: bool, eps: float, dtype_max: float):
    """§3 step 3 with ``value_for_inf`` = the input dtype's max (§6 step 2)."""
    eps = f32(eps)
    if block_amax < eps:
        block_amax = eps
    if math.isinf(block_amax) or block_amax == 0 or math.isnan(block_amax):
        return 1.0
    scale = f32(fmt.max / block_amax)  # one rounding of the exact quotient
    if math.isinf(scale):
        scale = dtype_max
    if pow2:
        scale = 2.0 ** (math.frexp(scale)[1] - 1)  # floor to a power of two
    return scale


def oracle(x, fmt, block_rows, block_cols, pow2, eps=0.0):
    """Values ``[M, K]``, per-block ``scale_inv`` ``[ceil(M/br), ceil(K/bc)]``, by loops."""
    m, k = x.shape
    dtype_max = torch.finfo(x.dtype).max
    rows = x.float().tolist()
    values = [[0.0] * k for _ in range(m)]
    n_m, n_k = shapes.ceil_div(m, block_rows), shapes.ceil_div(k, block_cols)
    scale_inv = [[0.0] * n_k for _ in range(n_m)]
    for bi in range(n_m):
        for bj in range(n_k):
            cells = [(i, j) for i in range(bi * block_rows, min(m, (bi + 1) * block_rows))
                     for j in range(bj * block_cols, min(k, (bj + 1) * block_cols))]
            block_amax = max((abs(rows[i][j]) for i, j in cells if not math.isnan(rows[i][j])),
                             default=0.0)
            scale = scale_oracle(block_amax, fmt, pow2, eps, dtype_max)
            scale_inv[bi][bj] = f32(1.0 / scale)
            for i, j in cells:
                values[i][j] = fp8_value(f32(rows[i][j] * scale), fmt)
    return torch.tensor(values).reshape(m, k), torch.tensor(scale_inv).reshape(n_m, n_k)


def padded_cols(s: torch.Tensor, cols: int) -> torch.Tensor:
    out = torch.zeros(s.shape[0], cols)
    out[:, : s.shape[1]] = s
    return out


def quantize(x, fmt=E4M3, dim=2, pow2=True, eps=0.0, rowwise=True, columnwise=True):
    return fp8_block_quantize(x, fp8_dtype=fmt, block_scaling_dim=dim, force_pow_2_scales=pow2,
                              amax_epsilon=eps, rowwise=rowwise, columnwise=columnwise)


def dequantize(data, scale_inv, fmt=E4M3, dim=2, columnwise=False, dtype=torch.float32):
    return fp8_block_dequantize(data, scale_inv, fp8_dtype=fmt, block_scaling_dim=dim,
                                columnwise=columnwise, dtype=dtype)


# ------------------------------------------------------------------- extremes pinned by TE


# All-max 128x128 tile, E4M3. scale = fp32(448 / dtype_max):
# - fp32: 448/((2-2^-23)*2^127) = 1.75*(1+2^-24+...)*2^-120; the extra 0.875 ulp rounds up:
#   (1.75+2^-23)*2^-120 = bits 0x03E00001. Floored: 2^-120, scale_inv 2^120.
#   Data: max*2^-120 = 256-2^-16 -> 256 (0x78); unfloored max*scale -> 3.5*2^7 = 448 (0x7E).
#   scale_inv = 1/((1.75+2^-23)*2^-120) = (8/7)*2^119*(1-0.57*2^-23): mantissa 0x124924 - 0.08
#   -> 0x124924, exponent 246: bits 0x7B124924.
# - bf16: 448/((2-2^-7)*2^127) = 1.757*2^-120 -> floored 2^-120; max*2^-120 = 255 -> 256 (0x78).
# - fp16: 448/65504 = 1.7509*2^-8 -> floored 2^-8; 65504/256 = 255.875 -> 256 (0x78).
ALL_MAX_POW2 = {torch.float32: 2.0**120, torch.bfloat16: 2.0**120, torch.float16: 256.0}


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_max_tile_pow2(dtype):
    x = torch.full((128, 128), torch.finfo(dtype).max, dtype=dtype)
    row, row_scale, _, _ = quantize(x)
    assert row_scale[0, 0].item() == ALL_MAX_POW2[dtype]
    assert bool((row == 0x78).all())


def test_all_max_tile_fp32_scales():
    x = torch.full((128, 128), torch.finfo(torch.float32).max)
    row, row_scale, _, _ = quantize(x, pow2=False)
    assert row_scale[0, 0].item() == bits_to_f32(0x7B124924)
    assert row_scale[0, 0].item() == f32(1.0 / bits_to_f32(0x03E00001))
    assert bool((row == 0x7E).all())


# All-zero tile with a tiny eps: amax -> eps, 448/eps overflows -> dtype max.
# pow2: fp32/bf16 max floor to 2^127 -> scale_inv 2^-127 (subnormal 0x00400000); fp16 2^15.
# Not pow2: 1/dtype_max. fp32: 2^-128*(1+2^-24) -> subnormal ulp 2^-149 -> 2^-128 (0x00200000).
# bf16: 2^-128*(1+2^-8+2^-16+~2^-24) -> 2^-128+2^-136+2^-144 (0x00202020).
# fp16: 2^-16*(1+2^-11+2^-22+...) -> mantissa 0x1002, exponent 111: 0x37801002.
TINY_EPS = [
    (torch.float32, True, 0x00400000), (torch.bfloat16, True, 0x00400000),
    (torch.float16, True, 0x38000000),  # 2^-15 = (112 << 23)
    (torch.float32, False, 0x00200000), (torch.bfloat16, False, 0x00202020),
    (torch.float16, False, 0x37801002),
]


@pytest.mark.parametrize("dtype,pow2,scale_inv_bits", TINY_EPS)
def test_all_zero_tile_tiny_eps(dtype, pow2, scale_inv_bits):
    x = torch.zeros(128, 128, dtype=dtype)
    x[0, 0] = -0.0
    row, row_scale, col, col_scale = quantize(x, pow2=pow2, eps=1e-45)  # fp32 eps = 2^-149
    assert row_scale[0, 0].item() == bits_to_f32(scale_inv_bits)
    assert col_scale[0, 0].item() == bits_to_f32(scale_inv_bits)
    assert row[0, 0] == 0x80 and int(row.count_nonzero()) == 1  # -0.0 kept


@pytest.mark.parametrize("dim", [1, 2])
def test_all_zero_block_no_eps_gives_one(dim):
    _, row_scale, _, col_scale = quantize(torch.zeros(3, 5), dim=dim)
    assert row_scale[0, 0].item() == 1.0 and col_scale[0, 0].item() == 1.0


def test_special_values():
    # Row 0: Inf block -> scale 1: Inf -> 448 (0x7E), -Inf -> -448, 3.0 = 1.5*2^1 -> 0x44.
    # Row 1: NaN dropped, amax 7 -> scale 64: 7 -> 448 (0x7E), NaN stays NaN, -0.0 kept.
    # Row 2: all NaN -> amax 0 -> scale 1, data NaN.
    # Row 3: fp32 subnormal amax 2^-140: 448*2^140 overflows -> FLT_MAX -> 2^127; 2^-13 -> 0.
    x = torch.tensor([[INF, -INF, 3.0], [7.0, NAN, -0.0], [NAN, NAN, NAN],
                      [2.0**-140, 0.0, 0.0]])
    row, row_scale, _, _ = quantize(x, dim=1, columnwise=False)
    assert row_scale[0, :4].tolist() == [1.0, 2.0**-6, 1.0, 2.0**-127]
    assert row[0].tolist() == [0x7E, 0xFE, 0x44]
    assert row[1, 0] == 0x7E and torch.isnan(decoded(row[1, 1], E4M3)) and row[1, 2] == 0x80
    assert bool(torch.isnan(decoded(row[2], E4M3)).all())
    assert row[3].tolist() == [0, 0, 0]


def test_fp16_subnormal_amax_does_not_overflow():
    # fp16 2^-24: 448 * 2^24 = 1.75*2^32 is finite in fp32. pow2: 2^32, data 2^-24*2^32 = 256
    # (0x78); otherwise data 448 (0x7E), scale_inv fp32(1/(1.75*2^32)) = (4/7)*2^-32.
    x = torch.tensor([[2.0**-24]], dtype=torch.float16)
    row, row_scale, _, _ = quantize(x, dim=1, columnwise=False)
    assert row.item() == 0x78 and row_scale[0, 0].item() == 2.0**-32
    row, row_scale, _, _ = quantize(x, dim=1, pow2=False, columnwise=False)
    assert row.item() == 0x7E and row_scale[0, 0].item() == f32(1 / (1.75 * 2.0**32))


def test_eps_raises_small_amax():
    # amax 2^-10 < eps 0.5 -> amax 0.5 -> scale 896 -> pow2 512; 2^-10 * 512 = 0.5 = 0 0110 000
    x = torch.tensor([[2.0**-10]])
    row, row_scale, _, _ = quantize(x, dim=1, eps=0.5, columnwise=False)
    assert row_scale[0, 0].item() == 2.0**-9 and row.item() == 0x30


# ------------------------------------------------------------------------ layouts and edges


def test_1d_rowwise_layout_ragged_k():
    # K = 130: blocks cols 0..127 and 128..129. Row r: block 0 all 448*2^-r -> scale 2^r,
    # scale_inv 2^-r; block 1 = 7*2^r -> scale 64*2^-r, scale_inv 2^(r-6). All data -> 448.
    m = 5  # K = 130
    r = torch.arange(m, dtype=torch.float32).reshape(-1, 1)
    x = torch.cat([448.0 * 2.0 ** (-r).expand(m, 128), 7.0 * 2.0 ** r.expand(m, 2)], dim=1)
    row, row_scale, _, _ = quantize(x, dim=1, columnwise=False)
    assert row_scale.shape == (2, 8)  # [ceil(130/128), roundup(5, 4)], scale of (r, b) at [b, r]
    expected = torch.tensor([[1, 2**-1, 2**-2, 2**-3, 2**-4, 0, 0, 0],
                             [2**-6, 2**-5, 2**-4, 2**-3, 2**-2, 0, 0, 0]])
    assert torch.equal(row_scale, expected)
    assert bool((row == 0x7E).all())
    y = dequantize(row, row_scale, dim=1)
    assert torch.equal(y, x)


def test_1d_columnwise_layout_ragged_m():
    # M = 130: row blocks 0..127 and 128..129 (2 valid rows). Column k: block 0 = 448*2^-k,
    # block 1 = 7*2^k. Column scales [b, k]: [ceil(130/128), roundup(5, 4)]; data [K, M].
    k = 5  # M = 130
    c = torch.arange(k, dtype=torch.float32).reshape(1, -1)
    x = torch.cat([448.0 * 2.0 ** (-c).expand(128, k), 7.0 * 2.0 ** c.expand(2, k)], dim=0)
    _, _, col, col_scale = quantize(x, dim=1, rowwise=False)
    assert col.shape == (5, 130) and col_scale.shape == (2, 8)
    expected = torch.tensor([[1, 2**-1, 2**-2, 2**-3, 2**-4, 0, 0, 0],
                             [2**-6, 2**-5, 2**-4, 2**-3, 2**-2, 0, 0, 0]])
    assert torch.equal(col_scale, expected) and bool((col == 0x7E).all())
    assert torch.equal(dequantize(col, col_scale, dim=1, columnwise=True), x)


def test_2d_layout_ragged_both():
    # M = 130, K = 260: tiles [2, 3], tile (i, j) filled with 448*2^-(3i+j) -> scale_inv
    # 2^-(3i+j). Row scales [2, roundup(3, 4)]; column scales = transpose, [3, roundup(2, 4)].
    m, k = 130, 260
    exponent = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    tile_value = 448.0 * 2.0 ** (-exponent)
    x = tile_value.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :k].contiguous()
    row, row_scale, col, col_scale = quantize(x, dim=2)
    assert row_scale.shape == (2, 4) and col_scale.shape == (3, 4)
    per_tile = 2.0 ** (-exponent)
    assert torch.equal(row_scale, padded_cols(per_tile, 4))
    assert torch.equal(col_scale, padded_cols(per_tile.t(), 4))
    assert torch.equal(col, row.t()) and bool((row == 0x7E).all())
    assert torch.equal(dequantize(row, row_scale), x)
    assert torch.equal(dequantize(col, col_scale, columnwise=True), x)


@pytest.mark.parametrize("dim", [1, 2])
def test_empty_m(dim):
    row, row_scale, col, col_scale = quantize(torch.empty(0, 200), dim=dim)
    assert row.shape == (0, 200) and col.shape == (200, 0)
    assert row_scale.shape == shapes.fp8_block_rowwise_scale_shape(0, 200, dim)
    assert col_scale.shape == shapes.fp8_block_columnwise_scale_shape(0, 200, dim)
    assert dequantize(row, row_scale, dim=dim).shape == (0, 200)
    assert dequantize(col, col_scale, dim=dim, columnwise=True).shape == (0, 200)


def test_directions_and_bad_dim():
    assert quantize(torch.ones(4, 4), rowwise=False, columnwise=False) == (None,) * 4
    with pytest.raises(ValueError):
        quantize(torch.ones(4, 4), dim=3)


# ------------------------------------------------------------------------ oracle comparisons


def random_tiles(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values with a random binade per 16x16 patch, plus special values."""
    g = torch.Generator().manual_seed(seed)
    binade = torch.randint(-12, 12, (shapes.ceil_div(m, 16), shapes.ceil_div(k, 16)), generator=g)
    binade = binade.repeat_interleave(16, 0).repeat_interleave(16, 1)[:m, :k]
    x = torch.randn(m, k, generator=g) * torch.pow(2.0, binade.float())
    x[0, :3] = torch.tensor([NAN, -0.0, INF])
    x[129, 1] = -INF
    x[5, 130:] = NAN
    x[130:, 3] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("fmt,dtype,pow2", [
    (E4M3, torch.float32, True), (E4M3, torch.bfloat16, False), (E4M3, torch.float16, True),
    (E5M2, torch.float32, False), (E5M2, torch.bfloat16, True), (E5M2, torch.float16, False),
])
def test_against_scalar_oracle(fmt, dtype, pow2):
    m, k = 133, 140
    x = random_tiles(m, k, dtype, seed=fmt.value * 7 + dtype.itemsize)
    row, row_scale, col, col_scale = quantize(x, fmt, dim=1, pow2=pow2)
    values, scale_inv = oracle(x, fmt, 1, 128, pow2)
    assert_same_values(decoded(row, fmt), values)
    assert torch.equal(row_scale, padded_cols(scale_inv.t(), shapes.roundup(m, 4)))
    values, scale_inv = oracle(x, fmt, 128, 1, pow2)
    assert_same_values(decoded(col, fmt), values.t())
    assert torch.equal(col_scale, padded_cols(scale_inv, shapes.roundup(k, 4)))
    row, row_scale, col, col_scale = quantize(x, fmt, dim=2, pow2=pow2)
    values, scale_inv = oracle(x, fmt, 128, 128, pow2)
    assert_same_values(decoded(row, fmt), values)
    assert torch.equal(col, row.t())
    assert torch.equal(row_scale, padded_cols(scale_inv, 4))
    assert torch.equal(col_scale, padded_cols(scale_inv.t(), 4))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dim,columnwise", [(1, False), (1, True), (2, False), (2, True)])
def test_round_trip_error_bound(fmt, dim, columnwise):
    # Below fp8_max, |q - x*s| <= half an ulp of the format: 2^-(m+1)*|x*s| in the normal range,
    # half the subnormal step 2^(emin-m-1) below it. With non-power-of-two scales the fp32
    # roundings of x*s, of 1/s and of q*(1/s) add relative 2^-24 each: the 2^-20 slack.
    mant_bits, emin = {E4M3: (3, -6), E5M2: (2, -14)}[fmt]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(150, 140, generator=g) * 2.0 ** torch.randint(-9, 9, (150, 1), generator=g)
    for pow2 in (True, False):
        row, row_scale, col, col_scale = quantize(x, fmt, dim=dim, pow2=pow2)
        data, scale_inv = (col, col_scale) if columnwise else (row, row_scale)
        y = dequantize(data, scale_inv, fmt, dim=dim, columnwise=columnwise)
        per_element = _per_element_scale_inv(scale_inv, dim, columnwise, 150, 140)
        bound = ((2.0 ** -(mant_bits + 1) + 2.0**-20) * x.abs()
                 + 2.0 ** (emin - mant_bits - 1) * per_element * (1 + 2.0**-20))
        assert bool(((y - x).abs() <= bound).all())


def _per_element_scale_inv(scale_inv, dim, columnwise, m, k):
    """Independent un-layout of the GEMM-ready scales (§6 table) to one value per element."""
    if dim == 2:
        tiles = scale_inv[:, : shapes.ceil_div(m, 128)].t() if columnwise else scale_inv
        return tiles.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :k]
    if columnwise:
        return scale_inv[:, :k].repeat_interleave(128, 0)[:m]
    return scale_inv[:, :m].t().repeat_interleave(128, 1)[:, :k]


def test_dequantize_casts_to_dtype():
    # 0x7E (448) * scale_inv (1 + 2^-8) = 449.75 in fp32; bf16 step 2 in [256, 512) -> 450.
    data = torch.full((1, 1), 0x7E, dtype=torch.uint8)
    scale_inv = torch.tensor([[1.0 + 2.0**-8, 0.0, 0.0, 0.0]])
    y = dequantize(data, scale_inv, dim=1, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.item() == 450.0


def test_traces_under_torch_compile():
    def run(x):
        return quantize(x, dim=1, pow2=True)

    x = random_tiles(133, 140, torch.bfloat16, seed=1)
    compiled = torch.compile(run, backend="eager", fullgraph=True)
    for a, b in zip(compiled(x), run(x), strict=True):
        assert torch.equal(a, b)
