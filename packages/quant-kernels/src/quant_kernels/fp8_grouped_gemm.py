"""Grouped FP8 GEMMs with per-group tensor scales: every group of a mixture-of-experts GEMM in
one launch, the group bounds read on the device (no host synchronization, so a step can be
captured in a CUDA graph). Any pair of E4M3 / E5M2 operands (TransformerEngine's HYBRID
backward multiplies E5M2 gradients by E4M3 inputs and weights).

Two GEMM shapes, both with the contraction along the contiguous dimension of both operands:

- :func:`fp8_grouped_rows_gemm` (forward and input gradient): ``out [T, N]``, rows
  ``offs[g-1]:offs[g]`` equal to group ``g``'s rows of ``a`` times ``b[g]ᵀ`` (``b [E, N, K]``),
  times ``a_scale_inv[g] * b_scale_inv[g]``. Group ``g``'s rows of ``a`` start at row
  ``a_ends[g-1]`` (``a_ends`` is ``offs`` when ``a`` holds the rows where they are, the padded
  ends when it holds them in a padded layout).
- :func:`fp8_grouped_tokens_gemm` (weight gradient): ``out [E, M, N]``, group ``g``'s product
  ``a[:, s:e] @ b[:, s:e]ᵀ`` of the transposed operands ``a [M, R]``, ``b [N, R]`` over its
  columns ``s:e = ends[g-1]:ends[g]`` (a group with none gives zeros).

Numerics: every FP8 product is exact; the sums are fp32, the tensor core's partial sum of each
``PROMOTE`` elements of the contraction (128, four MMA instructions, as DeepGEMM promotes)
added to the fp32 accumulator: Hopper's fast FP8 accumulation alone keeps too few bits over a
long contraction; then the reference's
``(P * a_scale_inv[g]) * b_scale_inv[g]`` and one RNE cast (``quant_core.reference.grouped_gemm``).
Under the interpreter the operands are decoded to fp32 and multiplied in fp32.

The kernels also take operands already decoded to exact values (bf16 on a GPU, fp32 under the
interpreter: the NVFP4 grouped GEMMs of :mod:`.nvfp4_grouped_gemm`), multiplied on the tensor
cores with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.dtypes import DType, check_fp8
from quant_core.kernel_capture import capturing
from quant_core.shapes import ceil_div
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import launch, out_code
from ._rounding import NATIVE_FP8, fp8_decode, to_out
from .configs import launch_config


@triton.jit
def _fp8_dot(a, b, acc, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr, PROMOTE: tl.constexpr):
    """``acc + a @ b`` of uint8 FP8 tiles: on the tensor cores, their partial sums added to the
    fp32 ``acc`` every ``PROMOTE`` elements of the contraction (0: after every MMA instruction;
    -1: Triton's default, Hopper's fast accumulation), or (interpreter) exactly decoded in
    fp32. Decoded tiles (bf16 or fp32; the FP8 flags unused) are multiplied as they are, fp32
    ones in IEEE fp32."""
    if a.dtype == tl.bfloat16:
        return tl.dot(a, b, acc)
    elif a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    elif NATIVE_FP8:
        av = _fp8_typed(a, A_E4M3)
        bv = _fp8_typed(b, B_E4M3)
        if PROMOTE >= 0:
            return tl.dot(av, bv, acc, max_num_imprecise_acc=PROMOTE)
        else:
            return tl.dot(av, bv, acc)
    else:
        return tl.dot(fp8_decode(a, A_E4M3), fp8_decode(b, B_E4M3), acc, input_precision="ieee")


@triton.jit
def _fp8_dot_pair(a0, b0, a1, b1, acc, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr,
                  PROMOTE: tl.constexpr):
    """``acc + a0 @ b0 + a1 @ b1`` of two consecutive chunks of the contraction, summed as two
    :func:`_fp8_dot` calls. Where each chunk is one promotion interval of FP8 tensor-core
    products, both chunks' MMAs go into fresh tiles that are added to ``acc`` (first, then
    second) after both are issued: the second chunk's MMAs run under the first one's fp32
    adds, instead of every chunk waiting for its own."""
    if (a0.dtype == tl.bfloat16 or a0.dtype == tl.float32 or not NATIVE_FP8
            or PROMOTE != a0.shape[1]):
        return _fp8_dot(a1, b1, _fp8_dot(a0, b0, acc, A_E4M3, B_E4M3, PROMOTE), A_E4M3, B_E4M3,
                        PROMOTE)
    else:
        p0 = tl.dot(_fp8_typed(a0, A_E4M3), _fp8_typed(b0, B_E4M3))
        p1 = tl.dot(_fp8_typed(a1, A_E4M3), _fp8_typed(b1, B_E4M3))
        return (acc + p0) + p1


@triton.jit
def _fp8_typed(x, E4M3: tl.constexpr):
    """The FP8 tile ``x`` (uint8 bytes or FP8-typed) as E4M3 or E5M2."""
    if E4M3:
        return x.to(tl.float8e4nv, bitcast=True)
    else:
        return x.to(tl.float8e5, bitcast=True)


@triton.jit
def _halves_dot(a, b_desc, b_row, k0, acc0, acc1, H: tl.constexpr, A_E4M3: tl.constexpr,
                B_E4M3: tl.constexpr, PROMOTE: tl.constexpr):
    """One main-loop step of a tile split in two halves of ``H`` columns (``SPLIT`` 2): the
    second operand's rows ``b_row`` and ``b_row + H`` loaded apart and each half's product
    added to its own accumulator, so that a promoted partial sum spans half the tile (the
    registers of a 128 x 256 tile and its partial sum exceed a thread's). Every output
    element's products and order of sums are those of the whole tile's."""
    b0 = b_desc.load([b_row, k0])
    b1 = b_desc.load([b_row + H, k0])
    acc0 = _fp8_dot(a, b0.T, acc0, A_E4M3, B_E4M3, PROMOTE)
    acc1 = _fp8_dot(a, b1.T, acc1, A_E4M3, B_E4M3, PROMOTE)
    return acc0, acc1


@triton.jit
def _entry(v, e, i):
    """Element ``i`` of the vector ``v`` indexed by ``e`` (``tl.arange``)."""
    return tl.sum(tl.where(e == i, v, 0), axis=0)


@triton.jit
def _tile_group(offs_ptr, pid, E, BM: tl.constexpr, EP2: tl.constexpr):
    """``(group, tile within it)`` of row tile ``pid``, the tiles numbered group after group
    (``cdiv(rows, BM)`` each); the group is ``E`` past the last tile."""
    e = tl.arange(0, EP2)
    emask = e < E
    ends = tl.load(offs_ptr + e, mask=emask, other=0).to(tl.int32)
    prev = tl.load(offs_ptr + e - 1, mask=emask & (e > 0), other=0).to(tl.int32)
    tiles = tl.where(emask, (ends - prev + BM - 1) // BM, 0)
    cum = tl.cumsum(tiles, axis=0)
    g = tl.sum((cum <= pid).to(tl.int32), axis=0)
    return g, pid - _entry(cum - tiles, e, g)


@triton.jit
def _start(ends_ptr, g):
    """Where group ``g`` starts: ``ends[g - 1]``, 0 for the first group."""
    return tl.load(ends_ptr + tl.maximum(g - 1, 0), mask=g > 0, other=0).to(tl.int64)


@triton.jit
def _rows_program(RT, N, BN: tl.constexpr, COLS_FASTEST: tl.constexpr):
    """``(row tile, column tile)`` of this program of a 1D grid of ``RT`` row tiles times the
    column tiles: with ``COLS_FASTEST`` the programs that run together share a row tile (its
    rows read from memory once, the expert's weight staying in L2), else a column tile."""
    pid = tl.program_id(0)
    if COLS_FASTEST:
        tiles_n = tl.cdiv(N, BN)
        return pid // tiles_n, pid % tiles_n
    else:
        return pid % RT, pid // RT


@triton.jit
def _tokens_tile(M, N, BM: tl.constexpr, BN: tl.constexpr, ROWS_FASTEST: tl.constexpr):
    """``(m0, n0)``: the first row and column of this program's tile of its group's ``[M, N]``
    product. The programs that run together share a row tile and sweep ``b``'s rows (which
    stay in L2 for the next row tile), or with ``ROWS_FASTEST`` share a column tile and sweep
    ``a``'s rows."""
    pid = tl.program_id(0)
    if ROWS_FASTEST:
        tiles_m = tl.cdiv(M, BM)
        return (pid % tiles_m) * BM, (pid // tiles_m) * BN
    else:
        tiles_n = tl.cdiv(N, BN)
        return (pid // tiles_n) * BM, (pid % tiles_n) * BN


@triton.jit
def _rows_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, offs_ptr, a_ends_ptr, c_ptr, N, K, E, RT,
                 s_sa, s_sb, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr, OUT: tl.constexpr,
                 EP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PROMOTE: tl.constexpr, COLS_FASTEST: tl.constexpr, CHUNKS: tl.constexpr = 1,
                 SPLIT: tl.constexpr = 1):
    """One ``[BM, BN]`` tile of one group's rows of :func:`fp8_grouped_rows_gemm`.

    a_ptr: uint8 FP8 ``[R, K]``; b_ptr: uint8 FP8 ``[E, N, K]``; both contiguous (or both
        decoded, :func:`_fp8_dot`).
    sa_ptr, sb_ptr: fp32 per-group scale-inverses, group ``g`` at ``g * s_sa`` / ``g * s_sb``.
    offs_ptr: int32/int64 ``[E]`` cumulative ends of the output rows (the real rows).
    a_ends_ptr: int32/int64 ``[E]`` cumulative ends of the groups' rows in ``a``.
    c_ptr: output ``[T, N]`` of the dtype ``OUT`` codes, contiguous.
    CHUNKS: the contraction chunks of ``BK`` a main-loop step of :func:`_rows_tma_kernel`
        multiplies, 1 or 2 (:func:`_fp8_dot_pair`; its loads past ``K`` are zeros); this kernel
        takes one a step. SPLIT: :func:`_rows_tma_kernel`'s halves; this kernel multiplies the
        whole tile.
    RT: the row tiles of the grid (group after group; past the last one a program exits); the
    program's row and column tile: :func:`_rows_program`.
    """
    rt, ct = _rows_program(RT, N, BN, COLS_FASTEST)
    g, t = _tile_group(offs_ptr, rt, E, BM, EP2)
    if g < E:
        out0 = _start(offs_ptr, g)
        rows = tl.load(offs_ptr + g).to(tl.int64) - out0
        local = t * BM + tl.arange(0, BM)
        rmask = local < rows
        ar = _start(a_ends_ptr, g) + tl.where(rmask, local, 0)
        rn = ct * BN + tl.arange(0, BN)
        nmask = rn < N
        b_rows = g.to(tl.int64) * N + tl.where(nmask, rn, 0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            kmask = rk < K
            a = tl.load(a_ptr + ar[:, None] * K + rk[None, :], mask=kmask[None, :], other=0)
            b = tl.load(b_ptr + b_rows[None, :] * K + rk[:, None], mask=kmask[:, None], other=0)
            acc = _fp8_dot(a, b, acc, A_E4M3, B_E4M3, PROMOTE)
        _store_rows_tile(acc, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, out0, rows, t, ct * BN, N,
                         OUT, BM, BN)


@triton.jit
def _tokens_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, ends_ptr, c_ptr, M, N, R, s_sa, s_sb,
                   A_E4M3: tl.constexpr, B_E4M3: tl.constexpr, OUT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PROMOTE: tl.constexpr,
                   ROWS_FASTEST: tl.constexpr, SPLIT: tl.constexpr = 1):
    """One ``[BM, BN]`` tile of group ``program_id(1)``'s product of
    :func:`fp8_grouped_tokens_gemm` (``SPLIT``: the TMA kernels' halves; this kernel multiplies
    the whole tile).

    a_ptr: uint8 FP8 ``[M, R]``; b_ptr: uint8 FP8 ``[N, R]``; both contiguous (or both
        decoded, :func:`_fp8_dot`).
    ends_ptr: int32/int64 ``[E]`` cumulative ends of the groups' columns (each group starts at a
        multiple of 16: the loads are 16-byte vectors).
    c_ptr: output ``[E, M, N]`` of the dtype ``OUT`` codes, contiguous.
    ROWS_FASTEST: the programs' order, :func:`_tokens_tile`.
    """
    g = tl.program_id(1)
    m0, n0 = _tokens_tile(M, N, BM, BN, ROWS_FASTEST)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    mmask, nmask = rm < M, rn < N
    am = tl.where(mmask, rm, 0).to(tl.int64)
    bn = tl.where(nmask, rn, 0).to(tl.int64)
    start = tl.multiple_of(_start(ends_ptr, g).to(tl.int32), 16)
    cols = tl.load(ends_ptr + g).to(tl.int32) - start
    a_rows = a_ptr + am[:, None] * R + start
    b_rows = b_ptr + bn[None, :] * R + start
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, cols, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < cols
        a = tl.load(a_rows + rk[None, :], mask=kmask[None, :], other=0)
        b = tl.load(b_rows + rk[:, None], mask=kmask[:, None], other=0)
        acc = _fp8_dot(a, b, acc, A_E4M3, B_E4M3, PROMOTE)
    _store_group_tile(acc, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, m0, n0, M, N, OUT, BM, BN)


@triton.jit
def _rows_tma_kernel(a_desc, b_desc, sa_ptr, sb_ptr, offs_ptr, a_ends_ptr, c_ptr, N, K, E,
                     RT, s_sa, s_sb, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr,
                     OUT: tl.constexpr, EP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, PROMOTE: tl.constexpr, COLS_FASTEST: tl.constexpr,
                     CHUNKS: tl.constexpr = 1, SPLIT: tl.constexpr = 1):
    """:func:`_rows_kernel` with the operand tiles loaded by the tensor memory accelerator:
    ``a_desc`` over ``a [R, K]``, ``b_desc`` over ``b [E·N, K]`` (FP8-typed on a GPU, or
    decoded; its tiles ``BN / SPLIT`` rows: with ``SPLIT`` 2 the tile is two halves,
    :func:`_halves_dot`, one chunk a step). A tile may hold rows of the next group or expert;
    they only reach output rows and columns that the masked store leaves out. The same products
    and the same order of sums as :func:`_rows_kernel`."""
    rt, ct = _rows_program(RT, N, BN, COLS_FASTEST)
    g, t = _tile_group(offs_ptr, rt, E, BM, EP2)
    if g < E:
        out0 = _start(offs_ptr, g)
        rows = tl.load(offs_ptr + g).to(tl.int64) - out0
        a_row = (_start(a_ends_ptr, g) + t * BM).to(tl.int32)
        n0 = ct * BN
        b_row = g * N + n0
        if SPLIT == 2:
            H: tl.constexpr = BN // 2
            acc0 = tl.zeros((BM, H), dtype=tl.float32)
            acc1 = tl.zeros((BM, H), dtype=tl.float32)
            for k0 in range(0, K, BK):
                acc0, acc1 = _halves_dot(a_desc.load([a_row, k0]), b_desc, b_row, k0, acc0,
                                         acc1, H, A_E4M3, B_E4M3, PROMOTE)
            _store_rows_tile(acc0, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, out0, rows, t, n0, N,
                             OUT, BM, H)
            _store_rows_tile(acc1, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, out0, rows, t, n0 + H,
                             N, OUT, BM, H)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK * CHUNKS):
                a = a_desc.load([a_row, k0])
                b = b_desc.load([b_row, k0])
                if CHUNKS == 2:
                    a1 = a_desc.load([a_row, k0 + BK])
                    b1 = b_desc.load([b_row, k0 + BK])
                    acc = _fp8_dot_pair(a, b.T, a1, b1.T, acc, A_E4M3, B_E4M3, PROMOTE)
                else:
                    acc = _fp8_dot(a, b.T, acc, A_E4M3, B_E4M3, PROMOTE)
            _store_rows_tile(acc, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, out0, rows, t, n0, N,
                             OUT, BM, BN)


@triton.jit
def _store_rows_tile(acc, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, out0, rows, t, n0, N,
                     OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Group ``g``'s fp32 product tile ``acc`` (row tile ``t`` of the group's ``rows`` output
    rows from ``out0``, columns ``n0 ...``) into the ``[T, N]`` output, scaled by the group's
    two scale-inverses and rounded once to the dtype ``OUT`` codes."""
    acc = (acc * tl.load(sa_ptr + g * s_sa)) * tl.load(sb_ptr + g * s_sb)
    local = t * BM + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    tl.store(c_ptr + (out0 + local)[:, None] * N + rn[None, :], to_out(acc, OUT),
             mask=(local < rows)[:, None] & (rn < N)[None, :])


@triton.jit
def _store_group_tile(acc, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, m0, n0, M, N,
                      OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Group ``g``'s fp32 product tile ``acc`` at ``(m0, n0)`` of the ``[E, M, N]`` output,
    scaled by the group's two scale-inverses and rounded once to the dtype ``OUT`` codes."""
    acc = (acc * tl.load(sa_ptr + g * s_sa)) * tl.load(sb_ptr + g * s_sb)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    out = c_ptr + g.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, to_out(acc, OUT), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _tokens_group_tma_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, ends_ptr, c_ptr, M, N, R, s_sa, s_sb,
                             A_E4M3: tl.constexpr, B_E4M3: tl.constexpr, OUT: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             PROMOTE: tl.constexpr, ROWS_FASTEST: tl.constexpr,
                             SPLIT: tl.constexpr = 1):
    """:func:`_tokens_kernel` with every chunk, the last partial one too, loaded by the tensor
    memory accelerator from descriptors made on the device over the group's own columns
    (``a [M, R]`` / ``b [N, R]`` from column ``ends[g-1]`` on, ``ends[g] - ends[g-1]`` wide,
    FP8-typed on a GPU, or decoded): the hardware fills the columns past the group's end with
    zeros, so no column of another group enters the sums. The same products and the same order
    of sums as :func:`_tokens_kernel` (a zero column adds an exact 0). ``SPLIT`` 2: the tile
    in two halves (:func:`_halves_dot`)."""
    g = tl.program_id(1)
    start = tl.multiple_of(_start(ends_ptr, g), 16)
    cols = tl.load(ends_ptr + g).to(tl.int32) - start.to(tl.int32)
    width = tl.maximum(cols, 1)  # a descriptor's dimensions are positive; none is loaded then
    a_desc = tl.make_tensor_descriptor(a_ptr + start, shape=[M, width], strides=[R, 1],
                                       block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr + start, shape=[N, width], strides=[R, 1],
                                       block_shape=[BN // SPLIT, BK])
    m0, n0 = _tokens_tile(M, N, BM, BN, ROWS_FASTEST)
    _tokens_main_loop(a_desc, b_desc, 0, cols, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, m0, n0, M, N,
                      A_E4M3, B_E4M3, OUT, BM, BN, BK, PROMOTE, SPLIT)


@triton.jit
def _tokens_tma_kernel(a_desc, b_desc, sa_ptr, sb_ptr, ends_ptr, c_ptr, M, N, R, s_sa, s_sb,
                       A_E4M3: tl.constexpr, B_E4M3: tl.constexpr, OUT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       PROMOTE: tl.constexpr, ROWS_FASTEST: tl.constexpr,
                       SPLIT: tl.constexpr = 1):
    """:func:`_tokens_kernel` for groups that start and end on multiples of ``BK`` columns:
    every chunk lies inside its group, so the tiles come by the tensor memory accelerator from
    the descriptors made on the host over the whole operands (``a [M, R]``, ``b [N, R]``), with
    no descriptor made per program. The same products and order of sums as
    :func:`_tokens_kernel` (``SPLIT`` 2: the tile in two halves, :func:`_halves_dot`)."""
    g = tl.program_id(1)
    m0, n0 = _tokens_tile(M, N, BM, BN, ROWS_FASTEST)
    start = tl.multiple_of(_start(ends_ptr, g).to(tl.int32), BK)
    end = tl.load(ends_ptr + g).to(tl.int32)
    _tokens_main_loop(a_desc, b_desc, start, end, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, m0, n0,
                      M, N, A_E4M3, B_E4M3, OUT, BM, BN, BK, PROMOTE, SPLIT)


@triton.jit
def _tokens_main_loop(a_desc, b_desc, k_start, k_end, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, m0,
                      n0, M, N, A_E4M3: tl.constexpr, B_E4M3: tl.constexpr, OUT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      PROMOTE: tl.constexpr, SPLIT: tl.constexpr):
    """Group ``g``'s ``[BM, BN]`` tile at ``(m0, n0)`` of a contraction kernel: the chunks
    ``k_start ... k_end`` of ``a_desc`` / ``b_desc`` (whose tiles are ``BN / SPLIT`` rows),
    multiplied, summed and stored (:func:`_store_group_tile`; with ``SPLIT`` 2 as two halves,
    :func:`_halves_dot`)."""
    if SPLIT == 2:
        H: tl.constexpr = BN // 2
        acc0 = tl.zeros((BM, H), dtype=tl.float32)
        acc1 = tl.zeros((BM, H), dtype=tl.float32)
        for k0 in range(k_start, k_end, BK):
            acc0, acc1 = _halves_dot(a_desc.load([m0, k0]), b_desc, n0, k0, acc0, acc1, H,
                                     A_E4M3, B_E4M3, PROMOTE)
        _store_group_tile(acc0, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, m0, n0, M, N, OUT, BM, H)
        _store_group_tile(acc1, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, m0, n0 + H, M, N, OUT,
                          BM, H)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(k_start, k_end, BK):
            a = a_desc.load([m0, k0])
            b = b_desc.load([n0, k0])
            acc = _fp8_dot(a, b.T, acc, A_E4M3, B_E4M3, PROMOTE)
        _store_group_tile(acc, sa_ptr, sb_ptr, g, s_sa, s_sb, c_ptr, m0, n0, M, N, OUT, BM, BN)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors a kernel makes on the device (Triton's allocator
    protocol; a CUDA-graph capture takes it from the graph's pool)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def device_descriptors_allowed() -> None:
    """Let kernels make tensor descriptors on the device: Triton asks its allocator for their
    memory, and has none unless one is set (set here only then, so that an allocator a program
    chose stays)."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


def _b_tile_rows(cfg: dict) -> int:
    """The rows of the second operand's TMA tiles under a config: ``BN``, halved with
    ``SPLIT`` 2 (a tile multiplied as two halves, one chunk a main-loop step); a clear error
    for any other ``SPLIT`` and for ``SPLIT`` 2 with ``CHUNKS`` 2."""
    split = cfg.get("SPLIT", 1)
    if split not in (1, 2) or (split == 2 and cfg.get("CHUNKS", 1) != 1):
        raise ValueError(f"grouped FP8 GEMM config: SPLIT must be 1 or 2, and 2 only with one "
                         f"chunk a step (CHUNKS 1), got SPLIT={split!r}, "
                         f"CHUNKS={cfg.get('CHUNKS', 1)!r}")
    return cfg["BN"] // split


def _tma_operands(tensors, dtypes, blocks, cfg):
    """``(views, descriptors)`` for the TMA kernels, or None where they don't apply: off
    (config ``tma`` 0), inside a kernel capture (a compiled graph records the pointer kernels),
    or an operand the tensor memory accelerator can't address (a base or row stride not a
    multiple of 16 bytes): :func:`descriptor_operands`."""
    if not cfg.get("tma", 0) or capturing() or not tma_addressable(tensors):
        return None
    return descriptor_operands(tensors, dtypes, blocks)


def tma_addressable(tensors) -> bool:
    """Every operand's base and row stride are multiples of 16 bytes (what the tensor memory
    accelerator addresses)."""
    return not any(t.data_ptr() % 16 or t.stride(0) % 16 for t in tensors)


def descriptor_operands(tensors, dtypes, blocks):
    """``(views, descriptors)`` of TMA-addressable operands: on a GPU the views of uint8 FP8
    bytes are their FP8 ``dtypes``, so that the tiles go to the tensor cores as loaded (the
    interpreter decodes the bytes itself); decoded operands (dtype ``None``) stay as they
    are."""
    native = NATIVE_FP8.value and tensors[0].is_cuda
    views = [t.view(d.torch_dtype) if native and d is not None else t
             for t, d in zip(tensors, dtypes, strict=True)]
    return views, [TensorDescriptor.from_tensor(v, list(b))
                   for v, b in zip(views, blocks, strict=True)]


def check_operands(name: str, a: torch.Tensor, b: torch.Tensor, ends, a_dtype: DType,
                   b_dtype: DType, out_dtype: torch.dtype) -> None:
    """Clear errors for a grouped GEMM's wrapper: FP8 dtypes, contiguous uint8 operands,
    integer ends on ``a``'s device."""
    check_fp8(a_dtype, "a_dtype")
    check_fp8(b_dtype, "b_dtype")
    out_code(out_dtype)
    for arg, t in (("a", a), ("b", b)):
        if t.dtype != torch.uint8 or not t.is_contiguous():
            raise TypeError(f"{name}: {arg} must be contiguous uint8 FP8 bytes, got {t.dtype}"
                            f"{'' if t.is_contiguous() else ' (not contiguous)'}")
    check_ends(name, a, ends)


def check_ends(name: str, a: torch.Tensor, ends) -> None:
    """Clear errors unless every ``(argument, tensor)`` of ``ends`` is a 1D int32/int64 tensor on
    ``a``'s device."""
    for arg, t in ends:
        if t.device != a.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but a on {a.device}")
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise TypeError(f"{name}: {arg} must be a 1D int32/int64 tensor of cumulative "
                            f"ends, got {t.dtype} {tuple(t.shape)}")


def _check(name: str, a: torch.Tensor, b: torch.Tensor, scales, ends, a_dtype: DType,
           b_dtype: DType, out_dtype: torch.dtype) -> None:
    """:func:`check_operands`, and fp32 per-group scales on ``a``'s device."""
    check_operands(name, a, b, ends, a_dtype, b_dtype, out_dtype)
    for arg, t in scales:
        if t.device != a.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but a on {a.device}")
    for arg, t in scales:
        if t.dtype != torch.float32 or t.dim() != 1:
            raise TypeError(f"{name}: {arg} must be a 1D fp32 tensor (one scale-inverse per "
                            f"group), got {t.dtype} {tuple(t.shape)}")


def check_rows_shapes(name: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                      a_ends: torch.Tensor, k: str = "K") -> None:
    """Clear errors unless ``a [R, k]`` and ``b [E, N, k]`` share ``k`` and ``offs``, ``a_ends``
    have one entry per group (``k`` names the contraction's columns in the messages)."""
    if b.dim() != 3 or a.dim() != 2 or a.shape[1] != b.shape[2]:
        raise ValueError(f"{name}: a must be [R, {k}] and b [E, N, {k}] with the same {k}, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if offs.shape[0] != b.shape[0] or a_ends.shape[0] != b.shape[0]:
        raise ValueError(f"{name}: offs and a_ends must have one entry per group ({b.shape[0]}), "
                         f"got {tuple(offs.shape)} and {tuple(a_ends.shape)}")


def check_tokens_shapes(name: str, a: torch.Tensor, b: torch.Tensor, r: str = "R") -> None:
    """A clear error unless ``a [M, r]`` and ``b [N, r]`` share ``r``."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"{name}: a must be [M, {r}] and b [N, {r}] with the same {r}, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")


def _flags(dtypes, out_dtype: torch.dtype, kw, fast_accum: bool = False) -> dict:
    """The constexprs of a launch: the operands' FP8 dtypes (``None``: decoded operands, which
    take no ``PROMOTE`` from their config), the output's code and the config's keywords;
    ``fast_accum``: no promotion (``PROMOTE`` -1, the tensor cores' own accumulation)."""
    flags = {"PROMOTE": 0, "A_E4M3": dtypes[0] == DType.E4M3,
             "B_E4M3": dtypes[1] == DType.E4M3, "OUT": out_code(out_dtype), **kw}
    if fast_accum:
        flags["PROMOTE"] = -1
    return flags


#: The rows kernels order their programs column tile first (``COLS_FASTEST`` in their configs)
#: unless one expert's ``b[g]`` is more than this many bytes and its output row at least as wide
#: as its contraction (:func:`rows_first`). Column tile first, the programs of a row tile sweep
#: the expert's columns, whose bytes stay in L2 for the group's next row tile only while the
#: expert fits; past that, row tile first re-reads ``a`` once per column tile instead, which
#: costs less where the columns are many and ``a``'s rows short. On an H100, Mixtral's down
#: projection's input gradient (a 59 MB expert of 14336 x 4096) ran 28% faster row tile first;
#: GPT-OSS's 8 and 17 MB experts and Qwen3-MoE's 1.5 and 3 MB ran faster column tile first, and
#: so did Mixtral's gate/up (117 MB, 4096 x 28672) in the long-contraction tiles
#: (:func:`long_contraction`; bench/RESULTS.md).
L2_EXPERT_BYTES = 32 * 2**20


def rows_first(n: int, k: int, element_size: int) -> bool:
    """Whether a rows GEMM over experts ``[n, k]`` of ``element_size``-byte elements orders its
    programs row tile first (:data:`L2_EXPERT_BYTES`)."""
    return n * k * element_size > L2_EXPERT_BYTES and n >= k


def long_contraction(n: int, k: int) -> bool:
    """Whether an FP8 grouped rows GEMM over experts ``[n, k]`` takes the 128 x 128 tiles that
    multiply two promoted chunks a main-loop step (``fp8_grouped_rows_gemm_long``): where the
    contraction is longer than the output row and the expert does not fit L2 (Mixtral's gate/up
    input gradient: 15% faster than the 128 x 256 tiles row tile first on an H100, 6% faster
    than them column tile first)."""
    return k > n and n * k > L2_EXPERT_BYTES


def rows_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
              offs: torch.Tensor, a_ends: torch.Tensor, total: int, dtypes, out_dtype, config,
              fast_accum: bool = False) -> torch.Tensor:
    """The launch of a grouped rows GEMM of checked operands ``a [R, K]``, ``b [E, N, K]``:
    uint8 FP8 bytes of ``dtypes`` (``(a_dtype, b_dtype)``), or decoded exactly (bf16 on a GPU,
    fp32 under the interpreter; ``dtypes`` ``(None, None)``); ``sa``, ``sb`` the fp32 per-group
    scales; ``config`` the ``(config, keywords)`` of :func:`launch_config`; its
    ``COLS_FASTEST`` holds unless :func:`rows_first`."""
    experts, n, k = b.shape
    out = torch.empty((total, n), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg, kw = config
    row_tiles = ceil_div(total, cfg["BM"]) + experts
    grid = (row_tiles * ceil_div(n, cfg["BN"]),)
    flags = {**_flags(dtypes, out_dtype, kw, fast_accum), "EP2": triton.next_power_of_2(experts)}
    if flags.get("COLS_FASTEST") and rows_first(n, k, b.element_size()):
        flags["COLS_FASTEST"] = 0
    scales = (sa, sb, offs, a_ends, out, n, k, experts, row_tiles, sa.stride(0), sb.stride(0))
    tma = _tma_operands((a, b.view(experts * n, k)), dtypes,
                        ((cfg["BM"], cfg["BK"]), (_b_tile_rows(cfg), cfg["BK"])), cfg)
    if tma is None:
        launch(_rows_kernel, grid, a, b, *scales, **flags)
    else:
        launch(_rows_tma_kernel, grid, *tma[1], *scales, **flags)
    return out


#: The contraction kernels' programs sweep ``b``'s columns of a group (sharing a row tile of
#: ``a``) unless that slice of ``b`` is more than this many bytes on average and ``a``'s is
#: smaller: then they sweep ``a``'s (``ROWS_FASTEST``), the slice that stays in L2. On an H100,
#: Mixtral's down-projection weight gradient (``b`` 14336 x 2048 rows, 29 MB, ``a`` 8 MB) ran 7%
#: faster sweeping ``a``; Qwen3-MoE's (1 MB slices) 5% slower (bench/RESULTS.md).
SWEPT_GROUP_BYTES = 16 * 2**20


def tokens_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                ends: torch.Tensor, dtypes, out_dtype, config, fast_accum: bool = False,
                group_multiple: int = 16) -> torch.Tensor:
    """The launch of a grouped tokens GEMM of checked operands ``a [M, R]``, ``b [N, R]``, as
    :func:`rows_gemm`'s; every group's columns start and end on a multiple of
    ``group_multiple``: where that is a multiple of the tile's contraction chunk, the tiles
    come from descriptors made on the host (:func:`_tokens_tma_kernel`), else from descriptors
    each program makes over its group's columns. The programs' order: the config's
    ``ROWS_FASTEST``, else by :data:`SWEPT_GROUP_BYTES`."""
    (m, r), n, experts = a.shape, b.shape[0], ends.shape[0]
    out = torch.empty((experts, m, n), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    cfg, kw = config
    flags = _flags(dtypes, out_dtype, kw, fast_accum)
    grid = (ceil_div(m, cfg["BM"]) * ceil_div(n, cfg["BN"]), experts)
    swept = n * (r // experts) * b.element_size()
    flags["ROWS_FASTEST"] = int(bool(kw.get("ROWS_FASTEST"))
                                or (m < n and swept > SWEPT_GROUP_BYTES))
    rest = (sa, sb, ends, out, m, n, r, sa.stride(0), sb.stride(0))
    tma = _tma_operands((a, b), dtypes, ((cfg["BM"], cfg["BK"]), (_b_tile_rows(cfg), cfg["BK"])),
                        cfg)
    if tma is None:
        launch(_tokens_kernel, grid, a, b, *rest, **flags)
    elif group_multiple % cfg["BK"] == 0:
        launch(_tokens_tma_kernel, grid, *tma[1], *rest, **flags)
    else:
        if a.is_cuda:
            device_descriptors_allowed()
        launch(_tokens_group_tma_kernel, grid, *tma[0], *rest, **flags)
    return out


def fp8_grouped_rows_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                          b_scale_inv: torch.Tensor, offs: torch.Tensor, a_ends: torch.Tensor,
                          *, total: int, a_dtype: DType, b_dtype: DType,
                          out_dtype: torch.dtype = torch.bfloat16,
                          fast_accum: bool = False) -> torch.Tensor:
    """``out [total, N]``: for each group ``g``, rows ``offs[g-1]:offs[g]`` are
    ``(a_g @ b[g]ᵀ) * a_scale_inv[g] * b_scale_inv[g]`` with ``a_g`` the group's rows of
    ``a [R, K]`` from row ``a_ends[g-1]`` on, ``b [E, N, K]`` (uint8 FP8 bytes of ``a_dtype`` /
    ``b_dtype``; ``offs``, ``a_ends`` ``[E]`` cumulative ends, ``offs[-1] == total``). Rows of
    ``a`` outside the groups are not read. ``fast_accum``: on FP8 tensor cores, no promotion
    to the fp32 accumulator (Hopper's fast accumulation over the whole contraction)."""
    name = "fp8_grouped_rows_gemm"
    _check(name, a, b, (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)),
           (("offs", offs), ("a_ends", a_ends)), a_dtype, b_dtype, out_dtype)
    check_rows_shapes(name, a, b, offs, a_ends)
    config = launch_config("fp8_grouped_rows_gemm_long" if long_contraction(*b.shape[1:])
                           else "fp8_grouped_rows_gemm")
    return rows_gemm(a, a_scale_inv, b, b_scale_inv, offs, a_ends, total, (a_dtype, b_dtype),
                     out_dtype, config, fast_accum)


#: Weight gradients whose groups contract over at most this many rows on average take the
#: ``fp8_grouped_tokens_gemm_short`` tiles: two programs per SM hide each one's prologue and
#: store behind the other's few main-loop steps (an H100: 5-6% faster at 512 rows a group, 10%
#: slower at 2048, bench/RESULTS.md).
SHORT_GROUP_ROWS = 1024


def fp8_grouped_tokens_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor,
                            b_scale_inv: torch.Tensor, ends: torch.Tensor, *, a_dtype: DType,
                            b_dtype: DType, out_dtype: torch.dtype = torch.bfloat16,
                            fast_accum: bool = False, group_multiple: int = 16) -> torch.Tensor:
    """``out [E, M, N]``: group ``g``'s ``(a[:, s:e] @ b[:, s:e]ᵀ) * a_scale_inv[g] *
    b_scale_inv[g]`` over its columns ``s:e = ends[g-1]:ends[g]`` of ``a [M, R]`` and
    ``b [N, R]`` (uint8 FP8 bytes; ``ends`` ``[E]`` cumulative, every group starting and ending
    on a multiple of ``group_multiple`` columns, 16 or a multiple of it: the padded layout of a
    grouped layer). A group without columns gives zeros. ``fast_accum`` as
    :func:`fp8_grouped_rows_gemm`'s."""
    name = "fp8_grouped_tokens_gemm"
    _check(name, a, b, (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)),
           (("ends", ends),), a_dtype, b_dtype, out_dtype)
    check_tokens_shapes(name, a, b)
    check_group_multiple(name, group_multiple)
    short = a.shape[1] <= SHORT_GROUP_ROWS * ends.shape[0]
    config = launch_config("fp8_grouped_tokens_gemm_short" if short
                           else "fp8_grouped_tokens_gemm")
    return tokens_gemm(a, a_scale_inv, b, b_scale_inv, ends, (a_dtype, b_dtype), out_dtype,
                       config, fast_accum, group_multiple)


def check_group_multiple(name: str, group_multiple) -> None:
    """A clear error unless ``group_multiple`` is a positive int multiple of 16."""
    if (isinstance(group_multiple, bool) or not isinstance(group_multiple, int)
            or group_multiple < 16 or group_multiple % 16):
        raise ValueError(f"{name}: group_multiple must be a positive multiple of 16 (the "
                         f"columns every group starts and ends on), got {group_multiple!r}")
