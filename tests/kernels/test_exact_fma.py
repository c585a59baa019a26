"""The interpreter's fused multiply-add (``_exact_fma.fused``) rounds once, as a GPU's does:
against exact rational arithmetic on random operands, on sums that cancel, and on sums that fp64
rounds onto a midpoint of two fp32 values."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from _exact_fma import fused


def _round_f32(v: Fraction) -> np.float32:
    """fp32 nearest to ``v``, ties to even (finite range)."""
    r = np.float32(float(v))
    cands = (np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf)))
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - v),
                                     int(np.array(c).view(np.uint32)) & 1))


def _operands(n: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    def f32(lo, hi):
        bits = (rng.integers(0, 2, n) << 31) | ((rng.integers(lo, hi, n) + 127) << 23) \
            | rng.integers(0, 1 << 23, n)
        return bits.astype(np.uint32).view(np.float32)

    a, b, c = f32(-40, 40), f32(-40, 40), f32(-80, 80)
    half = n // 2
    c[:half] = (-(a[:half].astype(np.float64) * b[:half])).astype(np.float32)  # cancel
    # (1 + e)(1 - e) = 1 - 2^-40, which fp64 drops next to 2^24: the sum rounds to the midpoint
    # 2^24 + 3 (or + 5) in fp64, whose tie goes the wrong way; the exact sum lies below (above)
    e = 2.0**-20
    a[:4] = [1 + e, 1 + e, -(1 + e), -(1 + e)]
    b[:4] = [1 - e, -(1 - e), -(1 - e), 1 - e]
    c[:4] = [2.0**24 + 2, 2.0**24 + 6, -(2.0**24 + 2), -(2.0**24 + 6)]
    return a, b, c


def test_fused_rounds_once():
    rng = np.random.default_rng(0)
    a, b, c = _operands(3000, rng)
    got = fused(a, b, c)
    want = [_round_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
            for x, y, z in zip(a, b, c, strict=True)]
    bad = [(i, got[i], w) for i, w in enumerate(want) if not (got[i] == w)]
    assert not bad, bad[:5]
    assert not np.array_equal(got, (a * b + c).astype(np.float32))  # the unfused one differs
