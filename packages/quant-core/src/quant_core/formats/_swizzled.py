"""What the formats whose scales can be GEMM-swizzled (128x4 tiles) refuse while swizzled."""

from __future__ import annotations

from ..tensor import QuantizedTensor


def split_refusal(t) -> str | None:
    """Why quantized tensor ``t`` cannot be split or concatenated along dim 0 (else None)."""
    if t._with_gemm_swizzled_scales:
        return "its scales are GEMM-swizzled in 128x4 tiles (quantize with optimize_for_gemm=False)"
    return QuantizedTensor._split_refusal(t)


def swizzled_shard_refusal(q) -> str | None:
    """Why a weight quantized by ``q`` does not all-gather along dim 0 for its scales' layout."""
    return "GEMM-swizzled scales do not concatenate along dim 0" if q.optimize_for_gemm else None
