"""Scalar oracles shared by the reference tests: independent restatements of `numerics.md`.

Imported as ``from _oracles import ...`` (pytest's default "prepend" import mode puts this
directory on ``sys.path``). Nothing here may import the code under test.
"""

from __future__ import annotations

import math
import struct

import torch

#: (mantissa bits, min normal exponent, max finite) by FP8 format name (§1).
_FP8_GRID = {"E4M3": (3, -6, 448.0), "E5M2": (2, -14, 57344.0)}
_FP8_TORCH = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}


def f32(v: float) -> float:
    """Round a double to fp32 (RNE, overflow to Inf, subnormals kept). A product or quotient of
    two fp32 values is exact or safely double-rounded in a double, so f32(a op b) is fp32(a op b).
    """
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def bits_to_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def fp8_value(v: float, fmt) -> float:
    """Scalar ``fp8_satfinite_rne`` (§2): RNE onto the format's grid, ±max on overflow."""
    mant_bits, emin, fmax = _FP8_GRID[fmt.name]
    if math.isnan(v) or v == 0:
        return v
    a = abs(v)
    if a >= fmax:
        return math.copysign(fmax, v)
    step = 2.0 ** (max(math.frexp(a)[1] - 1, emin) - mant_bits)
    return math.copysign(min(round(a / step) * step, fmax), v)  # round(): ties to even


def decoded(data: torch.Tensor, fmt) -> torch.Tensor:
    """FP8 bytes of format ``fmt`` (``DType.E4M3`` / ``E5M2``) as fp32 values."""
    return data.view(_FP8_TORCH[fmt.name]).to(torch.float32)


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor):
    """Equal values, equal sign bits (so -0.0 counts), NaN where expected NaN."""
    expected = expected.to(actual.dtype)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual[~nan], expected[~nan])
    assert torch.equal(torch.signbit(actual[~nan]), torch.signbit(expected[~nan]))


def lowbias32(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def random_byte(seed: int, index: int) -> int:
    """The documented formula of ``sr_random_byte`` (§7.8) with Python's unbounded ints."""
    s = seed & (2**64 - 1)
    h = lowbias32((s & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = lowbias32(h ^ (s >> 32))
    h = lowbias32(h ^ (index >> 32))
    h = lowbias32(h ^ (index & 0xFFFFFFFF))
    return h >> 24
