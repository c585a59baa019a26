"""Shared element encoders of the reference (one helper per rounding rule).

Only the FP8 cast rule (`numerics.md` §2) lives here; format-specific encoders (E8M0 round-up,
E2M1) live next to their format and reuse the bit helpers below.
"""

from __future__ import annotations

import torch

from ..dtypes import DType, check_fp8

#: The byte every FP8 NaN is written as (E4M3 and E5M2 alike: sign 0, all exponent and mantissa
#: bits set).
CANONICAL_NAN = 0x7F


def fp8_encode(v: torch.Tensor, fp8_dtype: DType) -> torch.Tensor:
    """``fp8_satfinite_rne(v)`` of fp32 ``v`` as raw uint8 bytes (§2): clamp to ±max, RNE cast.

    ``clamp`` keeps NaN and maps ±Inf to ±max, so clamp + torch's RNE cast equals the hardware's
    ``cvt.rn.satfinite``; the clamp is needed on every torch (pre-2.13 E4M3 casts give NaN above
    480, E5M2 casts overflow to Inf).
    """
    check_fp8(fp8_dtype, "fp8_dtype")
    if v.dtype != torch.float32:
        raise TypeError(f"fp8_encode expects fp32 values, got {v.dtype}")
    fmax = fp8_dtype.max
    data = v.clamp(-fmax, fmax).to(fp8_dtype.torch_dtype).view(torch.uint8)
    # NaN becomes the canonical positive NaN 0x7F: the sign of a NaN differs between CPU and CUDA
    # arithmetic, and one byte per NaN keeps every backend's buffers bytewise comparable.
    return torch.where(torch.isnan(v), torch.full_like(data, CANONICAL_NAN), data)


def fp8_decode(data: torch.Tensor, fp8_dtype: DType) -> torch.Tensor:
    """fp32 values of raw FP8 bytes."""
    check_fp8(fp8_dtype, "fp8_dtype")
    return data.view(fp8_dtype.torch_dtype).to(torch.float32)


def f32_bits(v: torch.Tensor) -> torch.Tensor:
    """The IEEE bits of fp32 ``v`` as int64 in ``[0, 2^32)``."""
    return v.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values whose IEEE bits are ``bits`` (int64 in ``[0, 2^32)``)."""
    b = bits & 0xFFFFFFFF
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.to(torch.int32).view(torch.float32)


def nan_to_zero_abs(x: torch.Tensor) -> torch.Tensor:
    """``|float(x)|`` with NaN mapped to 0, so maxima drop NaN as TE's ``fmaxf`` does (§10)."""
    a = x.to(torch.float32).abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)
