"""Memory: what a step holds at its peak and what backward keeps, per config, next to bf16's
and torchao's in the same run.

Subcommands (``python bench/memory.py <command> --help`` for each one's options):

- ``step``: the compiled Linear step (``speed.py step``'s) per config: peak GiB above what was
  allocated before it, as a ratio to bf16's, and MiB saved for backward per layer;
- ``saved``: the tensors a compiled Llama decoder layer keeps from forward to backward (the
  backward graph's inputs that are not gradients: what Inductor's partitioner saved), one line
  per tensor and the total per config;
- ``fsdp2``: an FSDP2 step of a stack of Linear layers on several GPUs: ms and peak GiB as
  ratios to bf16's, the all-gather bytes per step and what stays saved after forward.
"""

from __future__ import annotations

import argparse
import contextlib

import measure
import steps
import torch


def cmd_step(args, p) -> None:
    unknown = [c for c in args.configs.split(",") if not steps.check_linear_config(c)]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(steps.LINEAR_ALL)}")
    device = torch.device(args.device)
    m, k, n = (int(v) for v in args.shape.split("x"))
    if args.layers > 1 and k != n:
        p.error("--layers > 1 stacks K x K layers: the shape needs N == K")
    x, w, g = steps.step_inputs(m, k, n, device)
    rows = []
    for name in args.configs.split(","):
        with steps.linear_variant(name):
            step, clear, eager, params = steps.make_step(name, x, w, g, not args.no_compile,
                                                         layers=args.layers)
            saved = measure.saved_mib(eager, x, params) / args.layers
            for _ in range(measure.WARMUP):
                step()
            clear()
            rows.append((name, measure.peak_gib(step, device), saved))
            clear()
        del step, eager, params
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = next((peak for name, peak, _ in rows if name == "bf16"), None)
    print(f"\n### step peak, M={m} K={k} N={n}, {args.layers} layer(s), "
          f"{measure.env_line(device)['gpu']}\n")
    print("| config | peak GiB | vs bf16 peak | saved MiB/layer |\n| --- | --- | --- | --- |")
    for name, peak, saved in rows:
        shown = "-" if peak is None else f"{peak:.2f}"
        rel = f"{peak / base:.2f}x" if peak and base else "-"
        print(f"| {name} | {shown} | {rel} | {saved:.1f} |")


def saved_inputs(gm: torch.fx.GraphModule) -> list[tuple[str, tuple, torch.dtype]]:
    """The placeholders of a backward graph that are saved activations (not tangents)."""
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not node.name.startswith("tangents"):
            out.append((node.name, tuple(val.shape), val.dtype))
    return out


def saved_report(config: str, size: str, device: torch.device) -> float:
    """Print the saved set of one compiled Llama layer under ``config``; returns its MiB."""
    import torch._inductor.compile_fx as compile_fx

    graphs: list[torch.fx.GraphModule] = []

    def recording(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            graphs.append(gm)
        return compile_fx.compile_fx_inner(gm, example_inputs, **kwargs)

    def inductor(gm, example_inputs):
        return compile_fx.compile_fx(gm, example_inputs, inner_compile=recording)

    torch._dynamo.reset()
    if size in steps.MOE_SIZES:
        hidden, (seq, batch) = steps.MOE_SIZES[size][0], steps.seq_batch(size)
        model = steps.moe_model(size, device, layers=1)
    else:
        hidden, *_, seq, batch = steps.SIZES[size]
        model = steps.llama(size, device)
    with steps.llama_lowering(config):
        forward = steps.convert_llama(config, model)  # converts the layers
        layer = model.model.layers[0]
        x = torch.randn(batch, seq, hidden, device=device, dtype=torch.bfloat16,
                        requires_grad=True)
        pos = torch.arange(seq, device=device).unsqueeze(0)
        emb = model.model.rotary_emb(x, pos)

        def block(t):
            out = layer(t, position_embeddings=emb, position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

        fn = torch.compile(block, backend=inductor)
        # ours: inside the config's autocast and variant patches
        with getattr(forward, "autocast", contextlib.nullcontext)():
            y = fn(x)
        y.float().sum().backward()
    total = 0.0
    print(f"== {config}")
    for gm in graphs:
        for node_name, shape, dtype in saved_inputs(gm):
            mib = torch.Size(shape).numel() * dtype.itemsize / 2**20
            total += mib
            print(f"   {node_name:28s} {str(list(shape)):24s} {str(dtype):22s} {mib:9.2f} MiB")
    print(f"   total {total:.2f} MiB")
    return total


def cmd_saved(args, p) -> None:
    import quant_dynamo

    # every config is compiled afresh: a cache hit would skip the partitioner's graphs
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    if args.ops:
        quant_dynamo.capture.OPS_DEVICES.add(torch.device(args.device).type)
    totals = {c: saved_report(c, args.size, torch.device(args.device))
              for c in args.configs.split(",")}
    print(" | ".join(f"{c}: {v:.1f} MiB" for c, v in totals.items()))


def cmd_fsdp2(args, p) -> None:
    import fsdp2_cases

    fsdp2_cases.main(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "cmd"}))


def commands(sub) -> dict:
    """The subcommands, added to ``sub``."""
    s = sub.add_parser("step", help="peak memory of the compiled Linear step, vs bf16",
                       description="Per config, the compiled Linear step's peak GiB above what "
                       "was allocated before it (CUDA), its ratio to bf16's, and the MiB one "
                       "eager forward saves for backward per layer (parameters excluded; ours "
                       "include the weight's quantized copy unless :requant).")
    s.add_argument("--shape", default="16384x8192x8192", help="MxKxN")
    s.add_argument("--layers", type=int, default=1, help="a stack of K x K layers")
    s.add_argument("--configs", default="bf16,ao_fp8_tensorwise,fp8_current,fp8_current:requant",
                   help=f"comma-separated subset of {','.join(steps.LINEAR_ALL)} "
                   "(ours also with :requant)")
    s.add_argument("--device", default="cuda")
    s.add_argument("--no-compile", action="store_true", help="eager (smoke tests)")
    v = sub.add_parser("saved", help="what a compiled Llama layer saves for backward",
                       description="One decoder layer of --size (bf16; Llama or MoE) compiled "
                       "with Inductor, "
                       "forward and backward once: each tensor the backward graph takes that is "
                       "not a gradient (shape, dtype, MiB) and the total per config. "
                       "TORCH_LOGS=output_code prints Inductor's code as well.")
    v.add_argument("--size", choices=sorted(steps.SIZES) + sorted(steps.MOE_SIZES),
                   default="1b", help="Llama widths, or a mixture-of-experts model's")
    v.add_argument("--configs", default="bf16,fp8_current", help=steps.LLAMA_CONFIG_HELP)
    v.add_argument("--device", default="cuda")
    v.add_argument("--ops", action="store_true",
                   help="lower quant to torch ops on this device (the CPU), as on CUDA")
    f = sub.add_parser("fsdp2", help="FSDP2 step of Linear layers: peak, all-gather bytes",
                       description="Each rank trains --layers bias-free d x d layers, each and "
                       "the stack wrapped with fully_shard, eager, on --tokens tokens of its own: "
                       "bf16, torchao float8 tensorwise with FP8 all-gather, each recipe with the "
                       "bf16 all-gather, ':requant' (the weight requantized in backward) and "
                       "':fp8ag' (the weight all-gathered quantized). Per config: ms and peak as "
                       "ratios to bf16's, all-gather MiB per step, MiB saved after forward.")
    f.add_argument("--nproc", type=int, default=2)
    f.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: gloo with tiny shapes, no torchao")
    f.add_argument("--d", type=int, default=8192, help="layer width (d x d weights)")
    f.add_argument("--layers", type=int, default=8)
    f.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    f.add_argument("--iters", type=int, default=5)
    f.add_argument("--configs", default=None, help="comma-separated; default: all")
    f.add_argument("--port", type=int, default=29511)
    f.add_argument("--json", metavar="OUT")
    return {"step": cmd_step, "saved": cmd_saved, "fsdp2": cmd_fsdp2}


if __name__ == "__main__":
    steps.run_cli(__doc__, commands)
