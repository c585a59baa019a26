"""MoE expert layer (``speed.py moe``): forward + backward of gate/up then down grouped GEMMs,
bf16 against torchao's FP8 grouped GEMM and each quant recipe, every figure a ratio to bf16 of
the same run.

The layer is DeepSeek-V3's routed experts by default (hidden 7168, expert intermediate 2048,
8 of 256 experts per token, 32 of them on this GPU as under 8-way expert parallelism, 8192
tokens: 2048 rows per expert): ``h = silu(x W_gate) * (x W_up)`` with gate and up one grouped GEMM
``[E, 2 * inter, hidden]``, then ``y = h W_down`` ``[E, hidden, inter]``, on the rows sorted by
expert. Routing is ``balanced`` (every expert the same rows) or ``skewed`` (Zipf-like counts,
some experts empty); counts are multiples of 16, as MoE trainers pad them for grouped GEMMs.

Configs: ``bf16`` (``torch._grouped_mm`` directly), ``ao_fp8_rowwise`` (torchao's
``moe_training`` FP8 rowwise scaled grouped GEMM, when torchao is importable), and per quant
recipe ``fp8_current``, ``fp8_block``, ``mxfp8``, ``nvfp4``, ``fp8_current_e4m3`` (E4M3
gradients), their ``:cublas`` / ``:own`` variants (:data:`VARIANTS`) or a step patch's
(``:whole_tiles``, ``:two_pass``: ``steps.PATCH_VARIANTS``), ``fp8_current_lean``
(``save_weight_copy=False, save_input_copy=False``: the weight and input quantized again in
backward)
(``quant_recipes.GroupedLinear`` under ``autocast``, with the grouped GEMM paths it took). Per
config one JSON line (median ms of ``--iters`` steps after ``--warmup``, CUDA events on a GPU),
then a markdown table of speed-ups over bf16, with the peak memory of the timed steps.
``--smoke`` runs tiny shapes on the CPU in seconds.
"""

from __future__ import annotations

import contextlib
import json
import statistics

import measure
import steps
import torch
import torch.nn.functional as F

CONFIGS = ("bf16", "ao_fp8_rowwise", *steps.OURS, "fp8_current_e4m3", "fp8_current_lean",
           "fp8_current:cublas", "fp8_current_e4m3:own")
#: FP8 current scaling's variants, for an A/B: ``<config>:cublas`` runs the GEMMs of pairs
#: torch's grouped kernel does not take on cuBLAS per group under 64 experts
#: (``CUBLAS_PER_GROUP``: a host read per backward); ``<config>:own`` runs every GEMM on the
#: backend's grouped kernels, E4M3 x E4M3 too (``ROUTE``, ``OWN_KERNEL_MIN_EXPERTS`` 0); no
#: variant: the package's own routes (``None``). Values: (ROUTE, OWN_KERNEL_MIN_EXPERTS,
#: CUBLAS_PER_GROUP).
VARIANTS = {":cublas": ("auto", 64, True), ":own": ("fp8_grouped_gemm", 0, False), "": None}


#: The package's (ROUTE, OWN_KERNEL_MIN_EXPERTS, CUBLAS_PER_GROUP), read before a variant
#: first sets them.
_PACKAGE_ROUTE: dict[str, tuple[str, int, bool]] = {}


def _variant(name: str) -> str:
    """``name``'s route variant (a key of :data:`VARIANTS`; "" for none or a step patch's)."""
    return next((v for v in VARIANTS if v and name.endswith(v)), "")


def _recipe(name: str):
    """The recipe of config ``name``: ``fp8_current_e4m3`` is current scaling with E4M3
    gradients too (``Format.E4M3``), whose three GEMMs all take ``torch._scaled_grouped_mm``."""
    import quant_recipes as qr

    name = name.partition(":")[0]
    if name == "fp8_current_e4m3":
        return qr.Float8CurrentScaling(fp8_format=qr.Format.E4M3)
    if name == "fp8_current_lean":
        return qr.Float8CurrentScaling()
    return steps.recipes()[name]()


def route(tokens: int, topk: int, experts: int, kind: str, align: int = 16) -> list[int]:
    """Rows per expert for ``tokens * topk`` routed rows (``kind`` balanced or skewed), each a
    multiple of ``align``, summing to ``tokens * topk`` rounded up to ``align``."""
    rows = -(-tokens * topk // align) * align
    if kind == "balanced":
        weights = torch.ones(experts)
    else:  # Zipf-like: a few hot experts, a long tail, some empty
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        weights[experts // 2:: 3] = 0
    blocks = (weights / weights.sum() * (rows // align)).floor().long()
    blocks[0] += rows // align - int(blocks.sum())
    return (blocks * align).tolist()


def _ao_grouped_mm():
    """torchao's FP8 rowwise grouped GEMM as ``f(A [T, K], B_t [E, K, N], offs)``, or None."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import (
            _to_fp8_rowwise_then_scaled_grouped_mm as fp8_gmm,
        )

        # the groups are already multiples of 16 rows (route()); torchao 0.18 refuses its own
        # padding (pad_token_groups_for_grouped_mm=True, the default, is not supported yet)
        return lambda a, b_t, offs: fp8_gmm(a, b_t, offs, torch.bfloat16, torch.float8_e4m3fn,
                                            pad_token_groups_for_grouped_mm=False)
    except ImportError:
        pass
    try:
        from torchao.prototype.moe_training import _quantize_then_scaled_grouped_mm as gmm
        from torchao.prototype.moe_training.conversion_utils import MoEScalingType

        return lambda a, b_t, offs: gmm(a, b_t, offs, scaling_type=MoEScalingType.FP8_ROWWISE)
    except ImportError:
        return None


class Experts(torch.nn.Module):
    """The routed experts: ``mm(x, w [E, N, K], offs)`` computes each group times ``w[g]ᵀ``."""

    def __init__(self, experts: int, hidden: int, inter: int, mm, device, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w13 = torch.nn.Parameter((torch.randn(experts, 2 * inter, hidden, generator=g)
                                       * hidden ** -0.5).to(device, torch.bfloat16))
        self.w2 = torch.nn.Parameter((torch.randn(experts, hidden, inter, generator=g)
                                      * inter ** -0.5).to(device, torch.bfloat16))
        self.mm = mm

    def forward(self, x, offs):
        gate, up = self.mm(x, self.w13, offs).chunk(2, dim=-1)
        return self.mm(F.silu(gate) * up, self.w2, offs)


class QuantExperts(torch.nn.Module):
    """The same layer from two ``quant_recipes.GroupedLinear`` under ``recipe``."""

    def __init__(self, ref: Experts, recipe, copies: bool = True):
        super().__init__()
        import quant_recipes as qr

        e, n13, k = ref.w13.shape
        kw = dict(device="meta", save_weight_copy=copies, save_input_copy=copies)
        self.w13 = qr.GroupedLinear(e, k, n13, name="w13", **kw)
        self.w2 = qr.GroupedLinear(e, n13 // 2, k, name="w2", **kw)
        self.w13.weight, self.w2.weight = ref.w13, ref.w2  # the very same Parameters
        self.recipe = recipe

    def forward(self, x, offs):
        import quant_recipes as qr

        with qr.autocast(recipe=self.recipe):
            gate, up = self.w13(x, offs).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up, offs)


def build(name: str, ref_args, device):
    """The layer of config ``name``; ``steps.Unavailable`` where its API is missing here."""
    if name == "bf16":
        if not hasattr(torch, "_grouped_mm"):
            raise steps.Unavailable(f"torch {torch.__version__} has no torch._grouped_mm")
        return Experts(*ref_args, lambda x, w, offs: torch._grouped_mm(
            x, w.transpose(-2, -1), offs=offs), device)
    if name == "ao_fp8_rowwise":
        gmm = _ao_grouped_mm()
        if gmm is None:
            raise steps.Unavailable("torchao.prototype.moe_training is not importable")
        return Experts(*ref_args, lambda x, w, offs: gmm(x, w.transpose(-2, -1), offs), device)
    return QuantExperts(Experts(*ref_args, None, device), _recipe(name),
                        copies=name.partition(":")[0] != "fp8_current_lean")


def run(name: str, args, counts: list[int], device) -> dict:
    """One config at one routing: median ms of forward + backward, and quant's GEMM paths."""
    import quant_recipes as qr

    res = {"config": name, "routing": args.routing_now, "tokens": args.tokens,
           "rows": sum(counts), "experts": args.experts, "hidden": args.hidden,
           "inter": args.inter}
    try:
        layer = build(name, (args.experts, args.hidden, args.inter), device)
    except steps.Unavailable as e:
        return {**res, "error": f"unavailable: {e}"}
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), args.hidden, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    g = torch.randn_like(x)
    fwd = torch.compile(layer, fullgraph=True) if args.compile else layer
    from quant_recipes.moe import fp8_gemm as grouped_fp8_gemm

    package = _PACKAGE_ROUTE.setdefault(
        "fp8", (grouped_fp8_gemm.ROUTE, grouped_fp8_gemm.OWN_KERNEL_MIN_EXPERTS,
                grouped_fp8_gemm.CUBLAS_PER_GROUP))
    (grouped_fp8_gemm.ROUTE, grouped_fp8_gemm.OWN_KERNEL_MIN_EXPERTS,
     grouped_fp8_gemm.CUBLAS_PER_GROUP) = VARIANTS[_variant(name)] or package

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        fwd(x, offs).backward(g)

    try:
        step()
        qr.reset_gemm_paths()
        qr.reset_grouped_gemm_paths()
        step()
        res["grouped_gemm_paths"] = qr.grouped_gemm_paths()
        if device.type == "cuda" and name not in ("bf16", "ao_fp8_rowwise"):
            from quant_recipes.moe import fp8_gemm as grouped_fp8_gemm

            res["unpadded_row_groups"] = grouped_fp8_gemm.unpadded_rows_run("cuda")
        res["gemm_paths"] = qr.gemm_paths()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        res["ms"] = measure.time_steps(step, device, warmup=args.warmup, iters=args.iters)
        if device.type == "cuda":
            res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if args.profile:
            _profile(step, f"{name}_{args.routing_now}", args.trace)
    except Exception as e:  # noqa: BLE001 - report and go on with the next config
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def _profile(step, name: str, trace: str | None = None) -> None:
    """One step under torch.profiler: the kernels by total device time, and the step's timeline
    as a Chrome trace ``<trace>/<name>.json`` when ``trace`` names a folder (where the GPU waits
    on the host)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if trace:
        import os

        os.makedirs(trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(trace, f"{name}.json"))
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(f"# profile {name}\n" + prof.key_averages().table(sort_by=sort, row_limit=24,
                                                            max_name_column_width=60))


def table(rows: list[dict]) -> str:
    """Markdown: per routing, each config's ms and speed-up over that routing's bf16."""
    out = ["| routing | config | ms | speed-up over bf16 | peak GiB | grouped GEMM paths |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['routing']} | {r['config']} | {r['error'][:70]} | - | - | - |")
            continue
        base = next((b for b in rows if b["routing"] == r["routing"] and b["config"] == "bf16"
                     and "ms" in b), None)
        ratio = f"{base['ms'] / r['ms']:.3f}x" if base else "-"
        paths = ", ".join(f"{k} {v}" for k, v in sorted(r["grouped_gemm_paths"].items())) or "-"
        peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
        out.append(f"| {r['routing']} | {r['config']} | {r['ms']:.3f} | {ratio} | {peak} | "
                   f"{paths} |")
    return "\n".join(out)


def main(args) -> None:
    """Every routing of ``args.routing``, every config of ``args.configs``: a JSON line each,
    then the table (``speed.py moe``'s options)."""
    if args.smoke:
        args.tokens, args.topk, args.experts, args.hidden, args.inter = 24, 2, 4, 128, 64
        args.iters, args.warmup, args.device = 2, 1, "cpu"
    device = torch.device(args.device)
    print(json.dumps(measure.env_line(device)), flush=True)
    if device.type == "cuda":
        measure.warm_up(device=args.device)
    rows = []
    for kind in args.routing.split(","):
        args.routing_now = kind
        counts = route(args.tokens, args.topk, args.experts, kind)
        for name in args.configs.split(","):
            patch = steps.PATCH_VARIANTS.get(name.partition(":")[2], contextlib.nullcontext)
            with patch():  # a step patch's :variant (steps.PATCH_VARIANTS)
                res = run(name, args, counts, device)
            print(json.dumps(res), flush=True)
            rows.append(res)
    print(table(rows))
    ok = [r["ms"] for r in rows if "ms" in r]
    if ok:
        print(f"\nmedian over configs: {statistics.median(ok):.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
