"""The pure-torch reference gives the same bytes on CUDA as on the CPU (issue: quant-core).

Run on a CUDA machine: ``PYTHONPATH=packages/quant-core/src python bench/check_reference_cuda.py``.
Prints one line per case and a final ``N passed, N failed`` line; exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch
from quant_core import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

CASES = {
    "current": Float8CurrentScalingQuantizer(),
    "current_pow2": Float8CurrentScalingQuantizer(force_pow_2_scales=True),
    "mxfp8": MXFP8Quantizer(),
    "mxfp8_2d_swizzled": MXFP8Quantizer(with_2d_quantization=True, optimize_for_gemm=True),
    "block1d": Float8BlockQuantizer(block_scaling_dim=1),
    "block2d": Float8BlockQuantizer(block_scaling_dim=2),
    "nvfp4": NVFP4Quantizer(),
    "nvfp4_rht": NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
    "nvfp4_2d_swizzled": NVFP4Quantizer(with_2d_quantization=True, optimize_for_gemm=True),
}


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1040, 2048, generator=g) * torch.logspace(-30, 30, 2048).sqrt()
    x[3, :40] = 0.0
    x[5, 7] = float("nan")
    x[9, 100] = float("inf")
    x[17, 200] = -float("inf")
    x[33, 64:96] = 1e-40  # fp32 subnormals
    x[40, :] = -0.0
    return x.to(dtype)


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def main() -> int:
    passed = failed = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _inputs(dtype)
        for name, q in CASES.items():
            if "rht" in name and dtype != torch.bfloat16:
                continue
            cpu = q.quantize(x, backend="reference")
            gpu = q.quantize(x.cuda(), backend="reference")
            bad = [
                n for n, t in cpu.buffers().items()
                if t is not None and not torch.equal(_bytes(t), _bytes(getattr(gpu, n).cpu()))
            ]
            ok = not bad
            passed, failed = passed + ok, failed + (not ok)
            print(f"{'ok  ' if ok else 'FAIL'} {name:20s} {str(dtype):15s} {bad or ''}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
