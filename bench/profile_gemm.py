"""Hardware counters of the MXFP8 / NVFP4 GEMM implementations at 16384x8192x8192 (fprop), read
with Nsight Compute (``bench/ncu_gemm.sh``): the fused Triton mainloops (MXFP8 FP8-MMA with
per-block promotion, MXFP8 bf16 dequant, NVFP4 decode) and the default dequant + cuBLAS path,
next to a plain bf16 ``torch.mm``. Each case runs twice (the first launch compiles).

``python bench/profile_gemm.py``          launch the cases (under ncu)
``python bench/profile_gemm.py ncu.csv``  one line per kernel launch: time, tensor and FMA pipes,
                                          issue activity, registers, the top warp stalls
"""

from __future__ import annotations

import sys

from profile_kernels import METRICS as BASE_METRICS
from profile_kernels import num, read_rows, top_stalls

PIPES = ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",  # NaN on the
         # H200's ncu (2026-11-30): the GMMA pipe's counter name there is still to be found
         "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
         "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active")
METRICS = BASE_METRICS + list(PIPES)


def launch() -> None:
    import gemm as B
    import torch
    from quant_kernels import mxfp8_gemm, nvfp4_gemm
    from quant_recipes import gemm as G

    m, k, n = 16384, 8192, 8192
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    g = torch.randn(m, n, device="cuda").bfloat16()
    for _ in range(2):
        torch.mm(x, w.t())
    cases = [("mxfp8", mxfp8_gemm, mode) for mode in ("dequant", "bf16", "fp8")]
    cases += [("nvfp4", nvfp4_gemm, mode) for mode in ("dequant", "fused")]
    for name, module, mode in cases:
        args = B.roles(x, w, g, B.quantizers(name))["fprop"]
        module.MODE = mode
        print("case", name, mode, file=sys.stderr, flush=True)
        for _ in range(2):
            G.qgemm_impl(*args, None, torch.bfloat16)
        torch.cuda.synchronize()
        module.MODE = None


def summarize(path: str) -> None:
    print("| id | kernel | us | SM % | tensor pipe % | FMA pipe % | LSU % | issue % | regs "
          "| top stalls (cycles/issue) |")
    print("|" + " --- |" * 10)
    for r in read_rows(path):
        us = num(r, "gpu__time_duration.sum") / 1e3
        print(f"| {r['ID']} | {r['Kernel Name'][:44]} | {us:.0f} "
              f"| {num(r, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'):.0f} "
              + "".join(f"| {num(r, p):.0f} " for p in PIPES)
              + f"| {num(r, 'smsp__issue_active.avg.pct_of_peak_sustained_active'):.0f} "
              f"| {num(r, 'launch__registers_per_thread'):.0f} | {top_stalls(r)} |")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        summarize(sys.argv[1])
    else:
        launch()
