"""On CUDA: fullgraph-compiled ``quant::qdq`` equals eager bitwise for every quantizer, with the
Triton backend and with the reference; and a compiled quantized ``Linear`` per recipe equals its
eager run, with the GEMM path each recipe took.

Run on the GPU machine with the four packages installed (wheels):
``python bench/check_compile_cuda.py``.
Prints one line per case and a final ``N passed, N failed`` line.
"""

from __future__ import annotations

import os
import sys

import quant_dynamo
import torch
from quant_core import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    backends,
)

QUANTIZERS = {
    "current": Float8CurrentScalingQuantizer(),
    "mxfp8": MXFP8Quantizer(),
    "block2d": Float8BlockQuantizer(),
    "block1d": Float8BlockQuantizer(block_scaling_dim=1),
    "nvfp4_rht": NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
    "nvfp4_2d": NVFP4Quantizer(with_2d_quantization=True),
}


def _qdq_cases(results):
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    for backend in ("triton",):  # the reference is compiled on the CPU by tests/dynamo
        os.environ["QUANT_BACKEND"] = backend
        backends._choice_cache.clear()
        for name, q in QUANTIZERS.items():
            torch._dynamo.reset()
            fn = torch.compile(lambda t, q=q: quant_dynamo.qdq(t, q), fullgraph=True)
            ok = torch.equal(fn(x), quant_dynamo.qdq(x, q))
            results.append(ok)
            print(f"{'ok  ' if ok else 'FAIL'} qdq fullgraph inductor {backend:9s} {name}")
    os.environ.pop("QUANT_BACKEND")
    backends._choice_cache.clear()


def _linear_cases(results):
    import quant_recipes as qr

    recipes = {
        "fp8_current": qr.Float8CurrentScaling(),
        "fp8_block": qr.Float8BlockScaling(),
        "mxfp8": qr.MXFP8BlockScaling(),
        "nvfp4": qr.NVFP4BlockScaling(),
    }
    for name, recipe in recipes.items():
        torch.manual_seed(0)
        layer = qr.Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step(inp, layer=layer, recipe=recipe):
            with qr.autocast(recipe=recipe):
                return layer(inp)

        qr.reset_gemm_paths()
        eager = step(x)
        eager.float().sum().backward()
        g_eager = (x.grad.clone(), layer.weight.grad.clone())
        paths = qr.gemm_paths()
        x.grad = None
        layer.weight.grad = None
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True)(x)
        compiled.float().sum().backward()
        ok = (torch.equal(eager, compiled) and torch.equal(g_eager[0], x.grad)
              and torch.equal(g_eager[1], layer.weight.grad))
        results.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} Linear fwd+bwd compiled==eager {name:12s} gemm {paths}")


def main() -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"quant_dynamo mode {quant_dynamo.status()['mode']}, backends {backends.available()}")
    results: list[bool] = []
    _qdq_cases(results)
    _linear_cases(results)
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
