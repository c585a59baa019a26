"""On CUDA: an FP8 per-tensor GEMM (cuBLAS ``torch._scaled_mm``) lies within the bound of its
accumulation (numerics.md §8) of the emulated reference GEMM: with fast accumulation (the
recipe's ``MMParams(False)``) ``K · 2^-14`` of ``Σ|a_i b_i|``, with the split accumulator the
promoted bound ``2^-7``; each plus the output's rounding. The measured ratios are printed (``-s``)
for ``bench/results/``."""

from __future__ import annotations

import pytest
import torch
from quant_core import DType, Float8CurrentScalingQuantizer
from quant_recipes import gemm as G

DEV = "cuda"


def _operand(x: torch.Tensor, q):
    st = q.quantize(x)
    bufs = [b if b is not None else x.new_empty((0,), dtype=torch.uint8)
            for b in st.buffers().values()]
    return bufs, G.quantizer_meta(q)


@pytest.mark.parametrize("k", [256, 4096, 14336])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_scaled_mm_within_its_accumulation_bound(k, fast_accum):
    m, n = 256, 512
    gen = torch.Generator().manual_seed(k)
    # rows of very different magnitudes, and a shared column offset: partial sums that cancel
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None] + 0.5)
    w = torch.randn(n, k, generator=gen)
    q = Float8CurrentScalingQuantizer(DType.E4M3, internal=True)
    (xb, xm), (wb, wm) = _operand(x.to(DEV, torch.bfloat16), q), _operand(
        w.to(DEV, torch.bfloat16), q)
    args = (xb, xm, [m, k], False, False, wb, wm, [n, k], False, True, None, torch.float32)
    G.reset_gemm_paths()
    got = G.qgemm_impl(*args, fast_accum).cpu()
    assert G.gemm_paths() == {"scaled_mm": 1}
    cpu = ([t.cpu() for t in xb], xm, [m, k], False, False, [t.cpu() for t in wb], wm, [n, k],
           False, True, None, torch.float32)
    want = G.qgemm_impl(*cpu)
    xv = G.dequantize(cpu[0], xm, m, k, False)
    wv = G.dequantize(cpu[5], wm, n, k, False)
    mags = xv.abs() @ wv.abs().t()
    ratio = float(((got - want).abs() / mags).max())
    bound = (k if fast_accum else 128) * 2.0**-14
    print(f"K {k}, fast_accum {fast_accum}: max |got - want| / sum |a b| = {ratio:.3e} "
          f"(bound {bound:.3e})")
    assert ratio <= bound + 2.0**-23 * k
