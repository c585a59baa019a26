"""The Triton GEMMs (MXFP8, NVFP4; both implementations) against ``quant_core.reference``.

Two kinds of check (architecture.md contract 6: only the order of the fp32 accumulation may differ):
- bit for bit on operands whose products and partial sums are all exact in fp32;
- on random operands, elementwise within the bound of two fp32 summations of the same exact
  products in different orders: ``|fast - ref| <= 2 * K * 2^-24 * (|A| @ |B|ᵀ)`` (each order's
  error is at most ``(K - 1) * u * sum|a_i b_i|`` with ``u = 2^-24``), plus the final rounding.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _kernels_util import DEVICE
from quant_core import DType, MXFP8Quantizer, NVFP4Quantizer, reference
from quant_kernels import _gemm, dequant_gemm, mxfp8, mxfp8_gemm, nvfp4_gemm
from quant_kernels._common import interpreting
from quant_kernels.backend import BACKEND


def _x(m, k, seed, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:  # every 1x16..32x32 block has amax 28: equal power-of-two / 448 scales, exact
        v = torch.randint(-3, 4, (m, k), generator=g).float()
        diag = (torch.arange(m)[:, None] % 16) == (torch.arange(k)[None, :] % 16)
        return torch.where(diag, torch.full_like(v, 28.0), v).to(DEVICE)
    return (torch.randn(m, k, generator=g)
            * torch.exp2(torch.randint(-4, 5, (m, 1), generator=g))).to(DEVICE)


def _bias(n, seed):
    """Integer-valued bias ``[n]``, seeded: a failure reproduces in any test order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).round().to(DEVICE)


def _within_bound(got, ref, a_abs, b_abs, k):
    bound = 2 * k * 2.0**-24 * (a_abs @ b_abs.t()) + 1e-30
    close = (got.float() - ref.float()).abs() <= bound + 2.0**-7 * ref.float().abs() * (
        got.dtype != torch.float32)
    return bool(close.all())


def _operands(q, x, w, ta, tb):
    xs, ws = q.quantize(x), q.quantize(w)
    return xs.gemm_operand(ta), ws.gemm_operand(tb)


#: Both implementations, and "dequant_blocks": the dequant one with its fp32 product in blocks of
#: 10-20 output rows (the last one ragged), as a large GEMM runs it.
IMPLEMENTATIONS = ["fused", "dequant", "dequant_blocks"]
_SMALL_PRODUCT_BYTES = 5000


@pytest.fixture
def impl(request, monkeypatch) -> str:
    """The implementation to pass to ``*_gemm_using`` (the ``IMPLEMENTATIONS`` entry)."""
    if request.param == "dequant_blocks":
        monkeypatch.setattr(dequant_gemm, "MAX_FP32_PRODUCT_BYTES", _SMALL_PRODUCT_BYTES)
        return "dequant"
    return request.param


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, indirect=True)
@pytest.mark.parametrize("ta, tb, shape", [
    (False, False, (64, 96, 128)),    # fprop x @ Wᵀ
    (False, True, (72, 64, 96)),      # dgrad gy @ W (W's columnwise operand), ragged M
    (True, True, (64, 96, 200)),      # wgrad gyᵀ @ x, contraction over a ragged 200
])
@pytest.mark.parametrize("swizzle", [False, True])
def test_mxfp8_gemm_matches_reference(impl, ta, tb, shape, swizzle):
    m, n, k = shape
    q = MXFP8Quantizer(DType.E4M3, optimize_for_gemm=swizzle)
    for integer in (True, False):
        x = _x(k, m, 1, integer) if ta else _x(m, k, 1, integer)
        w = _x(k, n, 2, integer) if tb else _x(n, k, 2, integer)
        ra, rb = _operands(q, x, w, ta, tb)
        bias = _bias(n, 3)
        args = (ra.data, ra.scale, rb.data, rb.scale)
        kw = dict(a_dtype=ra.fp_dtype, b_dtype=rb.fp_dtype, a_swizzled=swizzle,
                  b_swizzled=swizzle, bias=bias)
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            got = mxfp8_gemm.mxfp8_gemm_using(impl, *args, **kw, out_dtype=out_dtype)
            ref = reference.mxfp8_gemm(*args, **kw, out_dtype=out_dtype)
            assert got.shape == (m, n) and got.dtype == out_dtype
            if integer:
                assert torch.equal(got, ref), (impl, out_dtype)
            else:
                av = reference.gemm._mxfp8_operand(ra.data, ra.scale, ra.fp_dtype, swizzle)
                bv = reference.gemm._mxfp8_operand(rb.data, rb.scale, rb.fp_dtype, swizzle)
                assert _within_bound(got, ref, av.abs(), bv.abs(), k), (impl, out_dtype)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, indirect=True)
def test_mxfp8_gemm_mixed_formats_nan_scale_and_empty(impl):
    gemm = functools.partial(mxfp8_gemm.mxfp8_gemm_using, impl)
    x, w = _x(32, 64, 3, True), _x(48, 64, 4, True)
    ra = MXFP8Quantizer(DType.E5M2).quantize(x).gemm_operand(False)
    rb = MXFP8Quantizer(DType.E4M3).quantize(w).gemm_operand(False)
    scale = ra.scale.clone()
    scale[3, 1] = 255  # the E8M0 NaN byte: row 3 of the product is NaN, as in the reference
    kw = dict(a_dtype=DType.E5M2, b_dtype=DType.E4M3, a_swizzled=False, b_swizzled=False,
              bias=None, out_dtype=torch.float32)
    got = gemm(ra.data, scale, rb.data, rb.scale, **kw)
    ref = reference.mxfp8_gemm(ra.data, scale, rb.data, rb.scale, **kw)
    assert torch.isnan(got[3]).all() and not torch.isnan(got[:3]).any()
    assert torch.equal(got.nan_to_num(), ref.nan_to_num())
    empty = gemm(ra.data[:0], scale, rb.data, rb.scale, **kw)
    assert empty.shape == (0, 48)
    bias = torch.arange(48.0, device=DEVICE)
    zero_k = gemm(ra.data[:, :0], scale, rb.data[:, :0], rb.scale, **{**kw, "bias": bias})
    assert torch.equal(zero_k, bias.expand(32, 48))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, indirect=True)
@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("swizzle", [False, True])
def test_nvfp4_gemm_matches_reference(impl, rht, swizzle):
    """fprop-like (rowwise, no RHT) and wgrad-like (columnwise, both in the RHT basis)."""
    m, n, k = 48, 80, 96
    q = NVFP4Quantizer(DType.E2M1, with_rht=rht, with_post_rht_amax=rht,
                       optimize_for_gemm=swizzle)
    for integer in ((False,) if rht else (True, False)):  # the RHT mixes values: not exact
        if rht:  # contraction over the rows of two bf16 tensors, through their columnwise forms
            x = _x(k, m, 5, integer).bfloat16()
            w = _x(k, n, 6, integer).bfloat16()
            ra, rb = _operands(q, x, w, True, True)
        else:
            ra, rb = _operands(q, _x(m, k, 5, integer), _x(n, k, 6, integer), False, False)
        args = (ra.data, ra.scale, ra.amax, rb.data, rb.scale, rb.amax)
        bias = _bias(n, 7).bfloat16()
        kw = dict(a_swizzled=swizzle, b_swizzled=swizzle, bias=bias)
        for out_dtype in (torch.float32, torch.bfloat16):
            got = nvfp4_gemm.nvfp4_gemm_using(impl, *args, **kw, out_dtype=out_dtype)
            ref = reference.nvfp4_gemm(*args, **kw, out_dtype=out_dtype)
            if integer:
                assert torch.equal(got, ref), (impl, out_dtype)
            else:
                av = reference.gemm.nvfp4_operand(ra.data, ra.scale, swizzle)
                bv = reference.gemm.nvfp4_operand(rb.data, rb.scale, swizzle)
                alpha = float(ra.amax) * float(rb.amax) / 2688**2
                assert _within_bound(got, ref, av.abs() * alpha, bv.abs(), k), (impl, out_dtype)


@pytest.mark.parametrize("fmt, ta, out_dtype, blocks", [
    ("nvfp4", False, torch.bfloat16, 3),   # 320 rows in blocks of 128 (the last one 64)
    ("nvfp4", False, torch.float32, 3),    # the per-tensor factors need the epilogue too
    ("nvfp4", True, torch.bfloat16, 3),    # A from columnwise (stored-transposed) data
    ("mxfp8", False, torch.bfloat16, 3),
    ("mxfp8", True, torch.bfloat16, 3),    # A a transposed view: dequantized whole, sliced
    ("mxfp8", False, torch.float32, 1),    # fp32 without epilogue: the product is the output
])
@pytest.mark.parametrize("swizzle", [False, True])
def test_dequant_gemm_works_in_row_blocks(monkeypatch, fmt, ta, out_dtype, blocks, swizzle):
    """The dequant path never holds the whole fp32 product of a larger output (nor a
    contiguous A's whole bf16 copy): each block's fp32 product is at most
    ``MAX_FP32_PRODUCT_BYTES``, and the result is the reference's bytes on exact operands."""
    m, n, k = 320, 80, 64
    monkeypatch.setattr(dequant_gemm, "MAX_FP32_PRODUCT_BYTES", 4 * n * 128)
    sizes, a_rows = [], []
    real_mm, real_nv, real_mx = (dequant_gemm._mm_fp32, dequant_gemm._nvfp4_bf16,
                                 mxfp8.mxfp8_dequantize)

    def counted(a, b):
        out = real_mm(a, b)
        sizes.append(out.numel() * out.element_size())
        return out

    def nv_rows(data, scale, swz):
        a_rows.append(data.shape[0])
        return real_nv(data, scale, swz)

    def mx_rows(data, scale, **kw):
        a_rows.append(data.shape[0])
        return real_mx(data, scale, **kw)

    monkeypatch.setattr(dequant_gemm, "_mm_fp32", counted)
    monkeypatch.setattr(dequant_gemm, "_nvfp4_bf16", nv_rows)
    monkeypatch.setattr(mxfp8, "mxfp8_dequantize", mx_rows)
    q = (NVFP4Quantizer(DType.E2M1, optimize_for_gemm=swizzle) if fmt == "nvfp4"
         else MXFP8Quantizer(DType.E4M3, optimize_for_gemm=swizzle))
    x = _x(k, m, 7, True) if ta else _x(m, k, 7, True)
    ra, rb = _operands(q, x, _x(n, k, 8, True), ta, False)
    bias = torch.arange(80.0, device=DEVICE).bfloat16() if out_dtype != torch.float32 else None
    if fmt == "nvfp4":
        args = (ra.data, ra.scale, ra.amax, rb.data, rb.scale, rb.amax)
        kw = dict(a_swizzled=swizzle, b_swizzled=swizzle, bias=bias, out_dtype=out_dtype)
        got, ref = dequant_gemm.nvfp4_gemm_dequant(*args, **kw), reference.nvfp4_gemm(*args, **kw)
    else:
        args = (ra.data, ra.scale, rb.data, rb.scale)
        kw = dict(a_dtype=DType.E4M3, b_dtype=DType.E4M3, a_swizzled=swizzle,
                  b_swizzled=swizzle, bias=bias, out_dtype=out_dtype)
        got, ref = dequant_gemm.mxfp8_gemm_dequant(*args, **kw), reference.mxfp8_gemm(*args, **kw)
    assert len(sizes) == blocks
    assert max(sizes) <= (dequant_gemm.MAX_FP32_PRODUCT_BYTES if blocks > 1 else 4 * m * n)
    whole_a = fmt == "mxfp8" and ta
    assert a_rows[0] == n  # B, dequantized whole, first
    assert a_rows[1:] == ([k] if whole_a else [m] if blocks == 1 else [128, 128, 64])
    assert torch.equal(got, ref)


def test_dequant_gemm_block_rule():
    """Blocks hold at most ``MAX_FP32_PRODUCT_BYTES`` of fp32 product, in multiples of 128 rows
    (a swizzled scale tile); one block when the product fits, when the output is the fp32
    product itself, or for symbolic shapes."""
    assert dequant_gemm._rows_per_block(16384, 8192, False) == 2048
    assert dequant_gemm._rows_per_block(16384, 8192, True) is None
    assert dequant_gemm._rows_per_block(4096, 4096, False) is None  # 64 MiB fits
    assert dequant_gemm._rows_per_block(100, 2**20, False) == 128  # never below one tile
    from quant_core.kernel_capture import capture

    with capture():  # recorded: MXFP8 keeps one block, NVFP4 refuses (the test below)
        assert dequant_gemm._rows_per_block(16384, 8192, False, recorded_blocks=False) is None


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_recorded_dequant_gemm_that_needs_blocks(monkeypatch, fmt):
    """While launches are recorded into a compiled graph, an NVFP4 GEMM whose product
    needs row blocks raises ``NotCapturable`` before it records anything, so the GEMM stays an
    opaque op whose eager body runs the blocks (recorded blocks failed in an Inductor copy kernel
    on the H200). MXFP8 records its whole product, which peaked lower there (see
    ``dequant_gemm._rows_per_block``). A GEMM that fits is recorded in both."""
    from quant_core.kernel_capture import NotCapturable, capture

    m, n, k = 320, 80, 64
    launches = []

    class Recorder:  # what wrap_triton(kernel) gives: kernel[grid](*args) records the launch
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(self.kernel)

    q = (NVFP4Quantizer(DType.E2M1) if fmt == "nvfp4" else MXFP8Quantizer(DType.E4M3))
    ra, rb = _operands(q, _x(m, k, 7, True), _x(n, k, 8, True), False, False)
    if fmt == "nvfp4":
        args = (ra.data, ra.scale, ra.amax, rb.data, rb.scale, rb.amax)
        kw = dict(a_swizzled=False, b_swizzled=False, bias=None, out_dtype=torch.bfloat16)
        gemm = dequant_gemm.nvfp4_gemm_dequant
    else:
        args = (ra.data, ra.scale, rb.data, rb.scale)
        kw = dict(a_dtype=DType.E4M3, b_dtype=DType.E4M3, a_swizzled=False, b_swizzled=False,
                  bias=None, out_dtype=torch.bfloat16)
        gemm = dequant_gemm.mxfp8_gemm_dequant
    monkeypatch.setattr(torch.library, "wrap_triton", Recorder)
    monkeypatch.setattr(dequant_gemm, "MAX_FP32_PRODUCT_BYTES", 4 * n * 128)
    mms = []
    real_mm = dequant_gemm._mm_fp32
    monkeypatch.setattr(dequant_gemm, "_mm_fp32", lambda a, b: mms.append(1) or real_mm(a, b))
    if fmt == "nvfp4":
        with capture(), pytest.raises(NotCapturable, match="row blocks"):
            gemm(*args, **kw)
        assert launches == [] and mms == []
    else:
        with capture():
            gemm(*args, **kw)
        assert mms == [1] and dequant_gemm._epilogue_kernel in launches  # one whole product
        launches.clear()
    monkeypatch.setattr(dequant_gemm, "MAX_FP32_PRODUCT_BYTES", 4 * m * n)
    with capture():
        gemm(*args, **kw)  # one block: its launches are recorded
    assert dequant_gemm._epilogue_kernel in launches


def test_unit_amax_decodes_every_e4m3_scale_exactly():
    """The dequant path's claim: ``fp32(fp32(e4m3 * 2688) * fp32(1/2688)) == e4m3`` for every
    finite E4M3 code, so ``nvfp4_dequantize(..., amax=2688)`` yields ``e2m1 * e4m3`` exactly."""
    e4 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = e4[~torch.isnan(e4)]
    unit = torch.tensor(dequant_gemm._UNIT_AMAX, dtype=torch.float32)
    rcp = torch.tensor(1.0, dtype=torch.float32) / 2688.0
    assert torch.equal((e4 * unit) * rcp, e4)


def test_gemm_argument_errors():
    a = torch.zeros(4, 32, dtype=torch.uint8, device=DEVICE)
    s = torch.zeros(128, 4, dtype=torch.uint8, device=DEVICE)
    kw = dict(a_dtype=DType.E4M3, b_dtype=DType.E4M3, a_swizzled=False, b_swizzled=False,
              bias=None)
    with pytest.raises(TypeError, match="a must be a 2D uint8 tensor"):
        BACKEND.mxfp8_gemm(a.float(), s, a, s, **kw, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="share dim 1"):
        BACKEND.mxfp8_gemm(a, s, a[:, :16], s, **kw, out_dtype=torch.float32)
    with pytest.raises(TypeError, match="out_dtype must be"):
        BACKEND.mxfp8_gemm(a, s, a, s, **kw, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="bias must have shape"):
        BACKEND.mxfp8_gemm(a, s, a, s, **{**kw, "bias": torch.zeros(5, device=DEVICE)},
                           out_dtype=torch.float32)
    with pytest.raises(ValueError, match="contiguous along K"):
        BACKEND.nvfp4_gemm(a.t(), s, s, a.t(), s, s, a_swizzled=False, b_swizzled=False, bias=None,
                           out_dtype=torch.float32)


def test_the_backend_runs_the_devices_implementation(monkeypatch):
    """The backend's GEMMs run ``"dequant"`` on GPUs and ``"fused"`` under the interpreter (as
    its ``gemm_route`` says), and an implementation not in ``_gemm.IMPLEMENTATIONS`` is named."""
    assert _gemm.default_implementation() == ("fused" if interpreting() else "dequant")
    ran = []
    for module, name in ((mxfp8_gemm, "mxfp8_gemm"), (nvfp4_gemm, "nvfp4_gemm")):
        monkeypatch.setattr(module, f"{name}_using", lambda impl, *a, **kw: ran.append(impl))
    a = torch.zeros(4, 32, dtype=torch.uint8, device=DEVICE)
    BACKEND.mxfp8_gemm(a, a, a, a, a_dtype=DType.E4M3, b_dtype=DType.E4M3, a_swizzled=False,
                       b_swizzled=False, bias=None, out_dtype=torch.float32)
    BACKEND.nvfp4_gemm(a, a, a, a, a, a, a_swizzled=False, b_swizzled=False, bias=None,
                       out_dtype=torch.float32)
    assert ran == [_gemm.default_implementation()] * 2
    assert BACKEND.gemm_route(DEVICE) == _gemm.IMPLEMENTATIONS[_gemm.default_implementation()]
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"mxfp8_gemm: implementation must be one of "
                                         r"\('dequant', 'fused'\), got 'fp8'"):
        mxfp8_gemm.mxfp8_gemm_using("fp8", a, a, a, a, a_dtype=DType.E4M3, b_dtype=DType.E4M3,
                                    a_swizzled=False, b_swizzled=False, bias=None,
                                    out_dtype=torch.float32)
    with pytest.raises(ValueError, match="nvfp4_gemm: implementation must be one of"):
        nvfp4_gemm.nvfp4_gemm_using("bf16", a, a, a, a, a, a, a_swizzled=False, b_swizzled=False,
                                    bias=None, out_dtype=torch.float32)


def _row_scaled(x):
    return NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False).quantize(x)


def test_row_scaled_reference_gemm_is_the_product_of_each_row_alone():
    """A row-scaled operand's factor is its row's: output row ``i`` (A row-scaled) or column
    ``j`` (B row-scaled) equals the GEMM of that row quantized alone, with its scalar amax."""
    m, n, k = 12, 20, 64
    x, w = _x(m, k, 11).cpu(), _x(n, k, 12).cpu()
    ra, rb = _row_scaled(x).gemm_operand(False), _row_scaled(w).gemm_operand(False)
    assert ra.amax.shape == (m,) and rb.amax.shape == (n,)
    out = reference.nvfp4_gemm(ra.data, ra.scale, ra.amax, rb.data, rb.scale, rb.amax,
                               a_swizzled=False, b_swizzled=False, bias=None,
                               out_dtype=torch.float32)
    for i in range(m):
        for j in (0, n - 1):
            a1 = NVFP4Quantizer(columnwise_usage=False).quantize(x[i:i + 1]).gemm_operand(False)
            b1 = NVFP4Quantizer(columnwise_usage=False).quantize(w[j:j + 1]).gemm_operand(False)
            one = reference.nvfp4_gemm(a1.data, a1.scale, a1.amax, b1.data, b1.scale, b1.amax,
                                       a_swizzled=False, b_swizzled=False, bias=None,
                                       out_dtype=torch.float32)
            assert torch.equal(out[i, j], one[0, 0])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, indirect=True)
@pytest.mark.parametrize("scaled", ["a", "b", "both"])
def test_row_scaled_nvfp4_gemm_matches_reference(impl, scaled):
    """Per-row factors on the exact (integer) operands: the reference's bytes, in every
    implementation, including the dequant one's row blocks (each block its rows' factors: 300
    rows in blocks of 128)."""
    m, n, k = 300, 48, 64
    x, w = _x(m, k, 13, True), _x(n, k, 14, True)
    x = x * torch.exp2(torch.arange(m, device=DEVICE) % 5 - 2.0)[:, None]  # rows of 5 amaxes
    qa = _row_scaled if scaled in ("a", "both") else NVFP4Quantizer(columnwise_usage=False).quantize
    qb = _row_scaled if scaled in ("b", "both") else NVFP4Quantizer(columnwise_usage=False).quantize
    ra, rb = qa(x).gemm_operand(False), qb(w).gemm_operand(False)
    args = (ra.data, ra.scale, ra.amax, rb.data, rb.scale, rb.amax)
    kw = dict(a_swizzled=False, b_swizzled=False, bias=torch.arange(48.0, device=DEVICE))
    for out_dtype in (torch.float32, torch.bfloat16):
        got = nvfp4_gemm.nvfp4_gemm_using(impl, *args, **kw, out_dtype=out_dtype)
        assert torch.equal(got, reference.nvfp4_gemm(*args, **kw, out_dtype=out_dtype))
    with pytest.raises(ValueError, match="a_amax must hold 1 value or one per row"):
        nvfp4_gemm.nvfp4_gemm_using("fused", ra.data, ra.scale, torch.ones(3, device=DEVICE),
                                    rb.data, rb.scale, rb.amax, **kw, out_dtype=torch.float32)
