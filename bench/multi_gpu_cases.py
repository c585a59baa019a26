"""A Llama training step on several GPUs (``speed.py multi-gpu``): FSDP2, or FSDP2 x tensor
parallelism on a 2-D mesh, for bf16, torchao's float8 and quant's recipes in one run; ms/step,
tokens/s per GPU, peak memory per GPU and bytes all-gathered per step, as ratios to bf16's.

The model is the model benchmark's Hugging Face Llama (``steps.SIZES``: ``8b`` is Llama-3-8B's
widths with 8 layers), bf16, built on every rank from one seed. Each decoder layer, then the
model, is wrapped with ``fully_shard`` on the data-parallel mesh dimension; with ``--tp T`` each
decoder layer's q/k/v and gate/up projections are first split column-wise and o/down row-wise
over the tensor-parallel dimension (torch's ``ColwiseParallel`` / ``RowwiseParallel`` for bf16,
torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``, quant's
``QuantColwiseParallel`` / ``QuantRowwiseParallel``), inputs replicated (no sequence
parallelism). The output head stays bf16 in every config.

Configs: ``bf16``; ``ao_fp8_tensorwise`` (torchao's tensorwise float8 with its float8 all-gather
and the scale precomputed after each optimizer step, as torchao recommends), ``ao_fp8_rowwise``;
quant's ``fp8_current``, ``fp8_block``, ``mxfp8``, ``nvfp4``, each also as ``<recipe>:fp8ag``
(the weight all-gathered in the recipe's quantized format, FSDP2 only). Each rank trains on its
own batch (tensor-parallel ranks share theirs); tokens/s per GPU counts every rank's tokens over
all GPUs. ``--compile`` compiles each decoder layer (the model benchmark's per-layer compile).
The all-gather column is one rank's bytes received by FSDP2's all-gathers in one step.

Run with ``python3 bench/speed.py multi-gpu --nproc 2`` (FSDP2 on 2 GPUs) or ``--nproc 4
--tp 2``; ``--device cpu --size tiny`` runs the same on gloo (the check that the command works;
torchao is skipped where it is not installed); ``--nproc 1`` is the one-GPU dry run.
"""

from __future__ import annotations

import gc
import json
import pathlib
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "recipes"))
from _fsdp_counting import count_all_gathers  # noqa: E402
from fsdp2_cases import join_group, run_configs  # noqa: E402  (registers the Triton backend)
from steps import OURS, SIZES, batches, llama, recipes  # noqa: E402

CONFIGS = ["bf16", "ao_fp8_tensorwise", "ao_fp8_rowwise", *OURS,
           *(f"{r}:fp8ag" for r in OURS)]
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
          "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def _styles(name: str):
    """``(column-wise, row-wise)`` parallel styles of config ``name``."""
    if name.startswith("ao_"):
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
        )
        return Float8ColwiseParallel, Float8RowwiseParallel
    if name in OURS:
        import quant_recipes as qr
        return qr.QuantColwiseParallel, qr.QuantRowwiseParallel
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return ColwiseParallel, RowwiseParallel


def build(config: str, args, mesh, device: torch.device):
    """``(model, forward(ids) -> loss, after_step)`` of ``config``, converted, split and
    sharded."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    name, _, variant = config.partition(":")
    model = llama(args.size, device)
    after_step = lambda: None  # noqa: E731
    recipe = None
    if name.startswith("ao_"):
        from torchao.float8 import (
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )

        ao = (Float8LinearConfig(enable_fsdp_float8_all_gather=True)
              if name == "ao_fp8_tensorwise"
              else Float8LinearConfig.from_recipe_name(name.removeprefix("ao_fp8_")))
        convert_to_float8_training(model, config=ao,
                                   module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
        if name == "ao_fp8_tensorwise":
            after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    elif name in OURS:
        import quant_recipes as qr

        recipe = recipes()[name]()
        qr.convert(model, recipe=recipe)
    elif name != "bf16":
        raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
    if variant not in ("", "fp8ag") or (variant and recipe is None):
        raise ValueError(f"config {config!r}: only quant's recipes take the suffix :fp8ag")
    if args.tp > 1:
        if variant:
            raise ValueError("the quantized all-gather does not compose with tensor parallelism")
        col, row = _styles(name)
        plan = {**{p: col() for p in COLUMN}, **{p: row() for p in ROW}}
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
    if variant == "fp8ag":
        import quant_recipes as qr

        qr.enable_fsdp_quantized_all_gather(model, recipe)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    if args.compile:
        for layer in model.model.layers:
            layer.compile()

    def forward(ids):
        if recipe is None:
            return model(input_ids=ids, labels=ids).loss
        import quant_recipes as qr

        with qr.autocast(recipe=recipe):
            return model(input_ids=ids, labels=ids).loss

    return model, forward, after_step


def run(config: str, args, mesh, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    gc.collect()
    base = torch.cuda.memory_allocated() if cuda else 0
    model, forward, after_step = build(config, args, mesh, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    dp_rank = mesh["dp"].get_local_rank()
    data = batches(args.size, args.steps * mesh["dp"].size(), device)[dp_rank::mesh["dp"].size()]
    losses = []

    def step(ids):
        opt.zero_grad(set_to_none=True)
        loss = forward(ids)
        loss.backward()
        opt.step()
        after_step()
        losses.append(loss.detach())

    warm = min(2, args.steps - 1)
    for ids in data[:warm]:
        step(ids)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for ids in data[warm:]:
        t0 = time.perf_counter()
        step(ids)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    with count_all_gathers() as counted:
        step(data[-1])
    ms = 1e3 * statistics.median(times)
    *_, seq, batch = SIZES[args.size]
    res = {"config": config, "ms": ms, "loss": float(losses[-1]),
           "tokens_per_s_per_gpu": mesh["dp"].size() * batch * seq / (ms / 1e3) / args.nproc,
           "ag_mib": sum(counted) / 2**20}
    if cuda:
        res["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return res


def worker(rank: int, args) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    device = join_group(rank, args)
    import quant_dynamo  # noqa: F401  (compile support before any quant module is traced)

    mesh = init_device_mesh(device.type, (args.nproc // args.tp, args.tp),
                            mesh_dim_names=("dp", "tp"))
    run_configs((args.configs or ",".join(CONFIGS)).split(","),
                lambda config: run(config, args, mesh, device), device, args, print_table)


def print_table(per_rank: list[list[dict]], args) -> None:
    dp = args.nproc // args.tp
    print(f"\n### Llama {args.size}, {args.nproc} ranks ({args.device}): FSDP2 over {dp}"
          f"{f' x TP over {args.tp}' if args.tp > 1 else ''}, {args.steps} steps"
          f"{', layers compiled' if args.compile else ''}, torch {torch.__version__}\n")
    print("| config | ms/step (rank 0) | vs bf16 | tokens/s per GPU | peak GiB (max over "
          "ranks) | vs bf16 peak | all-gather MiB/step (rank 0) | last loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    first = per_rank[0]
    bf16 = next((r for r in first if r["config"] == "bf16" and "ms" in r), None)
    bf16_peak = None
    if bf16 is not None and "peak_gib" in bf16:
        bf16_peak = max(r[first.index(bf16)]["peak_gib"] for r in per_rank)
    for i, row in enumerate(first):
        if "error" in row:
            print(f"| {row['config']} | {row['error'][:90]} | - | - | - | - | - | - |")
            continue
        peak = max(r[i]["peak_gib"] for r in per_rank) if "peak_gib" in row else None
        speed = f"{bf16['ms'] / row['ms']:.3f}x" if bf16 else "-"
        rel = f"{peak / bf16_peak:.3f}x" if peak and bf16_peak else "-"
        shown = f"{peak:.2f}" if peak is not None else "-"
        print(f"| {row['config']} | {row['ms']:.1f} | {speed} | "
              f"{row['tokens_per_s_per_gpu']:.0f} | {shown} | {rel} | {row['ag_mib']:.1f} | "
              f"{row['loss']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": per_rank}, f, indent=1)


def main(args) -> None:
    """``args.nproc`` processes, each running every config (``speed.py multi-gpu``'s options)."""
    mp.spawn(worker, args=(args,), nprocs=args.nproc, join=True)
