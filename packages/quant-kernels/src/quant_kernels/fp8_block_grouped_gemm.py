"""Grouped FP8 GEMMs with FP8 block scales (1x128 / 128x128): every group of a
mixture-of-experts GEMM in one launch on FP8 tensor cores, the block scales applied in the main
loop (DeepGEMM's m-grouped contiguous layout: groups padded to whole blocks), the group bounds
read on the device.

The two shapes of :mod:`.fp8_grouped_gemm`, with block scales instead of per-group tensor
scales:

- :func:`fp8_block_grouped_rows_gemm` (forward and input gradient): ``a [R, K]`` with 1x128
  scales ``a_scale_inv [R, ceil(K/128)]``, ``b [E, N, K]`` with 128x128 scales ``b_scale_inv
  [E, ceil(N/128), ceil(K/128)]``;
- :func:`fp8_block_grouped_tokens_gemm` (weight gradient): ``a [M, R]``, ``b [N, R]`` with the
  tokens' 128x1 columnwise scales ``a_scale_inv [M, ceil(R/128)]``, ``b_scale_inv [N,
  ceil(R/128)]``, each group starting at a multiple of 128 columns.

Numerics: each ``BK``-wide slice of the contraction (``BK`` divides 128, so a slice lies in one
block) is multiplied on the tensor cores into a fresh fp32 tile, which is scaled by its row's
and column's block scale-inverses (``P * (sa * sb)``) and added to the fp32 accumulator; one RNE
cast at the end. With power-of-2 scales (the FP8 block recipes' default) every scaling is exact,
so the result differs from the reference (``quant_core.reference.grouped_gemm``: decoded to
fp32, multiplied in fp32) only in the order of the fp32 sums, plus Hopper's narrower
accumulation inside each slice's MMA (at most ``BK`` x 2^-14 of the sum of magnitudes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.dtypes import DType
from quant_core.shapes import FP8_BLOCK, ceil_div

from ._common import launch, out_code
from ._rounding import to_out
from .configs import launch_config
from .fp8_grouped_gemm import (
    _fp8_dot,
    _rows_program,
    _start,
    _tile_group,
    check_operands,
    descriptor_operands,
    device_descriptors_allowed,
    tma_addressable,
)

BLOCK: tl.constexpr = tl.constexpr(FP8_BLOCK)


@triton.jit
def _scaled_slice(a, b, acc, sa, sb, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, PROMOTE: tl.constexpr):
    """``acc + (a @ b) * (sa ⊗ sb)``: one slice's product in a fresh fp32 tile, scaled by the
    row scale-inverses ``sa [BM]`` and column scale-inverses ``sb [BN]``."""
    p = _fp8_dot(a, b, tl.zeros((BM, BN), dtype=tl.float32), A_E4M3, B_E4M3, PROMOTE)
    return acc + p * (sa[:, None] * sb[None, :])


@triton.jit
def _block_rows_kernel(a_desc, b_desc, sa_ptr, sb_ptr, offs_ptr, a_ends_ptr, c_ptr, N, K, E,
                       RT, R, s_ar, s_ac, s_bg, s_br, s_bc, A_E4M3: tl.constexpr,
                       B_E4M3: tl.constexpr, OUT: tl.constexpr, EP2: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       PROMOTE: tl.constexpr, COLS_FASTEST: tl.constexpr):
    """One ``[BM, BN]`` tile of one group's rows of :func:`fp8_block_grouped_rows_gemm`, the
    tiles loaded by the tensor memory accelerator (``a_desc`` over ``a [R, K]``, ``b_desc``
    over ``b [E·N, K]``; a tile may hold another group's rows or expert's columns, which reach
    only outputs the masked store leaves out). Scale-inverse of ``a``'s row ``r`` in block
    ``c``: ``sa_ptr[r·s_ar + c·s_ac]``; of ``b``'s expert ``g``, row ``n``:
    ``sb_ptr[g·s_bg + (n // 128)·s_br + c·s_bc]``."""
    rt, ct = _rows_program(RT, N, BN, COLS_FASTEST)
    g, t = _tile_group(offs_ptr, rt, E, BM, EP2)
    if g < E:
        out0 = _start(offs_ptr, g)
        rows = tl.load(offs_ptr + g).to(tl.int64) - out0
        local = t * BM + tl.arange(0, BM)
        a0 = _start(a_ends_ptr, g) + t * BM
        ar = a0 + tl.arange(0, BM)
        sa_rows = sa_ptr + tl.where(ar < R, ar, 0) * s_ar
        n0 = ct * BN
        rn = n0 + tl.arange(0, BN)
        sb_cols = sb_ptr + g * s_bg + (tl.where(rn < N, rn, 0) // BLOCK) * s_br
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([a0.to(tl.int32), k0])
            b = b_desc.load([g * N + n0, k0])
            c = k0 // BLOCK
            acc = _scaled_slice(a, b.T, acc, tl.load(sa_rows + c * s_ac),
                                tl.load(sb_cols + c * s_bc), A_E4M3, B_E4M3, BM, BN, PROMOTE)
        out_rows = out0 + local
        tl.store(c_ptr + out_rows[:, None] * N + rn[None, :], to_out(acc, OUT),
                 mask=(local < rows)[:, None] & (rn < N)[None, :])


@triton.jit
def _block_tokens_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, ends_ptr, c_ptr, M, N, R, s_ar, s_ac,
                         s_br, s_bc, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr,
                         OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, PROMOTE: tl.constexpr):
    """One ``[BM, BN]`` tile of group ``program_id(1)``'s product of
    :func:`fp8_block_grouped_tokens_gemm`, every slice loaded by the tensor memory accelerator
    from descriptors made on the device over the group's own columns (the hardware fills past
    the group's end with zeros). Scale-inverse of ``a``'s row ``m`` in the block of column
    ``j``: ``sa_ptr[m·s_ar + (j // 128)·s_ac]`` (``b`` likewise)."""
    g = tl.program_id(1)
    tiles_n = tl.cdiv(N, BN)
    m0 = (tl.program_id(0) // tiles_n) * BM
    n0 = (tl.program_id(0) % tiles_n) * BN
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    start = tl.multiple_of(_start(ends_ptr, g), 16)
    cols = tl.load(ends_ptr + g).to(tl.int32) - start.to(tl.int32)
    width = tl.maximum(cols, 1)  # a descriptor's dimensions are positive; none is loaded then
    a_desc = tl.make_tensor_descriptor(a_ptr + start, shape=[M, width], strides=[R, 1],
                                       block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr + start, shape=[N, width], strides=[R, 1],
                                       block_shape=[BN, BK])
    sa_rows = sa_ptr + tl.where(rm < M, rm, 0) * s_ar
    sb_rows = sb_ptr + tl.where(rn < N, rn, 0) * s_br
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, cols, BK):
        a = a_desc.load([m0, k0])
        b = b_desc.load([n0, k0])
        c = (start + k0) // BLOCK
        acc = _scaled_slice(a, b.T, acc, tl.load(sa_rows + c * s_ac),
                            tl.load(sb_rows + c * s_bc), A_E4M3, B_E4M3, BM, BN, PROMOTE)
    out = c_ptr + g.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, to_out(acc, OUT), mask=(rm < M)[:, None] & (rn < N)[None, :])


def _check_scales(name: str, device, *scales) -> None:
    """fp32 scale-inverses of the expected shapes on ``device``."""
    for arg, t, shape in scales:
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise TypeError(f"{name}: {arg} must be fp32 {shape} (one scale-inverse per block), "
                            f"got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name}: {arg} is on {t.device} but a on {device}")


def _addressable(name: str, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``operands``, checked to be TMA-addressable (the kernels load every tile by TMA)."""
    if not tma_addressable(operands):
        raise ValueError(f"{name}: every operand's base and row stride must be multiples of "
                         "16 bytes (rows of a multiple of 16 elements)")
    return operands


def _check_slices(name: str, cfg) -> None:
    if FP8_BLOCK % cfg["BK"]:
        raise ValueError(f"{name}: the tile config's BK ({cfg['BK']}) must divide {FP8_BLOCK}, "
                         "so that a slice of the contraction lies in one block")


def fp8_block_grouped_rows_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                                b_scale_inv: torch.Tensor, offs: torch.Tensor,
                                a_ends: torch.Tensor, *, total: int, a_dtype: DType,
                                b_dtype: DType, out_dtype: torch.dtype = torch.bfloat16
                                ) -> torch.Tensor:
    """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are group ``g``'s rows of ``a [R, K]``
    (from row ``a_ends[g-1]`` on) times ``b[g]ᵀ`` (``b [E, N, K]``), with 1x128 scales
    ``a_scale_inv [R, ceil(K/128)]`` and 128x128 scales ``b_scale_inv [E, ceil(N/128),
    ceil(K/128)]`` (fp32, any strides). Rows of ``a`` outside the groups are not read."""
    name = "fp8_block_grouped_rows_gemm"
    check_operands(name, a, b, (("offs", offs), ("a_ends", a_ends)), a_dtype, b_dtype,
                    out_dtype)
    if b.dim() != 3 or a.dim() != 2 or a.shape[1] != b.shape[2]:
        raise ValueError(f"{name}: a must be [R, K] and b [E, N, K] with the same K, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    (r, k), (experts, n) = a.shape, b.shape[:2]
    kb = ceil_div(k, FP8_BLOCK)
    _check_scales(name, a.device, ("a_scale_inv", a_scale_inv, (r, kb)),
                  ("b_scale_inv", b_scale_inv, (experts, ceil_div(n, FP8_BLOCK), kb)))
    if offs.shape[0] != experts or a_ends.shape[0] != experts:
        raise ValueError(f"{name}: offs and a_ends must have one entry per group ({experts}), "
                         f"got {tuple(offs.shape)} and {tuple(a_ends.shape)}")
    out = torch.empty((total, n), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg, kw = launch_config("fp8_block_grouped_rows_gemm")
    _check_slices(name, cfg)
    row_tiles = ceil_div(total, cfg["BM"]) + experts
    grid = (row_tiles * ceil_div(n, cfg["BN"]),)
    _, descs = descriptor_operands(_addressable(name, a, b.view(experts * n, k)),
                                   (a_dtype, b_dtype),
                                   ((cfg["BM"], cfg["BK"]), (cfg["BN"], cfg["BK"])))
    launch(
        _block_rows_kernel, grid, *descs, a_scale_inv, b_scale_inv, offs, a_ends, out, n, k,
        experts, row_tiles, r, a_scale_inv.stride(0), a_scale_inv.stride(1),
        b_scale_inv.stride(0), b_scale_inv.stride(1), b_scale_inv.stride(2),
        A_E4M3=a_dtype == DType.E4M3, B_E4M3=b_dtype == DType.E4M3, OUT=out_code(out_dtype),
        EP2=triton.next_power_of_2(experts), **kw)
    return out


def fp8_block_grouped_tokens_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                                  b_scale_inv: torch.Tensor, ends: torch.Tensor, *,
                                  a_dtype: DType, b_dtype: DType,
                                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out [E, M, N]``: group ``g``'s ``a[:, s:e] @ b[:, s:e]ᵀ`` over its columns ``s:e =
    ends[g-1]:ends[g]`` of ``a [M, R]`` and ``b [N, R]``, with the 128-column block scales
    ``a_scale_inv [M, ceil(R/128)]``, ``b_scale_inv [N, ceil(R/128)]`` (fp32, any strides); every
    group starts at a multiple of 128 columns. A group without columns gives zeros."""
    name = "fp8_block_grouped_tokens_gemm"
    check_operands(name, a, b, (("ends", ends),), a_dtype, b_dtype, out_dtype)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{name}: a must be [M, R] and b [N, R] with the same R, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    (m, r), n, experts = a.shape, b.shape[0], ends.shape[0]
    rb = ceil_div(r, FP8_BLOCK)
    _check_scales(name, a.device, ("a_scale_inv", a_scale_inv, (m, rb)),
                  ("b_scale_inv", b_scale_inv, (n, rb)))
    out = torch.empty((experts, m, n), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    cfg, kw = launch_config("fp8_block_grouped_tokens_gemm")
    _check_slices(name, cfg)
    grid = (ceil_div(m, cfg["BM"]) * ceil_div(n, cfg["BN"]), experts)
    views, _ = descriptor_operands(_addressable(name, a, b), (a_dtype, b_dtype),
                                   ((cfg["BM"], cfg["BK"]), (cfg["BN"], cfg["BK"])))
    if a.is_cuda:
        device_descriptors_allowed()
    launch(
        _block_tokens_kernel, grid, *views, a_scale_inv, b_scale_inv, ends, out, m, n, r,
        a_scale_inv.stride(0), a_scale_inv.stride(1), b_scale_inv.stride(0),
        b_scale_inv.stride(1), A_E4M3=a_dtype == DType.E4M3, B_E4M3=b_dtype == DType.E4M3,
        OUT=out_code(out_dtype), **kw)
    return out
