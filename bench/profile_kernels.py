"""Hardware counters of every benchmarked kernel (bf16 16384^2), read with Nsight Compute.

Run under ncu (``bench/ncu_run.sh`` does): each case of ``bench/kernels.py`` is launched twice
(the first launch compiles), plus a device-to-device copy as the baseline. ``summarize`` turns
ncu's raw CSV into one line per kernel launch (second launch of each case).
``python bench/profile_kernels.py``            launch the cases (under ncu)
``python bench/profile_kernels.py ncu.csv``     summarize ncu's CSV
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


def launch() -> None:
    import torch
    from kernels import cases

    x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(2):
        y.copy_(x)
    for name, _target, _cfgs, fn, _nbytes in cases(x):
        print("case", name, file=sys.stderr, flush=True)
        fn()
        fn()
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


def summarize(path: str) -> None:
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


if __name__ == "__main__":
    if len(sys.argv) > 1:
        summarize(sys.argv[1])
    else:
        launch()
