"""Helpers for tests, not used by the backend: elementwise access to the shared rounding helpers,
so that tests and exhaustive GPU sweeps check each rule of ``_rounding`` on its own.

``encode(v, rule)`` applies one helper of ``_rounding`` to every fp32 element of ``v`` and returns
int32 codes: ``"e4m3"``/``"e5m2"`` (software FP8 RNE satfinite byte), ``"e4m3_native"`` /
``"e5m2_native"`` (the hardware cast path; GPU only), ``"e8m0"`` (round-up byte), ``"e2m1"`` (RNE
code), ``"div_rn"`` (bits of ``div_rn(1, v)``), ``"bf16"`` / ``"bf16_native"`` (bits of the
bf16-rounded value, software / hardware cast; the latter GPU only), ``"pow2_scale_e4m3"`` /
``"pow2_scale_e5m2"`` (bits of the power-of-two scale from amax ``v``, eps 0, ``value_for_inf``
FLT_MAX), ``"pow2_inverse"`` (bits of ``1 / v`` for a power of two ``v``), ``"div_1536"`` /
``"div_2688"`` (bits of ``div_rn_by(v, D)``) and ``"e2m1_value"`` (bits of the value
``e2m1_rne_with_value`` gives with the code).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.shapes import ceil_div

from ._common import interpreting, launch
from ._rounding import (
    FLT_MAX,
    bf16_rne,
    div_rn_by,
    e2m1_rne,
    e2m1_rne_with_value,
    e8m0_roundup,
    f32_bits,
    fp8_native,
    fp8_soft,
    scale_from_amax,
    scale_inverse,
)

RULES = ("e4m3", "e5m2", "e8m0", "e2m1", "div_rn", "bf16", "e4m3_native", "e5m2_native",
         "bf16_native", "pow2_scale_e4m3", "pow2_scale_e5m2", "pow2_inverse", "div_1536",
         "div_2688", "e2m1_value")


@triton.jit
def _encode_kernel(v_ptr, out_ptr, n, RULE: tl.constexpr, BLOCK: tl.constexpr):
    """``BLOCK`` codes of :func:`encode`.

    v_ptr: fp32 input, ``n`` contiguous elements.
    out_ptr: int32 codes, ``n`` contiguous elements.
    n: element count.
    RULE: index of the rule in ``RULES``.
    BLOCK: elements per program.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if RULE == 0:
        c = fp8_soft(v, True).to(tl.int32)
    elif RULE == 1:
        c = fp8_soft(v, False).to(tl.int32)
    elif RULE == 2:
        c = e8m0_roundup(v)
    elif RULE == 3:
        c = e2m1_rne(v)
    elif RULE == 4:
        c = f32_bits(tl.math.div_rn(1.0, v))
    elif RULE == 5:
        c = f32_bits(bf16_rne(v))
    elif RULE == 6:
        c = fp8_native(v, True).to(tl.int32)
    elif RULE == 7:
        c = fp8_native(v, False).to(tl.int32)
    elif RULE == 8:
        c = f32_bits(v.to(tl.bfloat16).to(tl.float32))
    elif RULE == 9:
        c = f32_bits(scale_from_amax(v, 0.0, 448.0, True, FLT_MAX))
    elif RULE == 10:
        c = f32_bits(scale_from_amax(v, 0.0, 57344.0, True, FLT_MAX))
    elif RULE == 11:
        c = f32_bits(scale_inverse(v, True))
    elif RULE == 12:
        c = f32_bits(div_rn_by(v, 1536.0))
    elif RULE == 13:
        c = f32_bits(div_rn_by(v, 2688.0))
    else:
        _, value = e2m1_rne_with_value(v)
        c = f32_bits(value)
    tl.store(out_ptr + offs, c, mask=mask)


def encode(v: torch.Tensor, rule: str) -> torch.Tensor:
    """int32 codes of fp32 ``v`` (1D, contiguous) under ``rule`` (one of ``RULES``)."""
    if rule.endswith("_native") and interpreting():
        raise ValueError(f"rule {rule!r} needs a GPU (the interpreter's casts are wrong)")
    out = torch.empty(v.shape, dtype=torch.int32, device=v.device)
    n = v.numel()
    if n:
        block = 4096 if interpreting() else 2048
        kw = {} if interpreting() else {"num_warps": 8}
        launch(_encode_kernel, (ceil_div(n, block),), v, out, n, RULE=RULES.index(rule),
               BLOCK=block, **kw)
    return out
