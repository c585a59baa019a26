"""Per-tensor FP8 kernels: the current-scaling scale, the cast (rowwise and/or transposed,
optional delayed-scaling amax accumulation, or the scale derived from amax partials) and
dequantization (`numerics.md` §2–§4, §8). The amax passes live in :mod:`._amax`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.dtypes import DType, check_fp8
from quant_core.inputs import check_input_dtype, check_output_dtype
from quant_core.shapes import ceil_div

from ._amax import amax, amax_partials
from ._common import fp8_data, launch, out_code
from ._rounding import (
    FLT_MAX,
    abs_for_max,
    f32_bits,
    fp8_decode,
    fp8_rne_sat,
    fp8_rne_sat_t,
    nan_to_0,
    scale_from_amax,
    to_out,
    widen,
)
from .configs import launch_config


@triton.jit
def _current_scale_kernel(amax_ptr, out_ptr, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """The current-scaling encode scale of an amax (:func:`current_scale`).

    amax_ptr: fp32 amax ``(1,)``.
    out_ptr: fp32 encode scale ``(1,)``, written.
    eps: ``amax_epsilon``, the floor of the amax.
    FP8_MAX: largest finite value of the FP8 format (448 for E4M3, 57344 for E5M2).
    POW2: floor the scale to a power of two (``force_pow_2_scales``).
    """
    tl.store(out_ptr, scale_from_amax(tl.load(amax_ptr), eps, FP8_MAX, POW2, FLT_MAX))


def current_scale(
    amax: torch.Tensor, *, fp8_dtype: DType, force_pow_2_scales: bool, amax_epsilon: float
) -> torch.Tensor:
    """Current-scaling encode scale, fp32 ``(1,)`` (§3 step 3), in one tiny launch. Mirrors
    ``reference.current_scale``."""
    check_fp8(fp8_dtype, "fp8_dtype")
    out = torch.empty(1, dtype=torch.float32, device=amax.device)
    launch(_current_scale_kernel, (1,), amax.to(torch.float32).reshape(1), out,
           float(amax_epsilon), FP8_MAX=fp8_dtype.max, POW2=bool(force_pow_2_scales))
    return out


@triton.jit
def _fp8_cast_kernel(
    x_ptr, scale_ptr, data_ptr, t_ptr, scale_inv_ptr, amax_bits_ptr, M, K, n_parts, eps,
    ROW: tl.constexpr, COL: tl.constexpr, AMAX: tl.constexpr, IS_E4M3: tl.constexpr,
    PARTS: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr,
):
    """One ``[BM, BK]`` tile of the per-tensor cast (:func:`_cast`).

    x_ptr: input x ``[M, K]``, contiguous (fp32, bf16 or fp16).
    scale_ptr: fp32 encode scale ``(1,)``; with ``PARTS > 0`` the ``n_parts`` fp32 amax partials.
    data_ptr: FP8 rowwise data ``[M, K]`` (uint8 or torch FP8: ``fp8_data``), written when
        ``ROW`` (else a dummy).
    t_ptr: FP8 transposed data ``[K, M]`` (uint8 or torch FP8), written when ``COL`` (else a
        dummy).
    scale_inv_ptr: fp32 ``(1,)``, ``div_rn(1, scale)``, written by program (0, 0).
    amax_bits_ptr: fp32 amax ``(1,)`` as int32, atomic max of ``max|x|`` when ``AMAX``.
    M: rows of x.
    K: columns of x.
    n_parts: number of amax partials at ``scale_ptr`` (0 without current scaling).
    eps: ``amax_epsilon`` of current scaling (0.0 otherwise).
    ROW: write the rowwise data.
    COL: write the transposed data.
    AMAX: accumulate the delayed-scaling amax into ``amax_bits_ptr``.
    IS_E4M3: E4M3 data, else E5M2.
    PARTS: power of two >= ``n_parts`` (the partials' load width); 0: ``scale_ptr`` is the scale.
    FP8_MAX: largest finite value of the FP8 format, for the derived scale.
    POW2: derived scale floored to a power of two (``force_pow_2_scales``).
    BM: tile rows.
    BK: tile columns.
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mask, other=0.0)
    if PARTS > 0:  # current scaling: the scale of the amax partials at scale_ptr (§3 step 3)
        i = tl.arange(0, PARTS)
        parts = tl.load(scale_ptr + i, mask=i < n_parts, other=0.0)
        amax = tl.max(parts, axis=0)
        # a NaN among them (a given amax; x's own partials drop NaN) is kept, as the
        # reference's amax < eps keeps it: tl.max would drop it
        amax = tl.where(tl.sum((parts != parts).to(tl.int32), axis=0) > 0, float("nan"), amax)
        s = scale_from_amax(amax, eps, FP8_MAX, POW2, FLT_MAX)
    else:
        s = tl.load(scale_ptr)
    v = widen(x) * s
    if ROW:
        tl.store(data_ptr + rm[:, None] * K + rk[None, :],
                 fp8_rne_sat(v, IS_E4M3).to(data_ptr.dtype.element_ty, bitcast=True), mask=mask)
    if COL:
        tl.store(t_ptr + rk[:, None].to(tl.int64) * M + rm[None, :],
                 tl.trans(fp8_rne_sat_t(v, IS_E4M3)).to(t_ptr.dtype.element_ty, bitcast=True),
                 mask=tl.trans(mask))
    if AMAX:
        tl.atomic_max(amax_bits_ptr,
                      f32_bits(nan_to_0(tl.max(tl.max(abs_for_max(x), axis=1), axis=0))))
    if (pid_m == 0) & (pid_k == 0):
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, s))


def _cast(x, scale_or_parts, fp8_dtype: DType, rowwise: bool, columnwise: bool, amax_out=None,
          current: dict | None = None):
    """The cast kernel's launch: with ``current`` (``force_pow_2_scales``, ``amax_epsilon``)
    ``scale_or_parts`` holds amax partials and every program derives the scale from them."""
    m, k = x.shape
    dev = x.device
    data_arg, data = fp8_data((m, k), fp8_dtype, dev) if rowwise else (None, None)
    trans_arg, trans = fp8_data((k, m), fp8_dtype, dev) if columnwise else (None, None)
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    cfg, kw = launch_config("fp8_cast")
    grid = (ceil_div(m, cfg["BM"]), ceil_div(k, cfg["BK"]))
    n_parts = scale_or_parts.numel() if current else 0
    dummy = scale_inv
    launch(
        _fp8_cast_kernel, grid,
        x, scale_or_parts, data_arg if rowwise else dummy, trans_arg if columnwise else dummy,
        scale_inv,
        amax_out.view(torch.int32) if amax_out is not None else dummy, m, k, n_parts,
        float(current["amax_epsilon"]) if current else 0.0,
        ROW=rowwise, COL=columnwise, AMAX=amax_out is not None,
        IS_E4M3=fp8_dtype == DType.E4M3,
        PARTS=1 << (max(n_parts, 16) - 1).bit_length() if current else 0,  # next power of 2
        FP8_MAX=fp8_dtype.max, POW2=bool(current and current["force_pow_2_scales"]),
        **kw,
    )
    return data, trans, scale_inv


def fp8_quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_dtype: DType,
    rowwise: bool,
    columnwise: bool,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """One pass: ``fp8_satfinite_rne(fp32(x * scale))`` into ``data [M, K]`` and/or the byte
    transpose ``[K, M]``, ``scale_inv = div_rn(1, scale)``, and (delayed scaling) an atomic max of
    ``max|x|`` into ``amax_out`` on its fp32 bits. Mirrors ``reference.fp8_quantize``."""
    check_input_dtype(x, "fp8_quantize")
    check_fp8(fp8_dtype, "fp8_dtype")
    m, k = x.shape
    scale = scale.to(torch.float32).reshape(1).contiguous()
    if m == 0 or k == 0:
        dev = x.device
        data = torch.empty((m, k), dtype=torch.uint8, device=dev) if rowwise else None
        trans = torch.empty((k, m), dtype=torch.uint8, device=dev) if columnwise else None
        scale_inv = (1.0 / scale.double()).float()  # fp64 then one rounding: div_rn
        return data, trans, scale_inv
    return _cast(x, scale, fp8_dtype, rowwise, columnwise, amax_out)


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
    """Current scaling in two launches: per-program amax partials, then the cast, each of whose
    programs takes the max of the partials and derives the scale itself (§3 step 3), instead of
    zeroing an amax, an atomic amax pass, a scale launch and the cast. With ``amax_in`` (fp32
    ``(1,)``) the cast alone, reading it as its one partial. Mirrors
    ``reference.fp8_current_quantize``."""
    check_input_dtype(x, "fp8_current_quantize")
    check_fp8(fp8_dtype, "fp8_dtype")
    if x.numel() == 0:  # amax 0 -> scale 1 (§3): the unfused steps, nothing to read
        scale = current_scale(amax(x) if amax_in is None else amax_in, fp8_dtype=fp8_dtype,
                              force_pow_2_scales=force_pow_2_scales, amax_epsilon=amax_epsilon)
        return fp8_quantize(x, scale, fp8_dtype=fp8_dtype, rowwise=rowwise,
                            columnwise=columnwise)
    current = {"force_pow_2_scales": force_pow_2_scales, "amax_epsilon": amax_epsilon}
    parts = (amax_partials(x) if amax_in is None
             else amax_in.to(torch.float32).reshape(1).contiguous())
    return _cast(x, parts, fp8_dtype, rowwise, columnwise, current=current)


@triton.jit
def _fp8_dequant_kernel(
    d_ptr, scale_inv_ptr, out_ptr, n, IS_E4M3: tl.constexpr, OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``BLOCK`` elements of ``fp8(data) * scale_inv`` (:func:`fp8_dequantize`).

    d_ptr: uint8 FP8 data, ``n`` contiguous elements (any shape).
    scale_inv_ptr: fp32 decode scale ``(1,)``.
    out_ptr: output, ``n`` contiguous elements of the dtype ``OUT`` codes.
    n: element count.
    IS_E4M3: E4M3 data, else E5M2.
    OUT: output dtype code (``out_code``: 0 fp32, 1 bf16, 2 fp16).
    BLOCK: elements per program.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(d_ptr + offs, mask=mask, other=0)
    v = fp8_decode(b, IS_E4M3) * tl.load(scale_inv_ptr)
    tl.store(out_ptr + offs, to_out(v, OUT), mask=mask)


def fp8_dequantize(
    data: torch.Tensor, scale_inv: torch.Tensor, *, fp8_dtype: DType, dtype: torch.dtype
) -> torch.Tensor:
    """``float(fp8(data)) * scale_inv`` cast (RNE) to ``dtype``; any shape of ``data``."""
    check_output_dtype(dtype, "fp8_dequantize")
    check_fp8(fp8_dtype, "fp8_dtype")
    data = data.contiguous()
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    n = data.numel()
    if n:
        cfg, kw = launch_config("fp8_dequant")
        launch(
            _fp8_dequant_kernel, (ceil_div(n, cfg["BLOCK"]),),
            data.view(torch.uint8), scale_inv.to(torch.float32).reshape(1).contiguous(), out, n,
            IS_E4M3=fp8_dtype == DType.E4M3, OUT=out_code(dtype), **kw,
        )
    return out
