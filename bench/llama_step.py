"""Training steps of a Hugging Face ``LlamaForCausalLM``: bf16, torchao's float8 and every quant
recipe in one run, each a ratio to bf16's step in that run.

The model is built from a config (random init, no download) at one of ``SIZES``, cast to bf16,
with every decoder layer compiled in place (``layer.compile()``, as torchtitan compiles per
block) and fused AdamW. The output head stays in bf16 for every config (quant's ``convert``
default; torchao through its module filter). Every config starts from the same weights and reads
the same batches: byte-level tokens of real text (this Python's standard-library sources), so the
losses are comparable. Per config it reports:

- ``ms``: the median wall time of the timed steps, host included (each step ends in a sync);
- ``tok/s``: tokens per second at that median;
- ``peak GiB``: the peak memory of a timed step (weights, gradients and optimizer state
  included);
- ``act GiB``: the memory held between forward and backward (what the forward allocated and
  did not free: the tensors saved for backward, the logits and the loss);
- ``kernels``: the GPU kernels one step launches (torch.profiler), with the largest ones by GPU
  time in the JSON;
- ``loss``: the mean loss of the last 10 steps, next to bf16's.

Configs: ``bf16``; torchao 0.18 ``ao_fp8_tensorwise``, ``ao_fp8_rowwise``; quant's
``fp8_current``, ``fp8_block``, ``mxfp8``, ``nvfp4``, compiled with quant's default form of the
quantization (``quant_dynamo.capture``). ``<quant config>@ops`` compiles it as the reference's
torch ops, which Inductor fuses, merges and recomputes (``QUANT_LOWERING=ops``), ``@kernels`` as
the recorded Triton kernels only, ``@opaque`` as opaque custom ops: an A/B in one process.
``<quant config>:requant`` converts with ``save_weight_copy=False`` (backward quantizes the
weights again instead of keeping their copies from forward), ``:requant_input`` with
``save_input_copy=False`` (the inputs, as torchao does), ``:requant_all`` with both;
``fp8_current:requant@ops`` combines a variant and a form.

``python bench/llama_step.py --size 1b --steps 150 [--configs bf16,fp8_current,...]
[--json OUT] [--device cpu]``; ``--size tiny --device cpu`` is a smoke run. The packages must be
installed (wheels, so that quant-kernels' entry point registers the Triton backend); torchao and
transformers are imported from the path.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import json
import os
import re
import statistics
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step import quant_lowering  # noqa: E402

# transformers probes for an optional package named "kernels", which bench/kernels.py would shadow
sys.path[:] = [p for p in sys.path
               if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

#: name -> (hidden, MLP, heads, KV heads, vocab, layers, sequence, batch)
SIZES = {
    "8b": (4096, 14336, 32, 8, 128256, 8, 8192, 1),
    "1b": (2048, 8192, 32, 8, 128256, 16, 4096, 2),
    "tiny": (256, 512, 4, 2, 512, 2, 256, 2),
}
OURS = ("fp8_current", "fp8_block", "mxfp8", "nvfp4")
PEERS = ("ao_fp8_tensorwise", "ao_fp8_rowwise")
DEFAULT_CONFIGS = ("bf16", *PEERS, *OURS)
#: ``@form`` suffix -> QUANT_LOWERING while the config compiles.
FORMS = {"ops": "ops", "kernels": "kernels", "opaque": "0"}
#: ``:variant`` suffix -> the ``Linear`` attributes set to False: which quantized copies backward
#: quantizes again instead of keeping them from forward.
VARIANTS = {"requant": ("save_weight_copy",), "requant_input": ("save_input_copy",),
            "requant_all": ("save_weight_copy", "save_input_copy")}
WARMUP = 3


def llama(size: str, device: torch.device):
    """The bf16 model of ``size``, seeded: every config starts from the same weights."""
    import transformers

    hidden, mlp, heads, kv, vocab, layers, _, _ = SIZES[size]
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16)


def corpus(tokens: int) -> torch.Tensor:
    """``tokens`` byte values of this Python's standard-library sources (real text, present on
    every machine), as int64."""
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= tokens:
            break
    if len(data) < tokens:
        data = data * (tokens // max(len(data), 1) + 1)
    return torch.tensor(list(data[:tokens]), dtype=torch.int64)


def batches(size: str, steps: int, device: torch.device) -> list[torch.Tensor]:
    """One ``[batch, seq]`` batch per step, consecutive windows of the corpus."""
    *_, seq, batch = SIZES[size]
    ids = corpus(steps * batch * seq).reshape(steps, batch, seq)
    return [ids[i].to(device) for i in range(steps)]


def parse(config: str) -> tuple[str, str, str]:
    """``(name, variant, form)`` of ``name[:variant][@form]`` (either suffix first)."""
    match = re.fullmatch(r"([^:@]+)((?:[:@][^:@]+)*)", config)
    if match is None:
        raise ValueError(f"config {config!r}: expected name[:variant][@form]")
    name, variant, form = match.group(1), "", ""
    for marker, value in re.findall(r"([:@])([^:@]+)", match.group(2)):
        if marker == ":":
            variant = value
        else:
            form = value
    if form and form not in FORMS:
        raise ValueError(f"{config!r}: unknown form {form!r}; known: {', '.join(FORMS)}")
    if variant and variant not in VARIANTS:
        raise ValueError(f"{config!r}: unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    return name, variant, form


@contextlib.contextmanager
def lowering(config: str):
    """``QUANT_LOWERING`` of config ``name@form`` while it compiles and runs."""
    form = parse(config)[2]
    if not form:
        yield
        return
    with quant_lowering(FORMS[form]):
        yield


def prepare(config: str, model):
    """Convert ``model`` in place for ``config``; returns ``forward(ids) -> loss``."""
    name, variant, _ = parse(config)
    if name in PEERS:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        ao = Float8LinearConfig.from_recipe_name(name.removeprefix("ao_fp8_"))
        convert_to_float8_training(model, config=ao,
                                   module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    elif name in OURS:
        import quant_recipes as qr

        recipe = qr.recipe(name)
        qr.convert(model, recipe=recipe)
        for m in model.modules():
            if isinstance(m, qr.Linear):
                for attr in VARIANTS.get(variant, ()):
                    setattr(m, attr, False)

        def forward(ids):
            with qr.autocast(recipe=recipe):
                return model(input_ids=ids, labels=ids).loss

        return forward
    elif name != "bf16":
        raise ValueError(f"unknown config {config!r}; known: {', '.join(DEFAULT_CONFIGS)}")
    return lambda ids: model(input_ids=ids, labels=ids).loss


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_stats(step, device: torch.device) -> dict:
    """GPU kernels of one step: their count and the largest by total GPU time."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
    return {"kernels": len(kernels), "gpu_ms": sum(v[1] for v in by_name.values()) / 1e3,
            "top": [{"name": n[:160], "count": c, "us": round(t, 1)} for n, (c, t) in top]}


def run(config: str, size: str, steps: int, device: torch.device) -> dict:
    """Train config ``config`` for ``steps`` steps; its row."""
    torch._dynamo.reset()
    data = batches(size, steps + WARMUP + 1, device)
    model = llama(size, device)
    row: dict = {"config": config, "size": size}
    with lowering(config):
        forward = prepare(config, model)
        for layer in model.model.layers:
            layer.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
        losses: list[float] = []
        held: list[int] = []

        def step(ids, record=True):
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            loss = forward(ids)
            if device.type == "cuda":
                held.append(torch.cuda.memory_allocated(device) - before)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if record:
                losses.append(loss.item())  # a sync: the step's wall time includes its GPU work
            return loss

        t0 = time.perf_counter()
        for i in range(WARMUP):
            step(data[i], record=False)
        sync(device)
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        held.clear()
        for i in range(steps):
            t = time.perf_counter()
            step(data[WARMUP + i])
            times.append((time.perf_counter() - t) * 1e3)
        row["ms"] = statistics.median(times)
        *_, seq, batch = SIZES[size]
        row["tok_s"] = batch * seq / row["ms"] * 1e3
        if device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            row["act_gib"] = statistics.median(held) / 2**30
        row.update(kernel_stats(lambda: step(data[-1], record=False), device))
    row["losses"] = losses
    row["loss"] = statistics.fmean(losses[-10:])
    row["finite"] = all(map(lambda v: v == v and abs(v) != float("inf"), losses))
    return row


def release(device: torch.device) -> None:
    """Free what the last config left (its model, optimizer and compiled code)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["config"] == "bf16" and "ms" in r), None)
    lines = ["| config | ms/step | vs bf16 | tok/s | peak GiB | act GiB | kernels | loss (bf16) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | error: {r['error'][:120]} | | | | | | |")
            continue
        ratio = f"{base['ms'] / r['ms']:.3f}" if base else "-"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        act = f"{r['act_gib']:.2f}" if "act_gib" in r else "-"
        ref = f" ({base['loss']:.4f})" if base else ""
        lines.append(f"| {r['config']} | {r['ms']:.1f} | {ratio} | {r['tok_s']:.0f} | {peak} | "
                     f"{act} | {r.get('kernels', '-')} | {r['loss']:.4f}{ref} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    ap.add_argument("--ops", action="store_true",
                    help="lower quant to torch ops on a device outside OPS_DEVICES (the CPU)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    import quant_dynamo  # compile support; before any quant module is traced

    if args.ops:
        quant_dynamo.capture.OPS_DEVICES.add(device.type)

    rows = []
    for config in args.configs.split(","):
        t0 = time.perf_counter()
        try:
            row = run(config, args.size, args.steps, device)
        except Exception as e:  # a failing config is reported, the run goes on
            row = {"config": config, "error": f"{type(e).__name__}: {e}"}
        release(device)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "top")}),
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "size": args.size, "rows": rows}, f,
                          indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
