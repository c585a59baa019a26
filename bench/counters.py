"""Nsight Compute counters (``profiling.py ncu``): the metrics read per kernel launch, the cases
launched under ncu, and ncu's raw CSV summarized as one table line per launch.

Cases: ``kernels``, every benchmarked quantize kernel (``kernel_cases.cases``) at bf16 16384^2
plus a device-to-device copy as the baseline; ``gemm``, the MXFP8 / NVFP4 GEMM implementations at
16384x8192x8192 (fprop: the fused Triton mainloops that dequantize to bf16, and the default
dequantize + cuBLAS path) next to a bf16 ``torch.mm``; ``grouped``, the grouped FP8 GEMMs of
quant-kernels at a Qwen3-MoE gate/up projection (128 experts, ~512 ragged rows each, 2048 ->
1536; the rows form and the weight gradient's contraction form, E5M2 x E4M3) next to bf16
``torch._grouped_mm`` on the same groups.
Each case runs twice (the first launch compiles).
"""

from __future__ import annotations

import csv
import sys

#: Counters read per launch: time, DRAM and L2 traffic, issue activity, occupancy, local memory,
#: shared-memory bank conflicts, and the warp-stall breakdown (cycles per issued instruction).
METRICS = [
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_bytes.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__inst_executed.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_static",
    "launch__shared_mem_per_block_dynamic",
    "launch__occupancy_limit_registers",
    "launch__grid_size",
    "launch__block_size",
    "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
]
STALLS = ("long_scoreboard", "lg_throttle", "barrier", "short_scoreboard", "mio_throttle",
          "math_pipe_throttle", "wait", "not_selected", "selected", "drain", "membar",
          "no_instruction", "dispatch_stall", "branch_resolving", "tex_throttle", "misc")
METRICS += [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS]


#: The GEMM table's pipe counters on top of METRICS.
PIPES = ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",  # NaN on the
         # H200's ncu: the GMMA pipe's counter name there is still to be found
         "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
         "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active")
GEMM_METRICS = METRICS + list(PIPES)
#: ncu's kernel filter per case set: the setup kernels (random fills, copies, the operands'
#: quantization for the GEMMs) are left out.
FILTERS = {
    "kernels": "regex:^(?!.*(distribution|fill|randn|normal)).*",
    "gemm": "regex:^(?!.*(distribution|fill|randn|normal|copy|elementwise|amax|_mxfp8_kernel|"
            "_nvfp4_row|_nvfp4_col|current_scale)).*",
    "grouped": "regex:^(?!.*(distribution|fill|randn|normal|copy|elementwise|cumsum|scan|"
               "reduce|arange)).*",
    "experts": "regex:^(?!.*(distribution|fill|randn|normal)).*",
}


def launch_kernels() -> None:
    import torch
    from kernel_cases import cases

    x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(2):
        y.copy_(x)
    for name, _target, _cfgs, fn, _nbytes in cases(x):
        print("case", name, file=sys.stderr, flush=True)
        fn()
        fn()
        torch.cuda.synchronize()


def launch_gemm() -> None:
    import gemm_cases
    import torch
    from quant_recipes import gemm as G

    m, k, n = 16384, 8192, 8192
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    g = torch.randn(m, n, device="cuda").bfloat16()
    for _ in range(2):
        torch.mm(x, w.t())
    cases = [(name, mode) for name in ("mxfp8", "nvfp4") for mode in ("dequant", "fused")]
    for name, mode in cases:
        args = gemm_cases.roles(x, w, g, gemm_cases.quantizers(name))["fprop"]
        print("case", name, mode, file=sys.stderr, flush=True)
        with gemm_cases.gemm_implementation(name, mode):
            for _ in range(2):
                G.qgemm_impl(*args, None, torch.bfloat16)
            torch.cuda.synchronize()


def launch_grouped() -> None:
    import grouped_cases
    import torch
    from quant_core.dtypes import DType
    from quant_kernels import fp8_grouped_gemm as kern

    e, rows, k, n = 128, 512, 2048, 1536
    for multiple in (16, 128):
        counts = grouped_cases.group_rows(e, rows, True, multiple)
        total = sum(counts)
        offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        a8 = torch.randint(0, 120, (total, k), device="cuda", dtype=torch.uint8)
        w8 = torch.randint(0, 120, (e, n, k), device="cuda", dtype=torch.uint8)
        at8 = torch.randint(0, 120, (n, total), device="cuda", dtype=torch.uint8)
        bt8 = torch.randint(0, 120, (k, total), device="cuda", dtype=torch.uint8)
        s = torch.ones(e, device="cuda")
        kw = {"a_dtype": DType.E5M2, "b_dtype": DType.E4M3}
        print("case own rows, tokens: groups of", multiple, file=sys.stderr, flush=True)
        for _ in range(2):
            kern.fp8_grouped_rows_gemm(a8, s, w8, s, offs, offs, total=total, **kw)
            kern.fp8_grouped_tokens_gemm(at8, s, bt8, s, offs, **kw, group_multiple=multiple)
        torch.cuda.synchronize()
    x = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    gt = torch.randn(n, total, device="cuda", dtype=torch.bfloat16)
    xt = torch.randn(k, total, device="cuda", dtype=torch.bfloat16)
    print("case bf16 _grouped_mm rows, tokens", file=sys.stderr, flush=True)
    for _ in range(2):
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        torch._grouped_mm(gt, xt.t(), offs=offs)
    torch.cuda.synchronize()


def read_rows(path: str) -> list[dict]:
    """ncu's raw CSV rows, one per kernel launch."""
    return [r for r in csv.DictReader(open(path)) if r.get("ID", "").isdigit()]


def num(r: dict, k: str) -> float:
    """Counter ``k`` of row ``r`` as a float (NaN when ncu did not report it)."""
    v = r.get(k, "").replace(",", "")
    try:
        return float(v)
    except ValueError:
        return float("nan")


def top_stalls(r: dict, n: int = 4) -> str:
    """The ``n`` largest warp-stall reasons of row ``r`` (cycles per issued instruction)."""
    stalls = sorted(((num(r, f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"),
                      s) for s in STALLS), reverse=True)[:n]
    return ", ".join(f"{s} {v:.1f}" for v, s in stalls)


def launch_experts() -> None:
    """The FP8 current quantize of Qwen3-MoE's gate/up expert weights (128 x 1536 x 2048 bf16):
    a bf16 copy of them, the one-pass cast, then the two passes."""
    import contextlib

    import grouped_cases
    import steps
    import torch

    e, n, k = 128, 1536, 2048
    w = torch.randn(e * n, k, device="cuda", dtype=torch.bfloat16)
    torch.empty_like(w).copy_(w)
    for name, passes in (("one pass", contextlib.nullcontext),
                         ("two passes", steps.two_pass_experts)):
        print("case", name, file=sys.stderr, flush=True)
        with passes():
            for _ in range(2):
                grouped_cases.cast_experts(w, e)
        torch.cuda.synchronize()


def summarize_kernels(path: str) -> None:
    rows = read_rows(path)
    print("| id | kernel | us | DRAM GB/s | DRAM % | L2 MB | SM % | issue % | warps % | regs "
          "| smem | st sect/req | ld sect/req | top stalls (cycles/issue) |")
    print("|" + " --- |" * 14)
    for r in rows:
        t = num(r, "gpu__time_duration.sum")  # ns
        dram = num(r, "dram__bytes_read.sum") + num(r, "dram__bytes_write.sum")
        st = num(r, "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum") / max(
            num(r, "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"), 1)
        ld = num(r, "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum") / max(
            num(r, "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"), 1)
        smem = num(r, "launch__shared_mem_per_block_static") + num(
            r, "launch__shared_mem_per_block_dynamic")
        print(f"| {r['ID']} | {r['Kernel Name'][:40]} | {t / 1e3:.0f} | {dram / t:.0f} "
              f"| {num(r, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):.0f} "
              f"| {num(r, 'lts__t_bytes.sum') / 1e6:.0f} "
              f"| {num(r, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'):.0f} "
              f"| {num(r, 'smsp__issue_active.avg.pct_of_peak_sustained_active'):.0f} "
              f"| {num(r, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.0f} "
              f"| {num(r, 'launch__registers_per_thread'):.0f} | {smem:.0f} | {st:.1f} | {ld:.1f} "
              "| " + top_stalls(r) + " |")



def summarize_gemm(path: str) -> None:
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


#: case set -> (metrics, launch, summarize)
SETS = {"kernels": (METRICS, launch_kernels, summarize_kernels),
        "gemm": (GEMM_METRICS, launch_gemm, summarize_gemm),
        "grouped": (METRICS, launch_grouped, summarize_kernels),
        "experts": (METRICS, launch_experts, summarize_kernels)}
