"""Where ``torch._grouped_mm`` runs: the bf16 GEMM (one or many groups) that the mixture-of-experts
routes and the dequantized block-scaled GEMMs multiply with. It accumulates in fp32 and rounds
each output once to bf16, with no split-K reduction in a narrower type, so its bf16 output is
the fp32 product rounded once, up to the accumulation order."""

from __future__ import annotations

import functools

import torch


@functools.cache
def grouped_mm_runs(device_type: str) -> bool:
    """``torch._grouped_mm`` exists and runs a small bf16 problem on this device type."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros((32, 16), dtype=torch.bfloat16, device=device_type)
        b = torch.zeros((2, 16, 16), dtype=torch.bfloat16, device=device_type)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device_type)
        torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True
