"""FP8 block scaling (`numerics.md` §6): 1x128 or 128x128 blocks with fp32 scales; the
storage, its tensor and the quantizer."""

from __future__ import annotations

import torch

from .. import backends
from ..dtypes import DType, check_fp8
from ..inputs import as_2d, check_amax_epsilon, check_block_scaling_dim, transposed_shape
from ..operand import GemmOperand
from ..quantizer import Quantizer, value_quantizer
from ..reference.pad import zero_pad
from ..shapes import (
    FP8_BLOCK,
    ceil_div,
    fp8_block_columnwise_scale_shape,
    fp8_block_rowwise_scale_shape,
    m_k,
)
from ..sharding import ShardPlan, row_blocks_refusal
from ..storage import QuantizedStorage, present_buffers
from ..tensor import QuantizedTensor


class Float8BlockwiseQTensorStorage(QuantizedStorage):
    """FP8 1x128 / 128x128 blocks: rowwise ``[shape]``, columnwise ``[K, *leading]``, fp32
    scale-inverses in the GEMM-ready layouts."""

    format = "fp8_block"
    buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
    )
    tag_types = {"_fp8_dtype": DType, "_is_2D_scaled": bool}
    rowwise_data_name, columnwise_data_name = "_rowwise_data", "_columnwise_data"
    rowwise_only_names = ("_rowwise_data", "_rowwise_scale_inv")

    def _decode(self, columnwise, dtype):
        m, k = m_k(self.shape)
        data = (self._columnwise_data.reshape(k, m) if columnwise
                else self._rowwise_data.reshape(m, k))
        return self._backend().fp8_block_dequantize(
            data, self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv,
            fp8_dtype=self._fp8_dtype, block_scaling_dim=2 if self._is_2D_scaled else 1,
            columnwise=columnwise, dtype=dtype,
        )

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """Rowwise ``[m, k]`` or columnwise ``[k, m]`` data (both K-contiguous) with the
        GEMM-ready scales of that direction."""
        m, k = m_k(self.shape)
        dim = 2 if self._is_2D_scaled else 1
        if transposed:
            if self._columnwise_data is None:
                return None
            return GemmOperand("fp8_block", self._columnwise_data.reshape(k, m),
                               self._columnwise_scale_inv, self._fp8_dtype, k, m,
                               block_scaling_dim=dim)
        if self._rowwise_data is None:
            return None
        return GemmOperand("fp8_block", self._rowwise_data.reshape(m, k), self._rowwise_scale_inv,
                           self._fp8_dtype, m, k, block_scaling_dim=dim)

    @classmethod
    def shard_plan(cls, q, shape, world, columnwise):
        """2D 128x128 weight blocks in row blocks of 128: data and the block scale rows; the
        columnwise copy is the byte transpose with the transposed scales."""
        if q.block_scaling_dim != 2:
            return ("FP8 1x128 weight blocks: the columnwise copy (128x1 blocks along dim 0) is "
                    "stored transposed and does not gather along dim 0; use 2D weight blocks "
                    "(Float8BlockScaling(w_block_scaling_dim=2), the default)")
        refusal = row_blocks_refusal("FP8 128x128 blocks", shape, world)
        if refusal:
            return refusal
        return ShardPlan(q.replace(rowwise_usage=True, columnwise_usage=False),
                         ("_rowwise_data", "_rowwise_scale_inv"), (), False,
                         rows_independent=False)

    @classmethod
    def columnwise_from_rowwise(cls, s, q) -> dict[str, torch.Tensor]:
        """With 2D blocks each 128x128 scale serves rows and columns alike."""
        if not s._is_2D_scaled:
            return super().columnwise_from_rowwise(s, q)
        m, k = m_k(s.shape)
        rs = s._rowwise_scale_inv[:, :ceil_div(k, FP8_BLOCK)]
        return {**present_buffers(cls, s),
                "_columnwise_data": s._rowwise_data.reshape(m, k).t().contiguous(),
                "_columnwise_scale_inv": zero_pad(rs.t(),
                                                  *fp8_block_columnwise_scale_shape(m, k, 2))}


class Float8BlockwiseQTensor(QuantizedTensor, Float8BlockwiseQTensorStorage):
    """FP8 1x128 / 128x128 blocks as a tensor."""

    _storage_type = Float8BlockwiseQTensorStorage
    _row_block = 128

    def _layout(self):
        if self._is_2D_scaled:
            return {"_rowwise_data": ("rows", 0, 1, 1), "_rowwise_scale_inv": ("2d", 0, 128, 1),
                    "_columnwise_data": ("cols_t", 1, 1, 1),
                    "_columnwise_scale_inv": ("2d", 1, 128, 4)}
        return {"_rowwise_data": ("rows", 0, 1, 1), "_rowwise_scale_inv": ("2d", 1, 1, 4),
                "_columnwise_data": ("cols_t", 1, 1, 1),
                "_columnwise_scale_inv": ("2d", 0, 128, 1)}

    def _piece_rows(self):
        # 1x128 blocks along K: any row, unless the 128x1 columnwise blocks are held too
        return 1 if not self._is_2D_scaled and self._columnwise_data is None else 128


@value_quantizer
class Float8BlockQuantizer(Quantizer):
    """FP8 blocks of ``block_len`` (always 128): 1D (1x128) or 2D (128x128); any shape."""

    _storage_class = Float8BlockwiseQTensorStorage

    dtype: DType = DType.E4M3
    block_len: int = FP8_BLOCK
    amax_epsilon: float = 0.0
    force_pow_2_scales: bool = True
    block_scaling_dim: int = 2

    def __init__(self, dtype: DType = DType.E4M3, **fields) -> None:
        check_fp8(dtype)
        super().__init__(dtype=dtype, **fields)
        check_block_scaling_dim(self.block_scaling_dim)
        if self.block_len != FP8_BLOCK:
            raise ValueError(f"block_len must be {FP8_BLOCK}, got {self.block_len}")
        check_amax_epsilon(self.amax_epsilon)

    def shape_rule(self) -> tuple[str, int]:
        return "FP8 block", 1

    def row_alignment(self) -> int:
        """The columnwise (and 2D) blocks of ``block_len`` rows."""
        return self.block_len

    def quantize(self, x, *, amax_reduction_group=None, backend=None):
        x2d = as_2d(x, *self.shape_rule())
        be = backends.get(backend, x.device)
        rd, rs, cd, cs = be.fp8_block_quantize(
            x2d, fp8_dtype=self.dtype, block_scaling_dim=self.block_scaling_dim,
            force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon,
            rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
        )
        return self._make_storage(x.shape, x.dtype, {
            "_rowwise_data": rd, "_rowwise_scale_inv": rs,
            "_columnwise_data": cd, "_columnwise_scale_inv": cs,
        })

    def inner_tensor_specs(self, shape):
        m, k = m_k(shape)
        dim = self.block_scaling_dim
        specs = {}
        if self.rowwise_usage:
            specs["_rowwise_data"] = (tuple(shape), torch.uint8)
            specs["_rowwise_scale_inv"] = (
                fp8_block_rowwise_scale_shape(m, k, dim), torch.float32
            )
        if self.columnwise_usage:
            specs["_columnwise_data"] = (transposed_shape(shape), torch.uint8)
            specs["_columnwise_scale_inv"] = (
                fp8_block_columnwise_scale_shape(m, k, dim), torch.float32
            )
        return specs

    def _storage_tags(self):
        return {"_fp8_dtype": self.dtype, "_is_2D_scaled": self.block_scaling_dim == 2}

    def decodes_exactly_to_bf16(self) -> bool:
        """With power-of-2 scales, ``fp8 * scale_inv`` is a bf16 value."""
        return self.force_pow_2_scales

    def rows_quantize_apart(self) -> bool:
        """1x128 blocks lie in one row; 128x128 blocks span 128 rows."""
        return self.block_scaling_dim == 1

    def is_requantization_safe(self) -> bool:
        return True

    def lowerings(self) -> tuple[str, ...]:
        """The backend's kernels, recorded into the graph."""
        return ("kernels",)
