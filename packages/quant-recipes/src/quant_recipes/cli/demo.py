"""``quant demo``: train a small model under every recipe and compare.

Two tasks, neither needs a download. ``--model mlp`` (the default): a fixed random teacher MLP
maps Gaussian inputs to targets and a student of three quantized ``Linear`` layers learns it with
mean-squared error. ``--model gpt``: a decoder-only transformer of plain ``torch.nn`` layers,
quantized with :func:`quant_recipes.convert`, learns a generated character corpus
(:mod:`.demo_gpt`); the table adds the validation loss and tokens per second. Every recipe sees
the same data and initial weights, so the loss gap to the high-precision baseline measures the
cost of the format.
"""

from __future__ import annotations

import collections
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from quant_core import DType, Float8CurrentScalingQuantizer, MXFP8Quantizer, backends
from torch import nn

from ..compiling import available, dynamo
from ..module import QuantizedModule
from .progress import Progress, fit, terminal_columns

D_IN, HIDDEN, D_OUT = 64, 128, 32


def _mixed_factory(role):
    """MXFP8 activations and weights, FP8 E5M2 gradients (current scaling) by role."""
    if role is not None and role.tensor_type in ("input", "weight"):
        return MXFP8Quantizer(DType.E4M3)
    if role is not None and role.tensor_type == "grad_output":
        return Float8CurrentScalingQuantizer(DType.E5M2)
    return Float8CurrentScalingQuantizer(DType.E4M3)


def _recipes() -> dict[str, Callable[[], object] | None]:
    from .. import CustomRecipe
    from ..recipe_names import recipe

    named = {n: (lambda n=n: recipe(n)) for n in ("fp8_current", "fp8_block", "mxfp8", "nvfp4")}
    return {"baseline": None, **named,
            "custom_mixed": lambda: CustomRecipe(qfactory=_mixed_factory)}


RECIPES = ("baseline", "fp8_current", "fp8_block", "mxfp8", "nvfp4", "custom_mixed")
DEFAULT_RECIPES = RECIPES

#: The final-loss gap to the baseline each recipe is expected to stay within on the demo's small
#: models (percent), and why: FP8 rounds each value to 3 mantissa bits (E4M3), NVFP4 to 1 (E2M1),
#: with one scale per 16 values; at this size and length the loss is dominated by that noise.
EXPECTED_GAP = {
    "fp8_current": (5.0, "FP8 values"),
    "fp8_block": (5.0, "FP8 values"),
    "mxfp8": (5.0, "FP8 values"),
    "custom_mixed": (5.0, "FP8 values"),
    "nvfp4": (50.0, "4-bit values"),
}


class TinyMLP(nn.Module):
    """Three quantized ``Linear`` layers with GELU between them."""

    def __init__(self, device, dtype) -> None:
        super().__init__()
        from .. import Linear

        self.fc1 = Linear(D_IN, HIDDEN, device=device, dtype=dtype, name="fc1")
        self.fc2 = Linear(HIDDEN, HIDDEN, device=device, dtype=dtype, name="fc2")
        self.fc3 = Linear(HIDDEN, D_OUT, device=device, dtype=dtype, name="fc3")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = nn.functional.gelu
        return self.fc3(act(self.fc2(act(self.fc1(x)))))


@dataclass
class RunResult:
    recipe: str
    losses: list[float] = field(default_factory=list)
    compiles: int = 0
    graph_breaks: int = 0
    ms_per_step: float | None = None  # None: no timed step (the first one compiles)
    gemm_path: str = "-"
    note: str = ""
    val_loss: float | None = None  # tasks with a held-out set (gpt)
    tokens_per_s: float | None = None  # tasks with tokens (gpt)


class MLPTask:
    """The teacher-student regression of :class:`TinyMLP` (rows of Gaussian inputs)."""

    name = "mlp"
    loss_label = "MSE loss"

    def __init__(self, device: torch.device, seed: int, batch: int | None = None) -> None:
        self.device, self.seed, self.batch = device, seed, batch or 64
        self.teacher = _teacher(device, seed)
        self.tokens_per_step = self.batch

    def model(self, dtype: torch.dtype) -> nn.Module:
        return TinyMLP(self.device, dtype)

    def batches(self, steps: int):
        for x in _batches(self.device, torch.bfloat16, self.batch, steps, self.seed):
            yield x, self.teacher(x)

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), target)

    def validate(self, forward) -> None:
        return None


def make_task(model: str, device: torch.device, seed: int, batch: int | None):
    """The task of ``--model`` (``mlp`` or ``gpt``)."""
    if model == "gpt":
        from .demo_gpt import GPTTask

        return GPTTask(device, seed, batch)
    return MLPTask(device, seed, batch)


class _CountingBackend:
    """A torch.compile backend that counts the graphs it compiles, then defers to ``inner``."""

    def __init__(self, inner: str) -> None:
        self.inner = inner
        self.frames = 0

    def __call__(self, gm, example_inputs):
        self.frames += 1
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)


def _teacher(device, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    w1 = (torch.randn(HIDDEN, D_IN, generator=g) / math.sqrt(D_IN)).to(device)
    w2 = (torch.randn(D_OUT, HIDDEN, generator=g) / math.sqrt(HIDDEN)).to(device)
    return lambda x: torch.tanh(x.float() @ w1.t()) @ w2.t()


def _batches(device, dtype, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed + 2)
    for _ in range(steps):
        yield torch.randn(batch, D_IN, generator=g).to(device=device, dtype=dtype)


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def train_one(name: str, recipe, args, device, progress: Progress, task) -> RunResult:
    """Train a fresh model of ``task`` (:func:`make_task`) under ``recipe`` (None: high
    precision) and collect the figures."""
    from .. import autocast, convert

    dtype = torch.bfloat16
    torch.manual_seed(args.seed)
    model = task.model(dtype)
    if recipe is not None and not any(isinstance(m, QuantizedModule) for m in model.modules()):
        convert(model, recipe=recipe)  # a plain model (gpt): quantize it as a user would
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    result = RunResult(recipe=name)

    def forward(x):
        with autocast(enabled=recipe is not None, recipe=recipe):
            return model(x)

    def loss_fn(x, y):
        return task.loss(forward(x), y)

    step_fn, counter = loss_fn, None
    if not args.no_compile:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        counter = _CountingBackend(args.compile_backend or _default_backend(device))
        step_fn = torch.compile(loss_fn, backend=counter, fullgraph=_fullgraph_supported())

    from ..gemm import reset_gemm_paths

    reset_gemm_paths()
    times = []
    warmup = max(1, args.steps // 10)  # one step at least: it includes compilation
    for i, (x, y) in enumerate(task.batches(args.steps)):
        start = time.perf_counter()
        try:
            loss = step_fn(x, y)
        except Exception as exc:  # keep the demo going; the table says what happened
            if step_fn is loss_fn:
                raise
            result.note = f"compile failed ({type(exc).__name__}); ran eagerly"
            step_fn, counter = loss_fn, None
            loss = step_fn(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:  # the first steps include compilation and first-use allocations
            times.append(time.perf_counter() - start)
        result.losses.append(loss.item())
        progress.update(name, i + 1, result.losses[-1])
    result.ms_per_step = 1000 * sorted(times)[len(times) // 2] if times else None
    if result.ms_per_step:
        result.tokens_per_s = task.tokens_per_step / (result.ms_per_step / 1000)
    if counter is not None:
        result.compiles = counter.frames
        result.graph_breaks = _graph_breaks()
    result.gemm_path = _gemm_path()
    result.val_loss = task.validate(forward)  # eagerly: no_grad would be a new graph
    return result


def _fullgraph_supported() -> bool:
    """``fullgraph=True`` where quant-dynamo has an opaque-object API; on older torch (2.9) the
    quantize calls are graph breaks, which the table counts."""
    return dynamo().status()["mode"] != "none"


def _backend_note(device: torch.device, backend: str) -> str | None:
    """A warning when a GPU run quantizes on the pure-torch reference (quant-kernels absent)."""
    if device.type == "cuda" and backend == "reference":
        return ("note: quant-kernels (the Triton backend) is not installed, so quantization "
                "runs on the reference, far slower than its kernels: pip install "
                "./packages/quant-kernels")
    return None


def _default_backend(device: torch.device) -> str:
    return "inductor" if device.type == "cuda" else "aot_eager"


def _gemm_path() -> str:
    """The GEMM paths taken since the last reset, most used first: those run through Python
    and those lowered into the compiled graph (decided when it was traced)."""
    from ..gemm import compiled_gemm_paths, gemm_paths

    counts = collections.Counter(gemm_paths()) + collections.Counter(compiled_gemm_paths())
    return ",".join(name for name, _ in counts.most_common()) or "-"


def _jsonable(value):
    """``value`` with every non-finite float as None (``json`` would write bare NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _final(r: RunResult) -> float:
    return sum(r.losses[-5:]) / len(r.losses[-5:])


def _gap_note(recipe: str, gap: float) -> str | None:
    """Whether ``recipe``'s loss gap to the baseline (percent) is within what it is expected to
    cost."""
    if recipe not in EXPECTED_GAP:
        return None
    bound, why = EXPECTED_GAP[recipe]
    verdict = "within" if abs(gap) <= bound else "beyond"
    return (f"{recipe}: {gap:+.1f}%, {verdict} the {bound:g}% expected of {why} at this size"
            + ("" if verdict == "within" else ": worth a look"))


def format_table(results: list[RunResult], columns: int | None = None,
                 speed: bool = True) -> str:
    """The result table, each line fitted to ``columns`` (default: the terminal's width); notes
    follow the table on lines of their own: one per recipe on whether its loss gap is expected.
    The quant backend is printed above it (one value). Tasks with a held-out set (gpt) show the
    validation loss and, with ``speed``, tokens/s instead of the compile count. Without
    ``speed`` (a CPU, where every quantized GEMM is emulated) no time is shown: it would say
    nothing about the formats."""
    columns = columns or terminal_columns()
    base = next((r for r in results if r.recipe == "baseline"), None)
    tokens = any(r.val_loss is not None for r in results)
    middle = (f"{'val loss':>8s}" + (f" {'tok/s':>8s}" if speed else "") if tokens
              else f"{'compiles':>8s}")
    header = (f"{'recipe':13s} {'final loss':>10s} {'vs base':>8s} {middle} {'breaks':>6s}"
              + (f" {'ms/step':>8s}" if speed else "") + "  gemm")
    lines = [header, "-" * min(len(header) + 16, columns - 1)]
    notes = []
    for r in results:
        final = _final(r)
        gap = "-"
        if base is not None and r is not base:
            ref = _final(base)
            pct = 100 * (final - ref) / ref
            gap = f"{pct:+.1f}%"
            note = _gap_note(r.recipe, pct)
            if note:
                notes.append(note)
        if tokens:
            val = "-" if r.val_loss is None else f"{r.val_loss:.4f}"
            tok = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.0f}"
            cells = f"{val:>8s}" + (f" {tok:>8s}" if speed else "")
        else:
            cells = f"{r.compiles:8d}"
        lines.append(
            f"{r.recipe:13s} {final:10.4f} {gap:>8s} {cells} {r.graph_breaks:6d}"
            + (f" {_ms(r.ms_per_step):>8s}" if speed else "") + f"  {r.gemm_path}"
        )
        if r.note:
            notes.append(f"{r.recipe}: {r.note}")
    if speed:
        notes.append("ms/step: median after a warm-up (the first tenth)")
    else:
        notes.append("no speed on a CPU: quantized GEMMs are emulated in fp32 (times in "
                     "results.json)")
    if any("emulated" in r.gemm_path for r in results):
        notes.append("gemm 'emulated': no tensor-core path for this format here (fp32 GEMM)")
    return "\n".join(fit(line, columns) for line in [*lines, *notes])


def _smoothed(values: list[float], window: int = 10) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _plot(results: list[RunResult], path: pathlib.Path, title: str,
          loss_label: str = "MSE loss") -> bool:
    """Loss curves (log scale) and, with a baseline, each recipe's loss relative to it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    base = next((r for r in results if r.recipe == "baseline"), None)
    panels = 2 if base is not None and len(results) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3.4 * panels), sharex=True, squeeze=False)
    ax = axes[0][0]
    colors = {}
    for r in results:
        (line,) = ax.plot(range(1, len(r.losses) + 1), r.losses, label=r.recipe, lw=1.4)
        colors[r.recipe] = line.get_color()
    ax.set_yscale("log")
    ax.set_ylabel(loss_label)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if panels == 2:  # the curves lie on top of each other: show each one against the baseline
        ratio_ax = axes[1][0]
        ref = _smoothed(base.losses)
        for r in results:
            if r is base:
                continue
            mine = _smoothed(r.losses)
            ratio_ax.plot(range(1, len(mine) + 1),
                          [a / b if b else float("nan") for a, b in zip(mine, ref, strict=False)],
                          label=r.recipe, lw=1.4, color=colors[r.recipe])
        ratio_ax.axhline(1.0, color="black", lw=0.8)
        ratio_ax.set_ylabel("loss / baseline loss\n(10-step mean)")
        ratio_ax.grid(alpha=0.3)
        ratio_ax.legend()
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _resolve_device(text: str) -> torch.device:
    allowed = "cpu, cuda, cuda:N or auto"
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise SystemExit(f"quant demo: --device must be {allowed}, got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise SystemExit(f"quant demo: --device {text} was asked for but no CUDA GPU is "
                             "available")
        if device.index is not None and device.index >= count:
            raise SystemExit(f"quant demo: --device {text} was asked for but this machine has "
                             f"{count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})")
    return device


def _output_folder(text: str) -> pathlib.Path:
    """``--out`` as a folder this process can write, made if missing; else one clear line
    (checked before any training, so a bad path costs nothing)."""
    out = pathlib.Path(text)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".quant-demo-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SystemExit(
            f"quant demo: --out {text!r} is not a writable folder ({e.strerror or e})"
        ) from None
    return out


def _check_compile_backend(name: str) -> None:
    """Refuse a ``--compile-backend`` torch.compile does not know (it would fail every compile,
    and the demo would run eagerly under that backend's name)."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise SystemExit(f"quant demo: --compile-backend {name!r} is not a torch.compile "
                         f"backend; allowed: {', '.join(sorted(known))}")


def _check_shapes(names: list[str], factories, task) -> None:
    """Refuse, before any training, a recipe whose quantizers cannot take the task's
    activations: its bf16 GEMM inputs of ``tokens_per_step`` rows (NVFP4's Hadamard transform
    mixes 16 rows, for one), asked of the recipe's own quantizers."""
    from ..convert import unsupported_shape

    rows = task.tokens_per_step
    for name in names:
        factory = factories[name]
        why = None if factory is None else unsupported_shape(
            factory(), "demo", 128, 128, torch.bfloat16, rows=rows)
        if why is not None:
            raise SystemExit(
                f"quant demo: recipe {name} cannot quantize this run's {rows} tokens per step "
                f"(--batch {task.batch}): {why}. Choose another --batch, or leave {name} out "
                "of --recipes")


def run_demo(args) -> int:
    names = [n.strip() for n in args.recipes.split(",")]
    if "" in names:
        raise SystemExit(
            f"quant demo: --recipes {args.recipes!r} has an empty entry; give recipe names "
            f"separated by single commas, from: {', '.join(RECIPES)}"
        )
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        raise SystemExit(
            f"quant demo: unknown recipe(s) {unknown or names}; choose from {', '.join(RECIPES)}"
        )
    device = _resolve_device(args.device)
    problem = backends.environment_problem(device)
    if problem is not None:
        raise SystemExit(f"quant demo: {problem}")
    if not args.no_compile:
        if not available():
            print("quant-dynamo is not installed: running eagerly (--no-compile)")
            args.no_compile = True
        elif args.compile_backend is not None:
            _check_compile_backend(args.compile_backend)
    factories = _recipes()
    task = make_task(args.model, device, args.seed, args.batch)
    _check_shapes(names, factories, task)
    out = _output_folder(args.out)
    backend = backends.get(None, device).name
    mode = "eager" if args.no_compile else (args.compile_backend or _default_backend(device))
    columns = terminal_columns()
    model_name = args.model
    print(fit(f"quant demo: {model_name}, {len(names)} recipes x {args.steps} steps on {device}",
              columns))
    print(fit(f"torch {torch.__version__}, compile: {mode}, quant backend: {backend}", columns))
    note = _backend_note(device, backend)
    if note:
        print(fit(note, columns))
    progress = Progress(total=len(names) * args.steps, stream=sys.stderr)
    results = []

    def write_results() -> None:  # after every recipe: a later failure keeps what finished
        (out / "results.json").write_text(json.dumps(  # strict JSON: a loss may be NaN or inf
            {"device": str(device), "torch": torch.__version__, "compile": mode,
             "model": model_name,
             "runs": [_jsonable(r.__dict__) for r in results]}, indent=1, allow_nan=False))

    for name in names:
        factory = factories[name]
        results.append(train_one(name, None if factory is None else factory(), args, device,
                                 progress, task))
        write_results()
    progress.close()
    table = format_table(results, speed=device.type != "cpu")
    print(table)
    png = out / "loss_curves.png"
    png.unlink(missing_ok=True)  # a plot left by an earlier run would not match results.json
    title = f"quant demo: {model_name} on {device} ({mode})"
    if not args.no_plot and _plot(results, png, title, task.loss_label):
        print(f"plot: {png}")
    print(f"results: {out / 'results.json'}")
    return 0
