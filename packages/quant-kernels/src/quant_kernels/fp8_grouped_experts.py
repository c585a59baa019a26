"""Per-expert FP8 current scaling of small experts in one launch that reads each weight from
memory once (``fp8_group_quantize_experts`` without given amaxes).

The two-pass form (:mod:`.fp8_grouped`: every expert's amax, then the cast) reads every weight
twice from memory: by the time the cast starts, the amax pass has streamed all experts through
the cache. Here program ``e * tiles + t`` max-reduces tile ``t`` of expert ``e`` into ``e``'s
amax (one atomic max) and counts its arrival, then waits until all of expert ``e - 1``'s tiles
have arrived and casts tile ``t`` of expert ``e - 1`` with that expert's finished amax. The cast
reads a tile read ``tiles`` programs earlier, which the L2 cache mostly still holds where two
experts fit in it (:data:`ONE_PASS_EXPERT_BYTES`). The amax is the same maximum and the cast the
same arithmetic as the two-pass kernels': the bytes are theirs.

A program waits only for programs of lower index, which the GPU starts first, so the launch
needs none of its programs resident together and makes progress beside other streams' kernels.
Should the wait pass ``spin`` polls all the same, the program computes the expert's amax itself
from all its tiles (the same maximum): the launch finishes whatever the order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.dtypes import DType
from quant_core.inputs import check_input_dtype, given_group_amax
from quant_core.shapes import ceil_div

from ._common import fp8_data, interpreting, launch
from ._layout import group_transposed_offsets
from ._rounding import (
    FLT_MAX,
    abs_for_max,
    f32_bits,
    f32_from_bits,
    nan_to_0,
    scale_from_amax,
    widen,
)
from .configs import launch_config
from .fp8_grouped import (
    group_amax,
    group_scale_inv,
    quantized_with_scale_inv,
    store_fp8_tile,
    store_scale_inv_of,
)

#: The largest expert (bytes of one expert's weight) cast in one pass: the two experts in flight
#: stay within an H100's or H200's 50 MiB L2 cache. Larger experts take the two passes.
ONE_PASS_EXPERT_BYTES = 12 << 20

#: Polls of an arrival count before a program computes the expert's amax itself (GPU): a
#: bound the launch never meets while the GPU starts programs in index order.
SPIN_POLLS = 1 << 16


@triton.jit
def _expert_tile(w_ptr, e, t, N, K, tiles_k, BM: tl.constexpr, BK: tl.constexpr):
    """Tile ``t`` of expert ``e`` of ``w [E * N, K]``: ``(x [BM, BK], rows within the expert,
    columns, row mask, column mask)``."""
    rn = ((t // tiles_k) * BM + tl.arange(0, BM)).to(tl.int64)
    rk = (t % tiles_k) * BK + tl.arange(0, BK)
    nmask = rn < N
    kmask = rk < K
    x = tl.load(w_ptr + (e * N + rn)[:, None] * K + rk[None, :],
                mask=nmask[:, None] & kmask[None, :], other=0.0)
    return x, rn, rk, nmask, kmask


@triton.jit
def _expert_max(w_ptr, e, tiles, N, K, tiles_k, BM: tl.constexpr, BK: tl.constexpr):
    """NaN-dropping ``max|w|`` of expert ``e``'s ``tiles`` tiles: an elementwise running max,
    reduced once."""
    acc = tl.zeros([BM, BK], tl.float32)
    t = tl.full((), 0, tl.int32)
    while t < tiles:  # a while loop: the interpreter cannot iterate range() of a runtime int
        x, _, _, _, _ = _expert_tile(w_ptr, e, t, N, K, tiles_k, BM, BK)
        acc = tl.maximum(acc, abs_for_max(x))
        t += 1
    return nan_to_0(tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _all_arrived(arrived_ptr, e, count, spin):
    """Poll expert ``e``'s arrival count until it reaches ``count`` or ``spin`` polls passed;
    whether it reached it. Each poll is an atomic read, whose one result every thread of the
    program sees (the fallback's reduction needs the whole program on one branch), and which
    orders the maxima added before the arrivals seen."""
    seen = tl.atomic_add(arrived_ptr + e, 0)
    polls = 0
    while (seen < count) & (polls < spin):
        seen = tl.atomic_add(arrived_ptr + e, 0)
        polls += 1
    return seen >= count


@triton.jit
def _expert_cast_kernel(
    w_ptr, amax_bits_ptr, arrived_ptr, data_ptr, t_ptr, sinv_ptr, E, N, K, eps, spin,
    ROW: tl.constexpr, COL: tl.constexpr, IS_E4M3: tl.constexpr, FP8_MAX: tl.constexpr,
    POW2: tl.constexpr, PITCH: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    """Program ``e * tiles + t`` (``(E + 1) * tiles`` programs): tile ``t``'s amax of
    expert ``e`` (``e < E``), then tile ``t``'s cast of expert ``e - 1`` (``e >= 1``).

    w_ptr: ``w [E * N, K]``, contiguous (fp32, bf16 or fp16); expert ``e`` is rows
        ``e * N ... (e + 1) * N``.
    amax_bits_ptr: int32 ``[E]``, zeros: each expert's fp32 amax bits, max-accumulated.
    arrived_ptr: int32 ``[E]``, zeros: the tiles of each expert whose amax is accumulated.
    data_ptr: FP8 rowwise bytes ``[E * N, K]`` (``ROW``).
    t_ptr: FP8 transposed bytes, each expert's ``[K, N]``, experts end to end (``COL``).
    sinv_ptr: fp32 ``[E, PITCH]`` scale-inverses and amaxes (``PITCH`` > 0).
    spin: polls before a program computes a missing amax itself.
    """
    tiles_k = tl.cdiv(K, BK)
    tiles = tl.cdiv(N, BM) * tiles_k
    e = tl.program_id(0) // tiles
    t = tl.program_id(0) % tiles
    if e < E:
        x, _, _, _, _ = _expert_tile(w_ptr, e, t, N, K, tiles_k, BM, BK)
        tl.atomic_max(amax_bits_ptr + e, f32_bits(nan_to_0(tl.max(tl.max(abs_for_max(x),
                                                                            axis=1), axis=0))))
        tl.atomic_add(arrived_ptr + e, 1)
    if e >= 1:
        c = e - 1
        if _all_arrived(arrived_ptr, c, tiles, spin):
            amax = f32_from_bits(tl.atomic_max(amax_bits_ptr + c, 0))
        else:
            amax = _expert_max(w_ptr, c, tiles, N, K, tiles_k, BM, BK)
        a = tl.zeros([BM], tl.float32) + amax
        if PITCH > 0:
            if t == 0:
                store_scale_inv_of(a, sinv_ptr, c + tl.arange(0, BM), tl.arange(0, BM) == 0,
                                   eps, FP8_MAX, POW2, PITCH, BM)
        s = scale_from_amax(a, eps, FP8_MAX, POW2, FLT_MAX)
        x, rn, rk, nmask, kmask = _expert_tile(w_ptr, c, t, N, K, tiles_k, BM, BK)
        store_fp8_tile(widen(x) * s[:, None], data_ptr, t_ptr,
                       (c * N + rn)[:, None] * K + rk[None, :],
                       group_transposed_offsets(c, rk, rn, K, N),
                       nmask[:, None] & kmask[None, :], kmask[:, None] & nmask[None, :],
                       ROW, COL, IS_E4M3)


def _one_pass(w: torch.Tensor, groups: int) -> bool:
    """Whether ``w [E * N, K]``'s experts are cast in one pass: experts of at most
    :data:`ONE_PASS_EXPERT_BYTES`, with elements."""
    return w.numel() > 0 and w.numel() * w.element_size() <= groups * ONE_PASS_EXPERT_BYTES


def _quantized_in_one_pass(w: torch.Tensor, groups: int, fp8_dtype: DType,
                           force_pow_2_scales: bool, amax_epsilon: float, rowwise: bool,
                           columnwise: bool, scale_pitch: int):
    """:func:`fp8_group_quantize_experts` of ``w [E * N, K]`` (contiguous, :func:`_one_pass`)
    in one launch of :func:`_expert_cast_kernel`."""
    e, k = groups, w.shape[1]
    n = w.shape[0] // e
    dev = w.device
    data_arg, data = fp8_data((e * n, k), fp8_dtype, dev) if rowwise else (None, None)
    t_arg, trans = fp8_data((e, k, n), fp8_dtype, dev) if columnwise else (None, None)
    sinv = torch.empty((e, scale_pitch), dtype=torch.float32, device=dev)
    counts = torch.zeros(2 * e, dtype=torch.int32, device=dev)  # amax bits, then arrivals
    cfg, kw = launch_config("fp8_expert_cast")
    tiles = ceil_div(n, cfg["BM"]) * ceil_div(k, cfg["BK"])
    launch(_expert_cast_kernel, ((e + 1) * tiles,), w, counts[:e], counts[e:],
           data_arg if rowwise else sinv, t_arg if columnwise else sinv, sinv, e, n, k,
           float(amax_epsilon), 0 if interpreting() else SPIN_POLLS, ROW=rowwise,
           COL=columnwise, IS_E4M3=fp8_dtype == DType.E4M3, FP8_MAX=fp8_dtype.max,
           POW2=bool(force_pow_2_scales), PITCH=scale_pitch, **kw)
    return data, trans, sinv


def fp8_group_quantize_experts(w: torch.Tensor, *, groups: int, fp8_dtype: DType,
                               force_pow_2_scales: bool, amax_epsilon: float, rowwise: bool,
                               columnwise: bool, scale_pitch: int = 1,
                               amax: torch.Tensor | None = None):
    """The backend contract's ``fp8_group_quantize_experts`` (``w [E * N, K]``, ``E =
    groups``): per-expert amaxes (unless ``amax`` is given), the cast and the scale-inverses.
    Without ``amax``, experts small enough are cast in one pass over ``w``
    (:func:`_expert_cast_kernel`); the others, and given amaxes, take the amax pass
    (:func:`~quant_kernels.fp8_grouped.group_amax`) and the cast apart."""
    check_input_dtype(w, "fp8_group_quantize_experts")
    n = w.shape[0] // groups if groups else 0
    if amax is None and n and _one_pass(w, groups):
        return _quantized_in_one_pass(w, groups, fp8_dtype, force_pow_2_scales, amax_epsilon,
                                      rowwise, columnwise, scale_pitch)
    amax = (group_amax(w, groups, None, group_rows=n) if amax is None
            else given_group_amax(amax, groups, w.device, "fp8_group_quantize_experts"))
    if n == 0:  # experts without rows: nothing to cast (and no row count marks the layout)
        k = w.shape[1]
        data = fp8_data((0, k), fp8_dtype, w.device)[1] if rowwise else None
        trans = fp8_data((groups, k, 0), fp8_dtype, w.device)[1] if columnwise else None
        return data, trans, group_scale_inv(amax, fp8_dtype, force_pow_2_scales, amax_epsilon,
                                            scale_pitch)
    return quantized_with_scale_inv(w, amax, fp8_dtype, force_pow_2_scales, amax_epsilon,
                                    scale_pitch, rowwise=rowwise, columnwise=columnwise,
                                    group_rows=n)
