"""Elementwise access to the shared rounding helpers, for tests and exhaustive GPU sweeps.

``encode(v, rule)`` applies one helper of ``_rounding`` to every fp32 element of ``v`` and returns
int32 codes: ``"e4m3"``/``"e5m2"`` (FP8 RNE satfinite byte), ``"e8m0"`` (round-up byte), ``"e2m1"``
(RNE code), ``"div_rn"`` (bits of ``div_rn(1, v)``), ``"bf16"`` (bits of the bf16-rounded value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting
from ._rounding import bf16_rne, e2m1_rne, e8m0_roundup, f32_bits, fp8_rne_sat

RULES = ("e4m3", "e5m2", "e8m0", "e2m1", "div_rn", "bf16")


@triton.jit
def _encode_kernel(v_ptr, out_ptr, n, RULE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if RULE == 0:
        c = fp8_rne_sat(v, True)
    elif RULE == 1:
        c = fp8_rne_sat(v, False)
    elif RULE == 2:
        c = e8m0_roundup(v)
    elif RULE == 3:
        c = e2m1_rne(v)
    elif RULE == 4:
        c = f32_bits(tl.math.div_rn(1.0, v))
    else:
        c = f32_bits(bf16_rne(v))
    tl.store(out_ptr + offs, c, mask=mask)


def encode(v: torch.Tensor, rule: str) -> torch.Tensor:
    """int32 codes of fp32 ``v`` (1D, contiguous) under ``rule`` (one of ``RULES``)."""
    out = torch.empty(v.shape, dtype=torch.int32, device=v.device)
    n = v.numel()
    if n:
        block = 4096 if interpreting() else 2048
        kw = {} if interpreting() else {"num_warps": 8}
        _encode_kernel[(triton.cdiv(n, block),)](v, out, n, RULE=RULES.index(rule), BLOCK=block,
                                                 **kw)
    return out
