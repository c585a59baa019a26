"""On CUDA: quantizers lowered to torch ops give the reference's bytes when Inductor compiles
them, fused with a producer or not.

Each case compiles ``quant_dynamo.quantize(producer(a, b), q)`` with ``fullgraph=True`` and
``dynamic=True`` (one compile serves every shape) and compares every buffer byte for byte with
the eager reference (``backend="reference"``) of the producer's output as Inductor computes it
alone: a fused low-precision producer is computed in fp32 and rounded once, so its compiled value
may differ from eager mode's, and the quantization must read the stored, rounded values.
Producers: the input itself and ``silu(a) * b``. Inputs: fp32, bf16 and fp16; ragged and 3-D
shapes up to 8192x8192; value sets with planted zeros, fp32 and input-dtype subnormals, values
at and past the FP8 maximum, ±Inf, NaN and -0.0, an all-zero tensor, a subnormal-only tensor.
One test per quantizer, dtype and producer; it asserts that every shape and value set matches.
"""

from __future__ import annotations

import itertools

import formats
import pytest
import quant_dynamo
import torch

DEV = "cuda"
SHAPES = [(7, 13), (127, 129), (256, 4096), (3, 5, 300), (1000, 3000), (8192, 8192), (1, 1)]
KINDS = ("normal", "special", "zeros", "tiny", "huge")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PRODUCERS = {
    "input": lambda a, b: a,
    "silu_mul": lambda a, b: torch.nn.functional.silu(a) * b,
}
#: Every usage pair with E4M3, and both usages with power-of-two scales and with E5M2: the fp8
#: row's variants of tests/formats.py (the format lowered to torch ops).
_FP8 = formats.FORMATS["fp8"].quantizers
QUANTIZERS = {
    "e4m3_row_col": lambda: _FP8["current"](rowwise_usage=True, columnwise_usage=True),
    "e4m3_row": lambda: _FP8["current"](rowwise_usage=True, columnwise_usage=False),
    "e4m3_col": lambda: _FP8["current"](rowwise_usage=False, columnwise_usage=True),
    "e4m3_pow2": _FP8["current_pow2"],
    "e5m2_eps": lambda: _FP8["current_e5m2"](amax_epsilon=1e-3),
}


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


@pytest.fixture(autouse=True, scope="module")
def cache_size():
    old = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 256
    yield
    torch._dynamo.config.cache_size_limit = old


@pytest.mark.parametrize("pname", list(PRODUCERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("qname", list(QUANTIZERS))
def test_compiled_ops_match_the_reference(qname, dtype, pname):
    q, producer = QUANTIZERS[qname](), PRODUCERS[pname]
    gen = torch.Generator(device=DEV).manual_seed(0)
    compiled_producer = torch.compile(producer, dynamic=True)
    fn = torch.compile(lambda a, b: quant_dynamo.quantize(producer(a, b), q),
                       fullgraph=True, dynamic=True)
    failures = []
    for shape, kind in itertools.product(SHAPES, KINDS):
        if kind != "normal" and torch.Size(shape).numel() > 4096 * 4096:
            continue
        a = values(kind, shape, dtype, gen)
        b = values("normal", shape, dtype, gen).abs() + 0.5
        got = [t.clone() for t in fn(a, b)]
        x = compiled_producer(a, b)  # Inductor's own value of the producer
        want = q.quantize(x, backend="reference").buffer_list(x)
        if not same(got, want):
            diffs = [int((g != w).sum()) if g.shape == w.shape else -1
                     for g, w in zip(got, want, strict=True)]
            failures.append(f"{shape} {kind}: mismatches {diffs}")
    assert not failures, f"{q!r} {dtype} {pname}: " + "; ".join(failures)
