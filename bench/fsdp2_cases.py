"""Peak memory and time of an FSDP2 training step of a stack of Linear layers, per rank
(``memory.py fsdp2``): bf16 ``nn.Linear``, torchao's float8 (tensorwise, FP8 all-gather of the
weights) and quant's recipes, all in one run; time and peak as ratios to bf16's.

Each rank trains ``--layers`` bias-free ``d x d`` layers, each wrapped with ``fully_shard`` (and
the stack too), on ``--tokens`` tokens of its own; eager mode (FSDP2's hooks and prefetching
are the same for every config). quant's layers all-gather the bf16 weight and quantize it after
the gather; with the suffix ``:fp8ag`` they all-gather the weight in the recipe's quantized
format instead (``enable_fsdp_quantized_all_gather``). The all-gather column is the
bytes one rank's all-gathers received in one step (all parameters, forward and backward),
counted at FSDP2's collective.
``--device cpu`` runs the same on gloo with tiny shapes (the CPU check that it works; no
torchao there).
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import statistics
import sys
import time

import quant_recipes as qr
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# the one all-gather counter, shared with the FSDP2 tests (a test helper, not package code)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "recipes"))
from _fsdp_counting import count_all_gathers  # noqa: E402
from steps import recipes, register_triton

register_triton()  # at import: in every rank
RECIPES = recipes()
CONFIGS = ["bf16", "ao_fp8_tensorwise", *RECIPES, "fp8_current:requant", "mxfp8:requant",
           *(f"{r}:fp8ag" for r in RECIPES)]


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def build(name: str, d: int, layers: int, device: torch.device):
    """``(model, forward)`` of config ``name``: ``layers`` sharded ``d x d`` layers. A quant
    config with the suffix ``:requant`` quantizes the weight again in backward
    (``Linear(save_weight_copy=False)``) instead of holding its copy through the step; with
    ``:fp8ag`` the weight is all-gathered quantized (and so not quantized by the layer)."""
    torch.manual_seed(0)
    base, _, variant = name.partition(":")
    if base in RECIPES:
        model = torch.nn.Sequential(*(qr.Linear(d, d, bias=False, dtype=torch.bfloat16,
                                                device=device,
                                                save_weight_copy=variant != "requant")
                                      for _ in range(layers)))
        recipe = RECIPES[base]()
        if variant == "fp8ag":
            qr.enable_fsdp_quantized_all_gather(model, recipe)

        def forward(x):
            with qr.autocast(recipe=recipe):
                return model(x)
    else:
        model = torch.nn.Sequential(*(torch.nn.Linear(d, d, bias=False, dtype=torch.bfloat16,
                                                      device=device) for _ in range(layers)))
        if name == "ao_fp8_tensorwise":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
            convert_to_float8_training(model, config=config)
        forward = model
    shard = _fully_shard()
    for layer in model:
        shard(layer)
    shard(model)
    return model, forward


def run(name: str, args, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    gc.collect()
    # what earlier configs left allocated (the peak is counted above it: configs run in one
    # process, and the absolute peak grew with each config run before, whatever it was)
    base = torch.cuda.memory_allocated() if cuda else 0
    model, forward = build(name, args.d, args.layers, device)
    gen = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    x = torch.randn(args.tokens, args.d, generator=gen).to(device, torch.bfloat16)
    g = torch.randn(args.tokens, args.d, generator=gen).to(device, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        forward(x).backward(g)
        opt.step()

    for _ in range(2):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    res = {"config": name, "ms": 1e3 * statistics.median(times)}
    if cuda:
        res["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        res["left_before_gib"] = base / 2**30
    with count_all_gathers() as counted:  # one more step, its all-gathers counted
        step()
    res["ag_mib"] = sum(counted) / 2**20
    res["saved_mib"] = saved_after_forward_mib(forward, x)
    return res


def saved_after_forward_mib(forward, x: torch.Tensor) -> float:
    """MiB that the tensors saved for backward hold once the forward has returned (and FSDP2 has
    resharded): distinct storages, their size read after the forward, so a gathered weight whose
    storage FSDP2 freed counts 0 and a copy made from it counts in full."""
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t):
        inner = [t] if type(t) is torch.Tensor else [
            getattr(t, n) for n in getattr(t, "__tensor_flatten__", lambda: ([], None))()[0]]
        for u in inner:
            if isinstance(u, torch.Tensor) and type(u) is torch.Tensor:
                saved.setdefault(id(u.untyped_storage()), u.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward(x)
    held = sum(st.nbytes() for st in saved.values()) / 2**20
    del y
    return held


def join_group(rank: int, args) -> torch.device:
    """Join the run's process group (NCCL on ``--device cuda``, else gloo); the rank's device."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.nproc)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    return device


def run_configs(configs: list[str], run_one, device: torch.device, args, print_table) -> None:
    """``run_one(config)`` for each config (an error becomes its row), then rank 0 prints every
    rank's rows with ``print_table(per_rank, args)``; leaves the process group."""
    rows = []
    for name in configs:
        try:
            rows.append(run_one(name))
        except Exception as e:  # noqa: BLE001 - report and go on with the next config
            rows.append({"config": name, "error": f"{type(e).__name__}: {e}"[:200]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    gathered = [None] * args.nproc
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        print_table(gathered, args)
    dist.destroy_process_group()


def worker(rank: int, args) -> None:
    device = join_group(rank, args)
    run_configs((args.configs or ",".join(CONFIGS)).split(","),
                lambda name: run(name, args, device), device, args, print_table)


def print_table(per_rank: list[list[dict]], args) -> None:
    print(f"\n### FSDP2 step, {args.nproc} ranks ({args.device}), {args.layers} layers "
          f"{args.d}x{args.d}, {args.tokens} tokens per rank, torch {torch.__version__}\n")
    print("Peak: the step's highest allocation (model, gradients, optimizer state, activations "
          "and transients included) above what earlier configs left allocated (rank 0: "
          + ", ".join(f"{r['config']} {r.get('left_before_gib', 0):.2f}" for r in per_rank[0])
          + " GiB).\n")
    print("| config | ms/step (rank 0) | vs bf16 (its ms / this ms) | peak GiB, max over ranks "
          "| vs bf16 peak | all-gather MiB/step (rank 0) | saved MiB after forward (rank 0) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    first_bf16 = next((r for r in per_rank[0] if r["config"] == "bf16" and "ms" in r), None)
    base, base_ms = None, first_bf16["ms"] if first_bf16 else None
    for i, row in enumerate(per_rank[0]):
        if "error" in row:
            print(f"| {row['config']} | {row['error'][:80]} | - | - | - | - | - |")
            continue
        peaks = [r[i].get("peak_gib") for r in per_rank]
        peak = max(peaks) if None not in peaks else None
        if row["config"] == "bf16":
            base = peak
        rel = f"{peak / base:.2f}x" if peak and base else "-"
        speed = f"{base_ms / row['ms']:.3f}x" if base_ms else "-"
        shown = f"{peak:.2f}" if peak is not None else "-"
        print(f"| {row['config']} | {row['ms']:.2f} | {speed} | {shown} | {rel} "
              f"| {row['ag_mib']:.2f} | {row['saved_mib']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": per_rank}, f, indent=1)


def main(args) -> None:
    """One process per rank (``args``: ``nproc``, ``device``, ``d``, ``layers``, ``tokens``,
    ``iters``, ``configs``, ``port``, ``json``)."""
    mp.spawn(worker, args=(args,), nprocs=args.nproc, join=True)
