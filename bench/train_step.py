"""One compiled training step (forward, dgrad, wgrad; no optimizer) of one bias-free Linear.

``y = x @ W.T`` with bf16 ``x [M, K]`` (requires grad) and ``W [N, K]``, then ``y.backward(g)``
with a fixed random bf16 ``g``; ``x.grad`` and ``W.grad`` are set to None before each step. Every
config uses the same ``x``, ``W`` and ``g`` and is compiled with ``torch.compile`` (Inductor):

- ``bf16``: ``torch.nn.Linear``, the baseline;
- torchao 0.18 peers: ``ao_fp8_tensorwise`` and ``ao_fp8_rowwise`` (``Float8Linear`` through
  ``convert_to_float8_training``), ``ao_fp8_blockwise`` (prototype ``Float8BlockwiseLinear``,
  1x128 activations / 128x128 weights through ``F.scaled_mm``); ``ao_fp8_blockwise_triton``
  (its Triton GEMMs) only when asked for with ``--configs``;
- ours: ``quant_recipes.Linear`` inside ``quant_recipes.autocast`` (in the compiled function,
  ``fullgraph=True``) with ``fp8_current``, ``fp8_block``, ``mxfp8``, ``nvfp4``.

``--layers L`` stacks L such layers (K x K, the same weight each). Per compile mode (``--modes
default,reduce-overhead``; the second runs CUDA graphs) every config is compiled first, then
``--repeat`` rounds time the configs in turn. Per config: median ms/step over CUDA-event timed steps
after warm-up (median over rounds), the speed-up over ``bf16`` of the same mode (its ms / this ms,
median over rounds of the round's ratio), the host time of a step (the wall time of ``ITERS``
back-to-back steps without synchronising, per step: when it is close to ms/step the step is bound by
Python and launches, not by the GPU), the peak memory of one step above what was allocated before
it, the MiB saved for backward per layer by one eager forward (distinct storages, parameters
excluded: for ours the quantized weight copy is included), and for ours the GEMM paths of one eager
step (``quant_recipes.gemm_paths()``). A failing config prints its error and the run goes on.

``PYTHONPATH=packages/quant-core/src:packages/quant-kernels/src:packages/quant-dynamo/src:\
packages/quant-recipes/src python bench/train_step.py [--shapes 16384x8192x8192,...] [--configs
bf16,mxfp8,...] [--modes default,reduce-overhead] [--json OUT] [--device cpu] [--no-compile]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time

import quant_dynamo  # noqa: F401  (switches torch.compile support on; before quant_recipes use)
import quant_recipes as qr
import torch
from quant_core import backends

try:  # run from source trees (PYTHONPATH), the entry point that registers Triton is absent
    from quant_kernels.backend import BACKEND

    backends.register(BACKEND)
except ImportError:
    pass

DEFAULT_SHAPES = "16384x8192x8192,8192x4096x14336"  # M (tokens) x K (in) x N (out)
OURS = {
    "fp8_current": qr.Float8CurrentScaling,
    "fp8_block": qr.Float8BlockScaling,
    "mxfp8": qr.MXFP8BlockScaling,
    "nvfp4": qr.NVFP4BlockScaling,
}
PEERS = ["ao_fp8_tensorwise", "ao_fp8_rowwise", "ao_fp8_blockwise"]
DEFAULT_CONFIGS = ["bf16", *PEERS, *OURS]
ALL_CONFIGS = [*DEFAULT_CONFIGS, "ao_fp8_blockwise_triton"]
WARMUP, ITERS = 3, 20
# every config of a mode stays compiled until its rounds end; ours share one forward's code
torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


class Unavailable(Exception):
    """A peer whose API is missing here."""


def plain_linear(w: torch.Tensor) -> torch.nn.Linear:
    n, k = w.shape
    lin = torch.nn.Linear(k, n, bias=False, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def torchao_linear(name: str, w: torch.Tensor) -> torch.nn.Module:
    """The torchao 0.18 module of peer ``name`` with weight ``w``."""
    try:
        if name in ("ao_fp8_tensorwise", "ao_fp8_rowwise"):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = Float8LinearConfig.from_recipe_name(name.removeprefix("ao_fp8_"))
            return convert_to_float8_training(plain_linear(w), config=config)
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    except (ImportError, AttributeError, AssertionError, ValueError) as e:
        raise Unavailable(f"{type(e).__name__}: {e}") from e
    mod = Float8BlockwiseLinear.from_float(plain_linear(w))  # use_triton=False: F.scaled_mm
    mod.use_triton = name == "ao_fp8_blockwise_triton"
    return mod


def _stack(make, layers: int) -> torch.nn.Module:
    return make() if layers == 1 else torch.nn.Sequential(*(make() for _ in range(layers)))


def build(name: str, w: torch.Tensor, compile_: bool, mode: str = "default", layers: int = 1):
    """``(module, compiled forward, eager forward)`` of config ``name`` (``mode``: torch.compile's
    mode, ``"default"`` or ``"reduce-overhead"``); ``layers > 1`` stacks that many layers, each
    with weight ``w`` (square). ``<ours>:requant`` quantizes the weight again in backward
    (``Linear(save_weight_copy=False)``) instead of saving its copy."""
    name, _, kind = name.partition(":")
    if name in OURS:
        n, k = w.shape
        save_weight_copy = kind != "requant"

        def make():
            layer = qr.Linear(k, n, bias=False, dtype=w.dtype, device=w.device,
                              save_weight_copy=save_weight_copy)
            with torch.no_grad():
                layer.weight.copy_(w)
            return layer

        lin = _stack(make, layers)
        recipe = OURS[name]()

        def fwd(x):
            with qr.autocast(recipe=recipe):
                return lin(x)

        fullgraph = True
    elif name == "bf16":
        lin = _stack(lambda: plain_linear(w), layers)
        fwd, fullgraph = lin, True
    else:
        lin = _stack(lambda: torchao_linear(name, w), layers)
        fwd, fullgraph = lin, False
    kw = {} if mode == "default" else {"mode": mode}
    return lin, (torch.compile(fwd, fullgraph=fullgraph, **kw) if compile_ else fwd), fwd


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, device: torch.device) -> float:
    """Median ms of ``step`` over ``ITERS`` calls after ``WARMUP`` (CUDA events on a GPU)."""
    for _ in range(WARMUP):
        step()
    sync(device)
    times = []
    for _ in range(ITERS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_ms(step, device: torch.device, iters: int = ITERS) -> float:
    """Wall ms per step of ``iters`` steps issued back to back, without synchronising."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    elapsed = (time.perf_counter() - t0) * 1e3 / iters
    sync(device)
    return elapsed


def peak_gib(step, device: torch.device) -> float | None:
    """Run one step; its peak memory above the memory allocated before it, in GiB (CUDA)."""
    if device.type != "cuda":
        step()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def saved_mib(eager, x: torch.Tensor, params) -> float:
    """MiB saved for backward by one eager forward (distinct storages; the parameters' own
    storages excluded, since saving a parameter costs no memory)."""
    own = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = eager(x)
    del y
    return sum(seen.values()) / 2**20


def step_inputs(m: int, k: int, n: int, device) -> tuple[torch.Tensor, ...]:
    """bf16 ``x [m, k]`` (requires grad), ``W [n, k]`` and ``g [m, n]``, seeded."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, torch.bfloat16)
    g = torch.randn(m, n, generator=gen).to(device, torch.bfloat16)
    return x, w, g


def warm_square_step(name: str, n: int, device: torch.device, warmup: int):
    """:func:`make_step`'s step of config ``name`` for one ``n`` square layer, run ``warmup``
    times (compiling it) and synchronised: what the profiling scripts then time or sample."""
    step = make_step(name, *step_inputs(n, n, n, device))[0]
    for _ in range(warmup):
        step()
    sync(device)
    return step


def make_step(name, x, w, g, compile_: bool = True, mode: str = "default", layers: int = 1):
    """``(step, clear, eager, params)`` of config ``name``: ``step()`` runs one training step
    (gradients cleared first), ``clear()`` drops the gradients, ``eager`` is the uncompiled
    forward. Also what bench/host_overhead.py and bench/profile_step.py time."""
    lin, fwd, eager = build(name, w, compile_, mode, layers)
    params = list(lin.parameters())
    graphs = mode == "reduce-overhead"

    def clear():
        x.grad = None
        for p in params:
            p.grad = None

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        clear()
        fwd(x).backward(g)

    return step, clear, eager, params


#: ``<ours>:<variant>`` runs one of OURS differently, for an A/B inside one process: "opaque"
#: keeps the quant ops opaque (QUANT_LOWERING=0), "static" has Inductor launch the recorded
#: Triton kernels with its C launcher (static_launch_user_defined_triton_kernels), "requant"
#: quantizes the weight again in backward instead of saving its quantized copy.
VARIANTS = ("opaque", "static", "requant")


@contextlib.contextmanager
def quant_lowering(value: str):
    """``QUANT_LOWERING=value`` while the block compiles and runs (read when graphs are traced)."""
    old = os.environ.get("QUANT_LOWERING")
    os.environ["QUANT_LOWERING"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["QUANT_LOWERING"]
        else:
            os.environ["QUANT_LOWERING"] = old


@contextlib.contextmanager
def variant(name: str):
    """The environment of config ``name``'s variant while it compiles and runs."""
    kind = name.partition(":")[2]
    if kind == "opaque":
        with quant_lowering("0"):
            yield
    elif kind == "static":
        import torch._inductor.config as inductor_config

        with inductor_config.patch(static_launch_user_defined_triton_kernels=True):
            yield
    else:
        yield


def prepare(name, x, w, g, compile_: bool, mode: str, layers: int) -> tuple[dict, object]:
    """Config ``name``'s row (GEMM paths, saved MiB) and its step, compiled and warmed up inside
    its variant's environment (what a variant changes is read when the graph is traced)."""
    res: dict = {"config": name, "mode": mode}
    with variant(name):
        step, clear, eager, params = make_step(name, x, w, g, compile_, mode, layers)
        if name.partition(":")[0] in OURS:  # paths from one eager step (compiled need not count)
            qr.reset_gemm_paths()
            clear()
            eager(x).backward(g)
            sync(x.device)
            res["gemm_paths"] = qr.gemm_paths()
        res["saved_mib_per_layer"] = saved_mib(eager, x, params) / layers
        for _ in range(WARMUP):
            step()
        sync(x.device)
    return res, (step, clear, params)


def finish(res: dict, prepared, x: torch.Tensor) -> None:
    """Host time, peak memory and a finiteness check of one prepared config, into ``res``."""
    step, clear, params = prepared
    res["host_ms"] = host_ms(step, x.device)
    clear()  # so that "before" holds no gradients of the last step
    res["peak_gib"] = peak_gib(step, x.device)
    finite = all(bool(t.isfinite().all()) for t in (x.grad, *(p.grad for p in params)))
    res["finite"] = finite
    if not finite:
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
        except Unavailable as e:
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
                res.setdefault("ms_rounds", []).append(time_steps(step, x.device))
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


def print_rounds(rows: list[dict]) -> None:
    """Per config and mode, the median over rounds of the ratio to the round's bf16."""
    print("\n| config | mode | vs bf16, median | each round |\n| --- | --- | --- | --- |")
    for r in rows:
        if "vs_bf16_rounds" in r:
            each = " ".join(f"{v:.2f}" for v in r["vs_bf16_rounds"])
            print(f"| {r['config']} | {r['mode']} | {r['vs_bf16']:.2f}x | {each} |")


def fmt_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['config']} | {r['error'][:60]} | - | - | - | - | - |"
    ratio = f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "-"
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
    paths = ", ".join(f"{k} {v}" for k, v in sorted(r.get("gemm_paths", {}).items())) or "-"
    bad = "" if r["finite"] else " (non-finite!)"
    host = f"{r['host_ms']:.3f}" if "host_ms" in r else "-"
    saved = f"{r['saved_mib_per_layer']:.1f}" if "saved_mib_per_layer" in r else "-"
    return (f"| {r['config']} | {r['ms']:.3f}{bad} | {ratio} | {host} | {peak} | {saved} "
            f"| {paths} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="MxKxN,... (M tokens, K in, N out)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated subset of {','.join(ALL_CONFIGS)}")
    p.add_argument("--layers", type=int, default=1,
                   help="a stack of this many layers (each K x K: needs N == K)")
    p.add_argument("--modes", default="default",
                   help="comma-separated torch.compile modes: default, reduce-overhead")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    p.add_argument("--repeat", type=int, default=1,
                   help="timing rounds over the compiled configs, taken in turn (ms and ratios: "
                   "median over rounds)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", action="store_true", help="eager (smoke tests)")
    p.add_argument("--static-launch", action="store_true",
                   help="torch._inductor.config.static_launch_user_defined_triton_kernels = True "
                   "(Inductor's C launcher for recorded Triton kernels; a torch option)")
    args = p.parse_args()
    if args.static_launch:
        import torch._inductor.config as inductor_config

        if not hasattr(inductor_config, "static_launch_user_defined_triton_kernels"):
            p.error(f"torch {torch.__version__} has no static_launch_user_defined_triton_kernels")
        inductor_config.static_launch_user_defined_triton_kernels = True
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in ALL_CONFIGS and not (
        c.partition(":")[0] in OURS and c.partition(":")[2] in VARIANTS)]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {ALL_CONFIGS}")
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",") if s]
    if args.layers > 1 and any(k != n for _, k, n in shapes):
        p.error("--layers > 1 stacks K x K layers: every shape needs N == K")
    device = torch.device(args.device)

    import triton

    try:
        import torchao

        ao_version = torchao.__version__
    except Exception as e:  # noqa: BLE001 - a broken torchao only loses the peers
        ao_version = f"unavailable ({type(e).__name__}: {e})"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    env = {"torch": torch.__version__, "triton": triton.__version__, "torchao": ao_version,
           "gpu": gpu, "compile": not args.no_compile, "static_launch": args.static_launch,
           "lowering": os.environ.get("QUANT_LOWERING", "1") != "0"}
    print(" | ".join(f"{k} {v}" for k, v in env.items()), flush=True)

    results = []
    for m, k, n in shapes:
        print(f"\n## M={m} K={k} N={n}", flush=True)
        x, w, g = step_inputs(m, k, n, device)
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
            print(f"\n### train step, M={m} K={k} N={n}{stack}, mode {mode} ({gpu})\n")
            print("| config | ms/step | vs bf16 | host ms/step | peak GiB | saved MiB/layer "
                  "| GEMM paths |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for r in s["rows"]:
                if r["mode"] == mode:
                    print(fmt_row(r))
        if args.repeat > 1:
            print_rounds(s["rows"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
