"""Profiling: where the time of a compiled step or a kernel goes.

Subcommands (``python bench/profiling.py <command> --help`` for each one's options):

- ``torch``: torch.profiler of the compiled Linear step (``speed.py step``'s): the operator table
  by host or GPU time, host and GPU busy ms per step, optionally a Chrome trace;
- ``cprofile``: cProfile of the same step, ours against a peer: the Python functions by own and
  cumulative time, us per step;
- ``spy-run`` / ``spy-report``: the step's loop for ``py-spy record -f raw`` to sample, then the
  share of the loop's samples under each function, as us per step;
- ``ncu``: Nsight Compute counters of the quantize kernels or the GEMM implementations, run
  under ``ncu`` and summarized as one table line per launch;
- ``sass``: offline SASS instruction counts per element of each quantize kernel for sm_90.
"""

from __future__ import annotations

import collections
import cProfile
import json
import os
import pstats
import subprocess
import sys

import steps

STEP_CONFIGS = (*steps.OURS, "bf16", "ao_fp8_tensorwise")
#: The timed loop's frame (``measure.host_ms``), as ``_short`` names it.
LOOP = "host_ms (measure.py)"


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cmd_torch(args, p) -> None:
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    step = steps.warm_square_step(args.recipe, args.n, dev, warmup=5, mode=args.mode)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
            if args.sync:
                torch.cuda.synchronize()
        host = (time.perf_counter() - t0) / args.steps * 1e3
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / args.steps
    print(f"{args.recipe} n={args.n} {args.mode}: host {host:.3f} ms/step (profiled), GPU busy "
          f"{gpu_us / 1e3:.3f} ms/step; torch {torch.__version__}")
    for order in dict.fromkeys([args.sort, "self_cpu_time_total"]):  # asked order, then host
        print(f"--- sorted by {order}")
        print(events.table(sort_by=order, row_limit=args.rows, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)


def cmd_cprofile(args, p) -> None:
    import torch

    dev = _device()
    # the autograd engine on the calling thread: cProfile sees one thread, and the engine would
    # run a CUDA backward on its own
    with torch.autograd.set_multithreading_enabled(False):
        step = steps.warm_square_step(args.recipe, args.n, dev, warmup=5)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, calls, own s, cumulative s, _)
    for col, label in ((2, "own"), (3, "cumulative")):
        print(f"--- {args.recipe} n={args.n}, {args.steps} steps: top by {label} time, us/step")
        print("| own us | cumulative us | calls/step | function |\n| --- | --- | --- | --- |")
        top = sorted(stats.items(), key=lambda kv: kv[1][col], reverse=True)[: args.rows]
        for (file, line, name), (_, calls, own, cum, _) in top:
            where = f"{file.split('site-packages/')[-1].split('/src/')[-1]}:{line}({name})"
            print(f"| {own / args.steps * 1e6:.1f} | {cum / args.steps * 1e6:.1f} "
                  f"| {calls / args.steps:g} | {where} |")


def cmd_spy_run(args, p) -> None:
    import torch
    from measure import host_ms

    dev = _device()
    with torch.autograd.set_multithreading_enabled(False):
        step = steps.warm_square_step(args.recipe, args.n, dev, warmup=10)
        us = host_ms(step, dev, args.steps) * 1e3  # the loop every sample of interest is in
    print(json.dumps({"recipe": args.recipe, "n": args.n, "steps": args.steps,
                      "us_per_step": us}))


def _short(frame: str) -> str:
    """``fn (file.py:line)`` of py-spy's raw format, without the directory."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit("/", 1)[-1]
    return f"{name} ({where.split(':')[0]})" if where else name


def cmd_spy_report(args, p) -> None:
    for path in args.raw:
        incl: collections.Counter = collections.Counter()
        own: collections.Counter = collections.Counter()
        total = 0
        for line in open(path):
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = [_short(f) for f in stack.split(";")]
            hits = [i for i, f in enumerate(frames) if f.startswith(LOOP)]
            if not hits:
                continue
            inner = frames[hits[-1] + 1:] or ["<loop>"]
            n = int(count)
            total += n
            for f in set(inner):
                incl[f] += n
            own[inner[-1]] += n
        # py-spy writes its own messages to the same stdout: the JSON line is spy-run's
        meta = json.loads([ln for ln in open(args.meta) if ln.startswith("{")][-1]) \
            if args.meta else {}
        # with the run's measured us/step, a share of the samples is a share of that time
        scale = meta.get("us_per_step", 100.0) / max(total, 1)
        unit = "us/step" if meta else "% of samples"
        print(f"--- {path}: {total} samples in the loop ({meta or 'no --meta: shares'})")
        for title, counter in (("inclusive", incl), ("own (leaf)", own)):
            print(f"| {unit} | {title} |\n| --- | --- |")
            for f, n in counter.most_common(args.rows):
                print(f"| {n * scale:.1f} | {f[:150]} |")


def cmd_ncu(args, p) -> None:
    import counters

    metrics, launch, summarize = counters.SETS[args.cases]
    if args.launch:  # the process ncu profiles
        launch()
        return
    if args.summarize:
        summarize(args.summarize)
        return
    out = args.out or os.environ.get("OUT", ".")
    raw, clean = os.path.join(out, f"ncu_{args.cases}.csv"), os.path.join(
        out, f"ncu_{args.cases}_clean.csv")
    cmd = ["ncu", "--clock-control", "none", "--metrics", ",".join(metrics), "--csv", "--page",
           "raw", "--kernel-name-base", "function", "-k", counters.FILTERS[args.cases],
           sys.executable, os.path.abspath(__file__), "ncu", args.cases, "--launch"]
    with open(raw, "w") as f, open(os.path.join(out, f"ncu_{args.cases}.err"), "w") as err:
        rc = subprocess.run(cmd, stdout=f, stderr=err, timeout=args.limit).returncode
    print(f"ncu rc={rc}", flush=True)
    with open(raw) as f, open(clean, "w") as g:
        g.writelines(ln for ln in f if not ln.startswith("=="))
    summarize(clean)


def cmd_sass(args, p) -> None:
    import sass_cases

    for case in sass_cases.CASES:
        if args.filter in case[0]:
            sass_cases.report(*case)


def commands(sub) -> dict:
    """The subcommands, added to ``sub``."""

    def step_args(s, steps_default):
        s.add_argument("--recipe", default="fp8_current", choices=STEP_CONFIGS)
        s.add_argument("--n", type=int, default=4096, help="the square layer's size")
        s.add_argument("--steps", type=int, default=steps_default)

    t = sub.add_parser("torch", help="torch.profiler of the compiled Linear step",
                       description="One bias-free Linear (--n square) under --recipe, compiled "
                       "(fullgraph for ours), warmed up, then --steps steps profiled with CPU and "
                       "CUDA activities: the operator table (by host time, or by GPU time and "
                       "then host time) and the host and GPU busy ms per step.")
    step_args(t, 10)
    t.add_argument("--mode", default="default", choices=["default", "reduce-overhead"],
                   help="torch.compile's mode (reduce-overhead: CUDA graphs)")
    t.add_argument("--sort", default="self_cpu_time_total",
                   choices=["self_cpu_time_total", "self_device_time_total"])
    t.add_argument("--trace", metavar="OUT", help="write a Chrome trace")
    t.add_argument("--sync", action="store_true", help="synchronise after each step")
    t.add_argument("--rows", type=int, default=30)
    c = sub.add_parser("cprofile", help="cProfile of the compiled Linear step",
                       description="The same step under cProfile with the autograd engine on the "
                       "calling thread: the top Python functions by own and by cumulative time, "
                       "us per step, to read ours against a peer.")
    step_args(c, 50)
    c.add_argument("--rows", type=int, default=30)
    r = sub.add_parser("spy-run", help="the step's loop for py-spy to sample",
                       description="The step warmed up, then --steps steps back to back without "
                       "synchronising, for `py-spy record -r 200 -f raw -o ours.raw -- python "
                       "bench/profiling.py spy-run > ours.json`; prints the loop's us per step. "
                       "Keep the rate low on the H200 hosts (py-spy falls behind at 1000 Hz).")
    step_args(r, 2000)
    rep = sub.add_parser("spy-report", help="py-spy raw samples as us per step per function",
                         description="Per raw file, the share of the loop's samples under each "
                         "function (inclusive) and at each leaf (own), as us per step from the "
                         "wall time spy-run measured (--meta).")
    rep.add_argument("raw", nargs="+")
    rep.add_argument("--meta", help="the output of spy-run (its JSON line: us_per_step)")
    rep.add_argument("--rows", type=int, default=40)
    n = sub.add_parser("ncu", help="Nsight Compute counters of the kernels or the GEMMs",
                       description="Runs the cases under ncu (clocks left alone) into "
                       "$OUT/ncu_<cases>.csv and prints one line per launch: time, DRAM and L2 "
                       "traffic, SM and issue activity, occupancy, registers, shared memory, "
                       "store / load sectors per request and the top warp stalls (the gemm set: "
                       "tensor, FMA and LSU pipes; grouped: the grouped FP8 GEMMs against bf16 "
                       "_grouped_mm at a Qwen3-MoE projection; experts: the FP8 current "
                       "quantize of Qwen3-MoE's gate/up expert weights in one pass and in two, "
                       "against a bf16 copy).")
    n.add_argument("cases", choices=("kernels", "gemm", "grouped", "experts"))
    n.add_argument("--out", help="directory of the CSV files (default $OUT, else .)")
    n.add_argument("--limit", type=int, default=240, help="seconds for the ncu run")
    n.add_argument("--launch", action="store_true", help="only launch the cases (under ncu)")
    n.add_argument("--summarize", metavar="CSV", help="only summarize ncu's clean CSV")
    s = sub.add_parser("sass", help="offline SASS instructions per element (sm_90, no GPU)",
                       description="Each quantize kernel compiled by Triton for sm_90 at the "
                       "package's GPU tile configs: instructions, instructions per element, "
                       "ALU-pipe share, shared and local memory, registers, opcode histogram.")
    s.add_argument("filter", nargs="?", default="", help="only the kernels whose name has this")
    return {"torch": cmd_torch, "cprofile": cmd_cprofile, "spy-run": cmd_spy_run,
               "spy-report": cmd_spy_report, "ncu": cmd_ncu, "sass": cmd_sass}


if __name__ == "__main__":
    steps.run_cli(__doc__, commands)
