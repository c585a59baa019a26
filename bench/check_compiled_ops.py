"""On CUDA: quantizers lowered to torch ops (``Quantizer.lowerings()`` starting with ``"ops"``)
give the reference's bytes when Inductor compiles them, fused with a producer or not.

Each case compiles ``quant_dynamo.quantize(producer(a, b), q)`` with ``fullgraph=True`` and
``dynamic=True`` (one compile serves every shape) and compares every buffer byte for byte with
the eager reference (``backend="reference"``) of the producer's output as Inductor computes it
alone (a fused low-precision producer is computed in fp32 and rounded once, so its compiled
value may differ from eager mode's). Producers: the
input itself and ``silu(a) * b`` (Inductor computes fused low-precision producers in
fp32; the quantization must read the stored, rounded values). Inputs: fp32, bf16 and fp16;
ragged and 3-D shapes; value sets with planted zeros, fp32 and input-dtype subnormals, values
at and past the FP8 maximum, ±Inf, NaN and -0.0, an all-zero tensor, a subnormal-only tensor.

``python bench/check_compiled_ops.py [cpu]`` (the four packages installed; ``cpu`` compiles
the traced ops with Inductor's C++ code, a smoke run of the script). Prints one line per
failing case and a final ``N passed, N failed`` line.
"""

from __future__ import annotations

import itertools
import sys

import quant_dynamo
import torch
from quant_core import DType, Float8CurrentScalingQuantizer, backends

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
SHAPES = [(7, 13), (127, 129), (256, 4096), (3, 5, 300), (1000, 3000), (8192, 8192), (1, 1)]
SMALL = [(7, 13), (127, 129), (3, 5, 300), (1, 1)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PRODUCERS = {
    "input": lambda a, b: a,
    "silu_mul": lambda a, b: torch.nn.functional.silu(a) * b,
}


def quantizers():
    """Every usage pair with E4M3, and both usages with power-of-two scales and with E5M2."""
    for row, col in ((True, True), (True, False), (False, True)):
        yield Float8CurrentScalingQuantizer(rowwise_usage=row, columnwise_usage=col)
    yield Float8CurrentScalingQuantizer(force_pow_2_scales=True)
    yield Float8CurrentScalingQuantizer(DType.E5M2, amax_epsilon=1e-3)


def values(kind: str, shape, dtype, gen) -> torch.Tensor:
    n = torch.Size(shape).numel()
    x = torch.randn(n, generator=gen, device=DEV)
    if kind == "special":
        x = x * 100
        specials = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 448.0, 480.0, 1e5, -6e4,
                                 float("inf"), -float("inf"), float("nan"), 2**-24, 6e-8],
                                device=DEV)
        idx = torch.randint(0, n, (max(n // 7, 1),), generator=gen, device=DEV)
        x[idx] = specials[torch.randint(0, len(specials), idx.shape, generator=gen,
                                        device=DEV)]
    elif kind == "zeros":
        x = torch.where(x > 0, 0.0, -0.0)
    elif kind == "tiny":
        x = x * 1e-42 if dtype == torch.float32 else x * 1e-7
    elif kind == "huge":
        x = x * 1e38 if dtype == torch.float32 else x * 6e4
    return x.to(dtype).reshape(shape)


def same(got, want) -> bool:
    return len(got) == len(want) and all(
        g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)
        for g, w in zip(got, want, strict=True))


def main() -> int:
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"torch {torch.__version__}, {name}, backends {backends.available()}")
    if DEV != "cuda":  # a smoke run of this script: the ops traced on the CPU too
        quant_dynamo.capture.OPS_DEVICES.add(DEV)
    torch._dynamo.config.cache_size_limit = 256
    gen = torch.Generator(device=DEV).manual_seed(0)
    passed = failed = 0
    compiled_producers = {name: torch.compile(p, dynamic=True) for name, p in PRODUCERS.items()}
    for q, dtype, (pname, producer) in itertools.product(quantizers(), DTYPES,
                                                         PRODUCERS.items()):
        fn = torch.compile(lambda a, b, q=q, p=producer: quant_dynamo.quantize(p(a, b), q),
                           fullgraph=True, dynamic=True)
        for shape, kind in itertools.product(SHAPES if DEV == "cuda" else SMALL,
                                             ("normal", "special", "zeros", "tiny",
                                                      "huge")):
            if kind != "normal" and torch.Size(shape).numel() > 4096 * 4096:
                continue
            a = values(kind, shape, dtype, gen)
            b = values("normal", shape, dtype, gen).abs() + 0.5
            got = [t.clone() for t in fn(a, b)]
            x = compiled_producers[pname](a, b)  # Inductor's own value of the producer
            want = q.quantize(x, backend="reference").buffer_list(x)
            if same(got, want):
                passed += 1
            else:
                failed += 1
                diffs = [int((g != w).sum()) if g.shape == w.shape else -1
                         for g, w in zip(got, want, strict=True)]
                print(f"FAIL {q!r} {dtype} {pname} {shape} {kind}: mismatches {diffs}",
                      flush=True)
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
