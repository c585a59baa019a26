"""4over6's squared errors are rounded before they are summed, on the GPU too.

The MSE metric sums ``fp32(d * d)`` per block, each square rounded on its own as the reference's
torch ops round it. A GPU compiler contracts a multiply and a following add into one FMA, which
rounds once, and a near-tie block then picks the other candidate. ptxas contracts a ``mul.f32``
even through a register move, so the kernels square with an inline ``mul.rn.f32``
(``_rounding.mul_rn``), which PTX never contracts. The check compiles each 4over6 MSE launch for
sm_90 with Triton's own ptxas (no GPU needed; this module runs itself in a subprocess without
``TRITON_INTERPRET``) and finds no ``FFMA`` whose two factors are one register, ``d * d + err``.
``python tests/kernels/test_kernel_contraction.py`` prints one line per kernel and exits 1 on a
contracted square.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

#: ``FFMA Rd, Ra, Ra, Rc``: a square fused into an add.
SQUARE_FMA = re.compile(r"FFMA\s+R\d+,\s*-?(R\d+),\s*-?\1\s*,")


def test_no_squared_error_is_contracted():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok  ") >= 5, run.stdout


def main() -> int:
    import torch
    from _sm90 import fake_target, sass

    fake_target()
    from quant_kernels import nvfp4_4over6

    launches = []

    def record(kernel, grid, *args, **kwargs):
        launches.append((kernel, grid, args, kwargs))

    nvfp4_4over6.launch = record
    one = torch.ones(1)
    bad = 0
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(256, 256, dtype=dtype)
        for two_d in (False, True):
            launches.clear()
            nvfp4_4over6.nvfp4_4over6_quantize(
                x, one, one, rowwise=True, columnwise=True, with_2d_quantization=two_d,
                e4m3_max=256, err_mode="MSE", swizzle=False)
            if not two_d:
                nvfp4_4over6.nvfp4_4over6_quantize(
                    x, torch.ones(256), None, rowwise=True, columnwise=False,
                    with_2d_quantization=False, e4m3_max=448, err_mode="MSE", swizzle=False,
                    row_scaled=True)
            for kernel, grid, args, kwargs in launches:
                fused = len(SQUARE_FMA.findall(sass(kernel.warmup(*args, grid=grid, **kwargs))))
                bad += bool(fused)
                print(f"{'FAIL' if fused else 'ok  '} {str(dtype)[6:]:9s} 2d={two_d!s:5s} "
                      f"{kernel.fn.__name__:28s} {fused} squares fused into adds")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
