"""Host time of one eager quantize call and of one GEMM call, and where it goes
(``speed.py host``).

Per format, with a value quantizer seen before and a bf16 ``x`` of each ``--shapes`` (4096x4096,
and 256x256 where the GPU work is negligible, so host time is all that is left):
``host_us``, the wall time of ``--iters`` back-to-back ``q.quantize(x)`` calls divided by the
count, with no synchronisation inside the loop (on a GPU the kernels are queued, so this is the
Python/launch cost as long as the GPU keeps up: ``gpu_us``, the CUDA-event time per call, says
whether it did). Floors measured in the same run: one ``torch.empty``, one launch of a trivial
Triton kernel through its normal launcher (GPU only), one call of a no-op Python custom op.
``--profile`` adds a cProfile table (top functions by own time) per format and for the GEMM, on
the last shape. On a GPU the clocks are raised first (3 s of copies: an idle H200 reads 345 MHz).

On a CPU-only machine the reference backend computes on the host, which would swamp the number,
so ``--device cpu`` registers a *replay* backend: each backend function computes once per input
shape with the reference, then returns freshly allocated buffers of the same shapes (``empty_like``)
without computing, as a kernel launch would. What is left is our layers' host cost plus allocation.

"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import io
import json
import pstats

import quant_dynamo  # noqa: F401  (defines the quant ops)
import quant_recipes as qr
import torch
from measure import per_call_us, warm_up
from quant_core import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    backends,
)
from steps import make_step, register_triton, step_inputs

register_triton()

#: Each format's quantizer returns its quantized tensor subclass (``internal=False``, the
#: default); ``<name>:storage`` is the same with ``internal=True``: the plain storage that
#: quant_recipes' modules use, without the wrapper subclass.
_FORMATS = {
    "fp8_current": (Float8CurrentScalingQuantizer, {}),
    "fp8_block_1d": (Float8BlockQuantizer, {"block_scaling_dim": 1}),
    "mxfp8": (MXFP8Quantizer, {}),
    "nvfp4": (NVFP4Quantizer, {}),
    "nvfp4_rht": (NVFP4Quantizer, {"with_rht": True, "with_post_rht_amax": True}),
}
QUANTIZERS = {
    f"{name}{suffix}": cls(**kw, internal=internal)
    for name, (cls, kw) in _FORMATS.items()
    for suffix, internal in (("", False), (":storage", True))
}


class ReplayBackend:
    """The reference's outputs per input signature, computed once; later calls allocate buffers
    of the same shapes and return them uncomputed (the CPU stand-in for a kernel launch)."""

    name, priority = "replay", 100

    def __init__(self) -> None:
        self._seen: dict = {}
        ref = backends.get("reference")
        for fn in backends.FUNCTIONS:
            setattr(self, fn, self._wrap(fn, getattr(ref, fn)))

    def supports(self, device) -> bool:
        return torch.device(device).type == "cpu"

    def _wrap(self, name, fn):
        def run(*args, **kwargs):
            key = (name, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                               for a in args), tuple(sorted(
                (k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)
                for k, v in kwargs.items())))
            if key not in self._seen:
                self._seen[key] = fn(*args, **kwargs)
            out = self._seen[key]
            if isinstance(out, torch.Tensor):
                return torch.empty_like(out)
            return tuple(None if t is None else torch.empty_like(t) for t in out)

        return run


def profile_table(fn, iters: int, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
    return "\n".join(lines[start:])


_noop_lib = torch.library.Library("quant_bench", "FRAGMENT")
_noop_lib.define("noop(Tensor x) -> Tensor")
_noop_lib.impl("noop", lambda x: x.new_empty(()), "CompositeExplicitAutograd")


def floors(x: torch.Tensor, iters: int) -> dict[str, float]:
    dev = x.device
    res = {
        "torch.empty": per_call_us(lambda: torch.empty(16, device=dev), iters, dev)[0],
        "python custom op (no-op)": per_call_us(
            lambda: torch.ops.quant_bench.noop(x), iters, dev)[0],
    }
    if dev.type == "cuda":
        from quant_kernels import _amax, _launcher
        from quant_kernels._common import launch

        _launcher._tables.pop(_amax._amax_kernel, None)  # the floors' launch is its only key
        out = torch.zeros(1, dtype=torch.float32, device=dev).view(torch.int32)
        res["triton launch (amax kernel, 1 program)"] = per_call_us(
            lambda: _amax._amax_kernel[(1,)](x, out, 1, 1, BLOCK=1024), iters, dev)[0]
        res["quant_kernels launch, direct (same kernel)"] = per_call_us(
            lambda: launch(_amax._amax_kernel, (1,), x, out, 1, 1, BLOCK=1024), iters, dev)[0]
        res["its compiled launcher alone (args prepared)"] = per_call_us(
            compiled_launcher_alone(_amax._amax_kernel, dev), iters, dev)[0]
    return res


def compiled_launcher_alone(kernel, dev: torch.device):
    """The last step of a direct launch with everything else prepared: the floor of any
    Python-side launch path (the C launcher, argument parsing and the driver's launch call)."""
    from quant_kernels import _launcher

    run, function, packed, arrange = next(iter(_launcher._tables[kernel].values()))
    key = next(iter(_launcher._tables[kernel]))
    x = torch.zeros(1024, device=dev)
    out = torch.zeros(1, dtype=torch.int32, device=dev)
    args = arrange((x, out, 1, 1, 1024))
    stream = _launcher._current_stream(key[0])
    return lambda: run(1, 1, 1, stream, function, packed, None, None, None, *args)


@contextlib.contextmanager
def tritons_own_launcher():
    """Every launch through ``kernel[grid](...)`` (the path before the direct launcher): the A/B
    baseline of the same run."""
    from quant_kernels import _launcher

    direct = _launcher.launch
    _launcher.launch = lambda kernel, grid, args, kwargs: kernel[grid](*args, **kwargs)
    try:
        yield
    finally:
        _launcher.launch = direct


def gemm_call(x: torch.Tensor, device: torch.device):
    """One forward GEMM of a Linear (the op and its dispatch) with current-scaling operands."""
    q = Float8CurrentScalingQuantizer()
    w = torch.randn(x.shape[1], x.shape[1], device=device, dtype=x.dtype)
    xb, wb = q.quantize(x).buffer_list(x), q.quantize(w).buffer_list(w)
    meta = qr.gemm.quantizer_meta(q)
    m, k = x.shape
    return lambda: qr.gemm.qgemm(xb, meta, (m, k), False, False, wb, meta, (k, k), False, True,
                                 None, x.dtype)


def compiled_step(n: int, device: torch.device, config: str = "fp8_current"):
    """One compiled training step of a bias-free ``Linear(n, n)`` on ``[n, n]`` under ``config``
    (``speed.py step``'s step)."""
    return make_step(config, *step_inputs(n, n, n, device))[0]


def main(args) -> None:
    """The floors, the quantize and GEMM host times per shape, then the profiles (``args``:
    ``device``, ``shapes``, ``iters``, ``profile``, ``step``, ``json``)."""
    dev = torch.device(args.device)
    if dev.type == "cpu":
        backends.register(ReplayBackend())
    else:
        warm_up(device=dev)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    print(f"torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
          + f", backend {backends.get(None, dev).name}, {args.iters} calls")
    results: dict = {"floors": {}, "quantize": {}, "qgemm_fp8_current": {}, "profiles": {}}
    for m, k in shapes:
        last = (m, k) == shapes[-1]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        tag = f"{m}x{k}"
        results["floors"][tag] = floors(x, args.iters)
        for name, us in results["floors"][tag].items():
            print(f"floor  {tag} {name:40s} {us:8.1f} us")
        ab = dev.type == "cuda"
        print(f"\n| format ({tag} bf16) | host us / quantize | gpu us / quantize |"
              + (" host us, Triton's launcher (same run) |" if ab else ""))
        print("| --- | --- | --- |" + (" --- |" if ab else ""))
        for name, q in QUANTIZERS.items():
            call = functools.partial(q.quantize, x)
            host, gpu = per_call_us(call, args.iters, dev)
            row = {"host_us": host, "gpu_us": gpu}
            line = f"| {name} | {host:.1f} | {'-' if gpu is None else f'{gpu:.1f}'} |"
            if ab:
                with tritons_own_launcher():
                    row["host_us_tritons_launcher"] = per_call_us(call, args.iters, dev)[0]
                line += f" {row['host_us_tritons_launcher']:.1f} |"
            results["quantize"].setdefault(name, {})[tag] = row
            print(line)
            if args.profile and last:
                results["profiles"][name] = profile_table(call, args.iters)
        if dev.type == "cuda":
            fn = gemm_call(x, dev)
            host, gpu = per_call_us(fn, args.iters, dev)
            results["qgemm_fp8_current"][tag] = {"host_us": host, "gpu_us": gpu}
            print(f"qgemm fp8_current {tag}: host {host:.1f} us, gpu {gpu:.1f} us")
            if args.profile and last:
                results["profiles"]["qgemm"] = profile_table(fn, args.iters)
    m = shapes[-1][0]
    if args.step and dev.type == "cuda":
        step = compiled_step(m, dev)
        host, gpu = per_call_us(step, 20, dev)
        results["step_fp8_current"] = {"host_us": host, "gpu_us": gpu}
        print(f"compiled step fp8_current {m}^3: host {host:.1f} us, gpu {gpu:.1f} us")
        step = compiled_step(4096, dev)
        host, gpu = per_call_us(step, 20, dev)
        results["step_fp8_current_4096"] = {"host_us": host, "gpu_us": gpu}
        print(f"compiled step fp8_current 4096^3: host {host:.1f} us, gpu {gpu:.1f} us")
        results["profiles"]["compiled step"] = profile_table(step, 20, top=30)
        for config in ("mxfp8", "bf16"):
            step = compiled_step(4096, dev, config)
            host, gpu = per_call_us(step, 20, dev)
            results[f"step_{config}_4096"] = {"host_us": host, "gpu_us": gpu}
            print(f"compiled step {config} 4096^3: host {host:.1f} us, gpu {gpu:.1f} us")
            results["profiles"][f"compiled step {config}"] = profile_table(step, 20, top=20)
    for name, table in results["profiles"].items():
        print(f"\n## cProfile: {name} ({args.iters} calls)\n{table}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

