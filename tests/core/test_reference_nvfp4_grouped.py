"""Per-group NVFP4 (``reference.nvfp4_group_quantize``) and the NVFP4 grouped GEMMs
(``reference.nvfp4_grouped_rows_gemm`` / ``_tokens_gemm``) against one ``nvfp4_quantize`` /
``nvfp4_gemm`` call per group: each group's bytes and amaxes are those of quantizing its rows
alone; each group's product that of the dense GEMM of its operands."""

from __future__ import annotations

import pytest
import torch
from quant_core import reference, shapes
from quant_core.reference.rht import signs_to_mask

COUNTS = (32, 0, 16, 48)  # padded groups (multiples of 16), one empty
K = 64
MASK = signs_to_mask([1, -1] * 8)


def _rows(counts=COUNTS, k=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x[3, 5] = float("nan")
    x[40, 7] = float("inf")
    x[50] = 0.0  # a planted zero row
    grp = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return x.to(torch.bfloat16), grp.to(torch.int32)


def _unswizzled(scale, rows, cols):
    return scale[:rows, :cols]


MODES = [dict(with_rht=False, with_2d_quantization=False),
         dict(with_rht=True, with_2d_quantization=False),
         dict(with_rht=False, with_2d_quantization=True)]


@pytest.mark.parametrize("mode", MODES, ids=["1x16", "rht", "2d"])
@pytest.mark.parametrize("swizzle", [False, True])
def test_each_group_quantizes_as_its_rows_alone(mode, swizzle):
    x, grp = _rows()
    kw = dict(rowwise=True, columnwise=True, rht_sign_mask=MASK, stochastic_rounding=False,
              rng_seed=None, **mode)
    rd, rs, cd, cs, ar, ac = reference.nvfp4_group_quantize(
        x, grp, groups=len(COUNTS), swizzle=swizzle, **kw)
    m = x.shape[0]
    rs, cs = (reference.unswizzle_scales(s) for s in (rs, cs)) if swizzle else (rs, cs)
    assert rd.shape == (m, K // 2) and cd.shape == (K, m // 2)
    assert rs.shape == shapes.nvfp4_rowwise_scale_shape(m, K)
    assert cs.shape == shapes.nvfp4_columnwise_scale_shape(m, K)
    start = 0
    for g, c in enumerate(COUNTS):
        if c == 0:
            assert ar[g] == 0 and ac[g] == 0
            continue
        xg = x[start:start + c]
        want_r, want_c = reference.nvfp4_amax(xg, rowwise=True, columnwise=True,
                                              with_rht=mode["with_rht"], rht_sign_mask=MASK)
        assert torch.equal(ar[g:g + 1], want_r) and torch.equal(ac[g:g + 1], want_c)
        wr, ws, wc, wcs = reference.nvfp4_quantize(xg, want_r, want_c, swizzle=False, **kw)
        assert torch.equal(rd[start:start + c], wr)
        assert torch.equal(rs[start:start + c, :K // 16], ws[:c, :K // 16])
        assert torch.equal(cd[:, start // 2:(start + c) // 2], wc)
        assert torch.equal(cs[:K, start // 16:(start + c) // 16], wcs[:K, :c // 16])
        start += c
    assert torch.all(rs[m:] == 0) and torch.all(rs[:, K // 16:] == 0)


def test_stochastic_rounding_numbers_the_whole_tensor():
    """With stochastic rounding the bytes are those of one call over ``x`` whose every group has
    the same amax (one stream, numbered as the dense quantize numbers it)."""
    x, grp = _rows()
    x = torch.nan_to_num(x.float(), posinf=0.0).to(torch.bfloat16)
    flat = torch.zeros_like(grp)  # one group: the dense call
    seed = torch.tensor([1234], dtype=torch.int64)
    kw = dict(rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=MASK,
              with_2d_quantization=False, stochastic_rounding=True, rng_seed=seed,
              swizzle=False)
    *got, ar, ac = reference.nvfp4_group_quantize(x, flat, groups=1, **kw)
    amax = reference.nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=True,
                                rht_sign_mask=MASK)
    want = reference.nvfp4_quantize(x, *amax, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(ar, amax[0]) and torch.equal(ac, amax[1])


def test_refuses_what_no_group_layout_gives():
    x, grp = _rows()
    kw = dict(rowwise=True, columnwise=False, with_rht=False, rht_sign_mask=0,
              with_2d_quantization=False, stochastic_rounding=False, rng_seed=None,
              swizzle=False)
    with pytest.raises(ValueError, match="whole 16-row blocks"):
        reference.nvfp4_group_quantize(x[:20], grp[:20], groups=4, **kw)
    with pytest.raises(ValueError, match="grp must be an int32/int64"):
        reference.nvfp4_group_quantize(x, grp[:-16], groups=4, **kw)
    with pytest.raises(ValueError, match="RHT and 2D|exclusive"):
        reference.nvfp4_group_quantize(x, grp, groups=4, **{**kw, "with_rht": True,
                                                              "with_2d_quantization": True})


def _quantized(t, grp, groups, rowwise, columnwise, rht=False):
    return reference.nvfp4_group_quantize(
        t, grp, groups=groups, rowwise=rowwise, columnwise=columnwise, with_rht=rht,
        rht_sign_mask=MASK, with_2d_quantization=False, stochastic_rounding=False,
        rng_seed=None, swizzle=False)


def test_grouped_gemms_are_each_groups_dense_gemm():
    x, grp = _rows()
    x = torch.nan_to_num(x.float(), nan=0.0, posinf=1.0).to(torch.bfloat16)
    e, n = len(COUNTS), 32
    w = torch.randn(e * n, K).to(torch.bfloat16)
    wgrp = torch.arange(e).repeat_interleave(n)
    xd, xs, *_, xa, _ = _quantized(x, grp, e, True, False)
    wd, ws, *_, wa, _ = _quantized(w, wgrp, e, True, False)
    ends = torch.tensor(COUNTS).cumsum(0)
    counts = [c - 3 if c else 0 for c in COUNTS]  # fewer rows than the padded groups
    offs = torch.tensor(counts).cumsum(0)
    y = reference.nvfp4_grouped_rows_gemm(xd, xs, xa, wd.view(e, n, K // 2), ws, wa, offs, ends,
                                          total=sum(counts), a_swizzled=False, b_swizzled=False)
    gy = torch.randn(x.shape[0], n).to(torch.bfloat16)
    *_, gc, gcs, _, ga = _quantized(gy, grp, e, False, True, rht=True)
    *_, xc, xcs, _, xca = _quantized(x, grp, e, False, True, rht=True)
    dw = reference.nvfp4_grouped_tokens_gemm(gc, gcs, ga, xc, xcs, xca, ends,
                                             a_swizzled=False, b_swizzled=False)
    start = row = 0
    for g, (c, cnt) in enumerate(zip(COUNTS, counts, strict=True)):
        sl, wl = slice(start, start + c), slice(g * n, (g + 1) * n)
        want = reference.nvfp4_gemm(xd[sl], xs[sl], xa[g:g + 1], wd[wl], ws[wl], wa[g:g + 1],
                                    a_swizzled=False, b_swizzled=False, bias=None,
                                    out_dtype=torch.bfloat16)
        assert torch.equal(y[row:row + cnt], want[:cnt])
        cols = slice(start // 2, (start + c) // 2)
        want_dw = reference.nvfp4_gemm(
            gc[:, cols], gcs[:, start // 16:(start + c) // 16], ga[g:g + 1], xc[:, cols],
            xcs[:, start // 16:(start + c) // 16], xca[g:g + 1], a_swizzled=False,
            b_swizzled=False, bias=None, out_dtype=torch.bfloat16)
        assert torch.equal(dw[g], want_dw)
        start += c
        row += cnt
