"""No kernel leaves the GPU compiler a product it may fuse into a following add.

The reference's torch ops round every product and every sum on their own. A GPU compiler
contracts a multiply and a following add into one FMA, which rounds once: 4over6's MSE metric
then picks the other candidate on a near-tie block, an epilogue's bias lands on another value.
LLVM contracts into ``fma.rn.f32``; ptxas contracts a PTX ``mul.f32`` (no rounding modifier) that
feeds an ``add.f32`` / ``sub.f32``, even through a register move. So the PTX of every kernel
must hold no such pair (a product that an add reads is an inline ``mul.rn.f32``,
``_rounding.mul_rn``), and ``fma.rn.f32`` only where the source asks for one (``tl.fma``: the
4over6 kernels' division, ``_rounding.div_rn_by``). The fused GEMM mainloops are left out: a
GEMM may differ from the reference by its accumulation order.

The check records each launch of the backend's quantize, dequantize, amax and GEMM-epilogue
functions (nothing runs), compiles it for sm_90 with Triton (no GPU needed; this module runs
itself in a subprocess without ``TRITON_INTERPRET``) and reads the PTX.
``python tests/kernels/test_kernel_contraction.py`` prints one line per kernel and exits 1 on
a contractible pair.
"""

from __future__ import annotations

import re
import sys

from _sm90 import run_as_script

#: Kernels whose source calls ``tl.fma``.
EXPLICIT_FMA = ("_nvfp4_4over6_row_kernel", "_nvfp4_4over6_col_kernel")


def test_no_kernel_leaves_a_contractible_product():
    run_as_script(__file__, min_ok=20)


def contractible(ptx: str) -> list[str]:
    """``mul.f32`` results (followed through register copies) that an ``add.f32`` /
    ``sub.f32`` reads: the pairs ptxas may fuse."""
    products: dict[str, str] = {}
    pairs = []
    for line in ptx.splitlines():
        if m := re.match(r"\s*mul\.f32\s+(%\w+),", line):
            products[m.group(1)] = line.strip()
        elif ((m := re.match(r"\s*mov\.[bf]32\s+(%\w+),\s*(%\w+);", line))
              and m.group(2) in products):
            products[m.group(1)] = products[m.group(2)]
        elif m := re.match(r"\s*(?:add|sub)\.f32\s+%\w+,\s*(\S+),\s*(\S+);", line):
            pairs += [f"{products[r]} -> {line.strip()}" for r in m.groups() if r in products]
    return pairs


def _calls(x, one):
    import torch
    from quant_core import DType
    from quant_kernels import dequant_gemm, fp8_grouped
    from quant_kernels.backend import BACKEND as B

    e4 = DType.E4M3
    nv = dict(with_rht=False, rht_sign_mask=0xD7E8, with_2d_quantization=False,
              stochastic_rounding=False, rng_seed=None, swizzle=True)
    n = x.shape[0]
    rows = torch.ones(n)
    fp8 = torch.zeros(n, n, dtype=torch.uint8)
    nvq = B.nvfp4_quantize(x, one, one, rowwise=True, columnwise=False, **nv)
    return {
        "fp8 current": lambda: B.fp8_current_quantize(
            x, fp8_dtype=e4, force_pow_2_scales=False, amax_epsilon=0.0, rowwise=True,
            columnwise=True),
        "fp8 delayed": lambda: B.fp8_quantize(x, one, fp8_dtype=e4, rowwise=True,
                                              columnwise=True, amax_out=one.clone()),
        "fp8 dequantize": lambda: B.fp8_dequantize(fp8, one, fp8_dtype=e4, dtype=x.dtype),
        "mxfp8": lambda: B.mxfp8_quantize(x, fp8_dtype=e4, rowwise=True, columnwise=True,
                                          with_2d_quantization=False, swizzle=True),
        "fp8 blocks 1x128": lambda: B.fp8_block_quantize(
            x, fp8_dtype=e4, block_scaling_dim=1, force_pow_2_scales=False, amax_epsilon=0.0,
            rowwise=True, columnwise=True),
        "fp8 blocks 128x128": lambda: B.fp8_block_quantize(
            x, fp8_dtype=e4, block_scaling_dim=2, force_pow_2_scales=False, amax_epsilon=0.0,
            rowwise=True, columnwise=True),
        "nvfp4": lambda: B.nvfp4_quantize(x, one, one, rowwise=True, columnwise=True, **nv),
        "nvfp4 rht": lambda: B.nvfp4_quantize(x, one, one, rowwise=True, columnwise=True,
                                              **dict(nv, with_rht=True)),
        "nvfp4 16x16": lambda: B.nvfp4_quantize(x, one, one, rowwise=True, columnwise=True,
                                                **dict(nv, with_2d_quantization=True)),
        "nvfp4 row-scaled": lambda: B.nvfp4_quantize(x, rows, None, rowwise=True,
                                                     columnwise=False,
                                                     **dict(nv, row_scaled=True)),
        "nvfp4 amax rht": lambda: B.nvfp4_amax(x, rowwise=True, columnwise=True,
                                               with_rht=True, rht_sign_mask=0xD7E8),
        "nvfp4 dequantize": lambda: B.nvfp4_dequantize(nvq[0], nvq[1], one, swizzled=True,
                                                       dtype=x.dtype),
        "4over6 MSE": lambda: B.nvfp4_quantize(
            x, one, one, rowwise=True, columnwise=True, **nv, four_over_six=True,
            e4m3_max=256, err_mode="MSE"),
        "4over6 MSE 16x16": lambda: B.nvfp4_quantize(
            x, one, one, rowwise=True, columnwise=True, **dict(nv, with_2d_quantization=True),
            four_over_six=True, e4m3_max=448, err_mode="MSE"),
        "nvfp4 GEMM epilogue": lambda: dequant_gemm._finish(
            torch.zeros(n, n), torch.ones(n), x.dtype, one, rows),
        "grouped fp8": lambda: fp8_grouped.fp8_group_quantize(
            x, one, fp8_dtype=e4, force_pow_2_scales=False, amax_epsilon=0.0, rowwise=True,
            columnwise=True, group_rows=128),
    }


def main() -> int:
    import torch
    from _sm90 import fake_target, record_launches

    fake_target()
    launches = record_launches()
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    bad = 0
    for name, call in _calls(x, torch.ones(1)).items():
        launches.clear()
        call()
        for kernel, grid, args, kwargs in launches:
            ptx = kernel.warmup(*args, grid=grid, **kwargs).asm["ptx"]
            pairs = contractible(ptx)
            explicit = kernel.fn.__name__ in EXPLICIT_FMA
            fmas = 0 if explicit else ptx.count("fma.rn.f32")
            wrong = bool(pairs or fmas)
            bad += wrong
            print(f"{'FAIL' if wrong else 'ok  '} {name:20s} {kernel.fn.__name__:28s} "
                  f"{len(pairs)} contractible products, "
                  + ("FMAs from tl.fma" if explicit else f"{fmas} compiler FMAs"))
            for pair in pairs[:3]:
                print(f"      {pair}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
