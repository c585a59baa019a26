"""GEMM dispatch (architecture.md contract 6): operands from storages, the path per format and
backend, the emulated fallbacks, and the custom op's contract."""

from __future__ import annotations

import os

import pytest
import quant_recipes as qr
import torch
from installed import TRITON_BACKEND
from quant_core import DType, MXFP8Quantizer, NVFP4Quantizer
from quant_recipes import gemm as G

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _integer(m, k, seed):
    """Every block of every format has amax 28 (equal scales): exact under any GEMM order."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(-3, 4, (m, k), generator=g).float()
    diag = (torch.arange(m)[:, None] % 16) == (torch.arange(k)[None, :] % 16)
    return torch.where(diag, torch.full_like(v, 28.0), v)


def _bufs(x, q):
    st = q.quantize(x)
    return ([b if b is not None else x.new_empty((0,), dtype=torch.uint8)
             for b in st.buffers().values()], G.quantizer_meta(q))


def _wgrad_args(q, m=64, n=32, k=96):
    """``gyᵀ @ x`` as Linear's backward calls it (columnwise operands of both)."""
    gb, gm = _bufs(_integer(m, n, 1), q)
    xb, xm = _bufs(_integer(m, k, 2), q)
    return (gb, gm, [m, n], True, True, xb, xm, [m, k], True, False)


@pytest.mark.parametrize("q", [MXFP8Quantizer(DType.E4M3), NVFP4Quantizer(DType.E2M1)])
def test_reference_backend_runs_block_formats_through_its_gemm(q):
    """On the CPU the reference backend's GEMM serves MXFP8/NVFP4 ("emulated"). MXFP8 equals the
    dequantize-then-matmul fallback bit for bit on exact operands; NVFP4 applies the per-tensor
    scales to the product (TE's GEMM alpha) instead of rounding each element's scale to fp32
    first, which also makes the fallback's partial sums inexact: the two differ within the fp32
    summation bound ``(K + 4) * 2^-24 * sum|a_i b_i|``."""
    args = _wgrad_args(q)
    G.reset_gemm_paths()
    got = G.qgemm_impl(*args, None, torch.float32)
    assert G.last_gemm_path() == "emulated"
    gb, gm, (m, n), _, _, xb, xm, (_, k), _, _ = args
    a, b = G.dequantize(gb, gm, m, n, True).t(), G.dequantize(xb, xm, m, k, True)
    want = a @ b
    if isinstance(q, MXFP8Quantizer):
        assert torch.equal(got, want)
    else:
        bound = (a.shape[1] + 4) * 2.0**-24 * (a.abs() @ b.abs())
        assert ((got - want).abs() <= bound).all()
        assert not torch.equal(got, want)  # the semantics really differ (so this test can fail)


def test_transposed_rowwise_blocks_and_mixed_formats_fall_back():
    """A transposed use of rowwise MXFP8 blocks (backward_override="dequantized") has its blocks
    across the contraction, and an MXFP8 x NVFP4 pair has no fused path: both are emulated."""
    mx = MXFP8Quantizer(DType.E4M3)
    x = _integer(64, 64, 3)
    xb, xm = _bufs(x, mx)
    assert G.operand(xb, xm, [64, 64], True, False) is None
    assert G.operand(xb, xm, [64, 64], True, True) is not None
    nb, nm = _bufs(x, NVFP4Quantizer(DType.E2M1))
    G.reset_gemm_paths()
    G.qgemm_impl(xb, xm, [64, 64], False, False, nb, nm, [64, 64], False, True, None,
                 torch.float32)
    assert G.last_gemm_path() == "emulated"


@pytest.mark.parametrize("fast_accum", [None, False, True])
def test_qgemm_opcheck(fast_accum):
    """The custom op's schema, fake kernel and autograd registration agree with the eager op,
    with ``fast_accum`` left to its default or given."""
    gb, gm, gs, gc, ta, xb, xm, xs, xc, tb = _wgrad_args(MXFP8Quantizer(DType.E4M3))
    bias = torch.randn(96)
    args = (gb, gm, gs, gc, ta, xb, xm, xs, xc, tb, bias, torch.bfloat16)
    torch.library.opcheck(torch.ops.quant_recipes.qgemm.default,
                          args if fast_accum is None else (*args, fast_accum))


@pytest.mark.skipif(not (TRITON_BACKEND and INTERPRET),
                    reason="needs quant-kernels and TRITON_INTERPRET=1 (the nox 'tests' session)")
@pytest.mark.parametrize("q, path", [(MXFP8Quantizer(DType.E4M3), "triton_mxfp8"),
                                     (NVFP4Quantizer(DType.E2M1), "triton_nvfp4")])
def test_triton_backend_takes_the_kernel_path_with_the_reference_bits(monkeypatch, q, path):
    args = _wgrad_args(q)
    want = G.qgemm_impl(*args, None, torch.float32)
    monkeypatch.setenv("QUANT_BACKEND", "triton")
    G.reset_gemm_paths()
    got = G.qgemm_impl(*args, None, torch.float32)
    assert G.gemm_paths() == {path: 1}
    assert torch.equal(got, want)


@pytest.mark.skipif(not (TRITON_BACKEND and INTERPRET),
                    reason="needs quant-kernels and TRITON_INTERPRET=1 (the nox 'tests' session)")
def test_a_lowered_gemm_records_its_path_when_traced(monkeypatch):
    """The body recorded into a compiled graph counts its path in ``compiled_gemm_paths`` (the
    graph's later calls run no Python), not in ``gemm_paths``."""
    args = _wgrad_args(MXFP8Quantizer(DType.E4M3))
    want = G.qgemm_impl(*args, None, torch.float32)
    monkeypatch.setenv("QUANT_BACKEND", "triton")
    G.reset_gemm_paths()
    got = G._qgemm_lowered(*args, None, torch.float32)
    assert G.compiled_gemm_paths() == {"triton_mxfp8": 1}
    assert G.gemm_paths() == {}
    assert torch.equal(got, want)


@pytest.mark.skipif(not (TRITON_BACKEND and INTERPRET),
                    reason="needs quant-kernels and TRITON_INTERPRET=1 (the nox 'tests' session)")
def test_linear_step_on_the_triton_gemms_matches_the_reference_backend(monkeypatch):
    """A whole MXFP8 Linear step (fprop, dgrad, wgrad) on the kernel path equals the reference
    backend's within the accumulation-order bound of its fp32 sums."""
    def step():
        torch.manual_seed(0)
        m = qr.Linear(64, 32)
        x = torch.randn(48, 64, requires_grad=True)
        with qr.autocast(recipe=qr.MXFP8BlockScaling()):
            y = m(x)
        y.sum().backward()
        return y, x.grad, m.weight.grad

    want = step()
    monkeypatch.setenv("QUANT_BACKEND", "triton")
    qr.reset_gemm_paths()
    got = step()
    assert qr.gemm_paths() == {"triton_mxfp8": 3}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k, takes_cublas", [(64, False), (192, False), (256, True)])
def test_blockwise_cublas_path_takes_k_multiples_of_128_only(monkeypatch, k, takes_cublas):
    """Compiled, torch 2.11's shape rule for 1x128 / 128x128 scales refused K = 64, which eager
    cuBLAS took (found on two H200s under FSDP2); eager and compiled now share the rule."""
    import torch.nn.functional as F
    from quant_core import Float8BlockQuantizer
    from quant_recipes import gemm_fast

    if not hasattr(F, "ScalingType") or not hasattr(F.ScalingType, "BlockWise1x128"):
        pytest.skip("this torch has no block-scaled F.scaled_mm")
    calls = []
    monkeypatch.setattr(gemm_fast, "blockwise_available", lambda device: True)
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **kw: calls.append(a) or "cublas")
    x = Float8BlockQuantizer(block_scaling_dim=1).quantize(_integer(32, k, 1))
    w = Float8BlockQuantizer().quantize(_integer(32, k, 2))
    out = gemm_fast._blockwise(x.gemm_operand(False), w.gemm_operand(False), None,
                               torch.bfloat16)
    assert (out == "cublas") is takes_cublas and len(calls) == takes_cublas
