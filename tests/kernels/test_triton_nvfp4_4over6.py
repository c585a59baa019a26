"""NVFP4 4over6 (`numerics.md` §7.9): the Triton kernels against the reference, bitwise, for both
bounds, both error metrics, 1x16 blocks and 16x16 tiles, both directions, swizzled or not; plus
special values, planted E2M1 ties, a zero amax, tiny amaxes and the tie rule (equal errors keep
map-to-6). Under the interpreter the tests marked with ``division`` also run the GPU's division
by FMAs, with a fused fma (``_exact_fma``)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from _exact_fma import gpu_fma_paths
from _kernels_util import DEVICE, INTERPRET, assert_all_same, assert_same, make_input
from quant_core import reference as ref
from quant_core.reference.nvfp4 import blocks_amax, global_encode_scale
from quant_core.reference.nvfp4_4over6 import _block_errors, _candidate, _tile_errors
from quant_kernels.backend import BACKEND as B

NAMES = ("row_data", "row_scale", "col_data", "col_scale")
BASE = dict(rowwise=True, columnwise=True, with_rht=False, rht_sign_mask=0,
            stochastic_rounding=False, rng_seed=None, four_over_six=True)


def _opts(two_d: bool, bound: int, err_mode: str, swizzle: bool = False) -> dict:
    return dict(BASE, with_2d_quantization=two_d, e4m3_max=bound, err_mode=err_mode,
                swizzle=swizzle)


def _check(x: torch.Tensor, amax: torch.Tensor, kw: dict, dequant: bool = False) -> tuple:
    """The backend's buffers on DEVICE equal the reference's on the CPU; with ``dequant`` the
    rowwise data also dequantizes to the reference's values."""
    got = B.nvfp4_quantize(x.to(DEVICE), amax.to(DEVICE), amax.to(DEVICE), **kw)
    want = ref.nvfp4_quantize(x, amax, amax, **kw)
    assert_all_same(got, want, None, NAMES)
    if dequant:
        dkw = dict(swizzled=kw["swizzle"], dtype=x.dtype, e4m3_max=kw["e4m3_max"])
        assert_same(B.nvfp4_dequantize(got[0], got[1], amax.to(DEVICE), **dkw),
                    ref.nvfp4_dequantize(want[0], want[1], amax, **dkw))
    return want


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    """The amax over the finite elements (an Inf element would make every error NaN)."""
    f = x.float()
    return f.masked_fill(~torch.isfinite(f), 0.0).abs().amax().reshape(1)


@pytest.fixture(params=["divide", "fma"])
def division(request, monkeypatch) -> str:
    """How the kernels divide an error by ``6E``: ``div_rn`` (the interpreter's path) or FMAs
    (the GPU's ``div_rn_by``; emulated under the interpreter). A GPU runs only its own."""
    if request.param == "fma" and INTERPRET:
        gpu_fma_paths(monkeypatch)
    elif request.param == "divide" and not INTERPRET:
        pytest.skip("a GPU divides with FMAs")
    return request.param


CASES = [((1, 16), torch.float32), ((17, 48), torch.float16), ((40, 64), torch.bfloat16)]


@pytest.mark.parametrize("bound", [256, 448])
@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("shape,dtype", CASES, ids=lambda c: str(c))
def test_4over6_equals_the_reference(shape, dtype, two_d, bound, division):
    """Random rows over 16 binades (so both candidates win somewhere), ragged M, the dtype's
    ±max planted; both metrics, one swizzled, and the rowwise dequantization."""
    x = make_input(*shape, torch.float32, seed=shape[0], specials=False).to(dtype)
    if shape[0] >= 2:
        big = torch.finfo(dtype).max
        x[1, :2] = torch.tensor([big, -big], dtype=dtype)
    amax = ref.nvfp4_amax(x, rowwise=True, columnwise=False, with_rht=False, rht_sign_mask=0)[0]
    for err_mode, swizzle in (("MAE", False), ("MSE", True)):
        _check(x, amax, _opts(two_d, bound, err_mode, swizzle), dequant=True)


def test_4over6_picks_both_candidates():
    """The worked example of §7.9 (amax 4, bound 256): a block [4, 3, 3, ...] takes map-to-4
    (byte 0x7C, codes 6, 5, 5, ...); [4, 2, 2, ...] is exact both ways and keeps map-to-6
    (0x78)."""
    x = torch.tensor([[4.0] + [3.0] * 15, [4.0] + [2.0] * 15])
    got = _check(x, torch.tensor([4.0]), _opts(False, 256, "MAE"))
    assert got[1][:2, 0].tolist() == [0x7C, 0x78]
    assert got[0][0, :2].tolist() == [0x56, 0x55]  # codes 6 | 5 << 4, then 5 | 5 << 4


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_4over6_special_values(two_d):
    """NaN, ±Inf, -0.0, subnormals, values past the FP8 maxima, all-zero and all-NaN blocks;
    with the tensor amax (Inf), the amax of the finite elements, 0 and NaN."""
    x = make_input(40, 64, torch.float32, seed=11)
    x[3, :2] = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max])
    true = ref.nvfp4_amax(x, rowwise=True, columnwise=False, with_rht=False, rht_sign_mask=0)[0]
    assert true.item() == float("inf")
    bound, mode = (256, "MSE") if two_d else (448, "MAE")
    for amax in (true, _finite_amax(x), torch.zeros(1), torch.full((1,), float("nan"))):
        _check(x, amax, _opts(two_d, bound, mode, swizzle=two_d))


#: Under amax 6 and bound 256 a block of amax 6 has map-to-6 scale 256 and enc 1 exactly, so
#: its values are scaled onto E2M1's ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
#: 3.5 -> 4, 5 -> 4 (and negated).
E2M1_TIES = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
             -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]


@pytest.mark.parametrize("bound", [256, 448])
@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_4over6_planted_blocks(two_d, bound):
    """E2M1 ties, an all-zero and an all -0.0 block, a ±amax block, a tiny block (scale byte 0)
    and one of E4M3-subnormal scale, in both directions (the columnwise blocks are the columns
    of the planted rows' transposes)."""
    x = make_input(33, 48, torch.float32, seed=5, specials=False)
    x[0, :16] = torch.tensor(E2M1_TIES)
    x[1, :16] = 0.0
    x[1, 16:32] = -0.0
    x[2, :16] = torch.tensor([6.0, -6.0] * 8)
    x[3, 16:32] = 1e-30
    x[4, 32:48] = 2e-3
    x[16:32, 0] = torch.tensor(E2M1_TIES)  # a columnwise block of ties
    x = x.clamp(-6.0, 6.0)
    for mode in ("MAE", "MSE"):
        _check(x, torch.tensor([6.0]), _opts(two_d, bound, mode, swizzle=mode == "MSE"))


def test_4over6_zero_amax():
    """An amax of 0 gives S_enc = 1; every element's error is then |x| (or x²) for both
    candidates, a tie, so map-to-6 is kept. Also an all-zero tensor, and an empty one."""
    x = make_input(17, 32, torch.float32, seed=3, specials=False)
    for two_d in (False, True):
        _check(x, torch.zeros(1), _opts(two_d, 256, "MAE"))
    _check(torch.zeros(20, 32), torch.zeros(1), _opts(True, 448, "MSE", swizzle=True))
    _check(torch.zeros(0, 32), torch.zeros(1), _opts(False, 256, "MAE"))


#: Blocks (amax 4, bound 256) whose two candidates have equal, non-zero errors under the metric
#: (found by a search over quarter-step values; the test re-derives the tie).
TIE_BLOCKS = {
    "MAE": [4.0, 2.5, 3.75, -2.0, 2.25, -0.75, -1.5, -2.75, 0.5, -2.5, 1.0, 3.0, -2.25, 2.0, -1.0,
            3.25],
    "MSE": [4.0, 3.75, 1.0, -2.0, -2.25, 1.25, 2.25, -2.75, 1.0, -3.0, 0.5, -2.25, 0.5, -0.25,
            1.75, -3.5],
}


def _candidates_and_errors(v: torch.Tensor, amax: torch.Tensor, err_mode: str, two_d: bool):
    """The reference's two candidates of the rows of ``v`` [16, 16]: (byte, error) of map-to-4,
    then of map-to-6 (per row, or per tile)."""
    s_enc = global_encode_scale(amax, 256)
    base = blocks_amax(v, 16 if two_d else 1) / 6.0 * s_enc
    out = []
    for factor in (1.5, 1.0):
        e4m3, codes = _candidate(v, base, 1.0 / s_enc, factor)
        err = _block_errors(v, e4m3, codes, amax, 256, err_mode)
        out.append((e4m3, _tile_errors(err) if two_d else err))
    return out


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("err_mode", ["MAE", "MSE"])
def test_4over6_tie_keeps_map_to_6(err_mode, two_d):
    """16 rows of a block whose candidates' errors tie (per block, and so per tile, whose tree
    sums add equal terms): the kernels keep map-to-6's byte in both directions (the columnwise
    one quantizes the transpose of ``x.t()``, i.e. the same blocks)."""
    v = torch.tensor(TIE_BLOCKS[err_mode]).repeat(16, 1)
    amax = torch.tensor([4.0])
    (b4, e4), (b6, e6) = _candidates_and_errors(v, amax, err_mode, two_d)
    assert torch.equal(e4, e6) and (e6 > 0).all(), "the errors really tie"
    assert (b4 != b6).all(), "and the candidates differ"
    got = _check(v, amax, _opts(two_d, 256, err_mode))
    assert torch.equal(got[1][:16, :1], b6)
    got_t = _check(v.t().contiguous(), amax, _opts(two_d, 256, err_mode))
    assert torch.equal(got_t[3][:16, :1], b6)


#: Tie blocks scaled by ``c = 1 + j * 2^-23`` (amax ``4c``, bound 256) fall within rounding of a
#: tie, so the order of the fp32 operations decides their candidate; each ``j`` was found to flip
#: under one other order: the scale times the amax first, a multiply by ``fp32(1/(6E))`` for the
#: division, the elements summed backwards (both metrics), and a fused multiply-add into the MSE
#: sum (the GPU compiler's contraction).
NEAR_TIES = {"MAE": (7777005, 4267653, 6662859), "MSE": (491263, 3937352, 4686059, 188317)}
#: A block whose base ``fp32(fp32(bmax / 6) * S_enc)`` lies within rounding of the E4M3 midpoint
#: 248 (``bmax = fp32(amax * 31/32)``): ``bmax * fp32(1/6)`` instead of the division flips it.
NEAR_MIDPOINT_J = 2621144
#: 16x16 tiles of those near-tie rows (``c_r = fp32(c * (1 - k_r * 2^-23))``, amax ``4c``): the
#: tile's candidate flips if the 16 row errors are summed in order, or as the tree of adjacent
#: rows, instead of the tree ``r + (r + 8)``, ``+ 4``, ``+ 2``, ``+ 1``.
NEAR_TIE_TILES = {
    "MAE": (3239219, (0, 1, 1, 1, 1, 1, 2, 1, 2, 2, 1, 0, 0, 1, 2, 2)),
    "MSE": (6763574, (0, 1, 0, 1, 0, 1, 0, 0, 1, 2, 1, 2, 2, 0, 1, 2)),
}


def _scale(j: int) -> torch.Tensor:
    return 1.0 + torch.tensor(float(j)) * 2.0**-23  # exact in fp32


@pytest.mark.parametrize("err_mode", ["MAE", "MSE"])
def test_4over6_near_ties_follow_the_reference_order(err_mode, division):
    """Blocks (row 0 and column 0 of a 16x16 input, so both directions) and tiles whose
    candidate depends on the exact order of the reference's fp32 operations."""
    blk = torch.tensor(TIE_BLOCKS[err_mode])
    cases = [(blk * _scale(j), 4.0 * _scale(j)) for j in NEAR_TIES[err_mode]]
    if err_mode == "MAE":
        amax = 4.0 * _scale(NEAR_MIDPOINT_J)
        cases.append((blk * (amax * (31 / 32) / 4.0), amax))
    for v, amax in cases:
        x = torch.zeros(16, 16)
        x[0], x[:, 0] = v, v
        _check(x, amax.reshape(1), _opts(False, 256, err_mode))
    j, k = NEAR_TIE_TILES[err_mode]
    c = _scale(j) * (1.0 - torch.tensor(k, dtype=torch.float32) * 2.0**-23)
    tile = blk[None, :] * c[:, None]
    amax = (4.0 * _scale(j)).reshape(1)
    _check(tile, amax, _opts(True, 256, err_mode))  # rowwise: the tile's rows
    _check(tile.t().contiguous(), amax, _opts(True, 256, err_mode))  # columnwise: the same


@pytest.mark.parametrize("amax_log2", [-79, -81, -125])
def test_4over6_tiny_amax(amax_log2, division):
    """An amax below 2^-80 makes a program divide with ``div_rn`` (dividends down to the
    subnormals, outside ``div_rn_by``'s range); 2^-79 divides by FMAs at the edge of it. Both
    bounds and metrics, 1x16 and 16x16, and row-scaled rows of which some are tiny."""
    x = make_input(48, 64, torch.float32, seed=3, specials=False)
    x = x * (2.0**amax_log2 / x.abs().amax())
    amax = x.abs().amax().reshape(1)
    for two_d, bound, err_mode in ((False, 256, "MSE"), (True, 448, "MAE")):
        _check(x, amax, _opts(two_d, bound, err_mode), dequant=True)
    rows = make_input(48, 64, torch.float32, seed=4, specials=False)
    rows[16:32] *= 2.0**amax_log2 / rows[16:32].abs().amax()
    kw = dict(_opts(False, 448, "MSE"), columnwise=False, row_scaled=True)
    row_amax = rows.abs().amax(dim=1)
    got = B.nvfp4_quantize(rows.to(DEVICE), row_amax.to(DEVICE), None, **kw)
    assert_all_same(got, ref.nvfp4_quantize(rows, row_amax, None, **kw), None, NAMES)


@triton.jit
def _nan_division(x, D: tl.constexpr):
    return x * float("nan")


@pytest.mark.skipif(not INTERPRET, reason="replaces a helper of the interpreted kernels")
@pytest.mark.parametrize("amax_log2, fma", [(-79, True), (-81, False)])
def test_4over6_divides_with_fmas_only_above_the_amax_floor(monkeypatch, amax_log2, fma):
    """With the FMA division replaced by one that returns NaN (every error NaN: map-to-6
    everywhere), the bytes leave the reference's exactly when the program takes that path:
    at amax 2^-79, not at 2^-81 (``div_rn_by`` is not exact for dividends near the
    subnormals)."""
    from quant_kernels import _rounding, nvfp4_4over6

    monkeypatch.setattr(_rounding, "FMA_DIVISION", tl.constexpr(True))
    monkeypatch.setattr(nvfp4_4over6, "div_rn_by", _nan_division)
    x = make_input(32, 64, torch.float32, seed=5, specials=False)
    x = x * (2.0**amax_log2 / x.abs().amax())
    amax = x.abs().amax().reshape(1)
    kw = _opts(False, 256, "MAE")
    got = B.nvfp4_quantize(x.to(DEVICE), amax.to(DEVICE), amax.to(DEVICE), **kw)
    want = ref.nvfp4_quantize(x, amax, amax, **kw)
    same = all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
    assert same != fma


@pytest.mark.parametrize("kwargs, message", [
    (dict(with_rht=True), "neither with_rht nor stochastic_rounding"),
    (dict(stochastic_rounding=True), "neither with_rht nor stochastic_rounding"),
    (dict(e4m3_max=300), "nvfp4_e4m3_max must be one of"),
    (dict(err_mode="L1"), "nvfp4_4over6_err_mode must be one of"),
])
def test_4over6_refuses_like_the_reference(kwargs, message):
    x = torch.zeros(16, 32, dtype=torch.bfloat16)
    kw = dict(_opts(False, 256, "MAE"), **kwargs)
    for impl in (ref, B):
        with pytest.raises(ValueError, match=message):
            impl.nvfp4_quantize(x, torch.ones(1), torch.ones(1), **kw)
