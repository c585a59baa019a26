"""The register-heavy quantize kernels compile for sm_90 without spilling to local memory.

NVFP4's 4over6 kernels hold each block's 16 elements and two candidates' errors per thread; with
a tile too large for its warps the compiler spills (a 1352-byte stack frame per thread at the
plain NVFP4 tile), and every spilled value goes through local memory. The check compiles each
launch for sm_90 with Triton's own ptxas (no GPU needed; this module runs itself in a subprocess
without ``TRITON_INTERPRET``) and reads the stack frame from the cubin. ``python
tests/kernels/test_kernel_registers.py`` prints one line per kernel and exits 1 on a spill.
"""

from __future__ import annotations

import sys

from _sm90 import run_as_script


def test_no_quantize_kernel_spills():
    run_as_script(__file__, min_ok=7)


def main() -> int:
    import torch
    from _sm90 import fake_target, record_launches, resource_usage

    fake_target()
    from quant_kernels import fp8_block, fp8_grouped, fp8_grouped_experts, nvfp4_4over6

    launches = record_launches()
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    one = torch.ones(1)
    common = dict(rowwise=True, columnwise=True, swizzle=True)
    from quant_core import DType

    calls = {
        "4over6 1x16 MAE": lambda: nvfp4_4over6.nvfp4_4over6_quantize(
            x, one, one, with_2d_quantization=False, e4m3_max=256, err_mode="MAE", **common),
        "4over6 16x16 MSE": lambda: nvfp4_4over6.nvfp4_4over6_quantize(
            x, one, one, with_2d_quantization=True, e4m3_max=448, err_mode="MSE", **common),
        "grouped fp8": lambda: fp8_grouped.fp8_group_quantize(
            x, one, fp8_dtype=DType.E4M3, force_pow_2_scales=False, amax_epsilon=0.0,
            rowwise=True, columnwise=True, src=torch.arange(256, dtype=torch.int32),
            grp=torch.zeros(256, dtype=torch.int32)),
        "grouped fp8 experts": lambda: fp8_grouped.fp8_group_quantize(
            x, one, fp8_dtype=DType.E4M3, force_pow_2_scales=False, amax_epsilon=0.0,
            rowwise=True, columnwise=True, group_rows=128),
        "grouped fp8 + scales": lambda: fp8_grouped.fp8_group_quantize(
            x, one, fp8_dtype=DType.E4M3, force_pow_2_scales=False, amax_epsilon=0.0,
            rowwise=True, columnwise=True, group_rows=128, scale_inv=torch.empty(1, 4)),
        "grouped amax": lambda: fp8_grouped.group_amax(x, 2, None, group_rows=128),
        "block 2D, col groups": lambda: fp8_block.fp8_block_quantize(
            x, fp8_dtype=DType.E4M3, block_scaling_dim=2, force_pow_2_scales=True,
            amax_epsilon=0.0, rowwise=False, columnwise=True, groups=2),
        "block 1D, col groups": lambda: fp8_block.fp8_block_quantize(
            x, fp8_dtype=DType.E4M3, block_scaling_dim=1, force_pow_2_scales=True,
            amax_epsilon=0.0, rowwise=True, columnwise=True, groups=2),
        "experts one pass": lambda: fp8_grouped_experts.fp8_group_quantize_experts(
            x, groups=2, fp8_dtype=DType.E4M3, force_pow_2_scales=False, amax_epsilon=0.0,
            rowwise=True, columnwise=True, scale_pitch=4),
    }
    bad = 0
    for name, call in calls.items():
        launches.clear()
        call()
        for kernel, grid, args, kwargs in launches:
            use = resource_usage(kernel.warmup(*args, grid=grid, **kwargs))
            spills = use.get("STACK", 0) > 0 or use.get("LOCAL", 0) > 0
            bad += spills
            print(f"{'FAIL' if spills else 'ok  '} {name:20s} {kernel.fn.__name__:28s} "
                  f"registers {use.get('REG')} stack {use.get('STACK')} bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
