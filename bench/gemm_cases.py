"""GEMMs of quantized operands on the GPU (``speed.py gemm``): correctness of every fast path,
then speed as a ratio to bf16 ``torch.mm`` of the same shape in the same run.

For each format the operands are quantized with the recipe's quantizers (input and gradient 1D,
weight as the recipe makes it) and multiplied through ``quant_recipes.gemm.qgemm_impl`` exactly as
``Linear`` calls it, for the three GEMMs of a training step:
fprop ``x @ Wᵀ``, dgrad ``gy @ W`` and wgrad ``gyᵀ @ x``.

1. Exactness: operands that are small integers times powers of two (every product and partial
   sum exact in fp32) must give the emulated reference's fp32 result bit for bit.
2. Random data: ``‖fast - exact‖ / ‖exact‖`` against the float64 product of the same quantized
   operands, next to the emulated path's own error.
3. Speed: median ms (CUDA-graph replay), TFLOP/s and the speed-up over bf16 ``torch.mm`` (its
   ms / this ms) of each path at M x K x N, next to FP8 tensorwise ``torch._scaled_mm``, all
   measured in the same run; the MXFP8 mainloops (FP8 MMA with per-block promotion, exact bf16
   dequantization) and a few tile configs are swept.
4. Probes: which output dtypes and bias cuBLAS's block-scaled GEMM takes here.

"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import torch
import torch.nn.functional as F
import triton
from measure import graph_ms
from quant_core import backends
from quant_core.dtypes import DType
from quant_kernels import configs, mxfp8_gemm, nvfp4_gemm
from quant_kernels.backend import BACKEND
from quant_recipes import gemm as G
from quant_recipes.recipes import (
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from quant_recipes.states import RecipeState

DEV = "cuda"
backends.register(BACKEND)  # from source trees (PYTHONPATH) the entry point is not installed
RECIPES = {"fp8_current": Float8CurrentScaling, "fp8_block": Float8BlockScaling,
           "mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}
SWEEP = {  # tile configs tried per kernel (the first of each list is the package default)
    "mxfp8_gemm": [dict(BM=128, BN=256, BK=128, GROUP_M=8, num_warps=8, num_stages=2)],
    "nvfp4_gemm": [dict(BM=128, BN=256, BK=128, GROUP_M=8, num_warps=8, num_stages=3)],
    "mxfp8_dequant": [dict(BM=16, BK=256, num_warps=4)],
    "nvfp4_dequant": [dict(BM=32, BK=64, num_warps=4)],
}
RESULTS: dict = {"checks": [], "speed": [], "probes": []}


@contextlib.contextmanager
def gemm_implementation(fmt: str, implementation: str):
    """Route the Triton backend's ``<fmt>_gemm`` through ``implementation`` (one of
    ``quant_kernels._gemm.IMPLEMENTATIONS``) while the block runs, so that the GEMM dispatch
    (``qgemm_impl``) times either one."""
    module = {"mxfp8": mxfp8_gemm, "nvfp4": nvfp4_gemm}[fmt]
    name = f"{fmt}_gemm"
    default = type(BACKEND).__dict__[name]
    using = functools.partial(getattr(module, f"{fmt}_gemm_using"), implementation)
    setattr(type(BACKEND), name, staticmethod(using))
    try:
        yield
    finally:
        setattr(type(BACKEND), name, default)


def quantizers(name: str, exact: bool = False):
    """(input, weight, grad) quantizers of recipe ``name`` with both usages; ``exact``: NVFP4
    without the RHT, whose mixing of 16 rows gives blocks of unequal amax (inexact sums)."""
    recipe = RECIPES[name](disable_rht=True) if exact and name == "nvfp4" else RECIPES[name]()
    qi, qw = RecipeState.create(recipe, mode="forward", num_quantizers=3,
                                device=DEV).make_quantizers()[:2]
    qg = RecipeState.create(recipe, mode="backward", num_quantizers=2,
                            device=DEV).make_quantizers()[0]
    return [q.with_usage(rowwise=True, columnwise=True) for q in (qi, qw, qg)]


def bufs_meta(t: torch.Tensor, q):
    st = q.quantize(t)
    bufs = [b if b is not None else t.new_empty((0,), dtype=torch.uint8)
            for b in st.buffers().values()]
    return bufs, G.quantizer_meta(q)


def roles(x, w, g, qs):
    """The three GEMMs of a Linear step as qgemm_impl argument tuples (Linear's calls)."""
    (m, k), n = x.shape, w.shape[0]
    xb, xm = bufs_meta(x, qs[0])
    wb, wm = bufs_meta(w, qs[1])
    gb, gm = bufs_meta(g, qs[2])
    return {
        "fprop": (xb, xm, (m, k), False, False, wb, wm, (n, k), False, True),
        "dgrad": (gb, gm, (m, n), False, False, wb, wm, (n, k), True, False),
        "wgrad": (gb, gm, (m, n), True, True, xb, xm, (m, k), True, False),
    }


def emulated(args, bias, out_dtype):
    """The dequantize-then-fp32-matmul result (the reference GEMM of every format) and the exact
    float64 product of the same dequantized operands."""
    ab, am, ash, acol, ta, bb, bm, bsh, bcol, tb = args
    fmt = am[0]
    if fmt in (G.MXFP8, G.NVFP4):  # the reference backend's GEMM on the row operands
        ra, rb = G.operand(ab, am, ash, ta, acol), G.operand(bb, bm, bsh, not tb, bcol)
        from quant_core import reference as R
        if fmt == G.MXFP8:
            ref = R.mxfp8_gemm(ra.data, ra.scale, rb.data, rb.scale, a_dtype=ra.fp_dtype,
                               b_dtype=rb.fp_dtype, a_swizzled=ra.swizzled,
                               b_swizzled=rb.swizzled, bias=bias, out_dtype=torch.float32)
            av = R.gemm._mxfp8_operand(ra.data, ra.scale, ra.fp_dtype, ra.swizzled).double()
            bv = R.gemm._mxfp8_operand(rb.data, rb.scale, rb.fp_dtype, rb.swizzled).double()
            exact = av @ bv.t()
        else:
            ref = R.nvfp4_gemm(ra.data, ra.scale, ra.amax, rb.data, rb.scale, rb.amax,
                               a_swizzled=ra.swizzled, b_swizzled=rb.swizzled, bias=bias,
                               out_dtype=torch.float32)
            av = R.gemm._nvfp4_operand(ra.data, ra.scale, ra.swizzled).double()
            bv = R.gemm._nvfp4_operand(rb.data, rb.scale, rb.swizzled).double()
            exact = (av @ bv.t()) * (ra.amax.double() / 2688) * (rb.amax.double() / 2688)
    else:
        a = G.dequantize(ab, am, ash[0], ash[1], acol)
        b = G.dequantize(bb, bm, bsh[0], bsh[1], bcol)
        a, b = (a.t() if ta else a), (b.t() if tb else b)
        ref = a @ b if bias is None else a @ b + bias.float()
        exact = a.double() @ b.double()
    if bias is not None:
        exact = exact + bias.double()
    return ref, exact


def rel(got, exact) -> float:
    if got is None:
        return float("nan")
    d = (got.double() - exact).norm() / exact.norm().clamp_min(1e-300)
    return float(d)


def integer_input(rows, cols, seed):
    """Integers in [-3, 3] with 28 wherever ``row % 16 == col % 16``: every block of every format
    (1x16 .. 128x128, rowwise or columnwise) has amax 28, so every scale is the same (a power of
    two for FP8 and MXFP8, 448 for NVFP4's E4M3), every element quantizes exactly, and every
    product and partial sum is a multiple of one unit far below 2^24 units: exact in fp32 in any
    order (the tensor cores' partial sums included)."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randint(-3, 4, (rows, cols), generator=gen).float()
    i = torch.arange(rows)[:, None] % 16
    j = torch.arange(cols)[None, :] % 16
    v = torch.where(i == j, torch.full_like(v, 28.0), v)
    return v.to(torch.bfloat16).to(DEV)


def check(name: str, m: int, k: int, n: int, with_bias: bool) -> None:
    for kind in ("integer", "random"):
        qs = quantizers(name, exact=kind == "integer")
        if kind == "integer":
            x, w, g = integer_input(m, k, 1), integer_input(n, k, 2), integer_input(m, n, 3)
        else:
            gen = torch.Generator(device=DEV).manual_seed(4)
            x = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
            w = (torch.randn(n, k, device=DEV, generator=gen) * 0.02).bfloat16()
            g = (torch.randn(m, n, device=DEV, generator=gen) * 1e-3).bfloat16()
        for role, args in roles(x, w, g, qs).items():
            cols = args[7][0] if args[9] else args[7][1]
            bias = (torch.randn(cols, device=DEV) * 0.5).bfloat16() if with_bias else None
            if kind == "integer" and bias is not None:
                bias = bias.float().round().bfloat16()
            for out_dtype in (torch.float32, torch.bfloat16):
                G.reset_gemm_paths()
                try:
                    got = G.qgemm_impl(*args, bias, out_dtype)
                    path, err = G.last_gemm_path(), None
                except Exception as e:  # noqa: BLE001 - report and go on
                    got, path, err = None, "error", f"{type(e).__name__}: {str(e)[:200]}"
                ref, exact = emulated(args, bias, out_dtype)
                if kind == "integer":
                    want = ref.to(out_dtype)
                    bad = -1 if got is None else int((got != want).sum())
                    rec = dict(format=name, role=role, shape=(m, k, n), out=str(out_dtype),
                               bias=with_bias, kind=kind, path=path, mismatches=bad, error=err)
                else:
                    rec = dict(format=name, role=role, shape=(m, k, n), out=str(out_dtype),
                               bias=with_bias, kind=kind, path=path, rel_err=rel(got, exact),
                               rel_err_emulated=rel(ref.to(out_dtype), exact), error=err)
                RESULTS["checks"].append(rec)
                print(json.dumps(rec), flush=True)


def ms(fn) -> float:
    return graph_ms(fn, rep=50)


def speed(m: int, k: int, n: int) -> None:
    flop = 2.0 * m * k * n
    base: list[float] = []

    def report(label, t):
        base.append(base[0] if base else t)  # the first row is bf16 torch.mm
        rec = dict(shape=(m, k, n), what=label, ms=t, tflops=flop / t / 1e9,
                   vs_bf16=base[0] / t)
        RESULTS["speed"].append(rec)
        print(f"  {label:46s} {t:8.3f} ms {rec['tflops']:7.1f} TFLOP/s "
              f"{rec['vs_bf16']:6.3f}x bf16", flush=True)

    a = torch.randn(m, k, device=DEV).bfloat16()
    b = torch.randn(n, k, device=DEV).bfloat16()
    report("bf16 torch.mm", ms(lambda: torch.mm(a, b.t())))
    try:
        report("bf16 torch.mm out_dtype=float32",
               ms(lambda: torch.mm(a, b.t(), out_dtype=torch.float32)))
    except Exception as e:  # noqa: BLE001
        print(f"  bf16 torch.mm out_dtype=float32: {type(e).__name__}: {e}", flush=True)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV)
    report("fp8 tensorwise torch._scaled_mm (bf16 out)",
           ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                       out_dtype=torch.bfloat16)))
    x, w = a, b
    g = torch.randn(m, n, device=DEV).bfloat16()
    for name in RECIPES:
        qs = quantizers(name)
        for role, args in roles(x, w, g, qs).items():
            G.reset_gemm_paths()
            G.qgemm_impl(*args, None, torch.bfloat16)
            path = G.last_gemm_path()
            sweeps = [None]  # (mode, config key, config)
            if path == "triton_mxfp8":
                sweeps = [("dequant", "mxfp8_dequant", c) for c in SWEEP["mxfp8_dequant"]]
                sweeps += [("fused", "mxfp8_gemm", c) for c in SWEEP["mxfp8_gemm"]]
            elif path == "triton_nvfp4":
                sweeps = [("dequant", "nvfp4_dequant", c) for c in SWEEP["nvfp4_dequant"]]
                sweeps += [("fused", "nvfp4_gemm", c) for c in SWEEP["nvfp4_gemm"]]
            for item in sweeps:
                label = f"{name} {role} {path}"
                tiles = contextlib.ExitStack()
                if item is not None:
                    mode, key, cfg = item
                    tiles.enter_context(configs.overridden(key, cfg))
                    tiles.enter_context(gemm_implementation(name, mode))
                    label += f" {mode} " + ",".join(f"{k_}={v}" for k_, v in cfg.items())
                with tiles:
                    try:
                        report(label,
                               ms(lambda args=args: G.qgemm_impl(*args, None, torch.bfloat16)))
                    except Exception as e:  # noqa: BLE001
                        print(f"  {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del qs
        torch.cuda.empty_cache()


def probes() -> None:
    """What cuBLAS's block-scaled FP8 GEMM accepts here (output dtypes, bias, ragged M)."""
    a = torch.randn(64, 64, device=DEV).bfloat16()
    try:
        ok = f"ok {torch.mm(a, a, out_dtype=torch.float32).dtype}"
    except Exception as e:  # noqa: BLE001
        ok = f"{type(e).__name__}: {str(e)[:160]}"
    print("probe", json.dumps(dict(what="torch.mm bf16 out_dtype=float32", result=ok)))
    if not hasattr(F, "scaled_mm"):
        print("probe: torch has no F.scaled_mm")
        return
    for m, out_dtype, bias in [(256, torch.bfloat16, False), (256, torch.float32, False),
                               (256, torch.float16, False), (256, torch.bfloat16, True),
                               (200, torch.bfloat16, False)]:
        k = n = 256
        a = torch.randn(m, k, device=DEV).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=DEV).to(torch.float8_e4m3fn)
        sa = torch.ones(k // 128, m, device=DEV).t()
        sb = torch.ones(n // 128, 4, device=DEV).t()  # [roundup(K/128, 4), N/128], strides (1, 4)
        try:
            out = F.scaled_mm(a, b.t(), sa, F.ScalingType.BlockWise1x128, sb,
                              F.ScalingType.BlockWise128x128,
                              bias=torch.ones(n, device=DEV, dtype=out_dtype) if bias else None,
                              output_dtype=out_dtype)
            ok = f"ok {out.dtype}"
        except Exception as e:  # noqa: BLE001
            ok = f"{type(e).__name__}: {str(e)[:160]}"
        rec = dict(m=m, out=str(out_dtype), bias=bias, result=ok)
        RESULTS["probes"].append(rec)
        print("probe", json.dumps(rec), flush=True)


def run(shapes: list[tuple[int, int, int]], out: str | None) -> int:
    """Probes, the checks, then speed per shape; 1 if a check mismatched or failed."""
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    probes()
    for name in RECIPES:
        for m, k, n in [(256, 512, 384), (208, 384, 256)]:
            check(name, m, k, n, with_bias=True)
        check(name, 2048, 4096, 1024, with_bias=False)
    bad = [c for c in RESULTS["checks"]
           if c.get("mismatches", 0) != 0 or c.get("error")]
    print(f"CHECKS: {len(RESULTS['checks'])} run, {len(bad)} with mismatches or errors",
          flush=True)
    for m, k, n in shapes:
        print(f"speed {m}x{k}x{n}", flush=True)
        speed(m, k, n)
    if out:
        with open(out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 1 if bad else 0


# --- MXFP8: dequantize + cuBLAS against max-autotune with the dequantization in the prologue


def _dequant_ops(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rowwise E4M3 MXFP8 ``[M, K]`` (unswizzled scales) as bf16: the reference's rule
    (``quant_core.reference.mxfp8_dequantize``, exact), in torch ops that Inductor compiles."""
    from quant_core import reference

    return reference.mxfp8_dequantize(data, scale, fp8_dtype=DType.E4M3, columnwise=False,
                                      swizzled=False, dtype=torch.bfloat16)


def _prologue_gemm(ad, asc, bd, bsc):
    """The GEMM with both dequantizations in front, for Inductor to fuse into its prologue."""
    return _dequant_ops(ad, asc) @ _dequant_ops(bd, bsc).t()


def autotune_row(shape: str, be, q) -> dict:
    """One shape's row: quant's MXFP8 GEMM (``quant_kernels.mxfp8_gemm``'s dequantize, then
    cuBLAS) against ``max-autotune-no-cudagraphs`` with prologue fusion of the reference's
    dequantization, bf16 ``x @ w.T`` of the same shape, what Inductor chose (a template kernel
    reading uint8 means the prologue fused) and the two results' relative difference."""
    from measure import time_steps
    from torch._inductor.utils import run_and_get_code

    m, k, n = (int(v) for v in shape.split("x"))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    a, b = q.quantize(x), q.quantize(w)
    ops = (*list(a.buffers().values())[:2], *list(b.buffers().values())[:2])  # rowwise data, scale

    def ours():
        return be.mxfp8_gemm(ops[0], ops[1], ops[2], ops[3], a_dtype=DType.E4M3,
                             b_dtype=DType.E4M3, a_swizzled=False, b_swizzled=False, bias=None,
                             out_dtype=torch.bfloat16)

    torch._dynamo.reset()
    compiled = torch.compile(_prologue_gemm, mode="max-autotune-no-cudagraphs", fullgraph=True)
    got, codes = run_and_get_code(compiled, *ops)
    code = "\n".join(codes)
    template = "triton_tem_" in code
    want = ours()
    row = {
        "shape": shape,
        "ours_ms": time_steps(ours, dev),
        "autotuned_ms": time_steps(lambda: compiled(*ops), dev),
        "bf16_mm_ms": time_steps(lambda: x @ w.t(), dev),
        "template_chosen": template,
        "prologue_fused": template and "uint8" in code and "triton_poi" not in code,
        "extern_mm": "extern_kernels.mm" in code,
        "rel_diff": ((got.float() - want.float()).norm() / want.float().norm()).item(),
    }
    row["ours_vs_bf16"] = row["bf16_mm_ms"] / row["ours_ms"]
    row["autotuned_vs_bf16"] = row["bf16_mm_ms"] / row["autotuned_ms"]
    return row


def autotune(shapes: list[str], out: str | None) -> None:
    """:func:`autotune_row` per shape, then the table (speeds as ratios to bf16 ``mm``)."""
    import torch._inductor.config as ic
    from quant_core import MXFP8Quantizer

    if hasattr(ic, "prologue_fusion"):
        ic.prologue_fusion = True
    # Inductor's Triton templates and cuBLAS compete (as TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS)
    ic.max_autotune_gemm_backends = os.environ.get("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS",
                                                   "TRITON,ATEN")
    be = backends.get(None, torch.device("cuda"))
    q = MXFP8Quantizer(rowwise_usage=True, columnwise_usage=False, optimize_for_gemm=False)
    rows = []
    for shape in shapes:
        rows.append(autotune_row(shape, be, q))
        print(json.dumps(rows[-1]), flush=True)
    print("| M x K x N | bf16 mm ms | quant dequant + cuBLAS ms (vs bf16) | max-autotune + "
          "prologue ms (vs bf16) | template | prologue fused | rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['bf16_mm_ms']:.3f} | {r['ours_ms']:.3f} "
              f"({r['ours_vs_bf16']:.3f}x) | {r['autotuned_ms']:.3f} "
              f"({r['autotuned_vs_bf16']:.3f}x) | {r['template_chosen']} | "
              f"{r['prologue_fused']} | {r['rel_diff']:.2e} |")
    if out:
        with open(out, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
