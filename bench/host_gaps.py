"""Where the GPU waits for the host in a model's training step: the idle gaps between kernels of
one profiled steady-state step, each put on the host-side operators that were running when the
kernel after the gap was launched.

    python3 bench/host_gaps.py --size qwen3-moe --configs bf16,fp8_current

Per config: the step's wall ms, GPU busy ms, idle ms in gaps of at least ``--min-us`` and the
operators (outermost named ones first) that launched the kernels after the largest gaps, summed.
A gap means the host had nothing queued: the launches after it waited on Python, on a host
synchronization, or on the allocator. ``--cprofile N``: then one more step under cProfile, its
``N`` functions of most own host time and of most cumulative host time.

``--held N``: then ``N`` steps each queued behind a GPU sleep longer than the step's host work,
so that the host never waits for the GPU: the host ms of forward, backward and the optimizer
(what launching them costs), the GPU ms of each (kernels back to back, no gaps), and the
host-side operators of most inclusive host time in one such step (torch.profiler, CPU only).
Where a phase's host ms exceed its GPU ms, that phase is host-bound whatever its kernels cost.
transformers' check for packed sequences, a host read before the first layer, is skipped in
these steps (the benchmark's batches hold none); a host read left in a step is reported.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
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


def host_profile(step, rows: int, dump: str | None = None) -> str:
    """cProfile of one call of ``step``: its ``rows`` functions of most own time, then of most
    cumulative time; ``dump``: also the raw statistics to that file (``pstats`` reads it)."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    if dump:
        prof.dump_stats(dump)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


#: GPU clock cycles of the sleep queued before a held step: longer than any step's host work
#: (about 0.5 s at an H100's or H200's clock).
HOLD_CYCLES = 900_000_000


def _held_step(forward, backward, update):
    """``(host ms, GPU ms, waited)`` of forward, backward and the optimizer of one step queued
    behind a GPU sleep; ``waited``: the host waited for the GPU after all (the sleep was too
    short, a host read was left in the step, or the launch queue filled behind the sleep)."""
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
    ev[0].record()
    torch.cuda._sleep(HOLD_CYCLES)
    ev[1].record()
    t = [time.perf_counter()]
    loss = forward()
    t.append(time.perf_counter())
    ev[2].record()
    backward(loss)
    t.append(time.perf_counter())
    ev[3].record()
    update()
    t.append(time.perf_counter())
    ev[4].record()
    torch.cuda.synchronize()
    host = [(t[i + 1] - t[i]) * 1e3 for i in range(3)]
    gpu = [ev[i].elapsed_time(ev[i + 1]) for i in (1, 2, 3)]
    return host, gpu, sum(host) >= ev[0].elapsed_time(ev[1])


@contextlib.contextmanager
def _no_packed_sequence_check():
    """transformers checks on the host whether the positions hold packed sequences, a read of
    a device tensor before the first layer that would hold the forward's launches up behind
    the sleep; the benchmark's batches hold none, so the check answers ``None`` here."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    packed = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda *args, **kwargs: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = packed


def held(forward, backward, update, steps: int, rows: int) -> dict:
    """Host and GPU ms of each phase of ``steps`` held steps (medians), and the ``rows``
    operators of most inclusive host time of one more held step."""
    from torch.profiler import ProfilerActivity, profile

    with _no_packed_sequence_check():
        runs = [_held_step(forward, backward, update) for _ in range(steps)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _held_step(forward, backward, update)
    res = {}
    for i, name in enumerate(("forward", "backward", "optimizer")):
        res[f"host_{name}_ms"] = round(sorted(r[0][i] for r in runs)[steps // 2], 2)
        res[f"gpu_{name}_ms"] = round(sorted(r[1][i] for r in runs)[steps // 2], 2)
    res["host_waited"] = any(r[2] for r in runs)
    res["host_ops"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows,
                                                max_name_column_width=70)
    return res


def run(config: str, size: str, layers: int | None, min_us: float, rows: int,
        cprofile_rows: int = 0, steps: int = 1, held_steps: int = 0,
        pstats_dir: str | None = None) -> dict:
    torch._dynamo.reset()
    # each compiled layer may compile once more under the profiler: room for all of them
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    device = torch.device("cuda")
    data = bench_steps.batches(size, measure.WARMUP + 2, device)
    with bench_steps.llama_lowering(config), bench_steps.whole_step_patch(config):
        _, forward, opt = bench_steps.compiled_training(config, size, device, layers)

        def update():
            opt.step()
            opt.zero_grad(set_to_none=True)

        def step(ids):
            loss = forward(ids)
            loss.backward()
            update()
            return loss.item()

        for i in range(measure.WARMUP):
            step(data[i])
        res = {"config": config, **gaps(lambda: step(data[-1]), min_us, rows, steps)}
        if cprofile_rows:
            dump = pstats_dir and os.path.join(pstats_dir, f"{config}.pstats")
            res["cprofile"] = host_profile(lambda: step(data[-1]), cprofile_rows, dump)
        if held_steps:
            res["held"] = held(lambda: forward(data[-1]), lambda loss: loss.backward(), update,
                               held_steps, rows)
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
    p.add_argument("--pstats", metavar="DIR",
                   help="with --cprofile: also each config's raw statistics, DIR/<config>.pstats")
    p.add_argument("--held", type=int, default=0, metavar="N",
                   help="also N steps queued behind a GPU sleep: host and GPU ms per phase")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    results = [run(c, args.size, args.layers, args.min_us, args.rows, args.cprofile, args.steps,
                   args.held, args.pstats) for c in args.configs.split(",")]
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
        if "held" in r:
            h = r["held"]
            if h["host_waited"]:
                print("(the host waited for the GPU in a held step: its host ms are an upper "
                      "bound)")
            print("| phase (GPU held) | host ms | GPU ms |\n| --- | --- | --- |")
            for name in ("forward", "backward", "optimizer"):
                print(f"| {name} | {h[f'host_{name}_ms']} | {h[f'gpu_{name}_ms']} |")
            print(h["host_ops"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
