"""The grouped NVFP4 GEMMs (quant_kernels.nvfp4_grouped_gemm) against the reference
(quant_core.reference.grouped_gemm): ragged, empty and one-row groups, rows read from a padded
layout, swizzled and plain scales, a group without tokens in the weight gradient.

Bitwise where the fp32 sums are exact in any order (every element a small multiple of one
power of two); elsewhere within the accumulation-order bound."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, GROUPED_LOAD_FORMS, GROUPED_LOAD_IDS, grouped_load_form
from quant_core import decoded_slices, reference
from quant_kernels import nvfp4_grouped_gemm as kern

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
QUANTIZE = {"with_rht": False, "rht_sign_mask": 0, "with_2d_quantization": False,
            "stochastic_rounding": False, "rng_seed": None}


@pytest.fixture(autouse=True, params=GROUPED_LOAD_FORMS, ids=GROUPED_LOAD_IDS)
def loads(request):
    """Every test runs each form of the kernels (as tests/kernels/test_fp8_grouped_gemm.py):
    tiles loaded by the tensor memory accelerator or by masked pointer loads, the rows kernel's
    programs column tile first or row tile first."""
    names = ("nvfp4_grouped_rows_gemm", "nvfp4_grouped_tokens_gemm")
    with grouped_load_form(names, *request.param):
        yield


def _values(grp: torch.Tensor, cols: int, seed: int, exact: bool) -> torch.Tensor:
    """``x [len(grp), cols]`` whose rows belong to the groups ``grp``, each group's values scaled
    by its own factor (so its own amax). ``exact``: E2M1 values times a power of two ``F`` per
    16x16 tile, every 16-element row and column block holding a ``±6 F`` (its diagonal), so that
    each block's E4M3 scale is ``448 F / max F`` and each decoded element an E2M1 value times
    ``448 F / max F``: all products multiples of one power of two times 49, their sums exact in
    any order. Else normal values spanning a few binades."""
    g = torch.Generator().manual_seed(seed)
    rows = grp.shape[0]
    factor = (torch.rand(int(grp.max()) + 1, generator=g) * 4 + 0.25)[grp][:, None]
    if not exact:
        v = torch.randn(rows, cols, generator=g) * torch.exp2(
            torch.randint(-3, 4, (rows, 1), generator=g).float())
        return v * factor
    sign = torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1
    v = E2M1[torch.randint(0, 8, (rows, cols), generator=g)] * sign
    diag = torch.arange(rows)[:, None] % 16 == torch.arange(cols)[None, :] % 16
    v = torch.where(diag, 6.0 * sign, v)
    tiles = torch.exp2(-torch.randint(0, 3, (-(-rows // 16), -(-cols // 16)), generator=g).float())
    return v * tiles.repeat_interleave(16, 0)[:rows].repeat_interleave(16, 1)[:, :cols] * factor


def _groups(counts) -> torch.Tensor:
    """The group of each row of groups of ``counts`` rows."""
    return torch.cat([torch.full((c,), i) for i, c in enumerate(counts)])


def _quantize(x, grp, groups: int, swizzle: bool, columnwise: bool = False):
    """``(data, scale, amax)`` of ``x``'s rows (or columns), each group with its own amax."""
    q = reference.nvfp4_group_quantize(x, grp, groups=groups, rowwise=not columnwise,
                                       columnwise=columnwise, swizzle=swizzle, **QUANTIZE)
    return (q[2], q[3], q[5]) if columnwise else (q[0], q[1], q[4])


def _swizzled(scale: torch.Tensor, swizzle: bool) -> torch.Tensor:
    return reference.swizzle_scales(scale) if swizzle else scale


def _magnitudes(data: torch.Tensor) -> torch.Tensor:
    """Packed NVFP4 data with the sign of every element cleared."""
    return data & 0x77


def _rows_operands(counts, padded: bool, swizzle: bool, exact: bool, k: int = 64, n: int = 32,
                   ends_dtype=torch.int64):
    """The arguments of the rows GEMM: ``a`` the groups' rows (each group padded to a multiple
    of 16 rows when ``padded``, else end to end) and 16 more rows never read, ``b`` one weight
    per group, quantized per group (the rows end to end: those of the padded layout)."""
    experts = len(counts)
    held = [-(-c // 16) * 16 for c in counts]
    a_rows = _groups(held + [16])
    a_rows[a_rows == experts] = experts - 1  # the rows past the groups: quantized with the last
    a, a_scale, a_amax = _quantize(_values(a_rows, k, 1, exact), a_rows, experts, False)
    if not padded:
        starts = torch.tensor([0, *held]).cumsum(0).tolist()
        keep = torch.cat([torch.arange(s, s + c)
                          for s, c in zip(starts, [*counts, 16], strict=True)])
        kept = torch.zeros_like(a_scale[:-(-keep.shape[0] // 128) * 128])  # padded to 128 rows
        kept[:keep.shape[0]] = a_scale[keep]
        a, a_scale = a[keep], kept
        held = counts
    b_rows = torch.arange(experts).repeat_interleave(n)
    b, b_scale, b_amax = _quantize(_values(b_rows, k, 2, exact), b_rows, experts, False)
    offs = torch.tensor(counts).cumsum(0).to(ends_dtype)
    a_ends = torch.tensor(held).cumsum(0).to(ends_dtype)
    return (a, _swizzled(a_scale, swizzle), a_amax, b.view(experts, n, k // 2),
            _swizzled(b_scale, swizzle), b_amax, offs, a_ends)


def _tokens_operands(counts, swizzle: bool, exact: bool, m: int = 48, n: int = 32):
    """The arguments of the tokens GEMM: the columnwise data of ``x [T, m]`` and
    ``dy [T, n]``, groups of tokens of ``counts`` (multiples of 16), quantized per group."""
    grp = _groups(counts)
    a, a_scale, a_amax = _quantize(_values(grp, m, 3, exact), grp, len(counts), swizzle, True)
    b, b_scale, b_amax = _quantize(_values(grp, n, 4, exact), grp, len(counts), swizzle, True)
    return (a, a_scale, a_amax, b, b_scale, b_amax, torch.tensor(counts).cumsum(0))


def _on_device(args):
    return tuple(t.to(DEVICE) for t in args)


@pytest.mark.parametrize("swizzle", [False, True], ids=["plain", "swizzled"])
@pytest.mark.parametrize("padded", [False, True], ids=["in_place", "padded"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_rows_gemm_matches_reference(swizzle, padded, out_dtype):
    counts = [0, 37, 1, 0, 20]
    args = _rows_operands(counts, padded, swizzle, True, ends_dtype=torch.int32)
    kw = {"total": sum(counts), "a_swizzled": swizzle, "b_swizzled": swizzle,
          "out_dtype": out_dtype}
    want = reference.nvfp4_grouped_rows_gemm(*args, **kw)
    got = kern.nvfp4_grouped_rows_gemm(*_on_device(args), **kw)
    assert torch.equal(got.cpu(), want)
    assert want.float().abs().amax(1).gt(0).sum() >= 50  # few rows are all zero


@pytest.mark.parametrize("swizzle", [False, True], ids=["plain", "swizzled"])
def test_tokens_gemm_matches_reference(swizzle):
    counts = [16, 0, 48, 96, 0]  # whole contraction chunks and partial ones
    args = _tokens_operands(counts, swizzle, True)
    kw = {"a_swizzled": swizzle, "b_swizzled": swizzle}
    want = reference.nvfp4_grouped_tokens_gemm(*args, **kw)
    got = kern.nvfp4_grouped_tokens_gemm(*_on_device(args), **kw)
    assert torch.equal(got.cpu(), want)
    assert not want[1].any() and not want[4].any()  # the groups without tokens: zeros
    assert want[0].any() and want[2].any() and want[3].any()


#: ``|got - want| / sum |a_i b_i|`` at most: fp32 sums of ``K`` exact products in another order
#: (each add rounds by at most one fp32 ulp of the running sum of magnitudes).
def _sum_bound(k: int) -> float:
    return k * 2.0**-23


def _ratio(name: str, args, kw) -> float:
    """``max |got - want| / sum |a_i b_i|`` of the GEMM ``name`` of ``args`` (the data at 0 and
    3, their magnitudes through the reference)."""
    want = getattr(reference, name)(*args, **kw).float()
    got = getattr(kern, name)(*_on_device(args), **kw).float().cpu()
    mags = getattr(reference, name)(_magnitudes(args[0]), *args[1:3], _magnitudes(args[3]),
                                    *args[4:], **{**kw, "out_dtype": torch.float32})
    ratio = float(((got - want).abs() / mags.clamp_min(2.0**-126)).max())
    print(f"{name}: max |got - want| / sum |a b|: {ratio:.3e}")
    return ratio


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_any_values_within_the_accumulation_bound(out_dtype):
    """Values of several binades: the kernels sum in another order; the results agree with the
    reference within :func:`_sum_bound` of the sum of magnitudes."""
    ulp = 2.0**-23 if out_dtype == torch.float32 else 2.0**-8
    k, counts = 128, [33, 0, 64]
    kw = {"total": sum(counts), "a_swizzled": True, "b_swizzled": True, "out_dtype": out_dtype}
    rows = _rows_operands(counts, True, True, False, k=k, n=48)
    assert _ratio("nvfp4_grouped_rows_gemm", rows, kw) <= _sum_bound(k) + ulp
    counts = [16, 0, 112]
    kw = {"a_swizzled": False, "b_swizzled": False, "out_dtype": out_dtype}
    tokens = _tokens_operands(counts, False, False)
    assert _ratio("nvfp4_grouped_tokens_gemm", tokens, kw) <= _sum_bound(max(counts)) + ulp


def test_empty_problems():
    experts = 3
    ones = torch.ones(experts).to(DEVICE)
    offs = torch.zeros(experts, dtype=torch.int64).to(DEVICE)
    b = torch.zeros((experts, 16, 16), dtype=torch.uint8).to(DEVICE)
    b_scale = torch.full((48, 2), 0x38, dtype=torch.uint8).to(DEVICE)
    a = torch.zeros((0, 16), dtype=torch.uint8).to(DEVICE)
    a_scale = torch.zeros((0, 2), dtype=torch.uint8).to(DEVICE)
    kw = {"a_swizzled": False, "b_swizzled": False}
    out = kern.nvfp4_grouped_rows_gemm(a, a_scale, ones, b, b_scale, ones, offs, offs, total=0,
                                       **kw)
    assert out.shape == (0, 16)
    no_tokens = torch.zeros((8, 0), dtype=torch.uint8).to(DEVICE)
    no_scales = torch.zeros((8, 0), dtype=torch.uint8).to(DEVICE)
    out = kern.nvfp4_grouped_tokens_gemm(no_tokens, no_scales, ones, no_tokens[:4],
                                         no_scales[:4], ones, offs, **kw)
    assert out.shape == (experts, 8, 4) and not out.any()


def test_argument_errors():
    a = torch.zeros((4, 16), dtype=torch.uint8)
    a_scale = torch.zeros((4, 2), dtype=torch.uint8)
    b = torch.zeros((2, 16, 16), dtype=torch.uint8)
    b_scale = torch.zeros((32, 2), dtype=torch.uint8)
    amax, offs = torch.ones(2), torch.tensor([2, 4])
    kw = {"total": 4, "a_swizzled": False, "b_swizzled": False}
    rows = kern.nvfp4_grouped_rows_gemm
    with pytest.raises(TypeError, match="a must be packed uint8 NVFP4 data"):
        rows(a.float(), a_scale, amax, b, b_scale, amax, offs, offs, **kw)
    with pytest.raises(TypeError, match=r"b_scale must be b's uint8 E4M3 block scales, at least"):
        rows(a, a_scale, amax, b, b_scale[:16], amax, offs, offs, **kw)
    with pytest.raises(TypeError, match=r"a_scale must be a's uint8 E4M3 block scales, swizzled"):
        rows(a, a_scale, amax, b, b_scale, amax, offs, offs, **{**kw, "a_swizzled": True})
    with pytest.raises(TypeError, match=r"b_amax must be an fp32 \[2\] tensor"):
        rows(a, a_scale, amax, b, b_scale, amax.double(), offs, offs, **kw)
    with pytest.raises(TypeError, match=r"a_amax must be an fp32 \[2\] tensor"):
        rows(a, a_scale, amax[:1], b, b_scale, amax, offs, offs, **kw)
    with pytest.raises(TypeError, match="a_ends must be a 1D int32/int64"):
        rows(a, a_scale, amax, b, b_scale, amax, offs, offs.float(), **kw)
    with pytest.raises(ValueError, match="same K/2"):
        rows(a, a_scale, amax, b[:, :, :8].contiguous(), b_scale, amax, offs, offs, **kw)
    with pytest.raises(ValueError, match="one entry per group"):
        rows(a, a_scale, amax, b, b_scale, amax, offs[:1], offs, **kw)
    with pytest.raises(ValueError, match="out_dtype|dtype"):
        rows(a, a_scale, amax, b, b_scale, amax, offs, offs, **{**kw, "out_dtype": torch.int8})
    with pytest.raises(ValueError, match="same C/2"):
        kern.nvfp4_grouped_tokens_gemm(a, a_scale, amax, a[:, :8].contiguous(), a_scale, amax,
                                       offs, a_swizzled=False, b_swizzled=False)


@pytest.mark.parametrize("swizzle", [False, True], ids=["plain", "swizzled"])
def test_rows_gemm_in_column_slices(monkeypatch, swizzle):
    """Experts past twice ``DECODED_SLICE_BYTES`` decoded are decoded and multiplied a slice of
    output columns at a time (plain scales; swizzled ones whole): the reference's bytes, with a
    last slice narrower than the others, and the bytes of one launch for any values."""
    counts = [0, 37, 1, 0, 20]
    args = _rows_operands(counts, False, swizzle, True, n=320, ends_dtype=torch.int32)
    kw = {"total": sum(counts), "a_swizzled": swizzle, "b_swizzled": swizzle}
    want = reference.nvfp4_grouped_rows_gemm(*args, **kw)
    width = 4 if DEVICE == "cpu" else 2  # decoded bytes per element: fp32 interpreted, bf16
    # 128 decoded columns of the 5 experts' 64-element rows a slice: 3 slices of 320 columns
    monkeypatch.setattr(decoded_slices, "DECODED_SLICE_BYTES", len(counts) * 64 * width * 128)
    launches = []
    real = kern.rows_gemm
    monkeypatch.setattr(kern, "rows_gemm", lambda *a, **k: launches.append(a[2].shape) or
                        real(*a, **k))
    got = kern.nvfp4_grouped_rows_gemm(*_on_device(args), **kw)
    assert torch.equal(got.cpu(), want)
    assert launches == ([(5, 320, 64)] if swizzle else
                        [(5, 128, 64), (5, 128, 64), (5, 64, 64)])
    # any values: each output element the same sum in the same order as in one launch
    args = _on_device(_rows_operands(counts, False, swizzle, False, n=320))
    sliced = kern.nvfp4_grouped_rows_gemm(*args, **kw)
    monkeypatch.setattr(decoded_slices, "DECODED_SLICE_BYTES", 2**40)
    assert torch.equal(sliced, kern.nvfp4_grouped_rows_gemm(*args, **kw))
