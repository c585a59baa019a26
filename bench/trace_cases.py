"""Trace time: what compiling a quantized model costs before any kernel is generated.

A Hugging Face Llama from a config (no download; small widths, since tracing does not depend on
them) is compiled whole (``model.compile()``) with the ``aot_eager`` backend, which runs
Dynamo and AOTAutograd but generates no code: the part of compile time that quant's Python adds
on every device. Per config, in one process: the first step's seconds (trace + one eager run
of the graph), Dynamo's phase times (``torch._dynamo.utils.compilation_time_metrics``), the bytecode
instructions Dynamo traced (in total and in quant's packages), graphs and recompiles; ratios to
bf16's trace time of the same run.
"""

from __future__ import annotations

import gc
import json
import time

import torch

#: The phases of ``compile_times`` reported (seconds, summed over the graphs).
PHASES = ("bytecode_tracing", "aot_trace_joint_graph", "OutputGraph.call_user_compiler")
QUANT = ("quant_core", "quant_dynamo", "quant_recipes")


class _StepCounter:
    """Counts the bytecode instructions Dynamo traces, per source package (patched in while
    counting: Dynamo's per-instruction ``step`` of its instruction translator)."""

    def __init__(self):
        import collections

        import torch._dynamo.symbolic_convert as sc

        self.cls, self.original = sc.InstructionTranslatorBase, sc.InstructionTranslatorBase.step
        self.total, self.quant = 0, 0
        #: quant's instructions per function (``file:function``)
        self.functions = collections.Counter()
        counter = self

        def step(tx):
            counter.total += 1
            code = tx.f_code
            if any(p in code.co_filename for p in QUANT):
                counter.quant += 1
                name = code.co_filename.rsplit("/", 1)[-1]
                counter.functions[f"{name}:{code.co_name}"] += 1
            return counter.original(tx)

        self.cls.step = step

    def close(self):
        self.cls.step = self.original


def _model(layers: int, kv_cache: bool):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        use_cache=kv_cache)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def run(config: str, layers: int, count: bool, regional: bool = False, top: int = 0,
        moe: bool = False, kv_cache: bool = False) -> dict:
    """One config's row: the model converted under ``config`` (a recipe name, or bf16),
    compiled with aot_eager (whole, or each decoder layer when ``regional``: the layers share
    one traced graph), one training step traced and run, then a second step. ``top``: how many
    of quant's functions to list, by instructions traced in them (their own, not callees').
    ``moe``: a Qwen3-MoE model at ``steps.MOE_SIZES["tiny-moe"]`` widths instead of the Llama
    (on the CPU its grouped layers run their per-group path). ``kv_cache``: the config's
    ``use_cache``; with it the training forward builds a KV cache, each compiled layer's guards
    on the cache's per-layer state fail, and every layer is traced again."""
    import quant_recipes as qr
    from torch._dynamo.utils import compilation_time_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    if moe:
        from steps import MOE_SIZES, moe_model

        model = moe_model("tiny-moe", torch.device("cpu"), layers, kv_cache)
        vocab = MOE_SIZES["tiny-moe"][7]
    else:
        model, vocab = _model(layers, kv_cache), 1024
    recipe = None if config == "bf16" else qr.recipe(config)
    if recipe is not None:
        qr.convert(model, recipe=recipe)
    if regional:
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
    else:
        model.compile(backend="aot_eager")
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(1))

    def step():
        if recipe is None:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            with qr.autocast(recipe=recipe):
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    counter = _StepCounter() if count else None
    try:
        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
    finally:
        if counter is not None:
            counter.close()
    t0 = time.perf_counter()
    step()
    second = time.perf_counter() - t0
    phases = {k: sum(v) for k, v in compilation_time_metrics.items()}
    row = {"config": config, "layers": layers, "regional": regional, "kv_cache": kv_cache,
           "first_s": round(first, 2),
           "second_s": round(second, 2),
           "graphs": int(counters["stats"]["unique_graphs"]),
           "frames": dict(counters["frames"])}
    for p in PHASES:
        row[p] = round(float(phases.get(p, 0.0)), 2)
    if counter is not None:
        row["traced"], row["traced_quant"] = counter.total, counter.quant
        row["top_functions"] = dict(counter.functions.most_common(top))
    gc.collect()
    return row


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["config"] == "bf16" and "error" not in r), None)
    head = ("| config | first step s | vs bf16 | bytecode tracing s | AOT joint s | "
            "instructions traced (quant's) | graphs |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['error']} | | | | | |")
            continue
        ratio = f"{r['first_s'] / base['first_s']:.2f}" if base else "-"
        traced = f"{r.get('traced', '-')} ({r.get('traced_quant', '-')})"
        lines.append(f"| {r['config']} | {r['first_s']} | {ratio} | {r['bytecode_tracing']} | "
                     f"{r['aot_trace_joint_graph']} | {traced} | {r['graphs']} |")
    return "\n".join(lines)


def main(args) -> None:
    import quant_dynamo  # noqa: F401 - compile support, registered before anything is traced

    rows = []
    for config in args.configs.split(","):
        for _ in range(args.repeat):
            try:
                row = run(config, args.layers, not args.no_count, args.regional,
                          args.top_functions, args.moe, args.kv_cache)
            except Exception as e:  # noqa: BLE001 - a failing config is reported, the run goes on
                row = {"config": config, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    print(table(rows))
    print(f"torch {torch.__version__}")
