"""Per-tensor FP8: current and delayed scaling (`numerics.md` §2–§4, §8, §10)."""

from __future__ import annotations

import threading

import torch

from ..constants import FLT_MAX  # the value_for_inf of current scaling (also imported from here)
from ..dtypes import DType, check_fp8
from ..inputs import check_input_dtype, check_output_dtype
from ._rounding import (
    compute_scale_from_amax,
    div_rn,
    fp8_decode,
    fp8_encode,
    nan_to_zero_abs,
    to_fp32,
)


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` of the whole tensor as fp32 ``(1,)``; NaN dropped, 0 for an empty tensor."""
    check_input_dtype(x, "amax")
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    return nan_to_zero_abs(x).amax().reshape(1)  # >= 0: NaN became 0


#: One read-modify-write of a shared amax at a time: threads running one module record into
#: the same delayed-scaling amax, and two unguarded updates can lose one of them.
_AMAX_LOCK = threading.Lock()


def accumulate_amax(amax_out: torch.Tensor, value: torch.Tensor) -> None:
    """``amax_out = max(amax_out, value)`` in place, atomically across threads (the Triton
    kernels do it with an atomic max)."""
    value = value.to(amax_out.device).reshape(amax_out.shape)
    with _AMAX_LOCK:
        amax_out.copy_(torch.maximum(amax_out, value))


def current_scale(
    amax: torch.Tensor, *, fp8_dtype: DType, force_pow_2_scales: bool, amax_epsilon: float
) -> torch.Tensor:
    """Current-scaling encode scale, fp32 ``(1,)``, with ``value_for_inf = FLT_MAX`` (§3)."""
    check_fp8(fp8_dtype, "fp8_dtype")
    return compute_scale_from_amax(
        amax.reshape(1),
        fp8_dtype.max,
        force_pow_2_scales=force_pow_2_scales,
        amax_epsilon=amax_epsilon,
        value_for_inf=FLT_MAX,
    )


def fp8_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_dtype: DType,
    rowwise: bool,
    columnwise: bool,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor FP8 cast of ``x [M, K]`` with the fp32 ``(1,)`` encode ``scale`` (§2, §4).

    Returns ``(data [M, K] | None, transpose [K, M] | None, scale_inv fp32 (1,))`` with
    ``data = fp8_satfinite_rne(fp32(float(x) * scale))`` as raw bytes, its byte transpose, and
    ``scale_inv = fp32(1 / scale)``. When ``amax_out`` (fp32 ``(1,)``) is given, ``max|x|`` is
    max-accumulated into it in place (delayed scaling).
    """
    check_input_dtype(x, "fp8_quantize")
    check_fp8(fp8_dtype, "fp8_dtype")
    scale = scale.to(torch.float32).reshape(1)
    wide = to_fp32(x)
    data = fp8_encode(wide * scale, fp8_dtype) if rowwise else None
    scale_inv = div_rn(torch.ones_like(scale), scale)
    if amax_out is not None:
        accumulate_amax(amax_out, amax(x))
    transpose = None
    if columnwise:
        # the byte transpose of the rowwise data; alone, the cast of the transposed input (the
        # same bytes), which a compiled graph cannot merge with a rowwise cast of ``x`` made
        # elsewhere: a backward that quantizes the weight again then really does so
        transpose = (data.t().contiguous() if rowwise
                     else fp8_encode(wide.t() * scale, fp8_dtype).contiguous())
    return (data if rowwise else None), transpose, scale_inv


def fp8_current_quantize(
    x: torch.Tensor,
    *,
    fp8_dtype: DType,
    force_pow_2_scales: bool,
    amax_epsilon: float,
    rowwise: bool,
    columnwise: bool,
    amax_in: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Current scaling in one call (§3, §4): ``amax(x)`` (or the given fp32 ``(1,)``
    ``amax_in``: an amax reduced over ranks, or one computed where ``x`` was made), its
    :func:`current_scale`, then :func:`fp8_quantize` with that scale; returns what
    :func:`fp8_quantize` returns. A backend may fuse the steps (the Triton one needs two launches
    instead of four, one with ``amax_in``)."""
    check_input_dtype(x, "fp8_current_quantize")
    scale = current_scale(amax(x) if amax_in is None else amax_in, fp8_dtype=fp8_dtype,
                          force_pow_2_scales=force_pow_2_scales, amax_epsilon=amax_epsilon)
    return fp8_quantize(x, scale, fp8_dtype=fp8_dtype, rowwise=rowwise, columnwise=columnwise)


def fp8_dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, *, fp8_dtype: DType, dtype: torch.dtype
) -> torch.Tensor:
    """``float(fp8(data)) * scale_inv`` in fp32, cast (RNE) to ``dtype``; any shape of ``data``."""
    check_output_dtype(dtype, "fp8_dequantize")
    return (fp8_decode(data, fp8_dtype) * scale_inv.to(torch.float32).reshape(())).to(dtype)
