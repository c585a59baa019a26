"""Peak memory and time of an FSDP2 training step of a stack of Linear layers, per rank: bf16
``nn.Linear``, torchao's float8 (tensorwise, FP8 all-gather of the weights) and quant's recipes,
all in one run (issue 14).

Each rank trains ``--layers`` bias-free ``d x d`` layers, each wrapped with ``fully_shard`` (and
the stack too), on ``--tokens`` tokens of its own; eager mode (FSDP2's hooks and prefetching
are the same for every config). quant's layers all-gather the bf16 weight and quantize it after
the gather; with the suffix ``:fp8ag`` they all-gather the weight in the recipe's quantized
format instead (``enable_fsdp_quantized_all_gather``, issue 18). The all-gather column is the
bytes one rank's all-gathers received in one step (all parameters, forward and backward),
counted at FSDP2's collective.

``python bench/fsdp2_step.py --nproc 2`` (GPUs, NCCL); ``--device cpu`` runs the same on gloo
with tiny shapes (the CPU check that it works; no torchao there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import quant_recipes as qr
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from quant_core import backends
from quant_recipes.fsdp import count_all_gathers

try:  # run from source trees (PYTHONPATH), the entry point that registers Triton is absent
    from quant_kernels.backend import BACKEND

    backends.register(BACKEND)
except ImportError:
    pass

RECIPES = {"fp8_current": qr.Float8CurrentScaling, "fp8_block": qr.Float8BlockScaling,
           "mxfp8": qr.MXFP8BlockScaling, "nvfp4": qr.NVFP4BlockScaling}
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


def worker(rank: int, args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.nproc)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    rows = []
    for name in args.configs.split(","):
        try:
            rows.append(run(name, args, device))
        except Exception as e:  # noqa: BLE001 - report and go on with the next config
            rows.append({"config": name, "error": f"{type(e).__name__}: {e}"[:200]})
        if cuda:
            torch.cuda.empty_cache()
    gathered = [None] * args.nproc
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print_table(gathered, args)
    dist.destroy_process_group()


def print_table(per_rank: list[list[dict]], args) -> None:
    print(f"\n### FSDP2 step, {args.nproc} ranks ({args.device}), {args.layers} layers "
          f"{args.d}x{args.d}, {args.tokens} tokens per rank, torch {torch.__version__}\n")
    print("Peak: the step's highest allocation (model, gradients, optimizer state, activations "
          "and transients included) above what earlier configs left allocated (rank 0: "
          + ", ".join(f"{r['config']} {r.get('left_before_gib', 0):.2f}" for r in per_rank[0])
          + " GiB).\n")
    print("| config | ms/step (rank 0) | peak GiB, max over ranks | vs bf16 peak "
          "| all-gather MiB/step (rank 0) | saved MiB after forward (rank 0) |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = None
    for i, row in enumerate(per_rank[0]):
        if "error" in row:
            print(f"| {row['config']} | {row['error'][:80]} | - | - | - | - |")
            continue
        peaks = [r[i].get("peak_gib") for r in per_rank]
        peak = max(peaks) if None not in peaks else None
        if row["config"] == "bf16":
            base = peak
        rel = f"{peak / base:.2f}x" if peak and base else "-"
        shown = f"{peak:.2f}" if peak is not None else "-"
        print(f"| {row['config']} | {row['ms']:.2f} | {shown} | {rel} | {row['ag_mib']:.2f} "
              f"| {row['saved_mib']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": per_rank}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--d", type=int, default=8192, help="layer width (d x d weights)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
