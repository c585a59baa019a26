"""The batched per-group FP8 current scaling of GroupedLinear (quant_recipes.grouped_fp8) and its
``"scaled_grouped_mm"`` path.

Oracles: the per-group path's own quantize calls (one per padded group, one per expert: tested
against the dense Linear in test_grouped_linear.py) for the bytes, bitwise; the per-group
path's GEMMs for the grouped GEMMs, up to the fp32 accumulation order (on the CPU through an
emulation of ``torch._scaled_grouped_mm`` that checks the layouts, offsets and scale shapes
torch's kernel requires), and bitwise for the backward GEMMs that stay per group.
"""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from quant_core import DType, Float8CurrentScalingQuantizer
from quant_recipes import grouped_fp8, grouped_gemm

K, N, ALIGN = 64, 32, 16
COUNTS = [5, 0, 1, 37, 16, 0, 22]  # ragged, empty groups, a group of one row, an exact one

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


@pytest.fixture(params=["torch", "triton"])
def impl(request, monkeypatch):
    """The batched quantization's two implementations (Triton through the interpreter)."""
    if request.param == "triton":
        pytest.importorskip("quant_kernels")
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels run on the CPU only through TRITON_INTERPRET=1")
        pytest.importorskip("quant_recipes.grouped_fp8_kernels")
    monkeypatch.setattr(grouped_fp8, "_triton", lambda device: request.param == "triton")
    return request.param


def _per_group(x, counts, q):
    """The per-group path's buffers of each group: its rows padded to ALIGN, one quantize."""
    out, s = [], 0
    for m in counts:
        mp = -(-m // ALIGN) * ALIGN if m else 0
        out.append(grouped_gemm.quantized(grouped_gemm._padded(x[s:s + m], mp), q) if m else None)
        s += m
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qid", list(QUANTIZERS))
def test_rows_bytes_equal_the_per_group_quantize(impl, qid, dtype):
    x = _rows(COUNTS, dtype)
    q = _quantizer(qid)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    lay = grouped_fp8.layout(offs, x.shape[0], ALIGN)
    data, trans, sinv = grouped_fp8.quantize_rows(x, lay, q, True, True)
    starts = grouped_fp8.padded_starts(offs.tolist(), ALIGN)
    assert lay.ends.tolist() == [*starts[1:], lay.ends[-1].item()]
    used = torch.zeros(lay.rows, dtype=torch.bool)
    for g, want in enumerate(_per_group(x, COUNTS, q)):
        p = starts[g]
        if want is None:  # an empty group: ALIGN zero rows, the scale of an empty tensor
            assert not data[p:p + ALIGN].any() and not trans[:, p:p + ALIGN].any()
            assert torch.equal(sinv[g:g + 1], q.quantize(x[:0]).buffer_list(x[:0])[2])
            continue
        wd, wt, ws = want
        mp = wd.shape[0]
        assert torch.equal(data[p:p + mp], wd), f"group {g} data"
        assert torch.equal(trans[:, p:p + mp], wt), f"group {g} transpose"
        assert torch.equal(sinv[g:g + 1], ws), f"group {g} scale_inv"
        used[p:p + mp] = True
    assert not data[~used].any() and not trans[:, ~used].any()  # padding past the groups


@pytest.mark.parametrize("qid", ["e4m3", "pow2"])
def test_expert_bytes_equal_one_quantize_per_expert(impl, qid):
    torch.manual_seed(1)
    w = torch.randn(3, N, K, dtype=torch.bfloat16) * torch.tensor([1e-3, 1.0, 300.0])[:, None,
                                                                                     None]
    w[1, 2, 3] = float("nan")
    q = _quantizer(qid)
    data, trans, sinv = grouped_fp8.quantize_experts(w, q, True, True)
    for e in range(w.shape[0]):
        wd, wt, ws = q.quantize(w[e]).buffer_list(w[e])
        assert torch.equal(data[e], wd) and torch.equal(trans[e], wt)
        assert torch.equal(sinv[e:e + 1], ws)


def test_a_layout_of_no_rows():
    lay = grouped_fp8.layout(torch.zeros(3, dtype=torch.int32), 0, ALIGN)
    assert lay.ends.tolist() == [16, 32, 48] and lay.rows == 48 and lay.dest.numel() == 0


# ------------------------------------------------------------------- the grouped GEMMs
def _emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    """``torch._scaled_grouped_mm``'s rowwise semantics, with the checks of its CUDA kernel:
    ``(acc * scale_a) * scale_b`` per row and column, acc the fp32 sum of the FP8 products."""
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


@pytest.fixture
def emulated(monkeypatch):
    """The ``"scaled_grouped_mm"`` path on the CPU, through the emulation; E4M3 x E4M3 only, as
    torch 2.11's CUTLASS kernel."""
    monkeypatch.setattr(grouped_fp8, "SCALED_GROUPED_MM_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(grouped_fp8, "scaled_grouped_mm", _emulated_scaled_grouped_mm)
    monkeypatch.setattr(grouped_fp8, "_runs",
                        lambda device_type, dtype: dtype == torch.float8_e4m3fn)
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
    emulated.setattr(grouped_fp8, "SCALED_GROUPED_MM_DEVICES", set())
    want, paths = _step(COUNTS, recipe)
    assert paths == {"per_group": 3}
    for a, b in zip(got, want, strict=True):  # the order of the fp32 sums and of the scales
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_e5m2_gradients_run_per_group_on_the_batched_bytes(emulated):
    recipe = qr.Float8CurrentScaling()  # HYBRID: E5M2 gradients, which the kernel does not take
    got, paths = _step(COUNTS, recipe)
    assert paths == {"scaled_grouped_mm": 1, "per_group": 2}
    emulated.setattr(grouped_fp8, "SCALED_GROUPED_MM_DEVICES", set())
    want, _ = _step(COUNTS, recipe)
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # the same GEMMs


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
    assert qr.grouped_gemm_paths() == {"per_group": 1}  # the kernel adds no bias


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
    if not grouped_fp8._runs("cuda", torch.float8_e4m3fn):
        return "torch._scaled_grouped_mm does not run on this GPU"
    return None


@pytest.mark.skipif(_cuda_fp8_grouped() is not None, reason=str(_cuda_fp8_grouped()))
def test_cuda_bytes_and_grouped_gemms_within_the_bound(monkeypatch):
    """On the GPU: the batched bytes equal the per-group quantize calls' (both Triton there),
    and each grouped GEMM output lies within the stated bound of the per-group path's
    (``torch._scaled_mm`` per group): ``|got - want| <= 2^-7 |want| + 2^-11 (|A| |B|)``, the
    second term from the operands' absolute product."""
    dev, e, k, n = "cuda", 8, 256, 128
    counts = [0, 1, 37, 200, 16, 0, 5, 61]
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    starts = grouped_fp8.padded_starts(offs.tolist(), ALIGN)
    for qid in QUANTIZERS:
        x = _rows(counts, torch.bfloat16).to(dev)
        q = _quantizer(qid)
        lay = grouped_fp8.layout(offs, x.shape[0], ALIGN)
        data, trans, sinv = grouped_fp8.quantize_rows(x, lay, q, True, True)
        for g, want in enumerate(_per_group(x, counts, q)):
            if want is not None:
                p, mp = starts[g], want[0].shape[0]
                assert torch.equal(data[p:p + mp], want[0]), (qid, g)
                assert torch.equal(trans[:, p:p + mp], want[1]), (qid, g)
                assert torch.equal(sinv[g:g + 1], want[2]), (qid, g)
    torch.manual_seed(0)
    m = qr.GroupedLinear(e, k, n, dtype=torch.bfloat16, device=dev)
    rows = torch.logspace(-2, 2, sum(counts), device=dev)[:, None]
    x = (torch.randn(sum(counts), k, device=dev) * rows).to(torch.bfloat16)
    gy = torch.randn(sum(counts), n, device=dev, dtype=torch.bfloat16)
    results = []
    for devices in ({"cuda"}, set()):
        monkeypatch.setattr(grouped_fp8, "SCALED_GROUPED_MM_DEVICES", devices)
        xi = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        qr.reset_grouped_gemm_paths()
        with qr.autocast(recipe=qr.Float8CurrentScaling(fp8_format=qr.Format.E4M3)):
            y = m(xi, offs)
        y.backward(gy)
        results.append(((y.detach(), xi.grad, m.weight.grad), qr.grouped_gemm_paths()))
    (got, paths), (want, want_paths) = results
    assert paths == {"scaled_grouped_mm": 3} and want_paths == {"per_group": 3}
    ax, aw, ag = x.float().abs(), m.weight.detach().float().abs(), gy.float().abs()
    spans = list(zip([0, *offs.tolist()[:-1]], counts, strict=True))
    mags = [torch.cat([ax[s:s + c] @ aw[g].t() for g, (s, c) in enumerate(spans)]),
            torch.cat([ag[s:s + c] @ aw[g] for g, (s, c) in enumerate(spans)]),
            torch.stack([ag[s:s + c].t() @ ax[s:s + c] for s, c in spans])]
    for name, a, b, s in zip(("y", "dx", "dw"), got, want, mags, strict=True):
        err = (a.float() - b.float()).abs()
        bound = 2.0 ** -7 * b.float().abs() + 2.0 ** -11 * s
        print(f"{name}: max |diff| {err.max().item():.3e}, max |diff| / bound "
              f"{(err / bound.clamp_min(1e-30)).max().item():.3f}, "
              f"bitwise equal {(err == 0).float().mean().item():.4f}")
        assert bool((err <= bound).all()), name
