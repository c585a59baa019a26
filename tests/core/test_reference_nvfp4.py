"""NVFP4 reference (numerics.md §7, §8, §10): hand-derived goldens and a scalar per-block oracle.

Recurring hand arithmetic (fp32 = 24 significant bits):
- fp32(1/6) = 11184811 * 2^-26 (2^26/6 = 11184810.67 rounds up).
- fp32(3 * fp32(1/6)) = fp32((2^25 + 1) * 2^-26) = 0.5 (26 bits, ulp 4: +1 rounds down).
- fp32(1/2688) = fp32(1/21) * 2^-7 = 12782641 * 2^-35 (2^28/21 = 12782640.76 rounds up), and
  21 * 12782641 = 2^28 + 5, so fp32(21 * 2^e * fp32(1/2688)) = 2^(e-7) exactly (5 * 2^-28 is
  below half an ulp of 1).
"""

from __future__ import annotations

import math

import pytest
import torch
from _oracles import assert_same_values, bits_to_f32, f32, random_byte
from quant_core import shapes
from quant_core.reference import nvfp4_amax, nvfp4_dequantize, nvfp4_quantize
from quant_core.reference._rounding import e2m1_encode
from quant_core.reference.nvfp4 import pack_e2m1
from quant_core.reference.rht import DEFAULT_SIGNS

INF, NAN = math.inf, math.nan
FLT_MAX = bits_to_f32(0x7F7FFFFF)
MASK = 55272

# ---------------------------------------------------------------------------------------------
# Scalar oracle: a straightforward per-block re-statement of §7.1-§7.8 with Python floats.
# ---------------------------------------------------------------------------------------------


#: Non-negative finite E4M3 values by byte 0x00..0x7E (bias 7, subnormals m/8 * 2^-6).
E4M3 = [m / 8 * 2.0**-6 for m in range(8)] + [
    (1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)
][:-1]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even(grid: list[float], a: float) -> int:
    """Index of the grid value nearest to ``a >= 0``, ties to the even index; past the end: last."""
    if a >= grid[-1]:
        return len(grid) - 1
    best = 0
    for i, g in enumerate(grid):
        d, db = abs(g - a), abs(grid[best] - a)
        if d < db or (d == db and i % 2 == 0):
            best = i
    return best


def e4m3_byte(v: float) -> int:
    return nearest_even(E4M3, v)  # v >= 0 here; satfinite: >= 448 -> 0x7E


def e2m1_code(v: float) -> int:
    if math.isnan(v):
        return 7
    return nearest_even(E2M1, abs(v)) | (8 if math.copysign(1.0, v) < 0 else 0)


def sr_value(v: float, byte: int) -> float:
    if math.isnan(v):
        return 6.0
    a = abs(v)
    u = byte / 256

    def step_of(z):
        return 2.0 if z >= 4 else 1.0 if z >= 2 else 0.5

    t = f32(a + u * step_of(a))
    q = 6.0 if math.isinf(t) else min(math.floor(t / step_of(t)) * step_of(t), 6.0)
    return math.copysign(q, v)


def s_enc_of(amax: float) -> float:
    s = FLT_MAX if math.isnan(amax) else (INF if amax == 0 else min(f32(2688 / amax), FLT_MAX))
    return 1.0 if amax == 0 or s == 0 else s


def oracle_direction(rows, ncols_valid, amax, block_amax, seed=None, offset=0):
    """Quantize ``rows`` (lists of floats) with 1x16 blocks; ``block_amax(r, b)`` per block.
    Returns (packed bytes per row, E4M3 bytes per row)."""
    s_enc = s_enc_of(amax)
    s_dec = f32(1 / s_enc)
    t = f32(s_enc * f32(1 / 6))
    data, scales = [], []
    for r, row in enumerate(rows):
        codes, srow = [], []
        for b in range(-(-ncols_valid // 16)):
            byte = e4m3_byte(min(f32(block_amax(r, b) * t), FLT_MAX))
            d = f32(E4M3[byte] * s_dec)
            enc = FLT_MAX if d == 0 else min(f32(1 / d), FLT_MAX)
            srow.append(byte)
            for c in range(16 * b, min(16 * b + 16, ncols_valid)):
                v = f32(row[c] * enc)
                if seed is not None:
                    v = sr_value(v, random_byte(seed, offset + r * ncols_valid + c))
                codes.append(e2m1_code(v))
        codes += [0] * (len(codes) % 2)
        data.append([codes[2 * j] | codes[2 * j + 1] << 4 for j in range(len(codes) // 2)])
        scales.append(srow)
    return data, scales


def nan0abs(v: float) -> float:
    return 0.0 if math.isnan(v) else abs(v)


def round_bf16(v: float) -> float:
    """RNE of a double to bf16 (normal range)."""
    if v == 0 or math.isinf(v) or math.isnan(v):
        return v
    m, e = math.frexp(v)
    return round(m * 2**8) * 2.0 ** (e - 8)  # round(): ties to even, exact in a double


def oracle_rht(xt: list[list[float]]) -> list[list[float]]:
    """bf16(v . R) per group of 16 along each row of x^T, summed exactly (inputs of small range)."""
    out = []
    for row in xt:
        o = []
        for g in range(0, len(row), 16):
            for j in range(16):
                acc = 0.0
                for i in range(16):
                    h = -1 if bin(i & j).count("1") % 2 else 1
                    acc += row[g + i] * DEFAULT_SIGNS[i] * h / 4
                o.append(round_bf16(acc))
        out.append(o)
    return out


def oracle_quantize(x, *, rowwise=True, columnwise=True, two_d=False, rht=False, seed=None):
    """Everything ``nvfp4_quantize`` returns (unswizzled), from the scalar oracle."""
    m, k = x.shape
    xs = x.float().tolist()
    xt = [[xs[r][c] for r in range(m)] for c in range(k)]
    amax_row = max((nan0abs(v) for row in xs for v in row), default=0.0)
    if rht:
        xt = oracle_rht(xt)
    amax_col = max((nan0abs(v) for row in xt for v in row), default=0.0)

    def tile_amax(rb, cb):
        return max(
            (nan0abs(xs[r][c]) for r in range(16 * rb, min(16 * rb + 16, m))
             for c in range(16 * cb, 16 * cb + 16)),
            default=0.0,
        )

    out = []
    if rowwise:
        blk = (lambda r, b: tile_amax(r // 16, b)) if two_d else (
            lambda r, b: max(nan0abs(v) for v in xs[r][16 * b : 16 * b + 16])
        )
        data, sc = oracle_direction(xs, k, amax_row, blk, seed, 0)
        out += [to_u8(data, (m, k // 2)), to_u8(sc, shapes.nvfp4_rowwise_scale_shape(m, k))]
    else:
        out += [None, None]
    if columnwise:
        blk = (lambda c, b: tile_amax(b, c // 16)) if two_d else (
            lambda c, b: max(nan0abs(v) for v in xt[c][16 * b : 16 * b + 16])
        )
        data, sc = oracle_direction(xt, m, amax_col, blk, seed, m * k)
        out += [to_u8(data, (k, -(-m // 2))), to_u8(sc, shapes.nvfp4_columnwise_scale_shape(m, k))]
    else:
        out += [None, None]
    return out, amax_row, amax_col


def to_u8(rows, shape) -> torch.Tensor:
    """A zero uint8 buffer of ``shape`` with ``rows`` written into its top-left corner."""
    t = torch.zeros(shape, dtype=torch.uint8)
    for r, row in enumerate(rows):
        if row:
            t[r, : len(row)] = torch.tensor(row, dtype=torch.uint8)
    return t


# ---------------------------------------------------------------------------------------------
# Helpers around the code under test
# ---------------------------------------------------------------------------------------------


def quantize(x, amax_row=None, amax_col=None, *, rowwise=True, columnwise=True, rht=False,
             two_d=False, seed=None, swizzle=False):
    if amax_row is None and amax_col is None:
        amax_row, amax_col = nvfp4_amax(
            x, rowwise=True, columnwise=True, with_rht=rht, rht_sign_mask=MASK
        )
    return nvfp4_quantize(
        x, amax_row, amax_col, rowwise=rowwise, columnwise=columnwise, with_rht=rht,
        rht_sign_mask=MASK, with_2d_quantization=two_d, stochastic_rounding=seed is not None,
        rng_seed=None if seed is None else torch.tensor([seed], dtype=torch.int64),
        swizzle=swizzle,
    )


def dequantize(data, scale, amax_value, dtype=torch.float32, swizzled=False):
    amax = torch.tensor([amax_value], dtype=torch.float32)
    return nvfp4_dequantize(data, scale, amax, swizzled=swizzled, dtype=dtype)


def u8(*vals) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------
# E2M1 element encoding and packing (§7.4)
# ---------------------------------------------------------------------------------------------

E2M1_CASES = [
    # (value, code) from the §7.4 interval table; ties go to the even code (0, 1, 2, 4, 6 -> codes
    # 0, 2, 4, 6 are even; code 1 = 0.5, 3 = 1.5, 5 = 3, 7 = 6 are odd).
    (0.0, 0x0), (0.25, 0x0), (0.2500001, 0x1), (0.5, 0x1), (0.7499999, 0x1), (0.75, 0x2),
    (1.0, 0x2), (1.25, 0x2), (1.2500001, 0x3), (1.5, 0x3), (1.75, 0x4), (2.0, 0x4), (2.5, 0x4),
    (2.5000002, 0x5), (3.0, 0x5), (3.4999998, 0x5), (3.5, 0x6), (4.0, 0x6), (5.0, 0x6),
    (5.0000005, 0x7), (6.0, 0x7), (7.0, 0x7), (1e30, 0x7), (FLT_MAX, 0x7), (INF, 0x7),
    # sign is bit 3; -0.0 keeps it (hardware), a negative value rounding to zero gives 0x8 too
    (-0.0, 0x8), (-0.25, 0x8), (-0.75, 0xA), (-1.75, 0xC), (-2.5, 0xC), (-3.5, 0xE), (-5.0, 0xE),
    (-6.0, 0xF), (-INF, 0xF), (1e-45, 0x0),
    (NAN, 0x7),  # project rule: NaN -> +6
]


def test_e2m1_tie_table():
    v = torch.tensor([c[0] for c in E2M1_CASES], dtype=torch.float32)
    assert e2m1_encode(v).tolist() == [c[1] for c in E2M1_CASES]


def test_packing_low_nibble_first():
    # codes [2, 4, 0xF, 0x1] -> bytes [2 | 4 << 4, 0xF | 1 << 4] = [0x42, 0x1F]
    assert pack_e2m1(torch.tensor([[2, 4, 0xF, 0x1]])).tolist() == [[0x42, 0x1F]]


# ---------------------------------------------------------------------------------------------
# One row worked through the two-level scale by hand (§7.2, §7.3, §8, §10)
# ---------------------------------------------------------------------------------------------
# Tensor amax 21 -> S_enc = fp32(2688/21) = 128 exactly, S_dec = 2^-7,
# t = fp32(128 * fp32(1/6)) = 11184811 * 2^-19 (21.33333397).
# Dequantize scale of a block = fp32(fp32(e4m3 * 21) * fp32(1/2688)).

# Block C (block amax 21): sdec = fp32(21 * 11184811 * 2^-19) = fp32(234881031 * 2^-19); 28 bits,
# ulp 16, remainder 7 -> 234881024 * 2^-19 = 448 -> byte 0x7E. enc = fp32(1/3.5) = 0.28571430
# (~2/7, 9586981 * 2^-25). Each v = x * 2/7 lies well inside one §7.4 interval:
BLOCK_C = [21, -10.5, 7, 0, 1, -14, 2, 4, 5, 8, 9.5, 12, 13, 17, 18, -0.5]
# v:  6.0000002 -3.0000001 2.0000001 0 0.286 -4.0 0.571 1.143 1.429 2.286 2.714 3.429 3.714
#     4.857 5.143 -0.143
CODES_C = [7, 0xD, 4, 0, 1, 0xE, 1, 2, 3, 4, 5, 5, 6, 6, 7, 8]
BYTES_C = [0xD7, 0x04, 0xE1, 0x21, 0x43, 0x55, 0x66, 0x87]  # code[2j] | code[2j+1] << 4
# Dequantize: fp32(448 * 21) = 9408, fp32(9408 * 12782641 * 2^-35) = fp32(1879048227 * 2^-29):
# 31 bits, ulp 128, remainder 35 -> 1879048192 * 2^-29 = 3.5. Values = e2m1 * 3.5.
DEQ_C = [21, -10.5, 7, 0, 1.75, -14, 1.75, 3.5, 5.25, 7, 10.5, 10.5, 14, 14, 21, -0.0]

# Block B (block amax 6): sdec = fp32(6 * 11184811 * 2^-19) = fp32((2^26 + 2) * 2^-19): 27 bits,
# ulp 8 -> 2^26 * 2^-19 = 128 = 2^7 -> byte 0x70 (exponent field 7 + 7 = 0b1110). enc =
# fp32(1 / (128 * 2^-7)) = 1, so the codes are the §7.4 table applied to x itself (ties included).
BLOCK_B = [6, -6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 0.5, -0.0, 3, -1.5, 5.5, -0.25, 4.5]
CODES_B = [7, 0xF, 0, 2, 2, 4, 4, 6, 6, 1, 8, 5, 0xB, 7, 8, 6]
BYTES_B = [0xF7, 0x20, 0x42, 0x64, 0x16, 0x58, 0x7B, 0x68]
# Dequantize: fp32(128 * 21) = 2688 = 21 * 2^7 -> scale 2^0 = 1: the e2m1 values themselves.
DEQ_B = [6, -6, 0, 1, 1, 2, 2, 4, 4, 0.5, -0.0, 3, -1.5, 6, -0.0, 4]

# Zero block in a non-zero tensor: block amax 0 -> e4m3 0 -> enc FLT_MAX; codes 0 / 0x8 (-0.0).
BLOCK_Z = [0.0, -0.0] * 8
BYTES_Z = [0x80] * 8
DEQ_Z = BLOCK_Z

# Tiny block: block amax 2^-16; sdec = 2^-16 * 21.33 = 3.3e-4 < 2^-10 (half the smallest E4M3
# subnormal 2^-9) -> byte 0x00 -> enc FLT_MAX; 2^-16 * FLT_MAX ~ 5e33 -> 6 (code 7), -2^-17 -> 0xF.
# Dequantizes to 0 (e4m3 = 0): +0 for code 7, -0.0 for code 0xF.
BLOCK_T = [2.0**-16, -(2.0**-17)] + [0.0] * 14
BYTES_T = [0xF7] + [0x00] * 7
DEQ_T = [0.0, -0.0] + [0.0] * 14

# E4M3-subnormal block scale: block amax 6 * 2^-15 -> sdec = 2^-15 * (block B's 128) = 2^-8 =
# 2 * 2^-9 -> byte 0x02 (torchao's 2^-6 floor would give 0x08). enc = fp32(1 / (2^-8 * 2^-7)) =
# 2^15, so v = x * 2^15: [6, 1, -1.5, 2.5 (tie -> 2), 0...].
BLOCK_S = [6 * 2.0**-15, 2.0**-15, -3 * 2.0**-16, 2.5 * 2.0**-15] + [0.0] * 12
BYTES_S = [0x27, 0x4B] + [0x00] * 6  # codes [7, 2, 0xB, 4, 0...]
# Dequantize: fp32(2^-8 * 21) = 21 * 2^-8 -> scale 2^-15; values e2m1 * 2^-15.
DEQ_S = [6 * 2.0**-15, 2.0**-15, -1.5 * 2.0**-15, 2 * 2.0**-15] + [0.0] * 12

HAND_ROW = BLOCK_C + BLOCK_B + BLOCK_Z + BLOCK_T + BLOCK_S  # K = 80, amax 21
HAND_BYTES = BYTES_C + BYTES_B + BYTES_Z + BYTES_T + BYTES_S
HAND_SCALES = [0x7E, 0x70, 0x00, 0x00, 0x02]
HAND_DEQ = DEQ_C + DEQ_B + DEQ_Z + DEQ_T + DEQ_S


def test_hand_worked_row():
    x = torch.tensor([HAND_ROW], dtype=torch.float32)
    a_row, a_col = nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=0)
    assert a_row.tolist() == [21.0] and a_col.tolist() == [21.0]
    assert a_row.dtype == torch.float32 and a_row.shape == (1,)
    data, scale, _, _ = quantize(x, a_row, a_col, columnwise=False)
    assert data.dtype == torch.uint8 and data.tolist() == [HAND_BYTES]
    assert scale.shape == (128, 8)  # roundup(1, 128), roundup(80/16, 4)
    expected_scale = torch.zeros(128, 8, dtype=torch.uint8)
    expected_scale[0, :5] = u8(*HAND_SCALES)
    assert torch.equal(scale, expected_scale)  # padding 0
    assert_same_values(dequantize(data, scale, 21.0), torch.tensor([HAND_DEQ]))


def test_hand_worked_row_bf16_and_fp16_inputs():
    # every value of the row is exact in bf16 and fp16 except 2^-16, 2^-17 (fp16 subnormals, exact)
    for dt in (torch.bfloat16, torch.float16):
        x = torch.tensor([HAND_ROW], dtype=dt)
        assert x.float().tolist() == [HAND_ROW]
        data, scale, _, _ = quantize(x, torch.tensor([21.0]), None, columnwise=False)
        assert data.tolist() == [HAND_BYTES] and scale[0, :5].tolist() == HAND_SCALES
        assert_same_values(dequantize(data, scale, 21.0, dtype=dt), torch.tensor([HAND_DEQ]))


def test_multiplication_order_t():
    # §7.3 step 1 is fp32(S_enc * fp32(1/6)), not fp32(S_enc / 6). amax 384 -> S_enc = 7 exactly.
    # t = fp32(7 * 11184811 * 2^-26) = fp32(78293677 * 2^-26): 27 bits, ulp 8, remainder 5 -> up
    # -> 9786710 * 2^-23 (fp32(7/6) would be 9786709 * 2^-23).
    # Block amax 288: sdec = fp32(9 * 9786710 * 2^-18) = fp32(88080390 * 2^-18): ulp 8, remainder
    # 6 -> 88080392 * 2^-18 = 336.00003, above the E4M3 tie 336 between 320 and 352 -> 352 = 1.375
    # * 2^8 -> byte 0x7B. (With fp32(7/6): 88080381 -> 88080384 * 2^-18 = 336, tie -> 320, 0x7A.)
    # Block amax 384: sdec = fp32(3 * 9786710 * 2^-16) = 448.00003 -> satfinite 448 (0x7E).
    x = torch.tensor([[384.0] + [0.0] * 15 + [288.0] + [0.0] * 15])
    _, scale, _, _ = quantize(x, torch.tensor([384.0]), None, columnwise=False)
    assert scale[0, :2].tolist() == [0x7E, 0x7B]


def test_multiplication_order_enc():
    # §7.3 step 4 is fp32(1 / fp32(e4m3 * S_dec)), not fp32(S_enc / e4m3). amax 9:
    # S_enc = fp32(2688/9) = 9786709 * 2^-15 (2^15 * 896/3 = 9786709.33 rounds down).
    # t = fp32(S_enc * 11184811 * 2^-26) = 13048946 * 2^-18 (exact 13048945.78); block amax 9:
    # sdec = fp32(9 * t) = fp32(117440514 * 2^-18) = 448 (ulp 8, remainder 2) -> 0x7E.
    # S_dec = fp32(2^15 / 9786709) = 14380471 * 2^-32; 448 * S_dec = 6442451008 * 2^-32 =
    # 1.50000001 -> fp32 (ulp 2^-23 = 512 units, remainder 64) 1.5 -> enc = fp32(1/1.5) =
    # fp32(2/3) = 11184811 * 2^-24. (fp32(S_enc / 448) would be 11184810 * 2^-24.)
    # x * enc then lands exactly on E2M1 ties, which go to the even code:
    #   5.25  * 11184811 = 58720257.75 * 2^-24 -> (ulp 4 units) 3.5  -> 4   (code 6)
    #   2.625 * 11184811 = 29360128.875 * 2^-24 -> (ulp 2)      1.75 -> 2   (code 4)
    #   1.125 * 11184811 = 12582912.375 * 2^-24 -> (ulp 1)      0.75 -> 1   (code 2)
    #   3.75  * 11184811 = 41943041.25 * 2^-24 -> (ulp 4)       2.5  -> 2   (code 4)
    #   9     -> 6.0000002 -> 6 (code 7)
    # The other order gives values one ulp below each tie: codes 5, 3, 1, 4.
    x = torch.tensor([[9.0, 5.25, 2.625, 1.125, 3.75] + [0.0] * 11])
    data, scale, _, _ = quantize(x, torch.tensor([9.0]), None, columnwise=False)
    assert scale[0, 0].item() == 0x7E
    assert data[0, :3].tolist() == [0x67, 0x24, 0x04]  # codes [7, 6, 4, 2, 4, 0]


def test_all_zero_tensor():
    # amax 0 -> S_enc = S_dec = 1; every block e4m3 0 -> enc FLT_MAX; codes 0 / 0x8 for -0.0.
    x = torch.tensor([[0.0, -0.0] * 8] * 3)
    a_row, a_col = nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=0)
    assert a_row.tolist() == [0.0] and a_col.tolist() == [0.0]
    rd, rs, cd, cs = quantize(x, a_row, a_col)
    assert rd.tolist() == [[0x80] * 8] * 3
    assert not rs.any() and not cs.any()
    # columnwise: x^T rows alternate all +0 (codes 0) and all -0.0 (codes 0x8); M = 3 -> 2 bytes,
    # the missing 4th nibble is 0: [0x8 | 0x8 << 4, 0x8] = [0x88, 0x08]
    assert cd.tolist() == [[0x00, 0x00], [0x88, 0x08]] * 8
    assert_same_values(dequantize(rd, rs, 0.0), x)  # ±0, sign kept


def test_inf_element():
    # amax Inf -> S_enc = 1 (2688/Inf = 0), S_dec = 1, t = fp32(1/6).
    # Block 0 [Inf, 1, -Inf, 0...]: block amax Inf -> sdec Inf -> FLT_MAX -> 448 (0x7E);
    #   enc = fp32(1/448) = 0.00223: Inf -> 6 (7), 1 -> 0.0022 -> 0, -Inf -> 0xF.
    # Block 1 [3, -1, 1.25, 0...]: sdec = fp32(3 * fp32(1/6)) = 0.5 -> 0x30 (exp field 6);
    #   enc = fp32(1 / (0.5 * 1)) = 2: 3 -> 6 (7), -1 -> -2 (0xC), 1.25 -> 2.5 tie -> 2 (4).
    x = torch.tensor([[INF, 1.0, -INF] + [0.0] * 13 + [3.0, -1.0, 1.25] + [0.0] * 13])
    a_row, _ = nvfp4_amax(x, rowwise=True, columnwise=False, with_rht=False, rht_sign_mask=0)
    assert a_row.tolist() == [INF]
    data, scale, _, _ = quantize(x, a_row, None, columnwise=False)
    assert data.tolist() == [[0x07, 0x0F] + [0] * 6 + [0xC7, 0x04] + [0] * 6]
    assert scale[0, :2].tolist() == [0x7E, 0x30]
    # §8 with amax Inf: fp32(448 * Inf) = Inf, fp32(0.5 * Inf) = Inf; non-zero codes -> ±Inf,
    # zero codes -> 0 * Inf = NaN.
    expected = [INF, NAN, -INF] + [NAN] * 13 + [INF, -INF, INF] + [NAN] * 13
    assert_same_values(dequantize(data, scale, INF), torch.tensor([expected]))


def test_nan_element():
    # NaN is dropped from the amaxes: amax 21 -> S_enc 128, as in block C: block amax 21 -> 0x7E,
    # enc = fp32(2/7): NaN -> +6 (0x7, project rule), 21 -> 6.0000002 (7), 7 -> 2.0000001 (4),
    # -10.5 -> -3.0000001 (0xD). Bytes [7 | 7 << 4, 4 | 0xD << 4] = [0x77, 0xD4].
    x = torch.tensor([[NAN, 21.0, 7.0, -10.5] + [0.0] * 12])
    a_row, a_col = nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=0)
    assert a_row.tolist() == [21.0] and a_col.tolist() == [21.0]
    data, scale, _, _ = quantize(x, a_row, a_col, columnwise=False)
    assert data.tolist() == [[0x77, 0xD4] + [0] * 6]
    assert scale[0, 0].item() == 0x7E
    # a block that is all NaN: block amax 0 -> e4m3 0, enc FLT_MAX, codes +6 (0x7)
    x = torch.tensor([[21.0] + [0.0] * 15 + [NAN] * 16])
    data, scale, _, _ = quantize(x, torch.tensor([21.0]), None, columnwise=False)
    assert data[0, 8:].tolist() == [0x77] * 8 and scale[0, :2].tolist() == [0x7E, 0x00]


def test_nan_amax_follows_fminf():
    # TE: S_enc = fminf(2688 / NaN, FLT_MAX) = FLT_MAX; t = FLT_MAX/6, sdec(1) = FLT_MAX / 6 -> 448
    # (0x7E); S_dec = fp32(1/FLT_MAX) (subnormal 2^-128 ~), enc = fp32(1/(448 * S_dec)) finite.
    x = torch.tensor([[1.0] + [0.0] * 15])
    data, scale, _, _ = quantize(x, torch.tensor([NAN]), None, columnwise=False)
    assert scale[0, 0].item() == 0x7E and data[0, 0].item() == 0x07


# ---------------------------------------------------------------------------------------------
# Shapes (§0, §7.5)
# ---------------------------------------------------------------------------------------------


def test_k_must_be_multiple_of_16():
    x = torch.zeros(4, 24)
    with pytest.raises(ValueError, match=r"NVFP4.*16"):
        nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=0)
    with pytest.raises(ValueError, match=r"NVFP4.*16"):
        quantize(x, torch.ones(1), torch.ones(1))


@pytest.mark.parametrize("two_d", [False, True])
def test_empty_m(two_d):
    x = torch.zeros(0, 32)
    a_row, a_col = nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=0)
    assert a_row.tolist() == [0.0] and a_col.tolist() == [0.0]
    rd, rs, cd, cs = quantize(x, a_row, a_col, two_d=two_d, swizzle=True)
    assert rd.shape == (0, 16) and rs.shape == (0, 4)
    assert cd.shape == (32, 0) and cs.shape == (128, 0)
    assert all(t.dtype == torch.uint8 for t in (rd, rs, cd, cs))
    assert dequantize(rd, rs, 0.0).shape == (0, 32)


def test_directions_not_asked_are_none():
    x = torch.randn(16, 32)
    assert nvfp4_amax(x, rowwise=True, columnwise=False, with_rht=False, rht_sign_mask=0)[1] is None
    assert nvfp4_amax(x, rowwise=False, columnwise=True, with_rht=False, rht_sign_mask=0)[0] is None
    a = torch.tensor([float(x.abs().max())])
    out = quantize(x, a, a, rowwise=False)
    assert out[0] is None and out[1] is None and out[2].shape == (32, 8)
    out = quantize(x, a, a, columnwise=False)
    assert out[2] is None and out[3] is None


def test_ragged_m_partial_columnwise_block():
    # M = 17: the second columnwise block of each column holds only row 16. Column 0: rows 0..15
    # are 1.0 and row 16 is 0.75, so block 1's amax is 0.75 (valid rows only) although 0 padding
    # follows. Tensor amax 1 -> S_enc = 2688 = 21 * 2^7, t = fp32(2688 * fp32(1/6)) = 448 (the
    # 7 * 2^7 * 3 * fp32(1/6) product: 21 * 11184811 * 2^-19 = 448 as in block C, times 2^0).
    # Block 1: sdec = 0.75 * 448 = 336 = 1.3125 * 2^8 -> E4M3 mantissa 0.3125 * 8 = 2.5, tie ->
    # even 2 -> 1.25 * 2^8 = 320 -> byte 0x7A; enc ~ 1 / (320/2688) = 8.4; 0.75 * 8.4 = 6.3 -> 6.
    x = torch.zeros(17, 16)
    x[:16, 0] = 1.0
    x[16, 0] = 0.75
    _, _, cd, cs = quantize(x, torch.ones(1), torch.ones(1), rowwise=True)
    assert cd.shape == (16, 9) and cs.shape == (128, 4)
    assert cs[0, :2].tolist() == [0x7E, 0x7A] and not cs[1:].any() and not cs[0, 2:].any()
    # column 0: 1.0 * enc(448 -> 6) = 6 -> code 7 for rows 0..15; row 16 -> code 7, nibble 2 = 0
    assert cd[0].tolist() == [0x77] * 8 + [0x07]


# ---------------------------------------------------------------------------------------------
# Property tests against the scalar oracle
# ---------------------------------------------------------------------------------------------


def spread_data(m: int, k: int, gen: torch.Generator, specials: bool) -> torch.Tensor:
    """randn with a random power-of-two scale per 16-block (subnormal, tiny and large block
    scales), some zeros, -0.0 and optionally NaN / Inf."""
    x = torch.randn(m, k, generator=gen)
    e = torch.randint(-24, 8, (m, max(k // 16, 1), 1), generator=gen).float()
    x = (x.reshape(m, -1, 16) * torch.exp2(e)).reshape(m, k) if k else x
    flat = x.view(-1)
    n = flat.numel()
    if n:
        pick = torch.randint(0, n, (max(n // 20, 1),), generator=gen)
        flat[pick[0::2]] = 0.0
        flat[pick[1::2]] = -0.0
        if specials:
            flat[pick[:2]] = NAN
            flat[pick[2:3]] = -INF if n > 40 else NAN
    return x


CASES = [(1, 16), (5, 32), (16, 16), (17, 48), (33, 32), (2, 64)]


@pytest.mark.parametrize("m,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_oracle(m, k, dtype):
    gen = torch.Generator().manual_seed(1000 * m + k)
    x = spread_data(m, k, gen, specials=(m == 17)).to(dtype)
    expected, amax_row, amax_col = oracle_quantize(x)
    a_row, a_col = nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=0)
    assert a_row.tolist() == [amax_row] and a_col.tolist() == [amax_col]
    got = quantize(x, a_row, a_col)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == torch.uint8 and torch.equal(g, e)


@pytest.mark.parametrize("m,k", [(16, 32), (17, 16), (40, 48)])
def test_2d_matches_oracle_and_transpose(m, k):
    gen = torch.Generator().manual_seed(7 * m + k)
    x = spread_data(m, k, gen, specials=False)
    expected, *_ = oracle_quantize(x, two_d=True)
    rd, rs, cd, cs = got = quantize(x, two_d=True)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    # §7.7: one scale per 16x16 tile, so the columnwise data is the transpose of the rowwise data
    codes = torch.stack([rd & 0xF, rd >> 4], -1).reshape(m, k).t()
    codes = torch.nn.functional.pad(codes, (0, m % 2))
    assert torch.equal(cd, codes[:, 0::2] | (codes[:, 1::2] << 4))
    mb = -(-m // 16)
    assert torch.equal(cs[:k, :mb], rs[: 16 * mb : 16, : k // 16].t().repeat_interleave(16, 0))


@pytest.mark.parametrize("m,k", [(16, 32), (3, 16)])
def test_stochastic_rounding_matches_oracle(m, k):
    # the oracle repeats the documented hash formula and the §7.8 definition element by element
    gen = torch.Generator().manual_seed(99 + m)
    x = spread_data(m, k, gen, specials=True)
    for seed in (0, -3, 2**40 + 17):
        expected, *_ = oracle_quantize(x, seed=seed)
        got = quantize(x, seed=seed)
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)


def test_rht_matches_oracle():
    # inputs of magnitude [0.5, 4): the oracle's exact sums equal fp32 accumulation (no rounding)
    gen = torch.Generator().manual_seed(5)
    mag = (1 + torch.rand(32, 32, generator=gen)) * torch.exp2(
        torch.randint(-1, 2, (32, 32), generator=gen).float()
    )
    x = (mag * torch.where(torch.rand(32, 32, generator=gen) < 0.5, -1.0, 1.0)).bfloat16()
    expected, amax_row, amax_col = oracle_quantize(x, rht=True)
    a_row, a_col = nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=MASK)
    assert a_row.tolist() == [amax_row] and a_col.tolist() == [amax_col]
    got = quantize(x, a_row, a_col, rht=True)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    # the rowwise direction is not transformed
    assert torch.equal(got[0], quantize(x, a_row, a_col, columnwise=False)[0])


def test_rht_and_2d_exclusive():
    x = torch.zeros(16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="with_rht"):
        quantize(x, torch.ones(1), torch.ones(1), rht=True, two_d=True)


def test_columnwise_is_rowwise_of_transpose():
    # M % 16 == 0, no RHT, same amax: the columnwise bytes are the rowwise bytes of x^T
    x = spread_data(48, 32, torch.Generator().manual_seed(3), specials=False)
    a = torch.tensor([float(x.abs().max())])
    _, _, cd, cs = quantize(x, a, a)
    rd, rs, _, _ = quantize(x.t().contiguous(), a, a, columnwise=False)
    assert torch.equal(cd, rd) and torch.equal(cs, rs)


def test_roundtrip_error_bound():
    # Per element |deq - x| <= D * 1 where D = dequantize scale of the block ~ e4m3_b * amax/2688:
    # the scaled value v = x * enc_b is within half a grid step (<= 1, between 4 and 6) of its
    # code, or at most 6 * 2^-4 = 0.375 above 6 when e4m3_b rounded down (E4M3 relative rounding
    # <= 2^-4). D <= (block_amax/6) * (1 + 2^-4) + 2^-10 * amax/2688 (E4M3 subnormal step), so
    # |deq - x| <= block_amax * 1.0625 / 6 + amax * 2^-10 / 2688 (plus fp32 slack 1e-6 relative).
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(11)) * 3
    amax = float(x.abs().max())
    rd, rs, _, _ = quantize(x, columnwise=False)
    err = (dequantize(rd, rs, amax) - x).abs().reshape(64, 4, 16)
    bamax = x.abs().reshape(64, 4, 16).amax(-1, keepdim=True)
    bound = bamax * 1.0625 / 6 * (1 + 1e-6) + amax * 2.0**-10 / 2688
    assert (err <= bound).all()
    assert err.max() > 0  # not vacuous


def test_dequantize_matches_oracle():
    # §8 scalar chain: e2m1 * fp32(fp32(e4m3 * amax) * fp32(1/2688)), then the cast to dtype
    gen = torch.Generator().manual_seed(21)
    data = torch.randint(0, 256, (20, 24), generator=gen, dtype=torch.uint8)
    scale = torch.zeros(128, 4, dtype=torch.uint8)
    scale[:20, :3] = torch.randint(0, 0x7F, (20, 3), generator=gen, dtype=torch.uint8)
    for amax in (1.0, 3.0, 9.0, 173.25, 2.0**-30):
        got = dequantize(data, scale, amax)
        c = f32(1 / 2688)
        expected = []
        for drow, srow in zip(data.tolist(), scale.tolist()[:20], strict=True):
            for j in range(48):
                code = (drow[j // 2] >> (4 * (j % 2))) & 0xF
                d = f32(f32(E4M3[srow[j // 16]] * amax) * c)
                expected.append(f32(math.copysign(E2M1[code & 7], -1.0 if code & 8 else 1.0) * d))
        assert_same_values(got, torch.tensor(expected).reshape(20, 48))
        bf = dequantize(data, scale, amax, dtype=torch.bfloat16)
        assert bf.dtype == torch.bfloat16 and torch.equal(bf, got.to(torch.bfloat16))


def test_swizzle():
    swz = pytest.importorskip("quant_core.reference.swizzle")
    x = spread_data(40, 80, torch.Generator().manual_seed(8), specials=False)
    plain = quantize(x)
    swizzled = quantize(x, swizzle=True)
    assert torch.equal(swizzled[0], plain[0]) and torch.equal(swizzled[2], plain[2])
    assert torch.equal(swizzled[1], swz.swizzle_scales(plain[1]))
    assert torch.equal(swizzled[3], swz.swizzle_scales(plain[3]))
    amax = float(x.abs().max())
    deq_swizzled = dequantize(swizzled[0], swizzled[1], amax, swizzled=True)
    assert torch.equal(deq_swizzled, dequantize(plain[0], plain[1], amax))


def test_traces_under_torch_compile():
    def f(x, seed):
        a_row, a_col = nvfp4_amax(
            x, rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=MASK
        )
        out = nvfp4_quantize(
            x, a_row, a_col, rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=MASK,
            with_2d_quantization=False, stochastic_rounding=True, rng_seed=seed, swizzle=False,
        )
        return out + (nvfp4_dequantize(out[0], out[1], a_row, swizzled=False, dtype=x.dtype),)

    x = torch.randn(32, 32).bfloat16()
    seed = torch.tensor([5], dtype=torch.int64)
    compiled = torch.compile(f, fullgraph=True, backend="eager")(x, seed)
    for c, e in zip(compiled, f(x, seed), strict=True):
        assert torch.equal(c, e)


def test_row_scaled_worked_example():
    """numerics.md §7.9's row-scaled example, derived by hand there: a row 2^20 times smaller
    than the tensor's amax flushes to zero under one amax and is exact under its own."""
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0], x[1, 1] = 448.0, 2.0**-12, 2.0**-13
    opts = dict(rowwise=True, columnwise=False, with_rht=False, rht_sign_mask=0)
    qopts = dict(opts, with_2d_quantization=False, stochastic_rounding=False, rng_seed=None,
                 swizzle=False)
    amax, _ = nvfp4_amax(x, **opts)
    data, scale, _, _ = nvfp4_quantize(x, amax, None, **qopts)
    assert scale[1, 0].item() == 0x00
    assert nvfp4_dequantize(data, scale, amax, swizzled=False,
                            dtype=torch.float32)[1].abs().sum().item() == 0.0
    amax, _ = nvfp4_amax(x, **opts, row_scaled=True)
    assert amax.tolist() == [448.0, 2.0**-12]
    data, scale, _, _ = nvfp4_quantize(x, amax, None, **qopts, row_scaled=True)
    assert scale[1, 0].item() == 0x7E and data[1, 0].item() == 0x57  # codes 7 (low), 5 (high)
    out = nvfp4_dequantize(data, scale, amax, swizzled=False, dtype=torch.float32)
    assert out[1, :2].tolist() == [2.0**-12, 2.0**-13]
