"""NVFP4 stochastic rounding (numerics.md §7.8): the counter-based hash and SR statistics."""

from __future__ import annotations

import pytest
import torch
from _oracles import random_byte
from quant_core.reference import nvfp4_dequantize, nvfp4_quantize
from quant_core.reference._rounding import sr_random_byte, sr_round_e2m1


@pytest.mark.parametrize("seed", [0, 1, -1, 12345, 2**62 + 7, -(2**40)])
def test_hash_matches_formula(seed):
    idx = [0, 1, 2, 255, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 3 * 2**40 + 9]
    idx += list(range(1000, 1100))
    got = sr_random_byte(torch.tensor([seed], dtype=torch.int64), torch.tensor(idx))
    assert got.dtype == torch.int64 and got.shape == (len(idx),)
    assert got.tolist() == [random_byte(seed, i) for i in idx]


def test_hash_keeps_index_shape_and_is_uniform():
    idx = torch.arange(1 << 16).reshape(256, 256)
    b = sr_random_byte(torch.tensor([42]), idx)
    assert b.shape == (256, 256) and int(b.min()) >= 0 and int(b.max()) <= 255
    counts = torch.bincount(b.flatten(), minlength=256).double()
    # 65536 draws, 256 cells of expectation 256: chi-square with 255 dof has mean 255, sd ~22.6
    chi2 = float(((counts - 256) ** 2 / 256).sum())
    assert chi2 < 255 + 6 * 22.6


def test_sr_round_hand_cases():
    # (v, byte, q): u = byte / 256; a < 2 -> step 0.5; t = a + u * step; q = floor(t/step_t)*step_t
    cases = [
        (0.3, 0, 0.0),  # t = 0.3 -> floor(0.6) * 0.5 = 0
        (0.3, 255, 0.5),  # t = 0.3 + 0.498 = 0.798 -> floor(1.596) * 0.5 = 0.5
        (0.3, 102, 0.0),  # fp32(0.3) = 0.30000001, t = 0.30000001 + 0.19921875 < 0.5 -> 0
        (1.9, 128, 2.0),  # t = 1.9 + 0.25 = 2.15 -> step_t 1 -> floor(2.15) = 2
        (2.5, 127, 2.0),  # step 1: t = 2.5 + 0.49609375 = 2.99609375 -> 2
        (2.5, 128, 3.0),  # t = 3.0 -> 3
        (5.0, 127, 4.0),  # step 2: t = 5 + 0.9921875 = 5.9921875 -> floor(2.996) * 2 = 4
        (5.0, 128, 6.0),  # t = 6 -> 6
        (5.9, 255, 6.0),  # t = 7.89 -> floor(3.9) * 2 = 6, min 6
        (-1.2, 0, -1.0),  # sign of v kept: a = 1.2 -> t = 1.2 -> floor(2.4) * 0.5 = 1
        (-0.0, 255, -0.0),  # t = 0.498 -> 0, sign kept
        (float("inf"), 0, 6.0),
        (float("-inf"), 0, -6.0),
        (float("nan"), 9, 6.0),  # NaN -> +6
        (6.0, 255, 6.0),
    ]
    v = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    rb = torch.tensor([c[1] for c in cases])
    q = sr_round_e2m1(v, rb)
    assert q.tolist() == [c[2] for c in cases]
    assert torch.signbit(q).tolist() == [c[2] < 0 or str(c[2]) == "-0.0" for c in cases]


def _quantize_sr(x, amax, seed, *, rowwise=True, columnwise=False):
    return nvfp4_quantize(
        x, amax, amax, rowwise=rowwise, columnwise=columnwise, with_rht=False, rht_sign_mask=0,
        with_2d_quantization=False, stochastic_rounding=seed is not None,
        rng_seed=None if seed is None else torch.tensor([seed], dtype=torch.int64), swizzle=False,
    )


def _deq(data, scale, amax):
    return nvfp4_dequantize(data, scale, amax, swizzled=False, dtype=torch.float32)


def test_sr_statistics():
    # TE test_nvfp4_sr_quantize.py: the mean of 50 SR draws is closer to x than RN; both directions
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    amax = x.abs().max().reshape(1)
    rn = _quantize_sr(x, amax, None, columnwise=True)
    rmse_rn = (_deq(rn[0], rn[1], amax) - x).pow(2).mean().sqrt()
    rmse_rn_t = (_deq(rn[2], rn[3], amax) - x.t()).pow(2).mean().sqrt()
    acc = torch.zeros_like(x)
    acc_t = torch.zeros_like(x.t())
    for seed in range(50):
        rd, rs, cd, cs = _quantize_sr(x, amax, seed, columnwise=True)
        acc += _deq(rd, rs, amax)
        acc_t += _deq(cd, cs, amax)
    assert (acc / 50 - x).pow(2).mean().sqrt() < rmse_rn
    assert (acc_t / 50 - x.t()).pow(2).mean().sqrt() < rmse_rn_t


def test_sr_reproducible_and_seed_dependent():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    amax = x.abs().max().reshape(1)
    a = _quantize_sr(x, amax, 7, columnwise=True)
    b = _quantize_sr(x, amax, 7, columnwise=True)
    c = _quantize_sr(x, amax, 8, columnwise=True)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[2], c[2])
    # scales do not depend on the random bits
    assert torch.equal(a[1], c[1]) and torch.equal(a[3], c[3])


def test_sr_within_one_grid_step():
    # every SR value lies within one grid step of v = x / D, D = e4m3 * amax / (6 * 448)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 5
    amax = x.abs().max().reshape(1)
    rd, rs, _, _ = _quantize_sr(x, amax, 3)
    d = rs[:32, :4].view(torch.float8_e4m3fn).float() * amax / 2688
    v = (x.reshape(32, 4, 16) / d[..., None]).reshape(32, 64)
    q = _deq(rd, rs, amax) / d.repeat_interleave(16, 1)
    a = v.abs()
    step = torch.where(a >= 4, 2.0, torch.where(a >= 2, 1.0, 0.5))
    assert ((q - v).abs() <= step * (1 + 1e-5)).all()
    # and SR really rounds both ways: some values rounded away from the RN result
    rn = _quantize_sr(x, amax, None)
    assert not torch.equal(rd, rn[0])
