"""quant-dynamo keeps torch's write analysis of quant's recorded Triton launches per signature
(``quant_dynamo._write_analysis``): the second launch of a kernel with the same argument dtypes
and scalars generates no TTIR and gets the same answer, also traced through ``wrap_triton``
(which wraps every launch given ``num_warps`` in a new autotuner), and as Inductor's lowering
passes it (tensor boxes); symbolic sizes are analysed once for every symbol; another dtype or
another kernel is analysed as torch does.

torch's analysis compiles real TTIR, which the interpreter cannot give: this module runs itself
in a subprocess without ``TRITON_INTERPRET``, for an sm_90 target on a CPU machine (as
tests/kernels/test_kernel_writes.py does). ``python tests/dynamo/test_write_analysis.py`` prints
one ``ok`` line per check and exits 1 on a failed one.
"""

from __future__ import annotations

import os
import sys

import pytest

_KERNELS_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels")


def test_quant_kernels_are_analysed_once_per_signature():
    pytest.importorskip("triton")
    pytest.importorskip("quant_kernels")
    wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if not any(hasattr(wrap, f) for f in ("identify_accessed_tensors",
                                          "identify_mutated_tensors")):
        pytest.skip("this torch has no TTIR write analysis")
    sys.path.insert(0, _KERNELS_TESTS)
    try:
        from _sm90 import run_as_script
    finally:
        sys.path.remove(_KERNELS_TESTS)
    run_as_script(__file__, min_ok=7, timeout=600)


def traced_launches(backend, dtype) -> int:
    """Trace one FP8 current-scaling quantize the way a compiled graph records it
    (functionalized, under ``capture()``, through ``wrap_triton``); the launches recorded."""
    import torch
    from quant_core.kernel_capture import capture
    from torch.fx.experimental.proxy_tensor import make_fx

    def quantize(x):
        with capture():
            return backend.fp8_current_quantize(x, fp8_dtype=dtype.E4M3,
                                                force_pow_2_scales=False, amax_epsilon=0.0,
                                                rowwise=True, columnwise=True)

    graph = make_fx(torch.func.functionalize(quantize), tracing_mode="fake")(
        torch.randn(256, 256, dtype=torch.bfloat16))
    return sum("triton_kernel_wrapper" in str(n.target) for n in graph.graph.nodes)


def main() -> int:
    sys.path.insert(0, _KERNELS_TESTS)
    import torch
    import triton
    import triton.language as tl
    from _sm90 import fake_target, record_launches
    from quant_core import DType

    fake_target()
    import quant_dynamo  # noqa: F401  (installs the kept analyses)
    from quant_kernels.backend import BACKEND as B
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    name = next(f for f in ("identify_accessed_tensors", "identify_mutated_tensors")
                if hasattr(wrap, f))
    kept = getattr(wrap, name)
    fresh = kept.__wrapped__

    def writes(analysis, kernel, kwargs):
        result = analysis(kernel, kwargs, {})
        if isinstance(result, list):  # identify_mutated_tensors
            return sorted(result)
        return sorted(d.name for d in result.read_writes.writes)

    generated = [0]
    generate = wrap.generate_ttir

    def counted(*args, **kwargs):
        generated[0] += 1
        return generate(*args, **kwargs)

    bad = 0

    def check(ok: bool, what: str) -> None:
        nonlocal bad
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}")

    wrap.generate_ttir = counted
    traced = []
    for _ in range(2):
        before = generated[0]
        traced.append((traced_launches(B, DType), generated[0] - before))
    check(traced[0][0] > 0 and traced[0][1] == traced[0][0] and traced[1] == (traced[0][0], 0),
          f"traced twice through wrap_triton (num_warps given: torch wraps each launch in a new "
          f"autotuner): {traced[0][1]} then {traced[1][1]} TTIR generations for "
          f"{traced[0][0]} launches")
    launches = record_launches()

    def analysed(x):
        """``([(writes by the kept analysis, writes by torch's own)] per launch, TTIR generations
        the kept analyses made)`` of one FP8 current-scaling quantize of ``x``."""
        launches.clear()
        B.fp8_current_quantize(x, fp8_dtype=DType.E4M3, force_pow_2_scales=False,
                               amax_epsilon=0.0, rowwise=True, columnwise=True)
        bound = []
        for kernel, _, args, kwargs in launches:
            names = [p.name for p in kernel.params]
            bound.append((kernel, {k: v for k, v in (dict(zip(names, args, strict=False))
                                                     | kwargs).items() if k in names}))
        before = generated[0]
        got = [writes(kept, kernel, kw) for kernel, kw in bound]
        made = generated[0] - before
        analysed.bound = bound
        return [(g, writes(fresh, kernel, kw)) for g, (kernel, kw) in zip(got, bound,
                                                                          strict=True)], made

    first, made = analysed(torch.randn(256, 256, dtype=torch.bfloat16))
    check(made == len(first) > 0 and all(k == f for k, f in first),
          f"first launches: {made} TTIR generations for {len(first)} launches, torch's writes")
    again, made = analysed(torch.randn(256, 256, dtype=torch.bfloat16))
    check(made == 0 and again == first,
          f"the same signature again: {made} TTIR generations, the same writes")
    bound = analysed.bound

    def lowered(kw, symbols=None):
        """``kw`` as Inductor's lowering passes it: tensors as tensor boxes; with ``symbols``,
        ints (not bools) as the sympy expressions it gives for their names."""
        from torch._inductor import ir

        def box(name, t):
            layout = ir.FixedLayout(t.device, t.dtype, list(t.shape))
            return ir.TensorBox.create(ir.InputBuffer(name=name, layout=layout))
        return {k: box(k, v) if isinstance(v, torch.Tensor)
                else symbols(k) if symbols and type(v) is int else v for k, v in kw.items()}

    before = generated[0]
    boxed = [writes(kept, kernel, lowered(kw)) for kernel, kw in bound]
    check(generated[0] == before and boxed == [k for k, _ in first],
          f"the same launches as Inductor's lowering passes them (tensor boxes): "
          f"{generated[0] - before} TTIR generations, the same writes")
    import sympy

    ints = [kw for _, kw in bound if any(type(v) is int for v in kw.values())]
    before = generated[0]
    for tag in ("s", "t"):
        symbolic = [writes(kept, kernel, lowered(kw, lambda k, tag=tag: sympy.Symbol(tag + k)))
                    for kernel, kw in bound]
    torch_own = [writes(fresh, kernel, lowered(kw, lambda k: sympy.Symbol("u" + k)))
                 for kernel, kw in bound]
    made = generated[0] - before - len(bound)
    check(ints and made == len(bound) and symbolic == torch_own,
          f"sizes as symbols, twice with other symbols: {made} TTIR generations for "
          f"{len(bound)} launches, torch's writes")
    other, made = analysed(torch.randn(256, 256, dtype=torch.float32))
    check(made == len(other) and all(k == f for k, f in other),
          f"fp32 input: {made} TTIR generations for {len(other)} launches, torch's writes")

    @triton.jit
    def _copy(src, dst, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, tl.load(src + i))

    src, dst = torch.zeros(16), torch.zeros(16)
    before = generated[0]
    answers = [writes(kept, _copy, dict(src=src, dst=dst, N=16)) for _ in range(2)]
    check(generated[0] - before == 2 and answers == [["dst"], ["dst"]],
          f"a kernel of another package: analysed by torch each time "
          f"({generated[0] - before} generations), writes {answers[0]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
