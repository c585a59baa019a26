"""The grouped FP8 GEMM kernels (quant_kernels.fp8_grouped_gemm) against the reference
(quant_core.reference.grouped_gemm): ragged and empty groups, rows read from a padded layout,
every pair of FP8 dtypes.

Bitwise where the fp32 sums are exact in any order (small integer elements); elsewhere within
the accumulation-order bound."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, FP8_GROUPED_LOAD_FORMS, FP8_GROUPED_LOAD_IDS, grouped_load_form
from quant_core import reference
from quant_core.dtypes import DType
from quant_kernels import configs
from quant_kernels import fp8_grouped_gemm as kern

PAIRS = [(DType.E4M3, DType.E4M3), (DType.E5M2, DType.E4M3), (DType.E4M3, DType.E5M2),
         (DType.E5M2, DType.E5M2)]


#: ``|got - want| / sum |a_i b_i|`` at most: fp32 sums in another order under the interpreter
#: (128 terms). On Hopper the tensor core sums ``PROMOTE`` products (32 per MMA instruction at
#: least) in its own accumulator, which keeps about 14 bits, before each fp32 add: up to
#: ``PROMOTE * 2^-14`` of the sum of magnitudes (2^-7 at the default 128, CUTLASS's and
#: DeepGEMM's promotion interval).
def _sum_bound(interval: int) -> float:
    """The bound above for a promotion every ``interval`` contraction elements (on Hopper; fp32
    sums of 128 terms elsewhere)."""
    return max(interval, 32) * 2.0**-14 if DEVICE == "cuda" else 128 * 2.0**-23


SUM_BOUND = _sum_bound(configs.config("fp8_grouped_rows_gemm")["PROMOTE"])


@pytest.fixture(autouse=True, params=FP8_GROUPED_LOAD_FORMS, ids=FP8_GROUPED_LOAD_IDS)
def loads(request):
    """Every test runs each form of the kernels: tiles loaded by the tensor memory accelerator
    (the default where the operands allow it; the weight-gradient kernel from descriptors
    bounded by the group) or by masked pointer loads; the programs in their configs' order or
    the other one; the rows kernel's steps over one promoted chunk or two."""
    with grouped_load_form(("fp8_grouped_rows_gemm", "fp8_grouped_rows_gemm_long",
                            "fp8_grouped_tokens_gemm", "fp8_grouped_tokens_gemm_short"),
                           *request.param):
        yield


def _bytes(shape, dtype: DType, seed: int, integers: bool) -> torch.Tensor:
    """FP8 bytes of ``dtype``: small integers (exact sums in any order), or any finite value."""
    g = torch.Generator().manual_seed(seed)
    if integers:
        return torch.randint(-8, 9, shape, generator=g).float().to(dtype.torch_dtype).view(
            torch.uint8)
    v = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g))
    return v.clamp(-dtype.max, dtype.max).to(dtype.torch_dtype).view(torch.uint8)


def _scales(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g) * 4 + 0.25


def _ends(counts, pad_to: int = 1) -> torch.Tensor:
    return torch.tensor([-(-c // pad_to) * pad_to for c in counts]).cumsum(0)


@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_rows_gemm_matches_reference(a_dtype, b_dtype, padded, fast_accum):
    counts = [0, 37, 1, 0, 70]
    total, k, n = sum(counts), 96, 80
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a_ends = _ends(counts, 16) if padded else offs.to(torch.int64)
    rows = int(a_ends[-1]) + 16  # rows past the last group are never read
    a = _bytes((rows, k), a_dtype, 1, True)
    b = _bytes((len(counts), n, k), b_dtype, 2, True)
    sa = torch.zeros(len(counts), 4)
    sa[:, 0] = _scales(len(counts), 3)  # a pitch of 4, as the layer's scale-inverses
    sb = _scales(len(counts), 4)
    args = (a, sa[:, 0], b, sb, offs, a_ends)
    kw = {"total": total, "a_dtype": a_dtype, "b_dtype": b_dtype}
    want = reference.fp8_grouped_rows_gemm(*args, **kw)
    got = kern.fp8_grouped_rows_gemm(*(t.to(DEVICE) for t in args), **kw, fast_accum=fast_accum)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("tiles", ["short", "long"] if DEVICE == "cuda" else ["short"])
@pytest.mark.parametrize("a_dtype,b_dtype", PAIRS)
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("counts, multiple", [
    ([16, 0, 80, 144, 0], 16),  # whole contraction chunks and partial ones
    ([128, 0, 256, 128], 128)])  # whole chunks only: loaded from descriptors made on the host
def test_tokens_gemm_matches_reference(a_dtype, b_dtype, fast_accum, counts, multiple, tiles,
                                       monkeypatch):
    # each tile config on the GPU (the interpreter's are one), whatever the group rows
    monkeypatch.setattr(kern, "SHORT_GROUP_ROWS", 0 if tiles == "long" else 2**31)
    ends = _ends(counts)
    # several tiles along both output dimensions in either mode's tiles (their order matters)
    r, (m, n) = int(ends[-1]), ((264, 136) if DEVICE == "cuda" else (72, 104))
    a = _bytes((m, r), a_dtype, 5, True)
    b = _bytes((n, r), b_dtype, 6, True)
    sa, sb = _scales(len(counts), 7), _scales(len(counts), 8)
    args = (a, sa, b, sb, ends)
    kw = {"a_dtype": a_dtype, "b_dtype": b_dtype}
    want = reference.fp8_grouped_tokens_gemm(*args, **kw)
    got = kern.fp8_grouped_tokens_gemm(*(t.to(DEVICE) for t in args), **kw,
                                       fast_accum=fast_accum, group_multiple=multiple)
    assert torch.equal(got.cpu(), want)
    assert [bool(want[g].any()) for g in range(len(counts))] == [c > 0 for c in counts]


@pytest.mark.parametrize("rows, groups, name", [
    (128 * 512, 128, "fp8_grouped_tokens_gemm_short"),  # Qwen3-MoE: 512 rows a group
    (8 * 1024, 8, "fp8_grouped_tokens_gemm_short"),
    (8 * 1024 + 16, 8, "fp8_grouped_tokens_gemm"),
    (8 * 2048, 8, "fp8_grouped_tokens_gemm"),  # Mixtral: 2048 rows a group
    (0, 4, "fp8_grouped_tokens_gemm_short")])
def test_tokens_gemm_takes_the_short_tiles_up_to_1024_rows_a_group(rows, groups, name,
                                                                   monkeypatch):
    launched = []
    monkeypatch.setattr(kern, "tokens_gemm", lambda *a, **k: launched.append(a[7]))
    a = torch.zeros((32, rows), dtype=torch.uint8)
    s = torch.ones(groups)
    ends = torch.full((groups,), rows, dtype=torch.int32)
    kern.fp8_grouped_tokens_gemm(a, s, a, s, ends, a_dtype=DType.E4M3, b_dtype=DType.E4M3)
    assert len(launched) == 1 and launched[0] is configs.launch_config(name)


@pytest.mark.parametrize("n, k, cols_fastest, tiles", [
    (8192, 4096, 1, "fp8_grouped_rows_gemm"),  # an expert of 32 MiB stays in L2: column first
    (8208, 4096, 0, "fp8_grouped_rows_gemm"),  # past 32 MiB, rows at least as wide: row first
    (4096, 8208, 1, "fp8_grouped_rows_gemm_long"),  # past 32 MiB, a longer contraction
    (2048, 8192, 1, "fp8_grouped_rows_gemm"),  # a longer contraction in L2
])
def test_rows_gemm_orders_and_tiles_by_expert_bytes_and_shape(n, k, cols_fastest, tiles,
                                                              monkeypatch):
    launched = []
    monkeypatch.setattr(kern, "launch", lambda kernel, grid, *a, **kw: launched.append(kw))
    configs_taken = []
    monkeypatch.setattr(kern, "rows_gemm", (lambda *a, _run=kern.rows_gemm, **kw:
                                            configs_taken.append(a[9]) or _run(*a, **kw)))
    a = torch.zeros((32, k), dtype=torch.uint8)
    b = torch.zeros((2, n, k), dtype=torch.uint8)
    s = torch.ones(2)
    offs = torch.tensor([16, 32])
    kern.fp8_grouped_rows_gemm(a, s, b, s, offs, offs, total=32, a_dtype=DType.E5M2,
                               b_dtype=DType.E4M3)
    config_order = configs.config(tiles)["COLS_FASTEST"]
    assert configs_taken == [configs.launch_config(tiles)]
    assert len(launched) == 1 and launched[0]["COLS_FASTEST"] == (cols_fastest and config_order)


@pytest.mark.parametrize("m, n, rows, rows_fastest", [
    (4096, 14336, 8 * 2048, 1),  # Mixtral's down projection: b's 29 MB a group, a's 8 MB
    (28672, 4096, 8 * 2048, 0),  # its gate/up: a's slice is the larger
    (4096, 14336, 8 * 1024, 0),  # b's 14.7 MB a group stay in L2
    (1536, 2048, 128 * 512, 0),  # Qwen3-MoE: 1 MB
])
def test_tokens_gemm_sweeps_a_when_bs_group_slices_pass_16_mib(m, n, rows, rows_fastest,
                                                               monkeypatch):
    launched = []
    monkeypatch.setattr(kern, "launch", lambda kernel, grid, *a, **kw: launched.append(kw))
    groups = 8 if rows < 2**16 else 128
    a = torch.empty((m, rows), dtype=torch.uint8)
    b = torch.empty((n, rows), dtype=torch.uint8)
    s = torch.ones(groups)
    ends = torch.arange(1, groups + 1) * (rows // groups)
    with grouped_load_form(("fp8_grouped_tokens_gemm", "fp8_grouped_tokens_gemm_short"), 1, 1):
        kern.fp8_grouped_tokens_gemm(a, s, b, s, ends, a_dtype=DType.E5M2, b_dtype=DType.E4M3)
    assert len(launched) == 1 and launched[0]["ROWS_FASTEST"] == rows_fastest


@pytest.mark.parametrize("multiple", [0, 8, 24, 16.0, True])
def test_tokens_gemm_rejects_a_group_multiple_not_of_16(multiple):
    a = torch.zeros((8, 32), dtype=torch.uint8)
    s = torch.ones(2)
    with pytest.raises(ValueError, match="group_multiple must be a positive multiple of 16"):
        kern.fp8_grouped_tokens_gemm(a, s, a, s, torch.tensor([16, 32]), a_dtype=DType.E4M3,
                                     b_dtype=DType.E4M3, group_multiple=multiple)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, fast_accum", [(128, False), (128, True), (2048, False),
                                           (2048, True)])
def test_any_finite_values_within_the_accumulation_bound(out_dtype, k, fast_accum):
    """Full-range values: the kernel sums in another order (and on Hopper with the tensor core's
    own partial sums): the results agree within :data:`SUM_BOUND` of the sum of magnitudes,
    ``_sum_bound(k)`` with ``fast_accum``."""
    counts = [33, 0, 64] if k == 128 else [17, 0, 15]
    offs = torch.tensor(counts).cumsum(0)
    a = _bytes((sum(counts), k), DType.E5M2, 9, False)
    b = _bytes((3, 48, k), DType.E4M3, 10, False)
    sa, sb = _scales(3, 11), _scales(3, 12)
    kw = {"total": sum(counts), "a_dtype": DType.E5M2, "b_dtype": DType.E4M3,
          "out_dtype": out_dtype}
    want = reference.fp8_grouped_rows_gemm(a, sa, b, sb, offs, offs, **kw).float()
    got = kern.fp8_grouped_rows_gemm(*(t.to(DEVICE) for t in (a, sa, b, sb, offs, offs)),
                                     **kw, fast_accum=fast_accum).float().cpu()
    mags = reference.fp8_grouped_rows_gemm(
        a.view(torch.float8_e5m2).float().abs().to(torch.float8_e5m2).view(torch.uint8), sa,
        b.view(torch.float8_e4m3fn).float().abs().to(torch.float8_e4m3fn).view(torch.uint8),
        sb, offs, offs, **{**kw, "out_dtype": torch.float32})
    ulp = 2.0**-23 if out_dtype == torch.float32 else 2.0**-8
    ratio = float(((got - want).abs() / mags).max())
    print(f"K {k}, fast_accum {fast_accum}: max |got - want| / sum |a b|: {ratio:.3e} "
          f"({ratio / 2.0**-23:.1f} fp32 ulps)")
    # fast accumulation: the tensor core's own accumulator over the whole contraction, one
    # slice of k; the fp32 sums of a longer contraction add k terms' rounding
    bound = max(_sum_bound(k) if fast_accum else SUM_BOUND, k * 2.0**-23)
    assert ratio <= bound + ulp


def test_empty_problems():
    offs = torch.zeros(3, dtype=torch.int64)
    b = torch.zeros((3, 16, 32), dtype=torch.uint8)
    kw = {"a_dtype": DType.E4M3, "b_dtype": DType.E4M3}
    out = kern.fp8_grouped_rows_gemm(torch.zeros((0, 32), dtype=torch.uint8).to(DEVICE),
                                     torch.ones(3).to(DEVICE), b.to(DEVICE),
                                     torch.ones(3).to(DEVICE), offs.to(DEVICE), offs.to(DEVICE),
                                     total=0, **kw)
    assert out.shape == (0, 16)
    ends = torch.tensor([0, 0, 0])
    out = kern.fp8_grouped_tokens_gemm(torch.zeros((8, 0), dtype=torch.uint8).to(DEVICE),
                                       torch.ones(3).to(DEVICE),
                                       torch.zeros((4, 0), dtype=torch.uint8).to(DEVICE),
                                       torch.ones(3).to(DEVICE), ends.to(DEVICE), **kw)
    assert out.shape == (3, 8, 4) and not out.any()


def test_argument_errors():
    a = torch.zeros((4, 32), dtype=torch.uint8)
    b = torch.zeros((2, 16, 32), dtype=torch.uint8)
    s, offs = torch.ones(2), torch.tensor([2, 4])
    kw = {"total": 4, "a_dtype": DType.E4M3, "b_dtype": DType.E4M3}
    with pytest.raises(TypeError, match="a must be contiguous uint8"):
        kern.fp8_grouped_rows_gemm(a.float(), s, b, s, offs, offs, **kw)
    with pytest.raises(TypeError, match="a_scale_inv must be a 1D fp32"):
        kern.fp8_grouped_rows_gemm(a, s.double(), b, s, offs, offs, **kw)
    with pytest.raises(TypeError, match="offs must be a 1D int32/int64"):
        kern.fp8_grouped_rows_gemm(a, s, b, s, offs.float(), offs, **kw)
    with pytest.raises(ValueError, match="same K"):
        kern.fp8_grouped_rows_gemm(a, s, b[:, :, :16].contiguous(), s, offs, offs, **kw)
    with pytest.raises(ValueError, match="one entry per group"):
        kern.fp8_grouped_rows_gemm(a, s, b, s, offs[:1], offs, **kw)
    with pytest.raises(ValueError, match="same R"):
        kern.fp8_grouped_tokens_gemm(a, s, a[:, :16].contiguous(), s, offs, a_dtype=DType.E4M3,
                                     b_dtype=DType.E4M3)


@pytest.mark.parametrize("change", [{"SPLIT": 3}, {"SPLIT": 2, "CHUNKS": 2}],
                         ids=["split 3", "halves of two chunks"])
def test_a_config_split_other_than_halves_of_one_chunk_is_refused(change):
    a = torch.zeros((32, 64), dtype=torch.uint8)
    s, offs = torch.ones(2), torch.tensor([16, 32])
    mode = "gpu" if DEVICE == "cuda" else "interp"
    with configs.overridden("fp8_grouped_rows_gemm",
                            {**configs.config("fp8_grouped_rows_gemm"), **change}, mode=mode):
        with pytest.raises(ValueError, match="SPLIT must be 1 or 2"):
            kern.fp8_grouped_rows_gemm(a.to(DEVICE), s.to(DEVICE), a.view(2, 16, 64).to(DEVICE),
                                       s.to(DEVICE), offs.to(DEVICE), offs.to(DEVICE), total=32,
                                       a_dtype=DType.E4M3, b_dtype=DType.E4M3)
