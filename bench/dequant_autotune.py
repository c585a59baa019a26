"""MXFP8 GEMM on Hopper: quant's dequantize + cuBLAS against Inductor's max-autotune Triton matmul
templates with the dequantization fused into their prologue.

quant's MXFP8 GEMM on GPUs without MX tensor cores dequantizes both operands exactly to bf16
(one Triton kernel each) and multiplies them with cuBLAS (``quant_kernels.mxfp8_gemm``, mode
``"dequant"``). The alternative measured here puts the reference's dequantization
(``quant_core.reference.mxfp8_dequantize``: torch ops, exact) in front of ``a @ b.T`` and
compiles it with
``mode="max-autotune-no-cudagraphs"`` and prologue fusion, so that Inductor may choose a Triton
template that decodes the FP8 tiles in its mainloop instead of writing bf16 copies. Per shape
(the forward GEMMs of the Llama benchmark's layers) it reports the median of CUDA-event timed
calls for both, whether Inductor's code fused the prologue (a template kernel reading uint8),
and the relative difference of the two results (both accumulate in fp32: they differ by the
order of the additions only).

``python bench/dequant_autotune.py [--shapes 8192x4096x14336,...] [--json OUT]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

# Inductor reads its GEMM backends when its config is first imported
os.environ.setdefault("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", "TRITON,ATEN")
import torch  # noqa: E402
from quant_core import reference  # noqa: E402
from quant_core.dtypes import DType  # noqa: E402

DEFAULT_SHAPES = "8192x4096x4096,8192x4096x14336,8192x14336x4096"  # M x K x N


def dequant_ops(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rowwise E4M3 MXFP8 ``[M, K]`` (unswizzled scales) as bf16: the reference's rule, in torch
    ops that Inductor compiles."""
    return reference.mxfp8_dequantize(data, scale, fp8_dtype=DType.E4M3, columnwise=False,
                                      swizzled=False, dtype=torch.bfloat16)


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fused(ad, asc, bd, bsc):
    """The GEMM with both dequantizations in front, for Inductor to fuse into its prologue."""
    return dequant_ops(ad, asc) @ dequant_ops(bd, bsc).t()


def measure(shape: str, be, q) -> dict:
    """One shape's row: times, what Inductor chose, and the two results' difference."""
    from torch._inductor.utils import run_and_get_code

    m, k, n = (int(v) for v in shape.split("x"))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    a, b = q.quantize(x), q.quantize(w)
    ops = (a._rowwise_data, a._rowwise_scale_inv, b._rowwise_data, b._rowwise_scale_inv)

    def ours():
        return be.mxfp8_gemm(ops[0], ops[1], ops[2], ops[3], a_dtype=DType.E4M3,
                             b_dtype=DType.E4M3, a_swizzled=False, b_swizzled=False, bias=None,
                             out_dtype=torch.bfloat16)

    torch._dynamo.reset()
    compiled = torch.compile(fused, mode="max-autotune-no-cudagraphs", fullgraph=True)
    got, codes = run_and_get_code(compiled, *ops)
    code = "\n".join(codes)
    template = "triton_tem_" in code
    want = ours()
    row = {
        "shape": shape,
        "ours_ms": timed(ours),
        "autotuned_ms": timed(lambda: compiled(*ops)),
        "bf16_mm_ms": timed(lambda: x @ w.t()),
        "template_chosen": template,
        "prologue_fused": template and "uint8" in code and "triton_poi" not in code,
        "extern_mm": "extern_kernels.mm" in code,
        "rel_diff": ((got.float() - want.float()).norm() / want.float().norm()).item(),
    }
    row["speedup_autotuned_vs_ours"] = row["ours_ms"] / row["autotuned_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch._inductor.config as ic
    from quant_core import MXFP8Quantizer, backends

    if hasattr(ic, "prologue_fusion"):
        ic.prologue_fusion = True
    be = backends.get(None, torch.device("cuda"))
    q = MXFP8Quantizer(rowwise_usage=True, columnwise_usage=False, optimize_for_gemm=False)
    rows = []
    for shape in args.shapes.split(","):
        rows.append(measure(shape, be, q))
        print(json.dumps(rows[-1]), flush=True)
    print("| M x K x N | bf16 mm ms | quant dequant + cuBLAS ms | max-autotune + prologue ms |"
          " template | prologue fused | rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['bf16_mm_ms']:.3f} | {r['ours_ms']:.3f} | "
              f"{r['autotuned_ms']:.3f} | {r['template_chosen']} | {r['prologue_fused']} | "
              f"{r['rel_diff']:.2e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
