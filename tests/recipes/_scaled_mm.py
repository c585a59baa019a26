"""cuBLAS's FP8 per-tensor GEMM (``torch._scaled_mm``) on the CPU, recording the accumulation each
call asks for: the probe of the tests that check which GEMMs accumulate fast."""

from __future__ import annotations

import contextlib

import torch
from quant_recipes import gemm_fast


@contextlib.contextmanager
def recorded_scaled_mm():
    """Within it, FP8 per-tensor GEMMs take the ``"scaled_mm"`` path on any device, through an
    emulation (the fp32 product of the FP8 values times both scales); yields the list of each
    call's ``use_fast_accum``, in call order."""
    calls: list[bool] = []

    def scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum=False):
        calls.append(use_fast_accum)
        out = (a.float() @ b.float()) * (scale_a * scale_b)
        return (out if bias is None else out + bias.float()).to(out_dtype)

    saved = gemm_fast.tensorwise_problem, torch._scaled_mm
    gemm_fast.tensorwise_problem, torch._scaled_mm = (lambda device: None), scaled_mm
    try:
        yield calls
    finally:
        gemm_fast.tensorwise_problem, torch._scaled_mm = saved
