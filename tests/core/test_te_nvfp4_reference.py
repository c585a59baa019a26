"""quant's NVFP4 reference against TransformerEngine's own pure-PyTorch reference
(``_te_nvfp4_ref``, vendored with its licence and commit id): the same bytes for the standard
rule, 4over6 (both bounds, both error metrics, 1x16 and 16x16) and row-scaled NVFP4 (with and
without 4over6), rowwise and, where the variant has one, columnwise, on finite inputs with
ragged shapes and planted specials.

TE's reference pads a direction to whole tiles, takes the amax with ``torch.max`` (so only
finite inputs are compared: quant drops NaN, TE's reference propagates it) and returns E4M3
scale tensors unpadded; the comparison reads quant's scales over the same rows and blocks.

One difference is documented and kept (numerics.md §7.4): a negative element whose scaled value
is -0.0 (the input -0.0, or a negative value that underflows when scaled) encodes to E2M1 code
0x8 here, as the hardware's conversion does, and to 0x0 in TE's Python reference; both decode to
zero. The comparison accepts exactly that difference: code 0x8 against 0x0 at a negative input.
"""

from __future__ import annotations

import pytest
import torch
from _te_nvfp4_ref import NVFP4QuantizerRef as TE
from quant_core import reference
from quant_core.shapes import ceil_div

BLOCK = 16


def te_direction(v: torch.Tensor, *, tile_rows: int, row_scaled: bool, four_over_six: bool,
                 e4m3_max: int, err_mode: str):
    """TE's packed data, E4M3 scale bytes and amax for ``v`` quantized along its rows, as TE's
    ``NVFP4QuantizerRef._quantize`` drives ``_quantize_blockwise_reference``."""
    if row_scaled:
        amax = torch.max(torch.abs(v), dim=1).values.to(torch.float32)
    else:
        amax = torch.max(torch.abs(v)).to(torch.float32).view(1)
    m, n = v.shape
    padded = TE._pad_tensor(v, row_divisor=tile_rows, col_divisor=BLOCK)
    data, scale = TE._quantize_blockwise_reference(
        padded, amax, BLOCK, tile_rows, pow_2_scales=False, row_scaled_nvfp4=row_scaled,
        nvfp4_use_4over6=four_over_six, nvfp4_e4m3_max=e4m3_max,
        nvfp4_4over6_err_mode=err_mode, eps=0.0,
    )
    return TE._rm_pad_tensor(data, (m, ceil_div(n, 2))), scale.view(torch.uint8)[:m], amax, v


def codes(data: torch.Tensor, n: int) -> torch.Tensor:
    """The E2M1 codes ``[R, n]`` of packed bytes (low nibble first)."""
    b = data.to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)[:, :n]

def quant_both(x: torch.Tensor, *, two_d: bool, row_scaled: bool, four_over_six: bool,
               e4m3_max: int, err_mode: str):
    columnwise = not row_scaled
    amax_r, amax_c = reference.nvfp4_amax(x, rowwise=True, columnwise=columnwise,
                                          with_rht=False, rht_sign_mask=0,
                                          row_scaled=row_scaled)
    out = reference.nvfp4_quantize(
        x, amax_r, amax_c, rowwise=True, columnwise=columnwise, with_rht=False,
        rht_sign_mask=0, with_2d_quantization=two_d, stochastic_rounding=False, rng_seed=None,
        swizzle=False, four_over_six=four_over_six, e4m3_max=e4m3_max, err_mode=err_mode,
        row_scaled=row_scaled,
    )
    return out, amax_r, amax_c


def assert_same(te, data, scale, amax):
    te_data, te_scale, te_amax, v = te
    rows, blocks = te_scale.shape
    assert torch.equal(amax, te_amax)
    assert torch.equal(scale[:rows, :blocks], te_scale)
    q, t = codes(data, v.shape[1]), codes(te_data, v.shape[1])
    kept_sign = (q == 8) & (t == 0) & torch.signbit(v)
    assert torch.equal(torch.where(kept_sign, t, q), t)


def inputs(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Normals of mixed magnitudes per row (so row-scaled amaxes differ by orders of
    magnitude), with planted finite specials: a zero row, a zero block, +-0.0, the largest
    bf16-representable magnitudes of the row and values on the E2M1 grid and its midpoints."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 6, m)[:, None]
    if m > 2:
        x[1] = 0.0
        x[2, :BLOCK] = 0.0
        x[2, BLOCK - 1] = -0.0
        x[2, BLOCK + 1] = -0.0
    if m > 4:
        x[3, : min(k, 8)] = torch.tensor([6.0, 3.0, 2.5, 1.75, 0.75, 0.25, -5.0, -3.5])[: min(k, 8)]
        x[4, 0] = 3.0e38
    return x.to(dtype)


SHAPES = [(1, 16), (17, 48), (40, 64), (64, 32)]
FOUR_OVER_SIX = [(256, "MAE"), (256, "MSE"), (448, "MAE"), (448, "MSE")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_standard_rule_equals_te(m, k, two_d, dtype):
    x = inputs(m, k, 1, dtype)
    opts = dict(row_scaled=False, four_over_six=False, e4m3_max=448, err_mode="MAE")
    (rd, rs, cd, cs), amax_r, amax_c = quant_both(x, two_d=two_d, **opts)
    tile = BLOCK if two_d else 1
    assert_same(te_direction(x, tile_rows=tile, **opts), rd, rs, amax_r)
    assert_same(te_direction(x.t().contiguous(), tile_rows=tile, **opts), cd, cs, amax_c)


@pytest.mark.parametrize("bound,err_mode", FOUR_OVER_SIX)
@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_4over6_equals_te(m, k, two_d, bound, err_mode):
    x = inputs(m, k, 2, torch.bfloat16)
    opts = dict(row_scaled=False, four_over_six=True, e4m3_max=bound, err_mode=err_mode)
    (rd, rs, cd, cs), amax_r, amax_c = quant_both(x, two_d=two_d, **opts)
    tile = BLOCK if two_d else 1
    assert_same(te_direction(x, tile_rows=tile, **opts), rd, rs, amax_r)
    assert_same(te_direction(x.t().contiguous(), tile_rows=tile, **opts), cd, cs, amax_c)


@pytest.mark.parametrize("variant", [None, *FOUR_OVER_SIX],
                         ids=["standard", *(f"4over6-{b}-{e}" for b, e in FOUR_OVER_SIX)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m,k", SHAPES)
def test_row_scaled_equals_te(m, k, dtype, variant):
    x = inputs(m, k, 3, dtype)
    bound, err_mode = variant or (448, "MAE")
    opts = dict(row_scaled=True, four_over_six=variant is not None, e4m3_max=bound,
                err_mode=err_mode)
    (rd, rs, cd, cs), amax_r, amax_c = quant_both(x, two_d=False, **opts)
    assert cd is None and cs is None and amax_c is None
    assert amax_r.shape == (m,)
    assert_same(te_direction(x, tile_rows=1, **opts), rd, rs, amax_r)


def test_row_scaled_rows_are_independent():
    """Each row of a row-scaled tensor quantizes as that row alone would (its own S_enc),
    which a per-tensor amax does not: the property that makes the variant worth having."""
    x = inputs(8, 32, 4, torch.bfloat16)
    (rd, rs, _, _), amax, _ = quant_both(x, two_d=False, row_scaled=True, four_over_six=False,
                                         e4m3_max=448, err_mode="MAE")
    for i in range(x.shape[0]):
        (rdi, rsi, _, _), ai, _ = quant_both(x[i:i + 1], two_d=False, row_scaled=False,
                                             four_over_six=False, e4m3_max=448, err_mode="MAE")
        assert torch.equal(rd[i:i + 1], rdi) and torch.equal(rs[i, :2], rsi[0, :2])
        assert torch.equal(amax[i:i + 1], ai)
    (pd, _, _, _), _, _ = quant_both(x, two_d=False, row_scaled=False, four_over_six=False,
                                     e4m3_max=448, err_mode="MAE")
    assert not torch.equal(pd, rd)
