"""GEMM operands: how a quantized tensor hands itself to a GEMM (architecture.md contract 6).

A GEMM ``op(A) @ op(B)`` contracts over one dim of each quantized tensor ``X [m, k]``. Seen from
the GEMM every operand is a *row operand* ``R [rows, K]`` with the contraction along dim 1: ``X``
itself when the contraction runs over ``k`` (rowwise buffers), ``Xᵀ`` when it runs over ``m``
(columnwise buffers, whose blocks run along ``m``). The GEMM then computes ``R_a @ R_bᵀ`` without
knowing any format's buffer names; the storage's ``gemm_operand(transposed)`` builds this view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dtypes import DType


@dataclass(frozen=True)
class GemmOperand:
    """A row operand ``R [rows, K]`` as views of a storage's buffers (no copy).

    ``data``: uint8 ``[rows, K]`` (NVFP4: packed ``[rows, ceil(K/2)]``), any strides.
    ``scale``, by ``format``:

    - ``"fp8"``: the fp32 ``(1,)`` scale-inverse;
    - ``"mxfp8"``: E8M0 bytes, the scale of (row ``i``, K block ``kb``) at ``scale[i, kb]`` (a
      strided view), or, when ``swizzled``, the raw bytes viewed as the padded
      ``[roundup(rows, 128), roundup(ceil(K/32), 4)]`` matrix whose GEMM swizzle they hold;
    - ``"fp8_block"``: the fp32 GEMM-ready scale-inverses as stored for this direction
      (``block_scaling_dim`` 1: ``[ceil(K/128), roundup(rows, 4)]``; 2:
      ``[ceil(rows/128), roundup(ceil(K/128), 4)]``, `numerics.md` §6);
    - ``"nvfp4"``: the padded E4M3 matrix ``[roundup(rows, 128), roundup(ceil(K/16), 4)]``
      (swizzled when ``swizzled``), with the per-tensor ``amax`` fp32 ``(1,)`` of the direction
      (``(rows,)``, one per row, for a row-scaled operand).
    """

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    fp_dtype: DType
    rows: int
    k: int
    swizzled: bool = False
    block_scaling_dim: int = 0
    amax: torch.Tensor | None = None

    def fp8_view(self) -> torch.Tensor:
        """``data`` as a torch FP8 tensor (FP8 formats)."""
        return self.data.view(self.fp_dtype.torch_dtype)
