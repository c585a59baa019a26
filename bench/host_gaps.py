"""Where the GPU waits for the host in a model's training step: the idle gaps between kernels of
one profiled steady-state step, each put on the host-side operators that were running when the
kernel after the gap was launched.

    python3 bench/host_gaps.py --size qwen3-moe --configs bf16,fp8_current

Per config: the step's wall ms, GPU busy ms, idle ms in gaps of at least ``--min-us`` and the
operators (outermost named ones first) that launched the kernels after the largest gaps, summed.
A gap means the host had nothing queued: the launches after it waited on Python, on a host
synchronization, or on the allocator. ``--cprofile N``: then one more step under cProfile, its
``N`` functions of most own host time and of most cumulative host time.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import cProfile
import io
import json
import os
import pstats
import tempfile
import time

import measure
import steps as bench_steps
import torch

#: Operator names that say nothing about which layer code ran (their children do).
_WRAPPERS = ("ProfilerStep", "## ", "Torch-Compiled Region", "CompiledFunction",
             "autograd::engine::evaluate_function")


def _stacks(trace: dict):
    """``(kernels, launch_stack)``: the kernels ``(start_us, end_us, correlation)`` in start
    order, and per correlation id the names of the CPU operators around its launch, outermost
    first."""
    events = trace["traceEvents"]
    ops = collections.defaultdict(list)
    launches, kernels = {}, []
    for e in events:
        cat = e.get("cat", "")
        if cat == "cpu_op" or cat == "user_annotation":
            ops[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e["tid"], e["ts"])
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append((e["ts"], e["ts"] + e.get("dur", 0), e["args"].get("correlation")))
    for tid in ops:
        ops[tid].sort()
    starts = {tid: [o[0] for o in lst] for tid, lst in ops.items()}

    def stack(corr):
        if corr not in launches:
            return ["?"]
        tid, ts = launches[corr]
        lst = ops.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), ts)
        return [name for s, e, name in lst[:i] if s <= ts <= e] or ["?"]

    kernels.sort()
    return kernels, stack


def _named(names: list[str]) -> str:
    """The two outermost operators of a launch stack that are not wrappers."""
    kept = [n for n in names if not n.startswith(_WRAPPERS)]
    return " > ".join(kept[:2]) if kept else names[-1]


def gaps(step, min_us: float, rows: int, steps: int = 1) -> dict:
    """Profile ``steps`` calls of ``step`` in a row and sum their GPU idle gaps by launching
    operators, per call (the mean; ``walls_ms``: each call's wall time, a gap between two calls
    counted in the second). A first profiled call is not measured: compiled code may recompile
    once under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities):
        step()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    kernels, stack = _stacks(trace)
    busy = idle = 0.0
    by_op: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    end = kernels[0][0] if kernels else 0.0
    for s, e, corr in kernels:
        gap = s - end
        if gap >= min_us:
            key = _named(stack(corr))
            by_op[key] += gap
            count[key] += 1
            idle += gap
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    return {"wall_ms": round(sum(walls) / steps, 2), "walls_ms": [round(w, 2) for w in walls],
            "busy_ms": round(busy / 1e3 / steps, 2), "idle_ms": round(idle / 1e3 / steps, 2),
            "kernels": len(kernels) // steps,
            "gaps": [{"op": k[:150], "count": round(count[k] / steps, 1),
                      "ms": round(v / 1e3 / steps, 3)} for k, v in by_op.most_common(rows)]}


def host_profile(step, rows: int) -> str:
    """cProfile of one call of ``step``: its ``rows`` functions of most own time, then of most
    cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def run(config: str, size: str, layers: int | None, min_us: float, rows: int,
        cprofile_rows: int = 0, steps: int = 1) -> dict:
    torch._dynamo.reset()
    # each compiled layer may compile once more under the profiler: room for all of them
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    device = torch.device("cuda")
    data = bench_steps.batches(size, measure.WARMUP + 2, device)
    with bench_steps.llama_lowering(config), bench_steps.whole_step_patch(config):
        _, forward, opt = bench_steps.compiled_training(config, size, device, layers)

        def step(ids):
            loss = forward(ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        for i in range(measure.WARMUP):
            step(data[i])
        res = {"config": config, **gaps(lambda: step(data[-1]), min_us, rows, steps)}
        if cprofile_rows:
            res["cprofile"] = host_profile(lambda: step(data[-1]), cprofile_rows)
        return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="qwen3-moe",
                   choices=sorted([*bench_steps.SIZES, *bench_steps.MOE_SIZES]))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--configs", default="bf16,fp8_current")
    p.add_argument("--min-us", type=float, default=20.0, help="smallest gap counted")
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--steps", type=int, default=1,
                   help="steps profiled in a row; the figures are per step (their mean)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also one step under cProfile: its N functions of most own and of "
                   "most cumulative host time")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    results = [run(c, args.size, args.layers, args.min_us, args.rows, args.cprofile, args.steps)
               for c in args.configs.split(",")]
    for r in results:
        print(f"\n{r['config']}: wall {r['wall_ms']} ms (steps: {r['walls_ms']}), GPU busy "
              f"{r['busy_ms']} ms, idle {r['idle_ms']} ms in gaps >= {args.min_us} us, "
              f"{r['kernels']} kernels (per step)")
        print("| operators launching the kernel after the gap | gaps | ms |")
        print("| --- | --- | --- |")
        for g in r["gaps"]:
            print(f"| {g['op']} | {g['count']} | {g['ms']} |")
        if "cprofile" in r:
            print(r["cprofile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
