"""NVFP4 4over6 (numerics.md §7.9): hand-derived goldens and a scalar oracle.

The oracle restates the rule element by element in double arithmetic rounded to fp32 at every
step (``_oracles.f32``), with its own E2M1 and E4M3 rounding; it shares no code with the
reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from _oracles import f32, fp8_value
from quant_core import DType
from quant_core.reference import nvfp4_4over6_quantize

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FLT_MAX = 3.4028234663852886e38


def _quantize(x, **kw):
    opts = dict(rowwise=True, columnwise=False, with_2d_quantization=False, e4m3_max=256,
                err_mode="MAE", swizzle=False)
    opts.update(kw)
    amax = x.abs().amax().reshape(1).to(torch.float32)
    return nvfp4_4over6_quantize(x, amax, amax, **opts)


def _codes(data: torch.Tensor) -> list[list[int]]:
    b = data.to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(data.shape[0], -1).tolist()


# ------------------------------------------------------------------------ hand-derived goldens
def test_a_block_whose_values_sit_on_the_map_to_4_grid_takes_the_1_5x_scale():
    """amax 4, bound 256: S_enc = 1536/4 = 384, base = fp32(4/6) * 384 = 256. Map-to-6 scales
    by e4m3(256) (0x78), encoding 3 as fp32(3 * 1.5) = 4.5 -> 4 (decodes to 2.667, error 1/3);
    map-to-4 scales by e4m3(384) (0x7C), encoding 4 and 3 exactly (4 -> code 6, 3 -> code 5)."""
    x = torch.tensor([[4.0] + [3.0] * 15])
    data, scale, _, _ = _quantize(x)
    assert scale[0, 0].item() == 0x7C
    assert data[0].tolist() == [0x56] + [0x55] * 7


def test_a_tie_keeps_map_to_6():
    """[4, 2, ...]: both candidates are exact (map-to-6: 4 -> 6, 2 -> 3; map-to-4: 4 -> 4,
    2 -> 2), so the errors tie at 0 and the block keeps map-to-6 (e4m3(256) = 0x78)."""
    x = torch.tensor([[4.0] + [2.0] * 15])
    data, scale, _, _ = _quantize(x)
    assert scale[0, 0].item() == 0x78
    assert data[0].tolist() == [0x57] + [0x55] * 7


def test_bad_bound_and_error_mode_are_refused_by_name():
    x = torch.ones(1, 16)
    with pytest.raises(ValueError, match="nvfp4_e4m3_max must be one of"):
        _quantize(x, e4m3_max=300)
    with pytest.raises(ValueError, match="nvfp4_4over6_err_mode must be one of"):
        _quantize(x, err_mode="mae")


# ------------------------------------------------------------------------------- the oracle
def _e2m1(v: float) -> float:
    """RNE onto the E2M1 grid, saturating at 6 (ties to the even code)."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1_GRID[i] - a), i % 2))
    return math.copysign(E2M1_GRID[best], v)


def _candidate(xs, base, s_dec, factor, amax, bound, mode):
    sf = fp8_value(min(f32(base * factor), 448.0), DType.E4M3)
    enc = min(f32(1.0 / f32(sf * s_dec)), FLT_MAX) if sf else FLT_MAX
    qs = [_e2m1(max(-6.0, min(6.0, f32(x * enc)))) for x in xs]
    err = 0.0
    for x, q in zip(xs, qs, strict=True):
        d = f32(f32(f32(f32(q * sf) * amax) / f32(6.0 * bound)) - x)
        err = f32(err + (f32(d * d) if mode == "MSE" else abs(d)))
    return sf, qs, err


def _oracle_row(rows, amax, bound, mode, tile):
    """Expected (scale values, decoded codes) of ``rows`` (lists of fp32 values, one block of 16
    per 16 columns; ``tile`` rows share one block amax and one choice)."""
    s_enc = min(f32(f32(6.0 * bound) / amax), FLT_MAX)
    s_dec = f32(1.0 / s_enc)
    scales = [[None] * (len(rows[0]) // 16) for _ in rows]
    values = [[None] * len(rows[0]) for _ in rows]
    for r0 in range(0, len(rows), tile):
        for b in range(len(rows[0]) // 16):
            blocks = [rows[r][16 * b:16 * b + 16] for r in range(r0, r0 + tile)]
            block_amax = max(abs(v) for blk in blocks for v in blk)
            base = f32(f32(block_amax / 6.0) * s_enc)
            cands = {f: [_candidate(blk, base, s_dec, f, amax, bound, mode) for blk in blocks]
                     for f in (1.5, 1.0)}
            errs = {f: [c[2] for c in cands[f]] for f in cands}
            if tile == 16:  # the rows' tree sum: r + 8, r + 4, r + 2, r + 1
                for f in errs:
                    e = errs[f]
                    for half in (8, 4, 2, 1):
                        e = [f32(e[i] + e[i + half]) for i in range(half)]
                    errs[f] = e
                pick = 1.5 if errs[1.5][0] < errs[1.0][0] else 1.0
                picks = [pick] * tile
            else:
                picks = [1.5 if errs[1.5][0] < errs[1.0][0] else 1.0]
            for i, pick in enumerate(picks):
                sf, qs, _ = cands[pick][i]
                scales[r0 + i][b] = sf
                values[r0 + i][16 * b:16 * b + 16] = qs
    return scales, values


def _check(data, scale, rows, amax, bound, mode, tile):
    scales, values = _oracle_row(rows, amax, bound, mode, tile)
    n = len(rows)
    got_scales = scale[:n, :len(scales[0])].view(torch.float8_e4m3fn).to(torch.float32).tolist()
    assert got_scales == scales
    got = [[E2M1_GRID[c & 7] * (-1 if c & 8 else 1) for c in row] for row in _codes(data)]
    assert got == values


@pytest.mark.parametrize("mode", ["MAE", "MSE"])
@pytest.mark.parametrize("bound", [256, 448])
@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_rowwise_and_columnwise_equal_the_oracle(mode, bound, two_d):
    g = torch.Generator().manual_seed(7 + bound + 2 * two_d)
    # heavy-tailed rows so that both candidates win some blocks
    x = (torch.randn(32, 48, generator=g) * torch.rand(32, 1, generator=g).pow(3) * 8)
    x = x.to(torch.bfloat16).to(torch.float32)
    amax = x.abs().amax().item()
    row_data, row_scale, col_data, col_scale = _quantize(
        x, columnwise=True, with_2d_quantization=two_d, e4m3_max=bound, err_mode=mode)
    tile = 16 if two_d else 1
    _check(row_data, row_scale, x.tolist(), amax, bound, mode, tile)
    _check(col_data, col_scale, x.t().tolist(), amax, bound, mode, tile)


def test_both_candidates_are_taken_on_the_oracle_inputs():
    """The oracle test's inputs exercise both branches: some blocks take the 1.5x scale."""
    g = torch.Generator().manual_seed(7 + 256)
    x = (torch.randn(32, 48, generator=g) * torch.rand(32, 1, generator=g).pow(3) * 8)
    x = x.to(torch.bfloat16).to(torch.float32)
    amax = x.abs().amax().item()
    scales, _ = _oracle_row(x.tolist(), amax, 256, "MAE", 1)
    s_enc = f32(1536.0 / amax)
    map4 = 0
    for r, row in enumerate(x.tolist()):
        for b in range(3):
            base = f32(f32(max(abs(v) for v in row[16 * b:16 * b + 16]) / 6.0) * s_enc)
            map4 += scales[r][b] != fp8_value(min(base, 448.0), DType.E4M3)
    assert 0 < map4 < 32 * 3
