"""torch.profiler of a compiled training step (issue 13): where the host time goes.

One bias-free ``quant_recipes.Linear`` (``--n`` square) under ``--recipe`` (or bf16
``nn.Linear``, or torchao's ``ao_fp8_tensorwise``), compiled with ``fullgraph=True``; after
warm-up, ``--steps`` steps are profiled with CPU and CUDA activities (``--mode reduce-overhead``:
CUDA graphs). Prints the operator table, sorted by self CPU time (``--sort
self_device_time_total``: by GPU time, to see the kernels, then again by CPU time), and the
per-step host and GPU busy time; ``--trace OUT`` writes a Chrome trace.

``PYTHONPATH=packages/quant-core/src:packages/quant-kernels/src:packages/quant-dynamo/src:\\
packages/quant-recipes/src python bench/profile_step.py --recipe fp8_current --n 4096``
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile
from train_step import OURS, make_step, step_inputs  # registers Triton from source trees


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="fp8_current", choices=[*OURS, "bf16", "ao_fp8_tensorwise"])
    p.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    p.add_argument(
        "--sort",
        default="self_cpu_time_total",
        choices=["self_cpu_time_total", "self_device_time_total"],
        help="the table's order: host time (default) or GPU time per kernel",
    )
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--trace", metavar="OUT")
    p.add_argument("--sync", action="store_true",
                   help="synchronise after each step, as train_step.py's timed steps do")
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args()
    dev = torch.device("cuda")
    n = args.n
    step = make_step(args.recipe, *step_inputs(n, n, n, dev), mode=args.mode)[0]  # train_step's
    for _ in range(5):
        step()
    torch.cuda.synchronize()
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
    print(
        f"{args.recipe} n={n} {args.mode}: host {host:.3f} ms/step (profiled), GPU busy "
        f"{gpu_us / 1e3:.3f} ms/step; torch {torch.__version__}"
    )
    for order in dict.fromkeys([args.sort, "self_cpu_time_total"]):  # asked order, then host
        print(f"--- sorted by {order}")
        print(events.table(sort_by=order, row_limit=args.rows, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
