"""No quantize kernel reads, to torch's TTIR analysis, as writing its input.

Compiled graphs record the kernels' launches (quant_dynamo.capture) and torch decides from a
kernel's TTIR which tensor arguments it mutates; a kernel read as writing its input gets a copy
of the input per call and turns CUDA graphs off ("skipping cudagraphs due to mutated inputs").
The analysis is conservative through helper calls (a helper that takes ``x_ptr`` and returns the
offsets a store uses marks ``x`` as written). The check runs every quantize function of the
Triton backend with its launches intercepted (nothing runs) and compiles real TTIR, which the
interpreter cannot give: this module runs itself in a subprocess without ``TRITON_INTERPRET``,
for an sm_90 target on a CPU machine (no GPU needed). ``python tests/kernels/test_kernel_writes.py``
prints one line per launch and exits 1 if any kernel is read as writing its input.
"""

from __future__ import annotations

import sys

import pytest
from _sm90 import run_as_script


def test_no_quantize_kernel_writes_its_input():
    wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if not any(hasattr(wrap, f) for f in ("identify_accessed_tensors",
                                          "identify_mutated_tensors")):
        pytest.skip("this torch has no TTIR mutation analysis")
    run_as_script(__file__, min_ok=12, timeout=600)


def _writes_analysis():
    """``f(kernel, kwargs) -> set of written argument names`` from this torch's analysis
    (``identify_accessed_tensors`` from 2.13, ``identify_mutated_tensors`` before)."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    if hasattr(wrap, "identify_accessed_tensors"):
        return lambda kernel, kw: {d.name for d in wrap.identify_accessed_tensors(
            kernel, kw, {}).read_writes.writes}
    return lambda kernel, kw: set(wrap.identify_mutated_tensors(kernel, kw, {}))


def main() -> int:
    import torch
    from _sm90 import fake_target, record_launches
    from quant_core import DType

    fake_target()
    from quant_kernels.backend import BACKEND as B

    writes_of = _writes_analysis()
    launches = record_launches()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(256, 256, dtype=torch.bfloat16, device=dev)
    one = torch.ones(1, device=dev)
    rows = torch.tensor([3, -1, *range(200)], dtype=torch.int32, device=dev)  # a padded layout
    calls = {
        "fp8_current": lambda: B.fp8_current_quantize(
            x, fp8_dtype=DType.E4M3, force_pow_2_scales=False, amax_epsilon=0.0, rowwise=True,
            columnwise=True),
        "mxfp8": lambda: B.mxfp8_quantize(x, fp8_dtype=DType.E4M3, rowwise=True,
                                          columnwise=True, with_2d_quantization=False,
                                          swizzle=True),
        "fp8_block_1d": lambda: B.fp8_block_quantize(
            x, fp8_dtype=DType.E4M3, block_scaling_dim=1, force_pow_2_scales=True,
            amax_epsilon=0.0, rowwise=True, columnwise=True),
        "fp8_block_2d": lambda: B.fp8_block_quantize(
            x, fp8_dtype=DType.E4M3, block_scaling_dim=2, force_pow_2_scales=True,
            amax_epsilon=0.0, rowwise=True, columnwise=True),
        "fp8_block_rows": lambda: B.fp8_block_quantize(
            x, fp8_dtype=DType.E4M3, block_scaling_dim=1, force_pow_2_scales=True,
            amax_epsilon=0.0, rowwise=True, columnwise=True, rows=rows),
        "mxfp8_values": lambda: B.mxfp8_quantize_decoded(
            x, fp8_dtype=DType.E4M3, rowwise=True, columnwise=True, with_2d_quantization=False,
            dtype=torch.bfloat16, rows=rows),
        "mxfp8_values_2d": lambda: B.mxfp8_quantize_decoded(
            x, fp8_dtype=DType.E4M3, rowwise=True, columnwise=True, with_2d_quantization=True,
            dtype=torch.bfloat16, rows=rows),
        "nvfp4_amax_rht": lambda: B.nvfp4_amax(x, rowwise=True, columnwise=True, with_rht=True,
                                               rht_sign_mask=0xD7E8),
        "nvfp4_rht": lambda: B.nvfp4_quantize(
            x, one, one, rowwise=True, columnwise=True, with_rht=True, rht_sign_mask=0xD7E8,
            with_2d_quantization=False, stochastic_rounding=False, rng_seed=None, swizzle=True),
    }
    bad = 0
    for name, call in calls.items():
        launches.clear()
        call()
        for kernel, _, args, kwargs in launches:
            names = [p.name for p in kernel.params]
            bound = {k: v for k, v in (dict(zip(names, args, strict=False)) | kwargs).items()
                     if k in names}
            read_only = {t.untyped_storage().data_ptr() for t in (x, rows)}
            inputs = {k for k, v in bound.items() if isinstance(v, torch.Tensor)
                      and v.untyped_storage().data_ptr() in read_only}
            writes = writes_of(kernel, bound)
            wrong = inputs & writes
            bad += bool(wrong)
            print(f"{'FAIL' if wrong else 'ok  '} {name:15s} {kernel.__name__:24s} "
                  f"writes {sorted(writes)}" + (f" INCLUDING THE INPUT {sorted(wrong)}"
                                               if wrong else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
