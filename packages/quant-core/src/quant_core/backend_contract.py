"""The backend contract (architecture.md contract 3), one documented method per function.

A backend is any object with these attributes; :mod:`quant_core.reference` is the definition
(every backend returns its bytes; GEMMs may differ only in the order of the fp32 accumulation)
and quant-kernels' ``TritonBackend`` the fast one. Inputs ``x`` are 2D ``[M, K]`` contiguous
views of dtype fp32, bf16 or fp16 (the quantizers flatten and validate first). Buffers are uint8
unless stated (FP8 data as its raw bytes), scale padding is zero, and a direction that was not
asked for is ``None``. Sections: `docs/numerics.md`.

Validation: the quantizers validate the input tensor (type, layout, dtype, shape rule) once.
Every backend validates again what it is handed (``x``'s dtype, the format's K multiple, the
FP8 dtype, mode combinations), each rule through the one helper of :mod:`quant_core.inputs`,
so a direct backend call is refused alike, with the same message, by every backend
(tests/kernels/test_backend.py runs the same bad calls against the reference and Triton).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .dtypes import DType

Tensors2 = tuple[torch.Tensor | None, torch.Tensor | None]
Tensors3 = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]
Tensors4 = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
                 torch.Tensor | None]
Tensors6 = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
                 torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@runtime_checkable
class Backend(Protocol):
    """What ``quant_core.backends`` registers and hands out. Optional, not listed here:
    ``preferred(device) -> bool`` (may automatic choice pick it; default ``supports``) and
    ``capturable: bool`` (its launches can be recorded into a compiled graph)."""

    name: str
    priority: int

    def supports(self, device: torch.device) -> bool:
        """Whether it can run on ``device`` (asked for by name or chosen automatically)."""

    # ---------------------------------------------------------------- per-tensor FP8 (§2-§4)
    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``(1,)``: NaN-dropping ``max|x|``, 0 for an empty tensor."""

    def current_scale(self, amax: torch.Tensor, *, fp8_dtype: DType, force_pow_2_scales: bool,
                      amax_epsilon: float) -> torch.Tensor:
        """fp32 ``(1,)``: current scaling's encode scale from ``amax`` (§3 step 3)."""

    def fp8_quantize(self, x: torch.Tensor, scale: torch.Tensor, *, fp8_dtype: DType,
                     rowwise: bool, columnwise: bool, amax_out: torch.Tensor | None = None
                     ) -> Tensors3:
        """``(data [M, K], transpose [K, M], scale_inv fp32 (1,))`` of
        ``fp8_satfinite_rne(fp32(x * scale))``; with ``amax_out`` (fp32 ``(1,)``) ``max|x|`` is
        max-accumulated into it in place (delayed scaling)."""

    def fp8_current_quantize(self, x: torch.Tensor, *, fp8_dtype: DType,
                             force_pow_2_scales: bool, amax_epsilon: float, rowwise: bool,
                             columnwise: bool, amax_in: torch.Tensor | None = None) -> Tensors3:
        """:meth:`fp8_quantize` with :meth:`current_scale` of :meth:`amax` of ``x`` (or of the
        fp32 ``(1,)`` ``amax_in``), in one call (a backend may fuse the steps)."""

    def fp8_dequantize(self, data: torch.Tensor, scale_inv: torch.Tensor, *, fp8_dtype: DType,
                       dtype: torch.dtype) -> torch.Tensor:
        """``float(fp8(data)) * scale_inv`` rounded to ``dtype``; any shape of ``data``."""

    # ------------------------------------------------------------------------ MXFP8 (§5)
    def mxfp8_quantize(self, x: torch.Tensor, *, fp8_dtype: DType, rowwise: bool,
                       columnwise: bool, with_2d_quantization: bool, swizzle: bool) -> Tensors4:
        """``(row_data [M, K], row_scale, col_data [M, K], col_scale)``: E8M0 scale bytes in the
        padded shapes of :mod:`quant_core.shapes`, GEMM-swizzled in place with ``swizzle``
        (columnwise: the swizzle of the transposed scale matrix)."""

    def mxfp8_dequantize(self, data: torch.Tensor, scale: torch.Tensor, *, fp8_dtype: DType,
                         columnwise: bool, swizzled: bool, dtype: torch.dtype) -> torch.Tensor:
        """``[M, K]`` in ``dtype`` from one direction's data and scales."""

    def mxfp8_quantize_decoded(self, x: torch.Tensor, *, fp8_dtype: DType, rowwise: bool,
                               columnwise: bool, with_2d_quantization: bool,
                               dtype: torch.dtype, rows: torch.Tensor | None = None) -> Tensors2:
        """``(row_values [M, K], col_values [M, K])`` in ``dtype``: :meth:`mxfp8_dequantize` of
        each asked direction of :meth:`mxfp8_quantize`, in one pass that writes no FP8 bytes
        (for a consumer of decoded values only). With ``rows`` (int32/int64 ``[P]``, ``M = P``)
        the tensor quantized is ``x``'s rows in that order, a zero row for each
        ``rows[p] < 0``."""

    # ------------------------------------------------------------------- FP8 blocks (§6)
    def fp8_block_quantize(self, x: torch.Tensor, *, fp8_dtype: DType, block_scaling_dim: int,
                           force_pow_2_scales: bool, amax_epsilon: float, rowwise: bool,
                           columnwise: bool, rows: torch.Tensor | None = None,
                           groups: int = 0) -> Tensors4:
        """``(row_data [M, K], row_scale_inv fp32, col_data [K, M], col_scale_inv fp32)`` in
        the GEMM-ready layouts (1x128 blocks, or 128x128 with ``block_scaling_dim=2``). With
        ``rows`` (int32/int64 ``[P]``, ``M = P``) the tensor quantized is ``x``'s rows in that
        order, a zero row for each ``rows[p] < 0`` (a grouped operand's padded layout). With
        ``groups = E > 0`` (``M / E`` a multiple of 128) ``col_data`` is ``[E, K, M / E]``: each
        group of rows transposed on its own (every expert's transposed weight), the same bytes
        and scales."""

    def fp8_block_dequantize(self, data: torch.Tensor, scale_inv: torch.Tensor, *,
                             fp8_dtype: DType, block_scaling_dim: int, columnwise: bool,
                             dtype: torch.dtype) -> torch.Tensor:
        """``[M, K]`` in ``dtype`` (columnwise data is transposed back)."""

    # ------------------------------------------------------------------------ NVFP4 (§7)
    def nvfp4_amax(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool, with_rht: bool,
                   rht_sign_mask: int, row_scaled: bool = False) -> Tensors2:
        """``(amax_row (1,), amax_col (1,))``; the columnwise one after the bf16-rounded RHT
        when ``with_rht`` (§7.6). ``row_scaled``: ``(amax_row (M,), None)``, one per row
        (§7.9)."""

    def nvfp4_quantize(self, x: torch.Tensor, amax_rowwise: torch.Tensor | None,
                       amax_columnwise: torch.Tensor | None, *, rowwise: bool, columnwise: bool,
                       with_rht: bool, rht_sign_mask: int, with_2d_quantization: bool,
                       stochastic_rounding: bool, rng_seed: torch.Tensor | None, swizzle: bool,
                       four_over_six: bool = False, e4m3_max: int = 448, err_mode: str = "MAE",
                       row_scaled: bool = False) -> Tensors4:
        """``(row_data [M, K/2], row_scale, col_data [K, ceil(M/2)], col_scale)``; ``rng_seed``
        an int64 ``(1,)`` (ignored without stochastic rounding), element ``i``'s random byte
        ``reference._rounding.sr_random_byte(seed, i)``, which any backend can repeat.
        ``four_over_six``: 4over6 block scaling with the global bound ``e4m3_max`` (256 or 448)
        and the error metric ``err_mode`` ("MAE" or "MSE"), §7.9. ``row_scaled``: rowwise only,
        ``amax_rowwise`` one per row ``(M,)``, each row with its own ``S_enc`` (§7.9)."""

    def nvfp4_dequantize(self, data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, *,
                         swizzled: bool, dtype, e4m3_max: int = 448) -> torch.Tensor:
        """``[M, K]`` in ``dtype`` from rowwise data quantized with the global bound
        ``e4m3_max``; ``amax`` ``(1,)``, or ``(M,)`` for a row-scaled tensor."""

    # ------------------------------------------------------------- scale swizzle (§5)
    def swizzle_scales(self, s: torch.Tensor) -> torch.Tensor:
        """The GEMM swizzle of ``s [R, C]`` (``R % 128 == 0``, ``C % 4 == 0``), same shape."""

    def unswizzle_scales(self, s: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`swizzle_scales`."""

    # -------------------------------------------------------------- GEMMs (contract 6)
    def mxfp8_gemm(self, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                   b_scale: torch.Tensor, *, a_dtype: DType, b_dtype: DType, a_swizzled: bool,
                   b_swizzled: bool, bias: torch.Tensor | None, out_dtype: torch.dtype
                   ) -> torch.Tensor:
        """``A @ B.T (+ bias)`` of row operands ``A [M, K]``, ``B [N, K]``: exact decoded
        elements, fp32 products and sums (any order), one rounding to ``out_dtype``."""

    def nvfp4_gemm(self, a: torch.Tensor, a_scale: torch.Tensor, a_amax: torch.Tensor,
                   b: torch.Tensor, b_scale: torch.Tensor, b_amax: torch.Tensor, *,
                   a_swizzled: bool, b_swizzled: bool, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
        """As :meth:`mxfp8_gemm` for packed NVFP4 row operands with their fp32 amaxes (``(1,)``,
        or one per row of a row-scaled operand: the factor of each output row or column)."""

    # --------------------------------- grouped FP8 current scaling (mixture of experts)
    def fp8_group_quantize_rows(self, x: torch.Tensor, gid: torch.Tensor, src: torch.Tensor,
                                grp: torch.Tensor, *, groups: int, fp8_dtype: DType,
                                force_pow_2_scales: bool, amax_epsilon: float, rowwise: bool,
                                columnwise: bool, row_padded: bool, scale_pitch: int = 1,
                                amax: torch.Tensor | None = None,
                                x_rows: torch.Tensor | None = None,
                                row_amax: torch.Tensor | None = None) -> Tensors3:
        """``(data, transpose [K, P], scale_inv [groups, scale_pitch])``: each group of the
        token rows ``x [T, K]`` (``gid [T]`` the group of each row) current-scaled with its own
        amax, written in the padded layout of ``P`` rows (``src [P]`` the source row of each,
        ``-1`` a zero row; ``grp [P]`` its group); ``data`` is ``[P, K]`` with ``row_padded``,
        else ``[T, K]``. Column 0 of ``scale_inv`` holds each group's, column 1 (a pitch of 2
        or more) the group's amax, the rest zero. ``amax`` (fp32 ``[groups]``, any stride):
        the groups' amaxes, given back from an earlier quantize of the same rows (column 1),
        so that no amax pass runs; the bytes are those the amaxes give. ``row_amax`` (fp32
        ``[T]``, when ``amax`` is None): each token row's NaN-dropping amax, computed where the
        rows were made; the backend reduces them per group instead of reading the rows.
        ``x_rows`` (int32/int64 ``[T]``): the token rows are ``x[x_rows]`` of an
        ``x [S, K]`` (a mixture-of-experts layer's tokens in routing order, each row read where
        it lies: no gathered copy is written); None: ``x`` holds them."""

    def fp8_group_quantize_experts(self, w: torch.Tensor, *, groups: int, fp8_dtype: DType,
                                   force_pow_2_scales: bool, amax_epsilon: float,
                                   rowwise: bool, columnwise: bool, scale_pitch: int = 1,
                                   amax: torch.Tensor | None = None) -> Tensors3:
        """``(data [E * N, K], transpose [E, K, N], scale_inv [E, scale_pitch])``: each expert's
        rows of ``w [E * N, K]`` (``E = groups``) current-scaled with its own amax;
        ``scale_inv`` and ``amax`` as :meth:`fp8_group_quantize_rows`'s."""

    # ------------------------------------------------- grouped GEMMs (mixture of experts)
    def grouped_rows_gemm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
                          a_ends: torch.Tensor, *, total: int,
                          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are ``a_g @ b[g]ᵀ``, ``a_g`` group
        ``g``'s rows of ``a [R, K]`` from row ``a_ends[g-1]`` on, ``b [E, N, K]``; high-precision
        operands (bf16, fp16 or fp32 values, such as a quantized operand decoded exactly),
        products and sums in fp32, one RNE cast. A fast backend reads no group bound on the
        host."""

    def fp8_grouped_rows_gemm(self, a: torch.Tensor, a_scale_inv: torch.Tensor,
                              b: torch.Tensor, b_scale_inv: torch.Tensor, offs: torch.Tensor,
                              a_ends: torch.Tensor, *, total: int, a_dtype: DType,
                              b_dtype: DType, out_dtype: torch.dtype = torch.bfloat16,
                              fast_accum: bool = False) -> torch.Tensor:
        """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are ``(a_g @ b[g]ᵀ) * a_scale_inv[g]
        * b_scale_inv[g]``, ``a_g`` group ``g``'s rows of ``a [R, K]`` from row ``a_ends[g-1]``
        on, ``b [E, N, K]``; uint8 FP8 bytes, fp32 ``[E]`` scale-inverses (any stride),
        int32/int64 ``[E]`` cumulative ends. A fast backend reads no group bound on the host.
        ``fast_accum``: FP8 tensor cores may accumulate the whole contraction at their own
        width (the recipe's ``MMParams``); a backend without them accumulates in fp32."""

    def fp8_grouped_tokens_gemm(self, a: torch.Tensor, a_scale_inv: torch.Tensor,
                                b: torch.Tensor, b_scale_inv: torch.Tensor, ends: torch.Tensor,
                                *, a_dtype: DType, b_dtype: DType,
                                out_dtype: torch.dtype = torch.bfloat16,
                                fast_accum: bool = False,
                                group_multiple: int = 16) -> torch.Tensor:
        """``out [E, M, N]``: group ``g``'s ``(a[:, s:e] @ b[:, s:e]ᵀ) * a_scale_inv[g] *
        b_scale_inv[g]`` over columns ``s:e = ends[g-1]:ends[g]`` of ``a [M, R]``, ``b [N, R]``
        (zeros for a group without columns); every group starts and ends on a multiple of
        ``group_multiple`` columns, a multiple of 16 (the padded layout of a grouped layer; a
        fast backend may read 16-byte vectors, or whole chunks of the contraction where the
        multiple allows). ``fast_accum`` as :meth:`fp8_grouped_rows_gemm`'s."""

    def fp8_block_grouped_rows_gemm(self, a: torch.Tensor, a_scale_inv: torch.Tensor,
                                    b: torch.Tensor, b_scale_inv: torch.Tensor,
                                    offs: torch.Tensor, a_ends: torch.Tensor, *, total: int,
                                    a_dtype: DType, b_dtype: DType,
                                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """As :meth:`fp8_grouped_rows_gemm` with FP8 block scales: ``a_scale_inv [R,
        ceil(K/128)]`` (1x128 blocks), ``b_scale_inv [E, ceil(N/128), ceil(K/128)]`` (128x128
        blocks), fp32, any strides."""

    def fp8_block_grouped_tokens_gemm(self, a: torch.Tensor, a_scale_inv: torch.Tensor,
                                      b: torch.Tensor, b_scale_inv: torch.Tensor,
                                      ends: torch.Tensor, *, a_dtype: DType, b_dtype: DType,
                                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """As :meth:`fp8_grouped_tokens_gemm` with FP8 block scales of 128 columns:
        ``a_scale_inv [M, ceil(R/128)]``, ``b_scale_inv [N, ceil(R/128)]``, fp32, any strides;
        every group starts at a multiple of 128 columns."""

    # ----------------------------------------------- grouped NVFP4 (mixture of experts)
    def nvfp4_group_quantize(self, x: torch.Tensor, grp: torch.Tensor, *, groups: int,
                             rowwise: bool, columnwise: bool, with_rht: bool,
                             rht_sign_mask: int, with_2d_quantization: bool,
                             stochastic_rounding: bool, rng_seed: torch.Tensor | None,
                             swizzle: bool) -> Tensors6:
        """``(row_data, row_scale, col_data, col_scale, amax_row [groups], amax_col
        [groups])``: :meth:`nvfp4_quantize`'s buffers of ``x [M, K]`` with each group of rows
        (``grp [M]`` the group of each row; every group starting at a multiple of 16 rows)
        quantized with its own amaxes, fp32 ``[groups]``; stochastic rounding numbers the
        elements of ``x`` as one tensor (``reference.nvfp4_grouped``)."""

    def nvfp4_grouped_rows_gemm(self, a: torch.Tensor, a_scale: torch.Tensor,
                                a_amax: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                                b_amax: torch.Tensor, offs: torch.Tensor, a_ends: torch.Tensor,
                                *, total: int, a_swizzled: bool, b_swizzled: bool,
                                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """As :meth:`fp8_grouped_rows_gemm` for packed NVFP4 row operands ``a [R, K/2]``,
        ``b [E, N, K/2]`` (``a_scale`` / ``b_scale`` the E4M3 block scales of the ``[R, K]`` /
        ``[E * N, K]`` tensors), each group's product scaled by NVFP4's factors of its amaxes,
        ``(P * (a_amax[g] * R)) * (b_amax[g] * R)``, ``R = fp32(1/2688)``."""

    def nvfp4_grouped_tokens_gemm(self, a: torch.Tensor, a_scale: torch.Tensor,
                                  a_amax: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                                  b_amax: torch.Tensor, ends: torch.Tensor, *,
                                  a_swizzled: bool, b_swizzled: bool,
                                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """As :meth:`fp8_grouped_tokens_gemm` for packed NVFP4 row operands ``a [M, C/2]``,
        ``b [N, C/2]`` (columnwise data, blocks of 16 along the tokens), scaled as
        :meth:`nvfp4_grouped_rows_gemm`."""


#: The functions of the contract, in declaration order (``name``, ``priority`` and
#: ``supports`` are checked apart).
FUNCTIONS: tuple[str, ...] = tuple(
    n for n, v in vars(Backend).items()
    if callable(v) and not n.startswith("_") and n != "supports"
)
