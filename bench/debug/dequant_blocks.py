"""Where a large NVFP4 / MXFP8 Linear step fails with the dequant GEMM in row blocks (issue 14):
eager, then compiled, per recipe, with and without blocks; ``CUDA_LAUNCH_BLOCKING=1`` makes the
failing launch raise where it is. One process per case (an illegal access poisons the context).

``python bench/debug/dequant_blocks.py CASE``, CASE ``<recipe>:<eager|compiled>:<blocks|whole>``.
A compiled case also checks its output and gradients against the eager step's, bit for bit
(same seed: NVFP4's stochastically rounded gradient draws from torch's generator).
"""

from __future__ import annotations

import sys

import quant_dynamo  # noqa: F401
import quant_recipes as qr
import torch
from quant_core import backends
from quant_kernels import dequant_gemm
from quant_kernels.backend import BACKEND

backends.register(BACKEND)
RECIPES = {"nvfp4": qr.NVFP4BlockScaling, "mxfp8": qr.MXFP8BlockScaling}


def main(case: str) -> None:
    recipe_name, mode, blocks = case.split(":")
    if blocks == "whole":
        dequant_gemm.MAX_FP32_PRODUCT_BYTES = 2**40
    m, k, n = 16384, 8192, 8192
    torch.manual_seed(0)
    lin = qr.Linear(k, n, bias=False, dtype=torch.bfloat16, device="cuda",
                    save_weight_copy=False)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    g = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    recipe = RECIPES[recipe_name]()

    def fwd(t):
        with qr.autocast(recipe=recipe):
            return lin(t)

    def step(fn):
        torch.manual_seed(1)
        y = fn(x)
        y.backward(g)
        out = (y.detach(), x.grad, lin.weight.grad)
        x.grad = None
        lin.weight.grad = None
        return out

    f = torch.compile(fwd, fullgraph=True) if mode == "compiled" else fwd
    for i in range(2):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        got = step(f)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        print(f"{case} step {i}: ok, peak {peak:.2f} GiB, x.grad finite "
              f"{bool(got[1].isfinite().all())}", flush=True)
    if mode == "compiled":
        want = step(fwd)
        same = [torch.equal(a, b) for a, b in zip(got, want, strict=True)]
        print(f"{case}: compiled == eager bitwise (y, x.grad, w.grad): {same}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
