"""The batched per-group FP8 current scaling of GroupedLinear (quant_recipes.moe.fp8) and its
quantize-once path (quant_recipes.moe.fp8_gemm): ``"scaled_grouped_mm"`` and
``"fp8_grouped_gemm"`` (the backend's grouped FP8 GEMMs; on the CPU the reference's).

Oracles: the per-group path's own quantize calls (one per padded group, one per expert: tested
against the dense Linear in test_grouped_linear.py) for the bytes, bitwise; the per-group
path's GEMMs for the grouped GEMMs, up to the fp32 accumulation order (on the CPU through
an emulation of ``torch._scaled_grouped_mm`` that checks the layouts, offsets, alignments and
scale shapes torch's kernel requires).
"""

from __future__ import annotations

import os

import pytest
import quant_recipes as qr
import torch
from _alive import log_alive_at, track_first_output
from installed import require_triton_backend
from moe_routing import plain_and_checkpointed, qwen3_moe_experts
from quant_core import DType, Float8CurrentScalingQuantizer, backends
from quant_core.reference.fp8_grouped import group_amaxes, row_amaxes
from quant_recipes.moe import fp8 as grouped_fp8
from quant_recipes.moe import fp8_gemm as grouped_fp8_gemm
from quant_recipes.moe import gemm as grouped_gemm
from quant_recipes.moe.linear import GroupedProjection
from quant_recipes.moe.routes import gather_tokens, route

K, N, ALIGN = 64, 32, 16
COUNTS = [5, 0, 1, 37, 16, 0, 22]  # ragged, empty groups, a group of one row, an exact one
#: ``(GEMM shape, fast_accum)`` of every emulated ``torch._scaled_grouped_mm`` call.
FAST_ACCUM: list[tuple[str, bool]] = []

QUANTIZERS = {
    "e4m3": dict(dtype=DType.E4M3),
    "e5m2": dict(dtype=DType.E5M2),
    "pow2": dict(dtype=DType.E4M3, force_pow_2_scales=True),
    "eps": dict(dtype=DType.E4M3, amax_epsilon=1e-3),
}


def _quantizer(qid, rowwise=True, columnwise=True):
    return Float8CurrentScalingQuantizer(**QUANTIZERS[qid], rowwise_usage=rowwise,
                                         columnwise_usage=columnwise)


def _rows(counts, dtype, seed=0):
    """Rows with special values: NaN, Inf, an all-zero group, a tiny (subnormal-amax) group."""
    torch.manual_seed(seed)
    x = torch.randn(sum(counts), K) * torch.logspace(-3, 3, sum(counts))[:, None]
    starts = [sum(counts[:g]) for g in range(len(counts))]
    x[starts[0], 3] = float("nan")
    x[starts[3]:starts[3] + 37] = 0.0  # group 3: amax 0 -> scale 1
    x[starts[3] + 36, 5] = float("nan")  # ... and a NaN, dropped by the amax
    x[starts[4] + 2, 7] = float("inf")  # group 4: amax Inf -> scale 1
    if dtype == torch.float32:
        x[starts[6]:starts[6] + 22] *= 1e-38  # subnormal amax: an Inf quotient -> FLT_MAX
    return x.to(dtype)


def _per_group(x, counts, q):
    """The per-group path's buffers of each group: its rows padded to ALIGN, one quantize (by
    the reference)."""
    out, s = [], 0
    with backends.using("reference"):
        for m in counts:
            mp = -(-m // ALIGN) * ALIGN if m else 0
            out.append(grouped_gemm.quantized(grouped_gemm._padded(x[s:s + m], mp), q)
                       if m else None)
            s += m
    return out


def _group_amaxes(x: torch.Tensor, counts) -> torch.Tensor:
    """fp32 ``[groups]``: each group's NaN-dropping ``max |x|`` (0 for an empty group)."""
    mags = torch.nan_to_num(x.float().abs(), nan=0.0, posinf=float("inf"))
    return torch.stack([m.amax() if m.numel() else torch.zeros(())
                        for m in mags.split(list(counts))])


def _routed(tokens: int, k: int, experts: int, seed: int = 0):
    """``(routes, offs)`` of a top-``k`` routing of ``tokens`` tokens to ``experts`` experts
    (the last one gets none): each token's routes sorted by expert, as a mixture-of-experts
    block orders them (``routes.rows`` the token of each)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)])
    sorted_ids, routes = route(ids)
    offs = torch.searchsorted(sorted_ids, torch.arange(experts), right=True)
    return routes, offs


@pytest.mark.parametrize("row_padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qid", list(QUANTIZERS))
def test_rows_bytes_equal_the_per_group_quantize(impl, qid, dtype, row_padded):
    x = _rows(COUNTS, dtype)
    q = _quantizer(qid)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    lay = grouped_fp8.layout(offs, x.shape[0], ALIGN)
    data, trans, sinv = grouped_fp8.quantize_rows(x, lay, q, True, True, row_padded=row_padded)
    starts = grouped_fp8.padded_starts(offs.tolist(), ALIGN)
    assert lay.ends.tolist() == [*starts[1:], lay.ends[-1].item()]
    assert sinv.shape == (len(COUNTS), grouped_fp8.SCALE_PITCH) and not sinv[:, 2:].any()
    assert torch.equal(sinv[:, 1], _group_amaxes(x, COUNTS))
    assert data.shape == ((lay.rows, K) if row_padded else (x.shape[0], K))
    used = torch.zeros(lay.rows, dtype=torch.bool)
    s = 0
    for g, want in enumerate(_per_group(x, COUNTS, q)):
        p = starts[g]
        if want is None:  # an empty group: ALIGN zero rows, the scale of an empty tensor
            assert not trans[:, p:p + ALIGN].any()
            assert torch.equal(sinv[g, :1], q.quantize(x[:0]).buffer_list(x[:0])[2])
            continue
        wd, wt, ws = want
        mp, m = wd.shape[0], COUNTS[g]
        got = data[p:p + mp] if row_padded else data[s:s + m]
        assert torch.equal(got, wd if row_padded else wd[:m]), f"group {g} data"
        assert torch.equal(trans[:, p:p + mp], wt), f"group {g} transpose"
        assert torch.equal(sinv[g, :1], ws), f"group {g} scale_inv"
        used[p:p + mp] = True
        s += m
    assert not trans[:, ~used].any()  # padding past the groups
    if row_padded:
        assert not data[~used].any()


@pytest.mark.parametrize("n", [N, 24])  # 24: an expert's rows are not a multiple of the tile's
@pytest.mark.parametrize("qid", ["e4m3", "pow2"])
def test_expert_bytes_equal_one_quantize_per_expert(impl, qid, n):
    torch.manual_seed(1)
    w = torch.randn(3, n, K, dtype=torch.bfloat16) * torch.tensor([1e-3, 1.0, 300.0])[:, None,
                                                                                     None]
    w[1, 2, 3] = float("nan")
    q = _quantizer(qid)
    data, trans, sinv = grouped_fp8.quantize_experts(w, q, True, True)
    for e in range(w.shape[0]):
        wd, wt, ws = q.quantize(w[e]).buffer_list(w[e])
        assert torch.equal(data[e], wd) and torch.equal(trans[e], wt)
        assert torch.equal(sinv[e, :1], ws)


def test_the_scale_inverses_of_more_experts_than_one_block_of_them(impl):
    """300 experts: the cast kernel writes the scale-inverses in more than one block of groups
    (``quant_kernels.fp8_grouped.SCALE_INV_BLOCK``, 256)."""
    torch.manual_seed(2)
    w = torch.randn(300, 16, K, dtype=torch.bfloat16) * torch.logspace(-3, 3, 300)[:, None, None]
    q = _quantizer("e4m3")
    _, _, sinv = grouped_fp8.quantize_experts(w, q, True, False)
    assert torch.equal(sinv[:, 0], torch.cat([q.quantize(e).buffer_list(e)[2] for e in w]))


@pytest.mark.parametrize("n, k", [(0, K), (4, 0)])
def test_experts_without_elements_still_get_their_scale_inverses(impl, n, k):
    """Nothing to cast (experts of no rows, or rows of no columns): empty bytes, and the
    scale-inverses still written, each 1 (an amax of 0 gives a scale of 1), with the amax 0 and
    zero padding in the pitch."""
    w = torch.randn(3, n, k, dtype=torch.bfloat16)
    data, trans, sinv = grouped_fp8.quantize_experts(w, _quantizer("e4m3"), True, True)
    assert data.numel() == trans.numel() == 0 and trans.shape == (3, k, n)
    assert sinv[:, 0].tolist() == [1.0] * 3 and not sinv[:, 1:].any()


@pytest.mark.parametrize("qid", ["e4m3", "pow2"])
def test_quantizing_again_from_the_kept_amaxes_gives_the_same_bytes(impl, qid):
    """Column 1 of the scale-inverses holds each group's amax; given back (``scale_inv``), the
    quantize runs no amax pass and makes the same bytes and scale-inverses, for rows (NaN, an
    empty group) and experts."""
    x = _rows(COUNTS, torch.bfloat16)
    x[3, 5] = float("nan")
    q = _quantizer(qid)
    lay = grouped_fp8.layout(torch.tensor(COUNTS).cumsum(0), x.shape[0], ALIGN)
    first = grouped_fp8.quantize_rows(x, lay, q, True, True)
    again = grouped_fp8.quantize_rows(x, lay, q, False, True, scale_inv=first[2])
    assert again[0] is None
    assert torch.equal(again[1], first[1]) and torch.equal(again[2], first[2])
    w = torch.randn(3, N, K, dtype=torch.bfloat16) * torch.tensor([1e-3, 1.0, 300.0])[:, None,
                                                                                     None]
    first = grouped_fp8.quantize_experts(w, q, True, True)
    again = grouped_fp8.quantize_experts(w, q, False, True, scale_inv=first[2])
    assert torch.equal(again[1], first[1]) and torch.equal(again[2], first[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_amaxes_reduce_to_the_groups_amaxes(impl, dtype):
    """Each row's amax (torch ops, what a compiled layer computes where the rows are made)
    reduced per group is the amax the quantize's own pass finds (NaN dropped, Inf kept, 0 for
    an empty group), and quantizing from it gives the same bytes."""
    x = _rows(COUNTS, dtype)
    q = _quantizer("e4m3")
    lay = grouped_fp8.layout(torch.tensor(COUNTS).cumsum(0), x.shape[0], ALIGN)
    rows = row_amaxes(x)
    assert rows.dtype == torch.float32 and rows.shape == (x.shape[0],)
    assert torch.equal(group_amaxes(rows, lay.gid, lay.groups), _group_amaxes(x, COUNTS))
    want = grouped_fp8.quantize_rows(x, lay, q, True, True)
    got = grouped_fp8.quantize_rows(x, lay, q, True, True, row_amax=rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(row_amaxes(x[:, :0]), torch.zeros(x.shape[0]))
    for bad in (rows[:-1], rows.double(), rows.to("meta")):
        with pytest.raises(ValueError, match="row_amax must be an fp32 tensor of shape"):
            grouped_fp8.quantize_rows(x, lay, q, True, True, row_amax=bad)


@pytest.mark.parametrize("row_padded", [False, True])
@pytest.mark.parametrize("amax", ["pass", "rows", "kept"])
def test_gathered_rows_quantize_to_the_bytes_of_their_copy(impl, row_padded, amax):
    """Token rows given as ``x[x_rows]`` (each row of ``x`` routed to several groups, some to
    none): the bytes and scale-inverses of quantizing the gathered copy, with the backend's own
    amax pass, with amaxes reduced from each row's, and with kept ones; a bad index is
    refused, naming ``x_rows``."""
    tokens, k = 29, 3
    torch.manual_seed(0)
    src = torch.randn(tokens, K) * torch.logspace(-3, 3, tokens)[:, None]
    src[4, 2], src[9, 0] = float("nan"), float("inf")
    src = src.bfloat16()
    routes, offs = _routed(tokens, k, len(COUNTS))
    rows = routes.rows
    lay = grouped_fp8.layout(offs, rows.shape[0], ALIGN)
    q = _quantizer("e4m3")
    want = grouped_fp8.quantize_rows(src[rows], lay, q, True, True, row_padded=row_padded)
    given = {"pass": {}, "rows": {"row_amax": row_amaxes(src)[rows]},
             "kept": {"scale_inv": want[2]}}[amax]
    got = grouped_fp8.quantize_rows(src, lay, q, True, True, row_padded=row_padded,
                                    x_rows=rows, **given)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for bad, error, says in ((rows[:-1], ValueError, "must have 87 entries"),
                             (rows.float(), TypeError, "must be a 1D int32/int64 tensor"),
                             (rows.to("meta"), ValueError, "is on meta")):
        with pytest.raises(error, match=f"x_rows {says}"):
            grouped_fp8.quantize_rows(src, lay, q, True, True, x_rows=bad)


def test_a_given_amax_is_used_and_checked(impl):
    """The backend casts with the amaxes it is given (twice the true ones give other
    scale-inverses), and refuses amaxes of the wrong shape, dtype or device."""
    w = torch.randn(2, N, K, dtype=torch.bfloat16)
    backend = backends.get(None, w.device)
    args = {"groups": 2, "fp8_dtype": DType.E4M3, "force_pow_2_scales": False,
            "amax_epsilon": 0.0, "rowwise": True, "columnwise": False, "scale_pitch": 4}
    flat = w.reshape(2 * N, K)
    _, _, sinv = backend.fp8_group_quantize_experts(flat, **args)
    doubled = sinv[:, 1] * 2
    _, _, got = backend.fp8_group_quantize_experts(flat, amax=doubled, **args)
    assert torch.equal(got[:, 1], doubled) and not torch.equal(got[:, 0], sinv[:, 0])
    for bad in (sinv[:1, 1], sinv[:, 1].double(), sinv[:, 1].to("meta")):
        with pytest.raises(ValueError, match="amax must be an fp32 tensor of shape"):
            backend.fp8_group_quantize_experts(flat, amax=bad, **args)


def test_a_layout_of_no_rows():
    lay = grouped_fp8.layout(torch.zeros(3, dtype=torch.int32), 0, ALIGN)
    assert lay.ends.tolist() == [16, 32, 48] and lay.rows == 48 and lay.dest.numel() == 0
    assert (lay.src == -1).all() and lay.grp.tolist() == [0] * 16 + [1] * 16 + [2] * 16


def test_layout_maps_padded_rows_to_their_rows():
    offs = torch.tensor(COUNTS).cumsum(0)
    lay = grouped_fp8.layout(offs, sum(COUNTS), ALIGN)
    assert lay.rows == -(-sum(COUNTS) // ALIGN) * ALIGN + len(COUNTS) * ALIGN
    r = torch.arange(sum(COUNTS))
    assert torch.equal(lay.src[lay.dest].long(), r)  # src inverts dest on the real rows
    assert int((lay.src >= 0).sum()) == sum(COUNTS)
    assert torch.equal(lay.grp[lay.dest].long(), lay.gid)


@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 0], [16, 0, 33], [0, 5, 0, 16, 1]])
def test_padding_rows_are_the_rows_no_row_maps_to(counts):
    lay = grouped_fp8.layout(torch.tensor(counts).cumsum(0), sum(counts), ALIGN)
    assert torch.equal(lay.pad, torch.nonzero(lay.src < 0).flatten())


@pytest.mark.parametrize("counts", [COUNTS, [0, 0, 0], [0, 5, 0, 16, 1]])
def test_padded_rows_hold_their_rows_and_zeros(counts):
    x = torch.randn(sum(counts), K, dtype=torch.bfloat16) + 1  # no zero row
    lay = grouped_fp8.layout(torch.tensor(counts).cumsum(0), x.shape[0], ALIGN)
    want = x.new_zeros((lay.rows, K)).index_copy_(0, lay.dest, x)
    assert torch.equal(grouped_fp8.padded(x, lay), want)


# ------------------------------------------------------------------- the grouped GEMMs
def _emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs, fast_accum=False,
                                aligned_rows=False):
    """``torch._scaled_grouped_mm``'s rowwise semantics, with the checks of its CUDA kernel:
    ``(acc * scale_a) * scale_b`` per row and column, acc the fp32 sum of the FP8 products
    (``aligned_rows``: a kernel that also needs 16-row group ends when the rows are grouped).
    ``fast_accum`` is recorded in :data:`FAST_ACCUM` (``"rows"`` or ``"tokens"``)."""
    FAST_ACCUM.append(("rows" if b.dim() == 3 else "tokens", fast_accum))
    assert a.dtype == torch.float8_e4m3fn or a.dtype == torch.float8_e5m2
    assert b.dtype == torch.float8_e4m3fn and offs.dtype == torch.int32
    assert a.stride(-1) == 1 and b.stride(-2) == 1, "A row-major, B column-major"
    assert a.shape[-1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0
    assert scale_a.is_contiguous() and scale_b.stride(-1) == 1
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    if b.dim() == 3:  # groups along the rows of A
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        assert not aligned_rows or all(e % 16 == 0 for e in ends)
        out = torch.zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            out[s:e] = (a32[s:e] @ b32[g]) * scale_a[s:e, None] * scale_b[g][None]
        return out.to(torch.bfloat16)
    m, n = a.shape[0], b.shape[1]  # groups along K: every group non-empty, 16-aligned starts
    assert scale_a.shape == (len(ends) * m,) and scale_b.shape == (len(ends) * n,)
    assert all(e > s for s, e in zip(starts, ends, strict=True))
    assert all(e % 16 == 0 for e in ends[:-1])
    out = torch.zeros(len(ends), m, n)
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        out[g] = ((a32[:, s:e] @ b32[s:e]) * scale_a[g * m:(g + 1) * m, None]
                  * scale_b[g * n:(g + 1) * n][None])
    return out.to(torch.bfloat16)


def _emulated_scaled_mm(a, b, scale_a, scale_b, out, fast_accum=False):
    """``torch._scaled_mm`` into ``out`` (tensor scales), with cuBLAS's requirements: A row-major
    and B column-major with 16-byte aligned rows and columns, widths multiples of 16, scale
    pointers on 16-byte boundaries (a slice of a packed scale vector is refused there)."""
    assert a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype in (
        torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype != torch.float8_e5m2 or (
        a.dtype != torch.float8_e5m2), "cuBLAS multiplies no E5M2 x E5M2"
    assert a.stride(1) == 1 and b.stride(0) == 1, "A row-major, B column-major"
    assert a.stride(0) % 16 == 0 and b.stride(1) % 16 == 0 and a.data_ptr() % 16 == 0
    assert a.shape[1] % 16 == 0 and b.shape[1] % 16 == 0
    for s in (scale_a, scale_b):
        assert s.numel() == 1 and s.dtype == torch.float32
        assert s.data_ptr() % 16 == 0, "cuBLAS refuses a scale pointer off a 16-byte boundary"
    assert out.is_contiguous() and out.shape == (a.shape[0], b.shape[1])
    out.copy_((a.to(torch.float32) @ b.to(torch.float32)) * (scale_a * scale_b))


@pytest.fixture(params=["unpadded", "padded"])
def emulated(request, monkeypatch):
    """The quantize-once path on the CPU, through the emulations; the grouped kernel takes
    E4M3 x E4M3 only, as torch 2.11's, and takes unaligned row groups or (``padded``) not."""
    aligned = request.param == "padded"
    monkeypatch.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(grouped_fp8_gemm, "scaled_grouped_mm",
                        lambda *a: _emulated_scaled_grouped_mm(*a, aligned_rows=aligned))
    FAST_ACCUM.clear()
    monkeypatch.setattr(grouped_fp8_gemm, "scaled_mm", _emulated_scaled_mm)
    monkeypatch.setattr(grouped_fp8_gemm, "OWN_KERNEL_MIN_EXPERTS", 0)
    monkeypatch.setattr(grouped_fp8_gemm, "ROUTE", "scaled_grouped_mm")
    monkeypatch.setattr(grouped_fp8_gemm, "_runs",
                        lambda device_type, dtype: dtype == torch.float8_e4m3fn)
    monkeypatch.setattr(grouped_fp8_gemm, "unpadded_rows_run", lambda device_type: not aligned)
    return monkeypatch


def _step(counts, recipe, seed=0):
    torch.manual_seed(seed)
    m = qr.GroupedLinear(len(counts), K, N, dtype=torch.bfloat16, name="experts")
    x = torch.randn(sum(counts), K, dtype=torch.bfloat16).requires_grad_()
    gy = torch.randn(sum(counts), N, dtype=torch.bfloat16)
    qr.reset_grouped_gemm_paths()
    with qr.autocast(recipe=recipe):
        y = m(x, counts=torch.tensor(counts))
    y.backward(gy)
    return (y.detach(), x.grad, m.weight.grad), qr.grouped_gemm_paths()


def test_grouped_gemms_equal_the_per_group_path(emulated):
    recipe = qr.Float8CurrentScaling(fp8_format=qr.Format.E4M3)
    got, paths = _step(COUNTS, recipe)
    assert paths == {"scaled_grouped_mm": 3}
    emulated.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", set())
    want, paths = _step(COUNTS, recipe)
    assert paths == {"per_group": 3}
    for a, b in zip(got, want, strict=True):  # the order of the fp32 sums and of the scales
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("gemm, split, want", [
    (None, None, [("rows", True), ("rows", False), ("tokens", False)]),
    ("fp8_gemm_fprop", True, [("rows", False), ("rows", False), ("tokens", False)]),
    ("fp8_gemm_dgrad", False, [("rows", True), ("rows", True), ("tokens", False)]),
    ("fp8_gemm_wgrad", False, [("rows", True), ("rows", False), ("tokens", True)])])
@pytest.mark.parametrize("compiled", [False, True])
def test_each_grouped_gemm_accumulates_as_the_recipes_mmparams_say(emulated, gemm, split, want,
                                                                   compiled):
    """Float8CurrentScaling's ``fp8_gemm_fprop=MMParams(False)`` (TransformerEngine's default)
    gives the forward GEMM the tensor cores' fast accumulation; dgrad and wgrad split theirs
    (``MMParams(True)``); each field changes its own GEMM only, eagerly and compiled."""
    fields = {} if gemm is None else {gemm: qr.MMParams(use_split_accumulator=split)}
    recipe = qr.Float8CurrentScaling(fp8_format=qr.Format.E4M3, **fields)
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16)

    def step(x, counts):
        with qr.autocast(recipe=recipe):
            return m(x, counts=counts)

    fn = torch.compile(step, fullgraph=True, backend=_compiled_counter()) if compiled else step
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16, requires_grad=True)
    fn(x, torch.tensor(COUNTS)).backward(torch.randn(sum(COUNTS), N, dtype=torch.bfloat16))
    assert FAST_ACCUM == want


def test_e5m2_gradients_run_the_backends_grouped_gemm(emulated):
    recipe = qr.Float8CurrentScaling()  # HYBRID: E5M2 gradients, which the kernel does not take
    got, paths = _step(COUNTS, recipe)
    assert paths == {"scaled_grouped_mm": 1, "fp8_grouped_gemm": 2}
    emulated.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", set())
    want, paths = _step(COUNTS, recipe)
    assert paths == {"per_group": 3}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("counts, per_group, e5m2_path", [
    (COUNTS, False, "fp8_grouped_gemm"), (COUNTS, True, "scaled_mm_per_group"),
    ([3, 0, 5, 16] * 16, True, "fp8_grouped_gemm")])
def test_e5m2_gradients_route_by_expert_count(emulated, counts, per_group, e5m2_path):
    """The GEMMs of an E5M2 x E4M3 pair run the backend's grouped kernel (no host read); with
    ``CUBLAS_PER_GROUP``, cuBLAS per group below ``OWN_KERNEL_MIN_EXPERTS`` (64) experts (one
    host read of the bounds per backward) and the grouped kernel from 64 on; either within the
    accumulation bound of the per-group path."""
    emulated.setattr(grouped_fp8_gemm, "OWN_KERNEL_MIN_EXPERTS", 64)
    emulated.setattr(grouped_fp8_gemm, "CUBLAS_PER_GROUP", per_group)
    recipe = qr.Float8CurrentScaling()
    got, paths = _step(counts, recipe)
    assert paths == {"scaled_grouped_mm": 1, e5m2_path: 2}
    emulated.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", set())
    want, paths = _step(counts, recipe)
    assert paths == {"per_group": 3}
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-2, atol=1e-2)


def test_every_gemm_on_the_backends_grouped_gemm_when_torchs_takes_none(emulated):
    emulated.setattr(grouped_fp8_gemm, "_runs", lambda device_type, dtype: False)
    recipe = qr.Float8CurrentScaling(fp8_format=qr.Format.E4M3)
    got, paths = _step(COUNTS, recipe)
    assert paths == {"fp8_grouped_gemm": 3}
    emulated.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", set())
    want, _ = _step(COUNTS, recipe)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_frozen_weight_and_frozen_input_keep_only_what_backward_reads(emulated):
    """Only the weight gradient (an input that needs none), or only the input gradient (a frozen
    weight): the forward keeps one transposed copy, and the gradient equals the full step's."""
    recipe = qr.Float8CurrentScaling()
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16)
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16)
    gy = torch.randn(sum(COUNTS), N, dtype=torch.bfloat16)
    counts = torch.tensor(COUNTS)
    xg = x.clone().requires_grad_()
    with qr.autocast(recipe=recipe):
        m(xg, counts=counts).backward(gy)
    full_dx, full_dw = xg.grad, m.weight.grad
    m.weight.grad = None
    with qr.autocast(recipe=recipe):
        m(x, counts=counts).backward(gy)
    assert torch.equal(m.weight.grad, full_dw)
    m.weight.requires_grad_(False)
    xg = x.clone().requires_grad_()
    with qr.autocast(recipe=recipe):
        m(xg, counts=counts).backward(gy)
    assert torch.equal(xg.grad, full_dx)


def test_other_operands_keep_their_paths(emulated):
    for recipe, want in ((qr.MXFP8BlockScaling(), {"per_group": 3}),
                         (qr.Float8CurrentScaling(backward_override="dequantized"),
                          {"scaled_grouped_mm": 1, "per_group": 2})):
        assert _step(COUNTS, recipe)[1] == want
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, bias=True, dtype=torch.bfloat16)
    qr.reset_grouped_gemm_paths()
    with torch.no_grad(), qr.autocast(recipe=qr.Float8CurrentScaling(fp8_format=qr.Format.E4M3)):
        m(torch.randn(sum(COUNTS), K, dtype=torch.bfloat16), counts=torch.tensor(COUNTS))
    # torch's grouped kernel gives no fp32 product to add a bias to: the backend's does
    assert qr.grouped_gemm_paths() == {"fp8_grouped_gemm": 1}


def test_widths_not_multiples_of_16_run_per_group(emulated):
    torch.manual_seed(0)
    m = qr.GroupedLinear(2, 24, N, dtype=torch.bfloat16)
    qr.reset_grouped_gemm_paths()
    with torch.no_grad(), qr.autocast(recipe=qr.Float8CurrentScaling(fp8_format=qr.Format.E4M3)):
        m(torch.randn(8, 24, dtype=torch.bfloat16), counts=torch.tensor([3, 5]))
    assert qr.grouped_gemm_paths() == {"per_group": 1}


# ----------------------------------------------------------------------- on a CUDA device
def _cuda_fp8_grouped():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not grouped_fp8_gemm._runs("cuda", torch.float8_e4m3fn):
        return "torch._scaled_grouped_mm does not run on this GPU"
    return None


@pytest.mark.skipif(_cuda_fp8_grouped() is not None, reason=str(_cuda_fp8_grouped()))
def test_cuda_bytes_equal_the_per_group_quantize():
    """On the GPU (Triton there): the batched bytes in both row layouts and the experts' bytes
    (an expert's rows a multiple of the cast tile's and not) equal one quantize per group."""
    dev = "cuda"
    counts = [0, 1, 37, 200, 16, 0, 5, 61]
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    starts = grouped_fp8.padded_starts(offs.tolist(), ALIGN)
    for qid in QUANTIZERS:
        x = _rows(counts, torch.bfloat16).to(dev)
        q = _quantizer(qid)
        lay = grouped_fp8.layout(offs, x.shape[0], ALIGN)
        for padded in (False, True):
            data, trans, sinv = grouped_fp8.quantize_rows(x, lay, q, True, True, padded)
            s = 0
            for g, want in enumerate(_per_group(x, counts, q)):
                if want is not None:
                    p, mp, m = starts[g], want[0].shape[0], counts[g]
                    got = data[p:p + mp] if padded else data[s:s + m]
                    assert torch.equal(got, want[0] if padded else want[0][:m]), (qid, g)
                    assert torch.equal(trans[:, p:p + mp], want[1]), (qid, g)
                    assert torch.equal(sinv[g, :1], want[2]), (qid, g)
                    s += m
        for n in (128, 72):
            w = (torch.randn(3, n, 256, device=dev) * 10).to(torch.bfloat16)
            wd, wt, ws = grouped_fp8.quantize_experts(w, q, True, True)
            for e in range(3):
                want = q.quantize(w[e]).buffer_list(w[e])
                assert torch.equal(wd[e], want[0]) and torch.equal(wt[e], want[1]), (qid, n, e)
                assert torch.equal(ws[e, :1], want[2]), (qid, n, e)


@pytest.mark.skipif(_cuda_fp8_grouped() is not None, reason=str(_cuda_fp8_grouped()))
@pytest.mark.parametrize("route", ["grouped", "grouped_padded_rows", "own_kernel", "cublas"])
@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_cuda_grouped_gemms_within_the_bound(monkeypatch, route, fmt):
    """On the GPU, each GEMM of the quantize-once path (torch's grouped kernel with unpadded or
    padded row groups, the backend's own grouped kernel, or cuBLAS per group; HYBRID's E5M2
    gradients the own kernel, or cuBLAS for ``cublas``) lies within
    the stated bound of the per-group path's (``torch._scaled_mm`` per group, each group
    quantized alone): ``|got - want| <= 2^-7 |want| + 2^-11 (|A| |B|)``, the second term from
    the operands' absolute product."""
    dev, e, k, n = "cuda", 8, 256, 128
    counts = [0, 1, 37, 200, 16, 0, 5, 61]
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    print("unpadded row groups run:", grouped_fp8_gemm.unpadded_rows_run("cuda"))
    if route == "grouped_padded_rows":
        monkeypatch.setattr(grouped_fp8_gemm, "unpadded_rows_run", lambda device_type: False)
    elif route in ("own_kernel", "cublas"):
        monkeypatch.setattr(grouped_fp8_gemm, "_runs", lambda device_type, dtype: False)
    monkeypatch.setattr(grouped_fp8_gemm, "OWN_KERNEL_MIN_EXPERTS",
                        1 << 30 if route == "cublas" else 0)
    monkeypatch.setattr(grouped_fp8_gemm, "CUBLAS_PER_GROUP", route == "cublas")
    monkeypatch.setattr(grouped_fp8_gemm, "ROUTE", "scaled_grouped_mm")
    torch.manual_seed(0)
    m = qr.GroupedLinear(e, k, n, dtype=torch.bfloat16, device=dev)
    rows = torch.logspace(-2, 2, sum(counts), device=dev)[:, None]
    x = (torch.randn(sum(counts), k, device=dev) * rows).to(torch.bfloat16)
    gy = torch.randn(sum(counts), n, device=dev, dtype=torch.bfloat16)
    results = []
    for devices in ({"cuda"}, set()):
        monkeypatch.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", devices)
        xi = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        qr.reset_grouped_gemm_paths()
        with qr.autocast(recipe=qr.Float8CurrentScaling(fp8_format=getattr(qr.Format, fmt))):
            y = m(xi, offs)
        y.backward(gy)
        results.append(((y.detach(), xi.grad, m.weight.grad), qr.grouped_gemm_paths()))
    (got, paths), (want, want_paths) = results
    want_fast = {"own_kernel": {"fp8_grouped_gemm": 3}, "cublas": {"scaled_mm_per_group": 3}}.get(
        route, {"scaled_grouped_mm": 3} if fmt == "E4M3"
        else {"scaled_grouped_mm": 1, "fp8_grouped_gemm": 2})
    assert paths == want_fast and want_paths == {"per_group": 3}
    ax, aw, ag = x.float().abs(), m.weight.detach().float().abs(), gy.float().abs()
    spans = list(zip([0, *offs.tolist()[:-1]], counts, strict=True))
    mags = [torch.cat([ax[s:s + c] @ aw[g].t() for g, (s, c) in enumerate(spans)]),
            torch.cat([ag[s:s + c] @ aw[g] for g, (s, c) in enumerate(spans)]),
            torch.stack([ag[s:s + c].t() @ ax[s:s + c] for s, c in spans])]
    for name, a, b, s in zip(("y", "dx", "dw"), got, want, mags, strict=True):
        err = (a.float() - b.float()).abs()
        bound = 2.0 ** -7 * b.float().abs() + 2.0 ** -11 * s
        print(f"{route} {fmt} {name}: max |diff| {err.max().item():.3e}, max |diff| / bound "
              f"{(err / bound.clamp_min(1e-30)).max().item():.3f}, "
              f"bitwise equal {(err == 0).float().mean().item():.4f}")
        assert bool((err <= bound).all()), name


# ------------------------------------------------------------------ under torch.compile
def _compiled_counter():
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not (quant_dynamo.compile_supported() and quant_dynamo.DERIVES_IN_GRAPH):
        pytest.skip("this torch cannot read a baked quantizer's value key (grouped ops need it)")
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    return CompileCounterWithBackend("aot_eager")


def _layer_steps(recipe, counter, **flags):
    """``(layer, step, compiled step, x, gy)``: a GroupedLinear over ``COUNTS`` rows (``flags``
    its copy flags), its step under ``recipe`` and that step compiled with ``fullgraph=True``
    by ``counter``."""
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, **flags)

    def step(x, counts):
        with qr.autocast(recipe=recipe):
            return m(x, counts=counts)

    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16)
    gy = torch.randn(sum(COUNTS), N, dtype=torch.bfloat16)
    return m, step, torch.compile(step, fullgraph=True, backend=counter), x, gy


def _recorded_quantize_calls(monkeypatch) -> list:
    """``(rows' shape, keywords)`` of every call of the CPU backend's
    ``fp8_group_quantize_rows`` from now on (``amax`` and ``x_rows`` always listed)."""
    backend = backends.get(None, "cpu")
    quantize, calls = backend.fp8_group_quantize_rows, []

    def recording(x, *args, amax=None, x_rows=None, **kw):
        calls.append((tuple(x.shape), {**kw, "amax": amax, "x_rows": x_rows}))
        return quantize(x, *args, amax=amax, x_rows=x_rows, **kw)

    monkeypatch.setattr(backend, "fp8_group_quantize_rows", recording)
    return calls


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_compiled_fullgraph_equals_eager_without_recompiles(emulated, fmt):
    """The quantize-once ops compiled with ``fullgraph=True``: bitwise the eager step, one
    frame for every routing (the groups' sizes never reach the graph)."""
    counter = _compiled_counter()
    recipe = qr.Float8CurrentScaling(fp8_format=getattr(qr.Format, fmt))
    m, step, compiled, x, gy = _layer_steps(recipe, counter)
    for counts in (COUNTS, [12] * 6 + [9], [0, 0, 81, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 60]):
        results = []
        for fn in (compiled, step):
            xi = x.clone().requires_grad_()
            m.zero_grad(set_to_none=True)
            qr.reset_grouped_gemm_paths()
            y = fn(xi, torch.tensor(counts))
            y.backward(gy)
            results.append((y.detach(), xi.grad, m.weight.grad, qr.grouped_gemm_paths()))
        for a, b in zip(*results, strict=True):
            assert a == b if isinstance(a, dict) else torch.equal(a, b)
    assert counter.frame_count == 1


def test_compiled_layer_of_few_experts_probes_torchs_kernel_outside_the_graph(monkeypatch):
    """A layer of fewer than ``OWN_KERNEL_MIN_EXPERTS`` experts asks, while Dynamo traces it,
    whether ``torch._scaled_grouped_mm`` takes HYBRID's E5M2 gradients: the probe runs torch's
    kernel on real tensors once and is baked as a constant, not traced (Dynamo traces through
    a cache decorator, and the traced probe's E5M2 call fails the compile). Bitwise the eager
    step."""
    monkeypatch.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(grouped_fp8_gemm, "_per_group_runs", lambda device: True)
    assert len(COUNTS) < grouped_fp8_gemm.OWN_KERNEL_MIN_EXPERTS
    counter = _compiled_counter()
    m, step, compiled, x, gy = _layer_steps(qr.Float8CurrentScaling(), counter)
    results = []
    for fn in (compiled, step):
        xi = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = fn(xi, torch.tensor(COUNTS))
        y.backward(gy)
        results.append((y.detach(), xi.grad, m.weight.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert counter.frame_count == 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the grouped kernels run here through Triton's interpreter")
@pytest.mark.parametrize("compiled", [False, True])
def test_whole_chunk_groups_give_the_same_bits(emulated, compiled):
    """``TOKENS_GROUP_MULTIPLE`` 128: the layout pads every group to whole chunks of the weight
    gradient's contraction and tells the backend's kernel so (it then loads the chunks from
    descriptors made on the host); the outputs and gradients are those of the 16-row layout,
    bit for bit, eagerly and compiled."""
    require_triton_backend()
    emulated.setattr(grouped_fp8_gemm, "_runs", lambda device_type, dtype: False)
    backend = backends.get("triton")
    tokens_gemm, multiples = backend.fp8_grouped_tokens_gemm, []

    def recording(a, sa, b, sb, ends, group_multiple=16, **kw):
        multiples.append((group_multiple, int(ends[-1]) % group_multiple))
        return tokens_gemm(a, sa, b, sb, ends, group_multiple=group_multiple, **kw)

    emulated.setattr(backend, "fp8_grouped_tokens_gemm", recording)
    counter = _compiled_counter() if compiled else None
    recipe = qr.Float8CurrentScaling()
    results = []
    for multiple in (16, 128):
        emulated.setattr(grouped_fp8_gemm, "TOKENS_GROUP_MULTIPLE", multiple)
        m, step, compiled_step, x, gy = _layer_steps(recipe, counter or "eager")
        x.requires_grad_()
        with backends.using("triton"):
            y = (compiled_step if compiled else step)(x, torch.tensor(COUNTS))
            y.backward(gy)
        results.append((y.detach(), x.grad, m.weight.grad))
        torch._dynamo.reset()
    assert multiples == [(16, 0), (128, 0)]  # the layout's groups end on the multiple
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("save_input_copy", [True, False])
def test_compiled_layer_gives_the_quantize_its_rows_amaxes(emulated, monkeypatch,
                                                           save_input_copy):
    """Under ``torch.compile`` the layer computes each row's amax of its input in the graph
    (where Inductor fuses it into the kernel that makes the input), so the input's grouped
    quantize runs no amax pass; eager code keeps the pass, and so does the output gradient's
    quantize. The same bytes either way: bitwise the eager step."""
    calls = _recorded_quantize_calls(monkeypatch)
    m, step, compiled, x, gy = _layer_steps(qr.Float8CurrentScaling(), _compiled_counter(),
                                            save_input_copy=save_input_copy)
    results = {}
    for name, fn in (("compiled", compiled), ("eager", step)):
        calls.clear()
        xi = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        fn(xi, torch.tensor(COUNTS)).backward(gy)
        results[name] = (xi.grad, m.weight.grad,
                         [kw["amax"] is not None or kw.get("row_amax") is not None
                          for _, kw in calls])
    # forward's input; in backward the output gradient with the quantize's own amax pass,
    # then, without a kept copy, the input again (from forward's amaxes) for the weight
    # gradient
    again = [] if save_input_copy else [True]
    assert results["compiled"][2] == [True, False, *again]
    assert results["eager"][2] == [False, False, *again]
    for a, b in zip(results["compiled"][:2], results["eager"][:2], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("save_input_copy", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_routed_rows_are_quantized_where_they_lie(emulated, monkeypatch, save_input_copy,
                                                  compiled):
    """``project(x, ..., routes)`` (a mixture-of-experts block's tokens, each routed to ``k``
    experts): the grouped quantize reads the rows in ``x`` (no gathered copy), and the output
    and the gradients equal, bitwise, those of the projection of the gathered copy
    (``gather_tokens``: each token's gradient the sum of its copies'), eager and compiled,
    keeping the input's transposed bytes or the input."""
    if compiled:
        _compiled_counter()
    calls = _recorded_quantize_calls(monkeypatch)
    tokens, k, experts = 30, 3, 7
    routes, offs = _routed(tokens, k, experts)
    torch.manual_seed(0)
    proj = GroupedProjection(experts, K, N, save_input_copy=save_input_copy)
    w = torch.randn(experts, N, K, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(tokens, K, dtype=torch.bfloat16)
    gy = torch.randn(tokens * k, N, dtype=torch.bfloat16)
    recipe = qr.Float8CurrentScaling()

    def in_place(x, w):
        with qr.autocast(recipe=recipe):
            return proj.project(x, offs, w, None, routes=routes)

    def on_a_copy(x, w):
        with qr.autocast(recipe=recipe):
            return proj.project(gather_tokens(x, routes), offs, w, None)

    results = []
    for fn in (in_place, on_a_copy):
        calls.clear()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
        xi = x.clone().requires_grad_()
        w.grad = None
        y = fn(xi, w)
        y.backward(gy)
        results.append((y.detach(), xi.grad, w.grad,
                        [(shape, kw["x_rows"] is not None) for shape, kw in calls]))
    (*got, got_reads), (*want, copy_reads) = results
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # every quantize but the output gradient's ([tokens * k, N]) reads the input's rows
    got_reads = [r for r in got_reads if r[0] != (tokens * k, N)]
    copy_reads = [r for r in copy_reads if r[0] != (tokens * k, N)]
    assert all(shape == (tokens, K) and given for shape, given in got_reads)
    assert all(shape == (tokens * k, K) and not given for shape, given in copy_reads)
    assert len(got_reads) == (1 if save_input_copy else 2)


def _fp8_bprop_ops(gy, lay, xt, sx, wt, sw, q, dgrad, wgrad, fast_dgrad=False,
                   fast_wgrad=False, group_multiple=16, requant_x=False, requant_w=False,
                   x_rows=None, check=False, padded=False):
    """``(dx, dw)`` of backward's three ops (None where not asked for), each opchecked with
    ``check``."""
    ops = torch.ops.quant_recipes

    def run(op, *args):
        if check:
            torch.library.opcheck(op, args)
        return op(*args)

    gd, gt, sg = run(ops.grouped_fp8_grad_bytes.default, gy, lay, q, dgrad, wgrad, padded)
    dx = (run(ops.grouped_fp8_dgrad.default, gd, sg, lay, wt, sw, q, padded, fast_dgrad,
              requant_w) if dgrad else None)
    dw = (run(ops.grouped_fp8_wgrad.default, gt, sg, lay, xt, sx, q, fast_wgrad,
              group_multiple, requant_x, x_rows) if wgrad else None)
    return dx, dw


def _same(a, b) -> bool:
    return (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_opcheck_fp8_ops(emulated):
    """``torch.library.opcheck`` of ``grouped_fp8_fprop`` / ``grouped_fp8_dgrad`` /
    ``grouped_fp8_wgrad``, with every transposed copy kept and with none, backward's ops also
    given the input or weight itself to quantize again (``requant_x`` / ``requant_w``): the
    same gradients, and the same as the eager backward's."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not quant_dynamo.DERIVES_IN_GRAPH:
        pytest.skip("this torch reads no member of a baked quantizer (grouped ops need its key)")
    from quant_recipes.moe.ops import quantizer_spec

    q = _quantizer("e4m3")
    g = _quantizer("e5m2")
    specs = [quantizer_spec(q), quantizer_spec(q)]
    torch.manual_seed(0)
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16)
    w = torch.randn(len(COUNTS), N, K, dtype=torch.bfloat16)
    gy = torch.randn(sum(COUNTS), N, dtype=torch.bfloat16)
    layout = grouped_fp8.layout(torch.tensor(COUNTS).cumsum(0), x.shape[0], ALIGN)
    lay = layout.tensors()
    fprop = torch.ops.quant_recipes.grouped_fp8_fprop.default
    b = torch.randn(len(COUNTS), N, dtype=torch.bfloat16)
    for keep in (True, False):
        for bias in (None, b):
            torch.library.opcheck(fprop, (x, lay, w, bias, specs, keep, keep))
    torch.library.opcheck(fprop, (x, lay, w, None, specs, True, True, True))
    _, xt, sx, wt, sw = fprop(x, lay, w, None, specs, True, True)
    gspecs = [quantizer_spec(g), *specs]
    for dgrad, wgrad in ((True, True), (True, False), (False, True)):
        dx, dw = _fp8_bprop_ops(gy, lay, xt, sx, wt, sw, gspecs, dgrad, wgrad, check=True)
        eager = grouped_fp8_gemm.backward(gy, layout, xt, sx, wt, sw, g, q, q, dgrad, wgrad)
        assert _same(dx, eager[0]) and _same(dw, eager[1])
    _fp8_bprop_ops(gy, lay, xt, sx, wt, sw, gspecs, True, True, True, True, check=True)
    padded = _fp8_bprop_ops(gy, lay, xt, sx, wt, sw, gspecs, True, True, check=True,
                            padded=True)  # the rowwise gradient bytes in the padded layout
    both = grouped_fp8_gemm.backward(gy, layout, xt, sx, wt, sw, g, q, q, True, True)
    assert all(torch.equal(a, b) for a, b in zip(padded, both, strict=True))
    # the rows' amaxes computed by the caller, and routed rows read where they lie
    routes, offs = _routed(x.shape[0] // 2, 2, len(COUNTS))
    rows = routes.rows
    routed = grouped_fp8.layout(offs, rows.shape[0], ALIGN).tensors()
    tokens = x[:rows.shape[0] // 2]
    torch.library.opcheck(fprop, (x, lay, w, None, specs, True, True, False, row_amaxes(x)))
    torch.library.opcheck(fprop, (tokens, routed, w, None, specs, False, True, False,
                                  row_amaxes(tokens)[rows], rows))
    # backward given the input and the weight themselves, quantizing them again
    want = _fp8_bprop_ops(gy, lay, xt, sx, wt, sw, gspecs, True, True)
    for requant_x, requant_w in ((True, False), (False, True), (True, True)):
        got = _fp8_bprop_ops(gy, lay, x if requant_x else xt, sx, w if requant_w else wt, sw,
                             gspecs, True, True, False, False, 16, requant_x, requant_w,
                             check=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    _, rxt, rsx, _, _ = fprop(tokens, routed, w, None, specs, True, False, False, None, rows)
    gy_routed = torch.randn(rows.shape[0], N, dtype=torch.bfloat16)
    routed_want = _fp8_bprop_ops(gy_routed, routed, rxt, rsx, wt, sw, gspecs, False, True)
    got = _fp8_bprop_ops(gy_routed, routed, tokens, rsx, wt, sw, gspecs, False, True, False,
                         False, 16, True, False, rows, check=True)
    assert torch.equal(got[1], routed_want[1])
    # the weight's bytes given (kept after an optimizer step): the same output, no weight bytes
    wd, _, _ = grouped_fp8.quantize_experts(w, q, True, False)
    torch.library.opcheck(fprop, (x, lay, w, None, specs, True, False, False, None, None, wd,
                                  sw))
    given = fprop(x, lay, w, None, specs, True, False, False, None, None, wd, sw)
    assert torch.equal(given[0], fprop(x, lay, w, None, specs, True, False)[0])
    assert given[3].numel() == 0 and torch.equal(given[4], sw)


def test_no_rows_at_all(emulated):
    """A step with no tokens: an empty output and input gradient, a zero weight gradient."""
    recipe = qr.Float8CurrentScaling()
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16)
    x = torch.zeros(0, K, dtype=torch.bfloat16, requires_grad=True)
    qr.reset_grouped_gemm_paths()
    with qr.autocast(recipe=recipe):
        y = m(x, counts=torch.zeros(len(COUNTS), dtype=torch.int64))
    y.backward(torch.zeros(0, N, dtype=torch.bfloat16))
    assert y.shape == (0, N) and x.grad.shape == (0, K)
    assert torch.equal(m.weight.grad, torch.zeros_like(m.weight))
    assert qr.grouped_gemm_paths() == {"scaled_grouped_mm": 1, "fp8_grouped_gemm": 2}


@pytest.mark.parametrize("inside", [True, False])
def test_activation_checkpointing(emulated, inside):
    """Recomputed in backward, inside autocast or outside it (under the forward's frame): the
    same output and gradients as without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    recipe = qr.Float8CurrentScaling()
    want, _ = _step(COUNTS, recipe)
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, name="experts")
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16).requires_grad_()
    gy = torch.randn(sum(COUNTS), N, dtype=torch.bfloat16)
    qr.reset_grouped_gemm_paths()
    with qr.autocast(recipe=recipe):
        y = checkpoint(m, x, counts=torch.tensor(COUNTS), use_reentrant=False)
        if inside:
            y.backward(gy)
    if not inside:
        y.backward(gy)
    for a, b in zip((y.detach(), x.grad, m.weight.grad), want, strict=True):
        assert torch.equal(a, b)
    assert qr.grouped_gemm_paths() == {"scaled_grouped_mm": 2, "fp8_grouped_gemm": 2}


def test_compiled_dynamic_shapes_equal_eager(emulated):
    """``dynamic=True``: other token counts run the same compiled code, bitwise the eager step.
    (The first call may trace its frame twice: dynamo restarts the analysis once to turn a
    Python float into a tensor; later calls compile nothing.)"""
    counter = _compiled_counter()
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16)
    recipe = qr.Float8CurrentScaling()

    def step(x, counts):
        with qr.autocast(recipe=recipe):
            return m(x, counts=counts)

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    frames = []
    for counts in (COUNTS, [3, 0, 0, 20, 1, 0, 9], [40, 2, 7, 0, 0, 1, 30]):
        x = torch.randn(sum(counts), K, dtype=torch.bfloat16)
        gy = torch.randn(sum(counts), N, dtype=torch.bfloat16)
        results = []
        for fn in (compiled, step):
            xi = x.clone().requires_grad_()
            m.zero_grad(set_to_none=True)
            fn(xi, torch.tensor(counts)).backward(gy)
            results.append((xi.grad, m.weight.grad))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)
        frames.append(counter.frame_count)
    assert frames[0] <= 2 and frames[1:] == [frames[0]] * 2


def test_a_token_alignment_off_16_runs_per_group(emulated):
    """A CustomRecipe's alignment that is not a multiple of 16: the GEMMs over tokens could not
    contract over whole padded groups, so the layer runs ``"per_group"``."""
    fp8 = Float8CurrentScalingQuantizer(dtype=DType.E4M3)
    recipe = qr.CustomRecipe(qfactory=lambda role: fp8, quantization_alignment=8)
    assert _step(COUNTS, recipe)[1] == {"per_group": 3}
    recipe = qr.CustomRecipe(qfactory=lambda role: fp8, quantization_alignment=32)
    assert _step(COUNTS, recipe)[1] == {"scaled_grouped_mm": 3}


def _saved(fn):
    """The tensors autograd saves while ``fn`` runs: ``(dtype, shape)`` of each."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("save_weight_copy, save_input_copy", [(False, True), (True, False),
                                                                (False, False)])
def test_without_copies_backward_quantizes_again_to_the_same_bits(emulated, save_weight_copy,
                                                                  save_input_copy, compiled):
    """``save_weight_copy=False`` / ``save_input_copy=False``: backward keeps the bf16 weight /
    input instead of its transposed FP8 bytes and quantizes it again, from forward's amaxes (no
    amax pass): the same gradients, bit for bit, eagerly and compiled."""
    recipe = qr.Float8CurrentScaling()
    want, _ = _step(COUNTS, recipe)
    backend = backends.get(None, torch.device("cpu"))
    again = []  # per quantize of a transposed copy alone (backward's): was the amax given?

    def spy(name):
        real = getattr(backend, name)

        def quantize(*args, **kw):
            if not kw["rowwise"]:
                again.append((name, kw.get("amax") is not None))
            return real(*args, **kw)
        return quantize

    for name in ("fp8_group_quantize_rows", "fp8_group_quantize_experts"):
        emulated.setattr(backend, name, spy(name), raising=False)
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, name="experts",
                         save_weight_copy=save_weight_copy, save_input_copy=save_input_copy)
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16).requires_grad_()
    gy = torch.randn(sum(COUNTS), N, dtype=torch.bfloat16)
    assert ("save_weight_copy=True" in repr(m)) == save_weight_copy
    assert ("save_input_copy=False" in repr(m)) != save_input_copy

    def step(x, counts):
        with qr.autocast(recipe=recipe):
            return m(x, counts=counts)

    if compiled:
        _compiled_counter()
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    y, saved = _saved(lambda: step(x, torch.tensor(COUNTS)))
    y.backward(gy)
    for a, b in zip((y.detach(), x.grad, m.weight.grad), want, strict=True):
        assert torch.equal(a, b)
    assert sorted(again) == sorted(
        [("fp8_group_quantize_experts", True)] * (not save_weight_copy)
        + [("fp8_group_quantize_rows", True)] * (not save_input_copy))
    if not compiled:
        kept = {shape for dtype, shape in saved if dtype == torch.uint8}
        assert ((len(COUNTS), K, N) in kept) == save_weight_copy
        assert any(s[0] == K for s in kept if len(s) == 2) == save_input_copy
        assert (((len(COUNTS), N, K) in {s for d, s in saved if d == torch.bfloat16})
                != save_weight_copy)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("save_input_copy", [True, False])
def test_the_weights_fp8_bytes_are_released_before_the_weight_gradient(emulated, compiled,
                                                                      save_input_copy):
    """Backward casts the weight's transposed bytes again for the input gradient and releases
    them, and the output gradient's rowwise bytes, before the weight gradient's GEMM makes its
    ``[E, N, K]`` output: at an expert block's widths the two would otherwise take memory at
    once (a Mixtral layer: 0.94 GB of FP8 weight beside a 1.9 GB gradient)."""
    made = []
    track_first_output(emulated, grouped_fp8_gemm, "weight_transposed", made)
    # the output gradient's two layouts
    track_first_output(emulated, grouped_fp8_gemm, "quantize_rows", made,
                       lambda x, lay, q, rowwise, columnwise, **kw:
                       rowwise and columnwise and x.shape[1] == N)
    alive_at_wgrad = log_alive_at(emulated, grouped_fp8_gemm, "tokens_gemm", made)
    recipe = qr.Float8CurrentScaling()
    want, _ = _step(COUNTS, recipe)
    made.clear()
    alive_at_wgrad.clear()
    m, step, compiled_step, x, gy = _layer_steps(
        recipe, _compiled_counter() if compiled else "aot_eager", save_input_copy=save_input_copy)
    x.requires_grad_()
    y = (compiled_step if compiled else step)(x, torch.tensor(COUNTS))
    y.backward(gy)
    for a, b in zip((y.detach(), x.grad, m.weight.grad), want, strict=True):
        assert torch.equal(a, b)
    assert len(made) == 2 and alive_at_wgrad == [[False, False]]


def test_compiled_backward_releases_the_output_gradient_once_it_is_quantized(emulated):
    """Compiled, the output gradient (bf16 ``[T, N]``: 0.94 GB at a Mixtral layer's gate/up
    projection) is released once it is quantized, before either backward GEMM makes its
    output: the graph's first backward op reads it, the GEMM ops only its FP8 bytes. (Eager
    code cannot release it: autograd holds a Function's output gradient until its backward
    returns.)"""
    import weakref

    grads = []
    real_rows = grouped_fp8_gemm.quantize_rows

    def rows(x, lay, q, rowwise, columnwise, **kw):
        if columnwise and x.shape[1] == N:  # the output gradient
            grads.append(weakref.ref(x))
        return real_rows(x, lay, q, rowwise, columnwise, **kw)

    emulated.setattr(grouped_fp8_gemm, "quantize_rows", rows)
    # rows_gemm: forward's GEMM, then the input gradient's
    alive_at_dgrad = log_alive_at(emulated, grouped_fp8_gemm, "rows_gemm", grads)
    alive_at_wgrad = log_alive_at(emulated, grouped_fp8_gemm, "tokens_gemm", grads)
    recipe = qr.Float8CurrentScaling()
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16)

    def step(x, counts):
        with qr.autocast(recipe=recipe):  # the layer's output gradient is made in the graph
            return m(x, counts=counts).float().square().sum()

    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16)
    results = []
    for fn in (torch.compile(step, fullgraph=True, backend=_compiled_counter()), step):
        xi = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        fn(xi, torch.tensor(COUNTS)).backward()
        results.append((xi.grad, m.weight.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert len(grads) == 2
    # compiled, then eager
    assert alive_at_dgrad == [[], [False], [False], [False, True]]
    assert alive_at_wgrad == [[False], [False, True]]


def test_by_default_backward_keeps_the_input_copy_and_the_weight_itself(emulated):
    """The defaults: backward keeps the input's transposed FP8 bytes, and the bf16 weight (a
    parameter) rather than its FP8 copy, whose bytes it casts again; the repr names neither
    flag."""
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, name="experts")
    assert "save_" not in repr(m)
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16).requires_grad_()
    with qr.autocast(recipe=qr.Float8CurrentScaling()):
        y, saved = _saved(lambda: m(x, counts=torch.tensor(COUNTS)))
    y.sum().backward()
    kept = {shape for dtype, shape in saved if dtype == torch.uint8}
    assert (len(COUNTS), K, N) not in kept
    assert any(s[0] == K for s in kept if len(s) == 2)
    assert (len(COUNTS), N, K) in {s for d, s in saved if d == torch.bfloat16}


def test_a_module_pickled_without_the_copy_flags_loads_and_runs(emulated):
    """A whole GroupedLinear saved before ``save_weight_copy`` / ``save_input_copy`` existed
    (no such attributes in its state) loads with ``torch.load`` and runs with the defaults."""
    from _pickling import pickled_without

    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, name="experts")
    old = pickled_without(m, "save_weight_copy", "save_input_copy")
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16)
    with qr.autocast(recipe=qr.Float8CurrentScaling()):
        y = old(x, counts=torch.tensor(COUNTS))
    assert y.shape == (sum(COUNTS), N) and "save_weight_copy" not in repr(old)


@pytest.mark.parametrize("qid", list(QUANTIZERS))
def test_a_weight_stored_transposed_quantizes_where_it_lies(impl, qid, monkeypatch):
    """GPT-OSS stores its experts ``[E, in, out]``: the transposed view quantizes to the bytes of
    its contiguous copy, in both layouts, without the copy (the backend reads the stored
    tensor)."""
    torch.manual_seed(0)
    stored = torch.randn(3, K, N, dtype=torch.bfloat16) * torch.logspace(-2, 2, 3)[:, None, None]
    w = stored.transpose(1, 2)
    q = _quantizer(qid)
    want = grouped_fp8.quantize_experts(w.contiguous(), q, True, True)
    backend = backends.get(None, w.device)
    quantize, read = backend.fp8_group_quantize_experts, []

    def spy(x, **kw):
        read.append(x.data_ptr())
        return quantize(x, **kw)

    monkeypatch.setattr(backend, "fp8_group_quantize_experts", spy, raising=False)
    got = grouped_fp8.quantize_experts(w, q, True, True)
    assert read == [stored.data_ptr()]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for rowwise, columnwise in ((True, False), (False, True)):
        part = grouped_fp8.quantize_experts(w, q, rowwise, columnwise)
        assert (part[0] is None) != rowwise and (part[1] is None) != columnwise
        assert torch.equal(part[2], want[2])


def test_scale_inverse_padding_is_written_zero(impl, monkeypatch):
    """The scale-inverses' pitch columns are zero whatever the buffer held before (a fresh
    buffer here is filled with NaN)."""
    empty = torch.empty

    def dirty(*args, **kw):
        t = empty(*args, **kw)
        return t.fill_(float("nan")) if t.dtype == torch.float32 else t

    monkeypatch.setattr(torch, "empty", dirty)
    x = _rows(COUNTS, torch.bfloat16)
    lay = grouped_fp8.layout(torch.tensor(COUNTS).cumsum(0), x.shape[0], ALIGN)
    _, _, sinv = grouped_fp8.quantize_rows(x, lay, _quantizer("e4m3"), True, True)
    assert not sinv[:, 2:].isnan().any() and not sinv[:, 2:].any()
    assert torch.equal(sinv[:, 1], _group_amaxes(x, COUNTS))
    w = torch.randn(3, N, K, dtype=torch.bfloat16)
    sinv = grouped_fp8.quantize_experts(w, _quantizer("e4m3"), True, False)[2]
    assert not sinv[:, 2:].isnan().any() and not sinv[:, 2:].any()
    assert torch.equal(sinv[:, 1], _group_amaxes(w.reshape(3 * N, K), [N] * 3))


@pytest.mark.parametrize("shape", [(3, 4, 16), (3, 4, 12), (2, 5, 8)])
def test_rows_moved_is_the_transposed_copy(shape):
    t = torch.randint(0, 256, shape, dtype=torch.uint8)
    got = grouped_fp8.rows_moved(t)
    assert got.is_contiguous() and torch.equal(got, t.transpose(0, 1))
    odd = grouped_fp8.rows_moved(t[:, :, 1:])  # rows off the 8-byte grid: copied as they are
    assert torch.equal(odd, t[:, :, 1:].transpose(0, 1))


def _hf_experts_block():
    """A converted Qwen3-MoE experts block (8 experts of width 32, top-2) from a config."""
    return qwen3_moe_experts(qr.Float8CurrentScaling(), hidden=K, expert_width=32)


@pytest.mark.parametrize("compiled", [None, "static", "dynamic"])
def test_hf_experts_quantize_their_routed_rows_where_they_lie(emulated, monkeypatch, compiled):
    """A converted Hugging Face experts block on the quantize-once path, eager and compiled
    (static and dynamic token counts, a step of no tokens): its up projection's quantize reads
    the hidden states through the routes, and the block equals, bitwise, the block that
    gathers the routed rows into a copy first (outputs and every gradient)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    experts, recipe = _hf_experts_block(), qr.Float8CurrentScaling()
    calls = _recorded_quantize_calls(monkeypatch)
    project = GroupedProjection.project

    def gathering_first(self, x, offs, w, b, layouts=None, routes=None, param=None):
        return project(self, x if routes is None else gather_tokens(x, routes), offs, w, b,
                       layouts, param=param)

    def run(tokens, fn):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, K, generator=gen).bfloat16().requires_grad_()
        ids = torch.rand(tokens, 7, generator=gen).argsort(dim=1)[:, :2]  # expert 7: none
        w = torch.rand(tokens, 2, generator=gen).softmax(-1).bfloat16()
        experts.zero_grad(set_to_none=True)
        calls.clear()
        qr.reset_grouped_gemm_paths()
        with qr.autocast(recipe=recipe):
            y = fn(x, ids, w)
        y.float().pow(2).sum().backward()
        return ((y, x.grad, experts.gate_up_proj.grad, experts.down_proj.grad),
                [kw["x_rows"] is not None for _, kw in calls], qr.grouped_gemm_paths())

    fn = experts
    if compiled:
        _compiled_counter()
        counter = CompileCounterWithBackend("aot_eager")
        fn = torch.compile(experts, backend=counter, fullgraph=True,
                           dynamic=compiled == "dynamic")
    for tokens in (40, 24, 0):
        got, reads, paths = run(tokens, fn)
        with monkeypatch.context() as patch:
            patch.setattr(GroupedProjection, "project", gathering_first)
            torch._dynamo.reset()
            want, copy_reads, _ = run(tokens, experts)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        # forward: the up projection's input through the routes, the down projection's input;
        # backward: the two output gradients
        assert reads == [True, False, False, False] and not any(copy_reads)
        assert set(paths) == {"scaled_grouped_mm", "fp8_grouped_gemm"}  # quantized once


@pytest.mark.parametrize("inside", [True, False])
def test_hf_experts_recomputed_by_activation_checkpointing(emulated, inside):
    """The experts block recomputed in backward (inside autocast, or outside it under the
    forward's frame), reading its routed rows in place: the same output and gradients as
    without checkpointing."""
    experts, recipe = _hf_experts_block(), qr.Float8CurrentScaling()
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(24, K, generator=gen).bfloat16()
    ids = torch.rand(24, 7, generator=gen).argsort(dim=1)[:, :2]
    w = torch.rand(24, 2, generator=gen).softmax(-1).bfloat16()
    (plain, paths), (again, again_paths) = plain_and_checkpointed(experts, h, ids, w, recipe,
                                                                  inside)
    assert paths == again_paths == {"scaled_grouped_mm", "fp8_grouped_gemm"}
    for a, b in zip(plain, again, strict=True):
        assert torch.equal(a, b)


def _experts_quantize_calls(emulated) -> list:
    """``(rowwise, columnwise)`` of every call of the CPU backend's
    ``fp8_group_quantize_experts`` from now on."""
    backend = backends.get(None, torch.device("cpu"))
    quantize, calls = backend.fp8_group_quantize_experts, []

    def recording(*args, **kw):
        calls.append((kw["rowwise"], kw["columnwise"]))
        return quantize(*args, **kw)

    emulated.setattr(backend, "fp8_group_quantize_experts", recording, raising=False)
    return calls


#: Four routings of the same 81 rows over 7 experts, two micro-batches per optimizer step.
ROUTINGS = (COUNTS, [12] * 6 + [9], [0, 0, 81, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 60])


@pytest.mark.parametrize("compiled", [False, True])
def test_weights_quantized_per_step_give_the_same_bits(emulated, compiled):
    """``quantize_weights_per_step`` on a GroupedLinear of the quantize-once path: two optimizer
    steps of two micro-batches each give the outputs, input gradients and weights of quantizing
    in forward, bit for bit. The experts' weights are quantized at the start and after each
    step (both layouts, one call), never in forward or backward; compiled with
    ``fullgraph=True``, the refreshes recompile nothing."""
    recipe = qr.Float8CurrentScaling()
    calls = _experts_quantize_calls(emulated)

    def train(keep: bool):
        counter = _compiled_counter() if compiled else None
        torch.manual_seed(0)
        m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, name="experts")
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        calls.clear()
        handle = qr.quantize_weights_per_step(m, recipe) if keep else None
        assert handle is None or len(handle) == 1

        def step(x, counts):
            with qr.autocast(recipe=recipe):
                return m(x, counts=counts)

        fn = torch.compile(step, fullgraph=True, backend=counter) if compiled else step
        gen, out = torch.Generator().manual_seed(1), []
        for first in (0, 2):
            for counts in ROUTINGS[first:first + 2]:
                x = torch.randn(sum(counts), K, generator=gen).bfloat16().requires_grad_()
                y = fn(x, torch.tensor(counts))
                y.float().pow(2).sum().backward()
                out += [y.detach(), x.grad]
            opt.step()
            opt.zero_grad()
        out.append(m.weight.detach().clone())
        if handle is not None:
            handle.remove()
        return out, list(calls), counter and counter.frame_count

    want, want_calls, _ = train(False)
    got, got_calls, frames = train(True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert want_calls == [(True, False), (False, True)] * 4  # forward's, backward's cast
    assert got_calls == [(True, True)] * 3  # at the start and after each step
    assert frames in (None, 1)


@pytest.mark.parametrize("transposed", [False, True])
def test_hf_experts_weights_quantized_per_step_give_the_same_bits(emulated, transposed):
    """A converted Hugging Face experts block under ``quantize_weights_per_step`` (its weights
    stored ``[experts, out, in]``, or transposed as GPT-OSS stores them, which the projections
    read as a view of the Parameter): two optimizer steps give the outputs and gradients of
    quantizing in forward, bit for bit, and the two projections' weights are quantized only at
    the start and after each step."""
    recipe = qr.Float8CurrentScaling()
    calls = _experts_quantize_calls(emulated)

    def train(keep: bool):
        experts = _hf_experts_block()
        if transposed:
            for name in ("gate_up_proj", "down_proj"):
                stored = getattr(experts, name).detach().transpose(1, 2).contiguous()
                setattr(experts, name, torch.nn.Parameter(stored))
            experts.is_transposed = True
        opt = torch.optim.SGD(experts.parameters(), lr=0.5)
        calls.clear()
        handle = qr.quantize_weights_per_step(experts, recipe) if keep else None
        assert handle is None or len(handle) == 2
        gen, out = torch.Generator().manual_seed(3), []
        for _ in range(2):
            x = torch.randn(24, K, generator=gen).bfloat16().requires_grad_()
            ids = torch.rand(24, 7, generator=gen).argsort(dim=1)[:, :2]
            w = torch.rand(24, 2, generator=gen).softmax(-1).bfloat16()
            with qr.autocast(recipe=recipe):
                y = experts(x, ids, w)
            y.float().pow(2).sum().backward()
            out += [y.detach(), x.grad]
            opt.step()
            opt.zero_grad()
        out += [experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()]
        if handle is not None:
            handle.remove()
        return out, list(calls)

    want, want_calls = train(False)
    got, got_calls = train(True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # per step: the two projections' casts in forward, their transposed casts in backward
    assert sorted(want_calls) == sorted([(True, False), (False, True)] * 4)
    assert got_calls == [(True, True)] * 6  # two weights, at the start and after each step


def test_kept_expert_weights_refresh_on_load_and_drop_on_conversion(emulated):
    """A GroupedLinear's kept weight: ``load_state_dict`` quantizes it again; after an in-place
    write, which a compiled graph cannot see, ``invalidate_cached_weights()`` does (the compiled
    output then equals a fresh layer's with the written weights, and differs before it);
    ``.float()`` and ``copy.deepcopy`` drop it."""
    import copy

    recipe = qr.Float8CurrentScaling()
    counter = _compiled_counter()
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, name="experts")
    other = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, name="experts")
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16)

    def step(layer, x, counts):
        with qr.autocast(recipe=recipe):
            return layer(x, counts=counts)

    compiled = torch.compile(step, fullgraph=True, backend=counter)

    def out(layer, fn=step):
        return fn(layer, x.clone().requires_grad_(), torch.tensor(COUNTS)).detach()

    handle = qr.quantize_weights_per_step(m, recipe)
    first = [b.clone() for b in m._step_weight.buffers]
    m.load_state_dict(other.state_dict())
    assert not all(torch.equal(a, b) for a, b in zip(m._step_weight.buffers, first, strict=True))
    assert torch.equal(out(m, compiled), out(other))
    with torch.no_grad():
        m.weight.mul_(2)
    fresh = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, name="experts")
    fresh.load_state_dict(m.state_dict())
    assert not torch.equal(out(m, compiled), out(fresh))  # the stale bytes
    qr.invalidate_cached_weights()
    assert torch.equal(out(m, compiled), out(fresh))
    assert copy.deepcopy(m)._step_weight is None and m._step_weight is not None
    m.float()
    assert m._step_weight is None and len(handle) == 0
    handle.remove()


@pytest.mark.parametrize("compiled", [False, True])
def test_kept_expert_weights_serve_only_their_quantizer(emulated, compiled):
    """A forward under another recipe (power-of-2 scales: another weight quantizer) quantizes
    the weights itself, eagerly and compiled, to the bytes of a layer without kept weights."""
    calls = _experts_quantize_calls(emulated)
    counter = _compiled_counter() if compiled else None
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, dtype=torch.bfloat16, name="experts")
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16)
    other = qr.Float8CurrentScaling(use_power_2_scales=True)

    def step(x, counts):
        with qr.autocast(recipe=other):
            return m(x, counts=counts)

    want = step(x, torch.tensor(COUNTS))
    handle = qr.quantize_weights_per_step(m, qr.Float8CurrentScaling())
    fn = torch.compile(step, fullgraph=True, backend=counter) if compiled else step
    calls.clear()
    assert torch.equal(fn(x, torch.tensor(COUNTS)), want)
    assert calls == [(True, False)]  # the forward's own cast
    handle.remove()
