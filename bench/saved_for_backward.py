"""What a compiled Llama decoder layer keeps from forward to backward, per config.

One ``LlamaDecoderLayer`` of ``llama_step.SIZES[size]`` (bf16) is compiled with Inductor and run
forward and backward once; the backward graph's inputs that are not gradients are what Inductor's
partitioner chose to save. Prints one line per saved tensor (shape, dtype, MiB) and the total per
config, so that quant's saved set can be read next to bf16's and torchao's: the quantized copies
a backward GEMM reads, and whether a high-precision tensor is kept beside them.

``python bench/saved_for_backward.py --size 1b [--configs bf16,fp8_current] [--device cpu]``
(on the CPU, ``--ops`` lowers quant's quantization to torch ops as on CUDA).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import llama_step  # noqa: E402


def saved_inputs(gm: torch.fx.GraphModule) -> list[tuple[str, tuple, torch.dtype]]:
    """The placeholders of a backward graph that are saved activations (not tangents)."""
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not node.name.startswith("tangents"):
            out.append((node.name, tuple(val.shape), val.dtype))
    return out


def report(config: str, size: str, device: torch.device) -> float:
    """Print the saved set of one compiled layer under ``config``; returns its MiB."""
    import torch._inductor.compile_fx as compile_fx

    graphs: list[torch.fx.GraphModule] = []

    def recording(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            graphs.append(gm)
        return compile_fx.compile_fx_inner(gm, example_inputs, **kwargs)

    def inductor(gm, example_inputs):
        return compile_fx.compile_fx(gm, example_inputs, inner_compile=recording)

    torch._dynamo.reset()
    hidden, *_, seq, batch = llama_step.SIZES[size]
    model = llama_step.llama(size, device)
    with llama_step.lowering(config):
        forward = llama_step.prepare(config, model)  # converts the layers
        del forward
        layer = model.model.layers[0]
        rotary = model.model.rotary_emb
        x = torch.randn(batch, seq, hidden, device=device, dtype=torch.bfloat16,
                        requires_grad=True)
        pos = torch.arange(seq, device=device).unsqueeze(0)
        emb = rotary(x, pos)

        def block(t):
            out = layer(t, position_embeddings=emb, position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

        fn = torch.compile(block, backend=inductor)
        name = llama_step.parse(config)[0]
        if name in llama_step.OURS:
            import quant_recipes as qr

            with qr.autocast(recipe=qr.recipe(name)):
                y = fn(x)
        else:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(llama_step.SIZES), default="1b")
    ap.add_argument("--configs", default="bf16,fp8_current")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ops", action="store_true", help="lower quant to torch ops on this device")
    args = ap.parse_args()
    import quant_dynamo

    # every config is compiled afresh: a cache hit would skip the partitioner's graphs
    torch._functorch.config.enable_autograd_cache = False
    torch._inductor.config.fx_graph_cache = False
    if args.ops:
        quant_dynamo.capture.OPS_DEVICES.add(torch.device(args.device).type)
    totals = {c: report(c, args.size, torch.device(args.device))
              for c in args.configs.split(",")}
    print(" | ".join(f"{c}: {v:.1f} MiB" for c, v in totals.items()))


if __name__ == "__main__":
    main()
