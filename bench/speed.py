"""Speed: every figure a ratio to a baseline measured in the same run (bf16, torchao, a copy).

Subcommands (``python bench/speed.py <command> --help`` for each one's options):

- ``step``: one compiled training step (forward, dgrad, wgrad) of a bias-free Linear (or a
  stack), bf16 against torchao's float8 and each quant recipe: ms, vs bf16, host ms, peak GiB,
  saved MiB per layer, GEMM paths;
- ``model``: training steps of a Hugging Face Llama, Qwen3-MoE or Mixtral (every decoder layer
  compiled, fused AdamW): ms, vs bf16, tok/s, peak and activation GiB, kernels and host syncs
  per step, GPU ms, loss;
- ``layer``: forward + backward of one mixture-of-experts decoder layer (Qwen3-MoE or Mixtral
  widths), bf16 against each quant recipe: ms, vs bf16, peak GiB, kernels, host syncs;
- ``gemm``: the quantized GEMM paths' exactness and error, then their speed against bf16
  ``torch.mm``; probes of cuBLAS's block-scaled GEMM;
- ``kernels``: the quantize kernels' bandwidth as a share of a device copy, with torchao peers;
- ``host``: host time of one eager quantize and one GEMM call against floors (an empty
  allocation, a bare Triton launch, a no-op custom op), with cProfile tables;
- ``autotune``: MXFP8's dequantize + cuBLAS against Inductor's max-autotune with the
  dequantization fused into the template's prologue, both against bf16 ``mm``;
- ``moe``: forward + backward of a mixture-of-experts expert layer (gate/up, then down grouped
  GEMMs; DeepSeek-V3 widths), bf16 ``torch._grouped_mm`` against torchao's FP8 grouped GEMM and
  quant's ``GroupedLinear`` per recipe: ms, speed-up over bf16, peak GiB, grouped GEMM paths;
- ``probe``: which grouped FP8 GEMM forms torch and Triton take on this GPU (E5M2 operands,
  per-group slices, fp32 outputs, quant-kernels' grouped kernels over tile configs): error
  against an fp32 product, ms, TFLOP/s;
- ``multi-gpu``: a Llama training step on several GPUs under FSDP2, or FSDP2 x tensor
  parallelism, bf16 against torchao's float8 and each quant recipe: ms/step, vs bf16, tokens/s
  per GPU, peak GiB per GPU, all-gather MiB per step.

The packages come from the environment (wheels; from source trees the Triton backend is
registered by hand); torchao and transformers are imported from the path.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import measure
import moe_cases
import steps
import torch
from torch._dynamo.utils import compilation_time_metrics as compile_phases
from torch._dynamo.utils import counters as compile_counters


def _shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in s.split("x")) for s in text.split(",") if s]


# --- step: the Linear step table


def prepare(name, x, w, g, compile_: bool, mode: str, layers: int) -> tuple[dict, object]:
    """Config ``name``'s row (GEMM paths, saved MiB) and its step, compiled and warmed up inside
    its variant's environment (what a variant changes is read when the graph is traced)."""
    import quant_recipes as qr

    res: dict = {"config": name, "mode": mode}
    with steps.linear_variant(name):
        step, clear, eager, params = steps.make_step(name, x, w, g, compile_, mode, layers)
        if name.partition(":")[0] in steps.OURS:  # paths from one eager step
            qr.reset_gemm_paths()
            clear()
            eager(x).backward(g)
            measure.sync(x.device)
            res["gemm_paths"] = qr.gemm_paths()
        res["saved_mib_per_layer"] = measure.saved_mib(eager, x, params) / layers
        for _ in range(measure.WARMUP):
            step()
        measure.sync(x.device)
    return res, (step, clear, params)


def finish(res: dict, prepared, x: torch.Tensor) -> None:
    """Host time, peak memory and a finiteness check of one prepared config, into ``res``."""
    step, clear, params = prepared
    res["host_ms"] = measure.host_ms(step, x.device)
    clear()  # so that "before" holds no gradients of the last step
    res["peak_gib"] = measure.peak_gib(step, x.device)
    res["finite"] = all(bool(t.isfinite().all()) for t in (x.grad, *(p.grad for p in params)))
    if not res["finite"]:
        print(f"  WARNING: {res['config']}: non-finite values in x.grad or weight.grad")
    clear()


def run_mode(names, x, w, g, compile_: bool, mode: str, layers: int, rounds: int) -> list[dict]:
    """Every config of one compile mode: all compiled first, then ``rounds`` timing rounds that
    take the configs in turn (reversed every other round), so that a slow spell of the host
    touches every config of a round alike; ``vs_bf16`` is the median over rounds of the ratio to
    that round's bf16. A failing config prints its error and the others go on."""
    rows, live = [], []
    for name in names:
        t0 = time.perf_counter()
        try:
            res, prepared = prepare(name, x, w, g, compile_, mode, layers)
            live.append((res, prepared))
            print(f"  {name} [{mode}]: ready ({time.perf_counter() - t0:.0f} s)", flush=True)
        except steps.Unavailable as e:
            res = {"config": name, "mode": mode, "error": f"unavailable: {e}"}
            print(f"  {name}: {res['error']}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on with the next config
            res = {"config": name, "mode": mode, "error": f"{type(e).__name__}: {e}"}
            print(f"  {name}: FAILED {res['error']}", flush=True)
        rows.append(res)
    for rnd in range(rounds):
        for res, (step, _, _) in (live if rnd % 2 == 0 else live[::-1]):
            if "error" in res:
                continue
            try:
                res.setdefault("ms_rounds", []).append(measure.time_steps(step, x.device))
            except Exception as e:  # noqa: BLE001
                res["error"] = f"{type(e).__name__}: {e}"
    for res, prepared in live:
        if "error" in res:
            continue
        res["ms"] = statistics.median(res["ms_rounds"])
        finish(res, prepared, x)
        print(f"  {res['config']} [{mode}]: {res['ms']:.3f} ms/step, host {res['host_ms']:.3f}"
              " ms", flush=True)
    base = next((r for r in rows if r["config"] == "bf16" and "ms_rounds" in r), None)
    for r in rows:
        if base is not None and "ms_rounds" in r and "error" not in r:
            pairs = zip(base["ms_rounds"], r["ms_rounds"], strict=False)
            r["vs_bf16_rounds"] = [b / t for b, t in pairs]
            r["vs_bf16"] = statistics.median(r["vs_bf16_rounds"])
    x.grad = None
    return rows


def free() -> None:
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def step_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['config']} | {r['error'][:60]} | - | - | - | - | - |"
    ratio = f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "-"
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
    paths = ", ".join(f"{k} {v}" for k, v in sorted(r.get("gemm_paths", {}).items())) or "-"
    bad = "" if r["finite"] else " (non-finite!)"
    return (f"| {r['config']} | {r['ms']:.3f}{bad} | {ratio} | {r['host_ms']:.3f} | {peak} "
            f"| {r['saved_mib_per_layer']:.1f} | {paths} |")


def cmd_step(args, p) -> None:
    if args.static_launch:
        import torch._inductor.config as inductor_config

        if not hasattr(inductor_config, "static_launch_user_defined_triton_kernels"):
            p.error(f"torch {torch.__version__} has no static_launch_user_defined_triton_kernels")
        inductor_config.static_launch_user_defined_triton_kernels = True
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if not steps.check_linear_config(c)]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(steps.LINEAR_ALL)} "
                f"(ours also with :{', :'.join(steps.LINEAR_VARIANTS)})")
    shapes = _shapes(args.shapes)
    if args.layers > 1 and any(k != n for _, k, n in shapes):
        p.error("--layers > 1 stacks K x K layers: every shape needs N == K")
    # every config of a mode stays compiled until its rounds end
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    device = torch.device(args.device)
    env = measure.env_line(device) | {
        "compile": not args.no_compile, "static_launch": args.static_launch,
        "lowering": os.environ.get("QUANT_LOWERING", "1") != "0"}
    print(" | ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    results = []
    for m, k, n in shapes:
        print(f"\n## M={m} K={k} N={n}", flush=True)
        x, w, g = steps.step_inputs(m, k, n, device)
        rows = []
        for mode in (md for md in args.modes.split(",") if md):
            rows += run_mode(configs, x, w, g, not args.no_compile, mode, args.layers,
                             args.repeat)
            free()
        results.append({"shape": [m, k, n], "rows": rows})
        del x, w, g
        free()
    for s in results:
        m, k, n = s["shape"]
        for mode in dict.fromkeys(r["mode"] for r in s["rows"]):
            stack = f", {args.layers} layers" if args.layers > 1 else ""
            print(f"\n### train step, M={m} K={k} N={n}{stack}, mode {mode} ({env['gpu']})\n")
            print("| config | ms/step | vs bf16 | host ms/step | peak GiB | saved MiB/layer "
                  "| GEMM paths |\n| --- | --- | --- | --- | --- | --- | --- |")
            for r in s["rows"]:
                if r["mode"] == mode:
                    print(step_row(r))
        if args.repeat > 1:
            print("\n| config | mode | vs bf16, median | each round |\n| --- | --- | --- | --- |")
            for r in s["rows"]:
                if "vs_bf16_rounds" in r:
                    each = " ".join(f"{v:.2f}" for v in r["vs_bf16_rounds"])
                    print(f"| {r['config']} | {r['mode']} | {r['vs_bf16']:.2f}x | {each} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)


# --- model: the Llama table


def run_model(config: str, size: str, n_steps: int, device: torch.device,
              layers: int | None = None, micro: int = 1, kv_cache: bool = False,
              whole: bool = False, mode: str = "default", peaks: bool = False,
              regions: bool = False) -> dict:
    """Train config ``config`` for ``n_steps`` steps after 3 warm-up steps; its row
    (``layers``: decoder layers instead of the size's; ``micro``: the batch's forward and
    backward run that many times per optimizer step, as gradient accumulation does;
    ``kv_cache``: the model builds a KV cache in training, see ``steps.llama``; ``whole``: the
    whole model compiled at once instead of each decoder layer (``regions``: each layer a nested
    compile region, compiled once); ``mode``: torch.compile's;
    ``peaks``: one more step with the allocator's history, what is alive at its peak)."""
    torch._dynamo.reset()
    data = steps.batches(size, n_steps + measure.WARMUP + 1, device)
    cuda = device.type == "cuda"
    with steps.llama_lowering(config), steps.whole_step_patch(config):
        model, forward, opt = steps.compiled_training(config, size, device, layers, kv_cache,
                                                      whole, mode, regions)
        row: dict = {"config": config, "size": size, "layers": len(model.model.layers),
                     "micro": micro, "whole": whole, "mode": mode, "regions": regions}
        graphs = mode == "reduce-overhead"
        losses: list[float] = []
        held: list[int] = []

        def step(ids, record=True):
            for _ in range(micro):
                if graphs:  # a new iteration: the graphs' outputs of the last one are dead
                    torch.compiler.cudagraph_mark_step_begin()
                before = torch.cuda.memory_allocated(device) if cuda else 0
                loss = forward(ids)
                if cuda:
                    held.append(torch.cuda.memory_allocated(device) - before)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if record:
                losses.append(loss.item())  # a sync: the step's wall time includes its GPU work
            return loss

        compile_counters.clear()
        compile_phases.clear()
        t0 = time.perf_counter()
        with TtirTimer() as ttir:
            for i in range(measure.WARMUP):
                step(data[i], record=False)
            measure.sync(device)
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        row.update(compile_breakdown(), ttir=ttir.summary())
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        held.clear()
        for i in range(n_steps):
            t = time.perf_counter()
            step(data[measure.WARMUP + i])
            times.append((time.perf_counter() - t) * 1e3)
        row["ms"] = statistics.median(times)
        seq, batch = steps.seq_batch(size)
        row["tok_s"] = micro * batch * seq / row["ms"] * 1e3
        if cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            row["act_gib"] = statistics.median(held) / 2**30
        row.update(measure.kernel_stats(lambda: step(data[-1], record=False), device))
        if peaks:
            row["peak_blocks"] = measure.peak_blocks(lambda: step(data[-1], record=False),
                                                     device)
    row["losses"] = losses
    row["loss"] = statistics.fmean(losses[-10:])
    row["finite"] = all(v == v and abs(v) != float("inf") for v in losses)
    return row


class TtirTimer:
    """Counts and times torch's TTIR generations while open: every Triton launch recorded into
    a traced graph (quant's kernels lowering) has its TTIR generated to find the tensors it
    writes, once per launch and trace, so per-layer compiles pay it in every layer."""

    def __enter__(self):
        self.calls, self.seconds, self._module = 0, 0.0, None
        try:
            from torch._higher_order_ops import triton_kernel_wrap as module
        except ImportError:
            return self
        original = getattr(module, "generate_ttir", None)
        if original is None:
            return self

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - t

        self._module, self._original = module, original
        module.generate_ttir = timed
        return self

    def __exit__(self, *exc):
        if self._module is not None:
            self._module.generate_ttir = self._original

    def summary(self) -> dict:
        return {"calls": self.calls, "s": round(self.seconds, 1)}


def compile_breakdown() -> dict:
    """Where the warm-up's compile time went: graphs compiled, Inductor's FX graph cache (hits,
    misses, bypasses: a layer whose graph misses compiles again in full), and the five longest
    compile phases that Dynamo times (seconds, summed over the graphs)."""
    cache = {k.removeprefix("fxgraph_cache_"): v for k, v in compile_counters["inductor"].items()
             if k.startswith("fxgraph_cache_")}
    phases = sorted(((name, sum(times)) for name, times in compile_phases.items()),
                    key=lambda kv: -kv[1])[:5]
    return {"graphs": compile_counters["stats"].get("unique_graphs", 0), "fx_cache": cache,
            "compile_phases": {name: round(t, 1) for name, t in phases}}


def _compile_cell(r: dict) -> str:
    """Compile + warm-up seconds, with the TTIR generations' share where there were any."""
    ttir = r.get("ttir") or {}
    extra = f" (TTIR: {ttir['calls']} in {ttir['s']} s)" if ttir.get("calls") else ""
    return f"{r.get('compile_s', '-')}{extra}"


#: Fewer steps than this compare the loss spikes of early training (at Mixtral widths bf16's
#: loss reaches 12 and FP8's 15 around step 6), not how the recipes train: the table says so.
MIN_LOSS_STEPS = 30


def model_table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["config"] == "bf16" and "ms" in r), None)
    lines = ["| config | ms/step | vs bf16 | tok/s | peak GiB | act GiB | kernels | syncs "
             "| GPU ms | compile + warm-up s | loss (bf16) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | error: {r['error'][:120]} | | | | | | | | | |")
            continue
        ratio = f"{base['ms'] / r['ms']:.3f}" if base else "-"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        act = f"{r['act_gib']:.2f}" if "act_gib" in r else "-"
        gpu = f"{r['gpu_ms']:.1f}" if "gpu_ms" in r else "-"
        ref = f" ({base['loss']:.4f})" if base else ""
        lines.append(f"| {r['config']} | {r['ms']:.1f} | {ratio} | {r['tok_s']:.0f} | {peak} | "
                     f"{act} | {r.get('kernels', '-')} | {r.get('syncs', '-')} | {gpu} | "
                     f"{_compile_cell(r)} | {r['loss']:.4f}{ref} |")
    loss_steps = min((len(r["losses"]) for r in rows if "losses" in r), default=MIN_LOSS_STEPS)
    if loss_steps < MIN_LOSS_STEPS:
        lines.append(f"\nloss: the mean of the last 10 of {loss_steps} steps, which compares early "
                     f"loss spikes, not training; compare losses over {MIN_LOSS_STEPS}+ steps")
    return "\n".join(lines)


def cmd_model(args, p) -> None:
    if args.micro < 1:
        p.error(f"--micro must be at least 1, got {args.micro}")
    if args.regions and not args.whole:
        p.error("--regions needs --whole (per-layer compiles already compile each layer once)")
    device = torch.device(args.device)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    import quant_dynamo  # compile support; before any quant module is traced

    if args.ops:
        quant_dynamo.capture.OPS_DEVICES.add(device.type)
    rows = []
    for config in args.configs.split(","):
        t0 = time.perf_counter()
        try:
            row = run_model(config, args.size, args.steps, device, args.layers, args.micro,
                            args.kv_cache, args.whole, args.mode, args.peaks, args.regions)
        except Exception as e:  # noqa: BLE001 - a failing config is reported, the run goes on
            row = {"config": config, "error": f"{type(e).__name__}: {e}"}
        torch._dynamo.reset()  # free what the config left (model, optimizer, compiled code)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()
                          if k not in ("losses", "top", "peak_blocks")}), flush=True)
        if row.get("peak_blocks"):
            print(f"  peak reached by {row['peak_blocks']['reached_by']}", flush=True)
        for site in (row.get("peak_blocks") or {}).get("sites", []):
            print(f"  at the peak: {site['gib']:.3f} GiB in {site['count']} blocks, "
                  f"{site['site']}" + (f": {site['code']}" if site.get("code") else ""),
                  flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "size": args.size, "rows": rows}, f,
                          indent=1)
    print(model_table(rows))
    if args.top:
        print(top_kernels_table(rows, args.top))


def top_kernels_table(rows: list[dict], n: int) -> str:
    """The ``n`` kernels of largest GPU time in one step, per config: calls and ms."""
    lines = []
    for row in rows:
        if not row.get("top"):
            lines.append(f"\n{row['config']}: no kernel profile (CUDA only)")
            continue
        lines += [f"\n{row['config']}: the {n} largest kernels of a step", "",
                  "| kernel | calls | ms |", "| --- | --- | --- |"]
        lines += [f"| {k['name'][:100]} | {k['count']} | {k['us'] / 1e3:.2f} |"
                  for k in row.get("top", [])[:n]]
    return "\n".join(lines)


# --- layer: one decoder layer of a mixture-of-experts model or a Llama


#: The package's (OWN_KERNEL_MIN_EXPERTS, ROUTE, CUBLAS_PER_GROUP), read before a layer config
#: first sets them.
_PACKAGE_ROUTES: dict[str, tuple[int, str]] = {}


def run_layer(config: str, size: str, tokens: int, device: torch.device, iters: int,
              seq: int = 0) -> dict:
    """Forward + backward of decoder layer 0 of ``size`` (attention and the MoE block, or a
    Llama's MLP; compiled) on ``tokens`` random tokens in sequences of ``seq`` (0: one
    sequence): median ms, peak GiB, kernels and host syncs of one step."""
    with steps.llama_lowering(config), steps.whole_step_patch(config):
        return _run_layer(config, size, tokens, device, iters, seq)


def _run_layer(config: str, size: str, tokens: int, device: torch.device, iters: int,
               seq: int) -> dict:
    from quant_recipes.moe import fp8_gemm

    torch._dynamo.reset()
    name = config
    config, _, own = config.partition("+")
    if own not in ("", "own", "ownall", "cublas"):
        raise ValueError(f"{name!r}: unknown suffix +{own}; known: +own, +ownall, +cublas")
    # +own: HYBRID's E5M2 GEMMs on the grouped kernels at any expert count, E4M3 x E4M3 on
    # torch's; +ownall: every FP8 GEMM on the grouped kernels; +cublas: the E5M2 GEMMs on cuBLAS
    # per group under 64 experts (a host read); none: the package's routes
    defaults = _PACKAGE_ROUTES.setdefault("fp8", (fp8_gemm.OWN_KERNEL_MIN_EXPERTS, fp8_gemm.ROUTE,
                                                  fp8_gemm.CUBLAS_PER_GROUP))
    fp8_gemm.OWN_KERNEL_MIN_EXPERTS = 0 if own in ("own", "ownall") else defaults[0]
    fp8_gemm.ROUTE = {"own": "scaled_grouped_mm", "ownall": "fp8_grouped_gemm"}.get(own,
                                                                                   defaults[1])
    fp8_gemm.CUBLAS_PER_GROUP = own == "cublas" or defaults[2]
    model = (steps.moe_model if size in steps.MOE_SIZES else steps.llama)(size, device, layers=1)
    forward = steps.convert_llama(config, model)  # converts ours; the layer runs under autocast
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = model.config.hidden_size
    seq = seq or tokens
    shape = (tokens // seq, seq, hidden)
    x = torch.randn(*shape, generator=gen).to(device, torch.bfloat16)
    x.requires_grad_()
    g = torch.randn(*shape, generator=gen).to(device, torch.bfloat16)
    pos = torch.arange(seq, device=device)[None]
    cos_sin = rotary(x, pos)
    autocast = getattr(forward, "autocast", None)
    compiled = torch.compile(layer)
    row: dict = {"config": name, "size": size, "tokens": tokens, "seq": seq}

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        if autocast is None:
            out = compiled(x, position_embeddings=cos_sin)
        else:
            with autocast():
                out = compiled(x, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(g)

    t0 = time.perf_counter()
    step()
    measure.sync(device)
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    row["ms"] = measure.time_steps(step, device, iters=iters)
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    row.update(measure.kernel_stats(step, device))
    return row


def layer_table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["config"] == "bf16" and "ms" in r), None)
    lines = ["| config | ms | vs bf16 | peak GiB | kernels | syncs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | error: {r['error'][:120]} | | | | |")
            continue
        ratio = f"{base['ms'] / r['ms']:.3f}" if base else "-"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        lines.append(f"| {r['config']} | {r['ms']:.2f} | {ratio} | {peak} | "
                     f"{r.get('kernels', '-')} | {r.get('syncs', '-')} |")
    return "\n".join(lines)


def cmd_layer(args, p) -> None:
    device = torch.device(args.device)
    # GPT-OSS's eager attention (its sinks) holds [heads, seq, seq] fp32 scores: its own sequence
    seq = args.seq if args.seq is not None else (
        steps.seq_batch(args.size)[0] if args.size.endswith("gpt-oss") else 0)
    if seq and args.tokens % seq:
        p.error(f"--tokens ({args.tokens}) must be a multiple of --seq ({seq})")
    rows = []
    for config in args.configs.split(","):
        try:
            row = run_layer(config, args.size, args.tokens, device, args.iters, seq)
        except Exception as e:  # noqa: BLE001 - a failing config is reported, the run goes on
            row = {"config": config, "error": f"{type(e).__name__}: {e}"}
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    print(layer_table(rows))


# --- gemm, kernels, host, autotune: the cases live in their own modules


def cmd_gemm(args, p) -> None:
    import gemm_cases

    sys.exit(gemm_cases.run([tuple(s) for s in _shapes(",".join(args.shapes))], args.json))


def cmd_kernels(args, p) -> None:
    import kernel_cases

    kernel_cases.main([int(v) for v in args.sizes.split(",") if v],
                      [w for w in args.only.split(",") if w], args.json)


def cmd_host(args, p) -> None:
    import host_cases

    host_cases.main(args)


def cmd_autotune(args, p) -> None:
    import gemm_cases

    gemm_cases.autotune([s for s in args.shapes.split(",") if s], args.json)


def cmd_moe(args, p) -> None:
    moe_cases.main(args)


def cmd_probe(args, p) -> None:
    import grouped_cases

    grouped_cases.main(args)


def cmd_multi_gpu(args, p) -> None:
    if args.tp < 1 or args.nproc % args.tp:
        p.error(f"--tp must divide --nproc ({args.nproc}), got {args.tp}")
    if args.steps < 2:
        p.error(f"--steps must be at least 2, got {args.steps}")
    import multi_gpu_cases

    multi_gpu_cases.main(argparse.Namespace(**{k: v for k, v in vars(args).items()
                                               if k != "cmd"}))


def cmd_trace(args, p) -> None:
    import trace_cases

    trace_cases.main(args)


def commands(sub) -> dict:
    """The subcommands, added to ``sub``."""
    s = sub.add_parser("step", help="the compiled Linear training step against bf16 and torchao",
                       description="One compiled training step (y = x @ W.T, y.backward(g); no "
                       "optimizer) of a bias-free Linear per config, all compiled first, then "
                       "--repeat rounds timed in turn. Per config: median ms (CUDA events), the "
                       "speed-up over bf16 of the same mode (median over rounds of the round's "
                       "ratio), host ms of back-to-back steps (close to ms: bound by the host), "
                       "the step's peak GiB above what was allocated before it, MiB saved for "
                       "backward per layer (eager, parameters excluded) and ours' GEMM paths.")
    s.add_argument("--shapes", default="16384x8192x8192,8192x4096x14336",
                   help="MxKxN,... (M tokens, K in, N out)")
    s.add_argument("--configs", default=",".join(steps.LINEAR_DEFAULT),
                   help=f"comma-separated subset of {','.join(steps.LINEAR_ALL)}; ours also "
                   f"as <ours>:{{{','.join(steps.LINEAR_VARIANTS)}}} (QUANT_LOWERING=0, "
                   "Inductor's static launcher, the weight requantized in backward)")
    s.add_argument("--layers", type=int, default=1,
                   help="a stack of this many layers (each K x K: needs N == K)")
    s.add_argument("--modes", default="default",
                   help="comma-separated torch.compile modes: default, reduce-overhead")
    s.add_argument("--repeat", type=int, default=1, help="timing rounds (median over rounds)")
    s.add_argument("--device", default="cuda")
    s.add_argument("--no-compile", action="store_true", help="eager (smoke tests)")
    s.add_argument("--static-launch", action="store_true",
                   help="Inductor's C launcher for recorded Triton kernels, for every config")
    s.add_argument("--json", metavar="OUT")
    m = sub.add_parser("model", help="Llama training steps against bf16 and torchao",
                       description="Training steps of a Hugging Face LlamaForCausalLM built from "
                       "a config (random init), bf16, each decoder layer compiled in place, fused "
                       "AdamW, the head in bf16, byte tokens of real text (every config the same "
                       "weights and batches). Per config: median ms (host included), vs bf16, "
                       "tok/s, peak GiB, act GiB (held between forward and backward), kernels "
                       "and GPU ms of one profiled step, mean loss of the last 10 steps.")
    m.add_argument("--size", choices=sorted([*steps.SIZES, *steps.MOE_SIZES]), default="1b",
                   help="Llama 8b / 1b widths; mixture of experts: qwen3-moe, mixtral, gpt-oss "
                   "(expert biases; transformers' grouped_mm experts for bf16); tiny, tiny-moe, "
                   "tiny-mixtral, tiny-gpt-oss with --device cpu are smoke runs")
    m.add_argument("--steps", type=int, default=150)
    m.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: the size's, 8 at 8b widths, 16 at 1b, 4 MoE)")
    m.add_argument("--micro", type=int, default=1,
                   help="micro-batches per optimizer step (gradient accumulation: each step "
                   "runs the batch's forward and backward this many times; ms is per step)")
    m.add_argument("--kv-cache", action="store_true",
                   help="the models' configs with use_cache=True: training forwards build a KV "
                   "cache, and each compiled decoder layer is traced again (its guards on the "
                   "cache's per-layer state fail) instead of reusing the first layer's code")
    m.add_argument("--whole", action="store_true",
                   help="compile the whole model at once (model.compile()) instead of each "
                   "decoder layer: every layer's Python is traced, in one graph")
    m.add_argument("--regions", action="store_true",
                   help="with --whole: each decoder layer a nested compile region "
                   "(torch.compiler.nested_compile_region), traced and compiled once")
    m.add_argument("--mode", choices=("default", "reduce-overhead"), default="default",
                   help="torch.compile's mode for every config (reduce-overhead: each compiled "
                   "graph replayed as a CUDA graph, no host time per kernel)")
    m.add_argument("--configs", default=",".join(steps.LLAMA_DEFAULT),
                   help=steps.LLAMA_CONFIG_HELP)
    m.add_argument("--device", default="cuda")
    m.add_argument("--ops", action="store_true",
                   help="lower quant to torch ops on a device outside OPS_DEVICES (the CPU)")
    m.add_argument("--peaks", action="store_true",
                   help="one more step per config with the CUDA allocator's history recorded: "
                   "the blocks alive at its peak, by allocation site")
    m.add_argument("--top", type=int, default=0, metavar="N",
                   help="after the table, each config's N kernels of largest GPU time in one "
                   "step (calls, ms; up to 30)")
    m.add_argument("--json", metavar="OUT")
    d = sub.add_parser("layer", help="one decoder layer's forward + backward vs bf16",
                       description="Forward + backward of one decoder layer (attention and the "
                       "mixture-of-experts block, or a Llama's MLP) of a Hugging Face model "
                       "built from a config, compiled, on random tokens: median ms, vs bf16 "
                       "(MoE: transformers' grouped_mm experts), peak GiB, kernels and host "
                       "synchronizations of one step. A Llama-3-8B layer: --size 8b --tokens "
                       "8192 --configs bf16,ao_fp8_tensorwise,fp8_current.")
    d.add_argument("--size", choices=sorted(steps.MOE_SIZES) + sorted(steps.SIZES),
                   default="qwen3-moe")
    d.add_argument("--tokens", type=int, default=16384)
    d.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default: one sequence; GPT-OSS: its own 4096)")
    d.add_argument("--configs", default="bf16," + ",".join(steps.OURS),
                   help="bf16, torchao's (" + ", ".join(steps.LLAMA_PEERS) + "; Llama sizes) "
                   "and ours, each with an optional :variant (" + ", ".join(
                       steps.variants()) + ") and @form; fp8_current+own: HYBRID's E5M2 GEMMs on "
                   "the grouped kernels and E4M3 x E4M3 on torch's at any expert count; "
                   "+ownall: every FP8 GEMM on the grouped kernels; +cublas: the E5M2 GEMMs "
                   "on cuBLAS per group under 64 experts (a host read)")
    d.add_argument("--iters", type=int, default=measure.ITERS)
    d.add_argument("--device", default="cuda")
    d.add_argument("--json", metavar="OUT")
    g = sub.add_parser("gemm", help="quantized GEMM paths: exactness, error, speed vs bf16 mm",
                       description="Per recipe, the three GEMMs of a Linear step (fprop, dgrad, "
                       "wgrad) through quant_recipes.gemm.qgemm_impl: exact operands must give "
                       "the emulated reference's fp32 bit for bit (CHECKS line); random operands "
                       "report the relative error next to the emulated path's; then median ms "
                       "(CUDA-graph replay), TFLOP/s and the speed-up over bf16 torch.mm per path "
                       "at each shape; probes of cuBLAS's block-scaled GEMM. Exits 1 on a "
                       "mismatch.")
    g.add_argument("shapes", nargs="*", default=["16384x8192x8192"], help="MxKxN ...")
    g.add_argument("--json", metavar="OUT")
    k = sub.add_parser("kernels", help="quantize kernels' bandwidth as a share of a copy",
                       description="Per quantize kernel: median ms of the best tile config of a "
                       "small sweep (package default first), GB/s over the minimal bytes, share "
                       "of the device copy bandwidth of the same run against the kernel's target; "
                       "torchao's Triton MXFP8 casts and compiled to_mx / nvfp4_quantize as peers.")
    k.add_argument("--sizes", default="8192,16384", help="square bf16 input sizes")
    k.add_argument("--only", default="",
                   help="comma-separated words: keep the kernels whose names contain one (and "
                   "skip the compiled peers), e.g. NVFP4,MXFP8")
    k.add_argument("--json", metavar="OUT")
    h = sub.add_parser("host", help="host time of an eager quantize / GEMM call against floors",
                       description="Per format (quantized tensor and :storage), host us per "
                       "q.quantize(x) over --iters back-to-back calls and the GPU us per call, "
                       "next to floors of the same run: torch.empty, a no-op custom op, a Triton "
                       "launch through its own launcher and quant_kernels' direct one (on the GPU "
                       "also every quantize through Triton's launcher). On the CPU a replay "
                       "backend stands in for the kernels. --profile adds cProfile tables, --step "
                       "compiled steps (fp8_current, mxfp8, bf16).")
    h.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    h.add_argument("--shapes", default="4096x4096,256x256")
    h.add_argument("--iters", type=int, default=200)
    h.add_argument("--profile", action="store_true", help="cProfile tables (last shape)")
    h.add_argument("--step", action="store_true",
                   help="also time and profile compiled training steps (GPU)")
    h.add_argument("--json", metavar="OUT")
    a = sub.add_parser("autotune", help="MXFP8 GEMM: dequantize + cuBLAS vs max-autotune",
                       description="Per shape: quant's MXFP8 GEMM (exact dequantize to bf16, "
                       "then cuBLAS) and torch.compile(max-autotune-no-cudagraphs, prologue "
                       "fusion) of the reference's dequantization in front of a @ b.T, each as "
                       "ms and a ratio to bf16 mm; whether a template with a fused prologue was "
                       "chosen; the two results' relative difference.")
    a.add_argument("--shapes", default="8192x4096x4096,8192x4096x14336,8192x14336x4096")
    a.add_argument("--json", metavar="OUT")
    e = sub.add_parser("moe", help="MoE expert layer: bf16 / torchao / quant's GroupedLinear",
                       description="Forward + backward of a mixture-of-experts expert layer "
                       "(h = silu(x W_gate) * (x W_up), one grouped GEMM for gate and up, then "
                       "y = h W_down; DeepSeek-V3's routed experts by default: 32 local experts, "
                       "8192 tokens, top-8), balanced and skewed routing: bf16 "
                       "torch._grouped_mm, torchao's FP8 rowwise grouped GEMM and quant's "
                       "GroupedLinear per recipe (and variants: bench/moe_cases.py). Per config a "
                       "JSON line (median ms, grouped GEMM paths), then a table of speed-ups over "
                       "bf16 with the peak GiB.")
    # 8192 tokens x top-8 over 32 local experts: 2048 rows per expert, the shape the issue's
    # roofs were measured at (DeepSeek-V3's 256 experts over 8 expert-parallel ranks)
    e.add_argument("--tokens", type=int, default=8192, help="tokens per step (before top-k)")
    e.add_argument("--topk", type=int, default=8, help="experts per token")
    e.add_argument("--experts", type=int, default=32, help="experts on this GPU")
    e.add_argument("--hidden", type=int, default=7168)
    e.add_argument("--inter", type=int, default=2048, help="expert intermediate width")
    e.add_argument("--routing", default="balanced,skewed", help="balanced,skewed")
    e.add_argument("--configs", default=",".join(moe_cases.CONFIGS),
                   help=f"comma-separated subset of {','.join(moe_cases.CONFIGS)}")
    e.add_argument("--iters", type=int, default=measure.ITERS, help="timed steps (median)")
    e.add_argument("--warmup", type=int, default=measure.WARMUP)
    e.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the layer")
    e.add_argument("--trace", metavar="DIR", help="with --profile: Chrome traces of the steps")
    e.add_argument("--profile", action="store_true",
                   help="print one step's kernels by device time, per config")
    e.add_argument("--device", default="cuda")
    e.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, in seconds")
    e.add_argument("--json", metavar="OUT", help="also write the rows to this file")
    r = sub.add_parser("probe", help="grouped FP8 GEMM forms of torch and Triton: error, speed",
                       description="Which FP8 GEMM forms the running torch and Triton take on "
                       "this GPU for GroupedLinear's grouped GEMMs (DeepSeek-V3 expert widths by "
                       "default): torch._scaled_grouped_mm with E4M3 and E5M2 first operands, "
                       "rows and contraction grouped; torch._scaled_mm per group on slices; bf16 "
                       "torch._grouped_mm and its fp32 output; a plain Triton tile kernel with "
                       "and without fast accumulation; quant-kernels' grouped FP8 GEMMs over tile "
                       "configs and promotion intervals. A JSON line per form (ok, max relative "
                       "error against the fp32 product, ms, TFLOP/s), then a table. CUDA only.")
    r.add_argument("--experts", type=int, default=32)
    r.add_argument("--rows", type=int, default=2048, help="rows per expert")
    r.add_argument("--hidden", type=int, default=7168)
    r.add_argument("--out", type=int, default=4096, help="the grouped GEMM's output width")
    r.add_argument("--own", action="store_true", help="quant-kernels' forms only")
    r.add_argument("--skew", type=float, default=0.3,
                   help="with --ragged: the spread of the experts' log-weights (0.3: mild; a "
                   "router at initialization can skew more)")
    r.add_argument("--ragged", action="store_true",
                   help="the own forms' groups skewed as a router makes them (--rows on average)")
    r.add_argument("--multiple", type=int, default=16,
                   help="the row multiple the groups are padded to; the weight-gradient kernel "
                   "runs with 16 and, where this is more, with it too")
    r.add_argument("--cast", action="store_true",
                   help="instead of the own GEMMs: the grouped FP8 quantize over tile configs "
                   "(TFLOP/s column: the share of a bf16 copy's speed)")
    r.add_argument("--experts-cast", action="store_true",
                   help="instead of the own GEMMs: the per-expert FP8 quantize of [--experts, "
                   "--out, --hidden] bf16 weights in two passes and in one (TFLOP/s column: "
                   "the share of a bf16 copy's speed)")
    r.add_argument("--wgrad", action="store_true",
                   help="instead of the own GEMMs: the weight-gradient GEMM ([E, --out, "
                   "--hidden] from the groups' rows), bf16 torch._grouped_mm and the own "
                   "grouped FP8 kernel over tile configs")
    r.add_argument("--triton-only", action="store_true",
                   help="only the plain Triton tile kernels of one --rows x --hidden x --out "
                   "product, the second operand K-major and MN-major")
    r.add_argument("--match", metavar="TEXT[,TEXT]",
                   help="only the forms whose name contains one of these (the sweeps compile a "
                   "kernel per config)")
    r.add_argument("--no-triton", action="store_true",
                   help="leave out the plain Triton tile kernels (torch's and the own forms)")
    u = sub.add_parser("multi-gpu", help="Llama step on several GPUs: FSDP2, FSDP2 x TP",
                       description="A Llama training step (the model command's Hugging Face "
                       "Llama, eager unless --compile) on --nproc processes, one GPU each: each "
                       "decoder layer and the model wrapped with fully_shard, with --tp T each "
                       "layer's projections first split over a tensor-parallel mesh dimension "
                       "(torch's, torchao's or quant's parallel styles). bf16, torchao's float8 "
                       "tensorwise and rowwise, each recipe and <recipe>:fp8ag (the weight "
                       "all-gathered quantized; FSDP2 only). Per config: ms/step and peak GiB, "
                       "each also as a ratio to bf16's, tokens/s per GPU, all-gather MiB per "
                       "step, last loss. --device cpu --size tiny: the same on gloo.")
    u.add_argument("--nproc", type=int, default=2, help="processes, one GPU each")
    u.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides nproc)")
    u.add_argument("--size", choices=sorted(steps.SIZES), default="8b")
    u.add_argument("--steps", type=int, default=8, help="steps per config (2 of them warm-up)")
    u.add_argument("--configs", default=None, help="comma-separated; default: all")
    u.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    u.add_argument("--compile", action="store_true", help="compile each decoder layer")
    u.add_argument("--port", type=int, default=29513)
    u.add_argument("--json", metavar="OUT")
    t = sub.add_parser("trace", help="Dynamo + AOTAutograd trace time of a Llama, vs bf16",
                       description="The device-independent part of compile time: a Hugging Face "
                       "Llama from a config (small widths) compiled whole with the aot_eager "
                       "backend on the CPU, one training step. Per config: first-step seconds "
                       "and their ratio to bf16's, Dynamo's phase times, the bytecode "
                       "instructions Dynamo traced (quant's in brackets), graphs "
                       "(bench/trace_cases.py).")
    t.add_argument("--configs", default="bf16,fp8_current,fp8_block,mxfp8,nvfp4",
                   help="comma-separated: bf16 and recipe names")
    t.add_argument("--layers", type=int, default=8, help="decoder layers")
    t.add_argument("--repeat", type=int, default=1, help="runs per config")
    t.add_argument("--regional", action="store_true",
                   help="compile each decoder layer (layer.compile()) instead of the whole model")
    t.add_argument("--kv-cache", action="store_true",
                   help="the model's config with use_cache=True (see model --kv-cache)")
    t.add_argument("--moe", action="store_true",
                   help="a Qwen3-MoE model at the tiny-moe widths (grouped experts) instead of "
                   "the Llama")
    t.add_argument("--no-count", action="store_true",
                   help="do not count traced instructions (their counting costs time)")
    t.add_argument("--top-functions", type=int, default=0, metavar="N",
                   help="list quant's N functions with the most instructions traced")
    t.add_argument("--json", metavar="OUT")
    return {"step": cmd_step, "model": cmd_model, "layer": cmd_layer, "gemm": cmd_gemm,
            "kernels": cmd_kernels, "host": cmd_host, "autotune": cmd_autotune, "moe": cmd_moe,
            "probe": cmd_probe, "multi-gpu": cmd_multi_gpu, "trace": cmd_trace}


if __name__ == "__main__":
    steps.run_cli(__doc__, commands)
