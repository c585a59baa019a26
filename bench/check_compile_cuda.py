"""On CUDA: fullgraph-compiled ``quant::quantize`` and ``quant::qdq`` equal eager bitwise for
every quantizer with the Triton backend, and a compiled quantized ``Linear`` per recipe equals its
eager run, with the GEMM path each recipe took. Each line also says how many opaque ``quant`` op
calls and counted GEMMs the compiled call made: 0 where the ops are lowered to their kernels in
Inductor's code (quant_dynamo.capture); ``QUANT_LOWERING=0`` keeps them opaque.

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

try:  # run from source trees (PYTHONPATH), the entry point that registers Triton is absent
    from quant_kernels.backend import BACKEND

    backends.register(BACKEND)
except ImportError:
    pass

QUANTIZERS = {
    "current": Float8CurrentScalingQuantizer(),
    "mxfp8": MXFP8Quantizer(),
    "block2d": Float8BlockQuantizer(),
    "block1d": Float8BlockQuantizer(block_scaling_dim=1),
    "nvfp4_rht": NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
    "nvfp4_2d": NVFP4Quantizer(with_2d_quantization=True),
}


_OPAQUE_CALLS = [0]


def _count_opaque_calls() -> None:
    """Count the Python bodies of the opaque ``quant`` ops (lowered ops never run them)."""
    from quant_dynamo import ops

    def counting(f):
        def counted(*args):
            _OPAQUE_CALLS[0] += 1
            return f(*args)

        return counted

    for name in ("_quantize_impl", "_qdq_impl"):
        setattr(ops, name, counting(getattr(ops, name)))


def _compiled_call(fn, *args):
    """``fn(*args)`` and the number of opaque quant op calls it made."""
    _OPAQUE_CALLS[0] = 0
    out = fn(*args)
    torch.cuda.synchronize()
    return out, _OPAQUE_CALLS[0]


def _qdq_cases(results):
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    os.environ["QUANT_BACKEND"] = "triton"  # the reference is compiled on the CPU by tests/dynamo
    backends._choice_cache.clear()
    for name, q in QUANTIZERS.items():
        q = q.with_usage(columnwise=True)
        for op in ("quantize", "qdq"):
            torch._dynamo.reset()
            fn = torch.compile(lambda t, q=q, op=op: getattr(quant_dynamo, op)(t, q),
                               fullgraph=True)
            fn(x)  # compile
            got, opaque = _compiled_call(fn, x)
            want = getattr(quant_dynamo, op)(x, q)
            ok = (all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
                  if op == "quantize" else torch.equal(got, want))
            results.append(ok)
            print(f"{'ok  ' if ok else 'FAIL'} {op:8s} fullgraph inductor {name:10s} "
                  f"opaque calls {opaque}")
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
        fn = torch.compile(step, fullgraph=True)
        fn(x).float().sum().backward()  # compile forward and backward
        x.grad = None
        layer.weight.grad = None
        qr.reset_gemm_paths()
        _OPAQUE_CALLS[0] = 0
        compiled = fn(x)
        compiled.float().sum().backward()
        torch.cuda.synchronize()
        ok = (torch.equal(eager, compiled) and torch.equal(g_eager[0], x.grad)
              and torch.equal(g_eager[1], layer.weight.grad))
        results.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} Linear fwd+bwd compiled==eager {name:12s} gemm {paths}"
              f"; compiled call: opaque quant calls {_OPAQUE_CALLS[0]}, "
              f"counted GEMMs {qr.gemm_paths()}")


def main() -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"quant_dynamo mode {quant_dynamo.status()['mode']}, backends {backends.available()}")
    results: list[bool] = []
    _count_opaque_calls()
    _qdq_cases(results)
    _linear_cases(results)
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
