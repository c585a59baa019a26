"""Where a large NVFP4 / MXFP8 Linear step fails with the dequant GEMM in row blocks (issue 14):
eager, then compiled, per recipe, with and without blocks; ``CUDA_LAUNCH_BLOCKING=1`` makes the
failing launch raise where it is. One process per case (an illegal access poisons the context).

``python bench/debug/dequant_blocks.py CASE`` with CASE ``<recipe>:<eager|compiled>:<blocks|whole>``
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

    f = torch.compile(fwd, fullgraph=True) if mode == "compiled" else fwd
    for i in range(2):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        f(x).backward(g)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        print(f"{case} step {i}: ok, peak {peak:.2f} GiB, x.grad finite "
              f"{bool(x.grad.isfinite().all())}", flush=True)
        x.grad = None
        lin.weight.grad = None


if __name__ == "__main__":
    main(sys.argv[1])
