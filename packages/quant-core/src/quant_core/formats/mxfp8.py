"""MXFP8 (`numerics.md` §5): 1x32 blocks with E8M0 scales, or 32x32 in 2D mode; the storage,
its tensor and the quantizer."""

from __future__ import annotations

import torch

from .. import backends
from ..dtypes import DType, check_fp8
from ..inputs import as_2d
from ..operand import GemmOperand
from ..quantizer import Quantizer, value_quantizer
from ..reference.pad import zero_pad
from ..shapes import (
    MXFP8_BLOCK,
    m_k,
    mxfp8_columnwise_scale_shape,
    mxfp8_rowwise_scale_shape,
)
from ..sharding import ShardPlan, row_blocks_refusal
from ..storage import QuantizedStorage, present_buffers
from ..tensor import QuantizedTensor
from ._swizzled import split_refusal, swizzled_shard_refusal


class MXFP8TensorStorage(QuantizedStorage):
    """MXFP8: rowwise and columnwise data ``[shape]`` (not transposed) with padded E8M0 scales."""

    format = "mxfp8"
    buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
    )
    tag_types = {"_fp8_dtype": DType, "_with_gemm_swizzled_scales": bool}
    rowwise_data_name, columnwise_data_name = "_rowwise_data", "_columnwise_data"
    rowwise_only_names = ("_rowwise_data", "_rowwise_scale_inv")

    def _decode(self, columnwise, dtype):
        data, scale = ((self._columnwise_data, self._columnwise_scale_inv) if columnwise
                       else (self._rowwise_data, self._rowwise_scale_inv))
        return self._backend().mxfp8_dequantize(
            data.reshape(m_k(self.shape)), scale, fp8_dtype=self._fp8_dtype,
            columnwise=columnwise, swizzled=bool(self._with_gemm_swizzled_scales), dtype=dtype,
        )

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """Rowwise data with its ``[rows, K/32]`` scales, or the columnwise data viewed
        transposed with the transposed scale matrix (swizzled: the raw bytes viewed in the
        transposed shape, whose swizzle they already hold)."""
        m, k = m_k(self.shape)
        swz = bool(self._with_gemm_swizzled_scales)
        if transposed:
            if self._columnwise_data is None:
                return None
            scale = self._columnwise_scale_inv  # [roundup(m/32, 4), roundup(k, 128)]
            scale = scale.reshape(scale.shape[1], scale.shape[0]) if swz else scale.t()
            return GemmOperand("mxfp8", self._columnwise_data.reshape(m, k).t(), scale,
                               self._fp8_dtype, k, m, swz)
        if self._rowwise_data is None:
            return None
        return GemmOperand("mxfp8", self._rowwise_data.reshape(m, k), self._rowwise_scale_inv,
                           self._fp8_dtype, m, k, swz)

    @classmethod
    def shard_plan(cls, q, shape, world, columnwise):
        """Row blocks of 128 (the rowwise scales pad rows to 128, the columnwise ones pad 32-row
        blocks to 4): the rowwise data and scales; with 2D 32x32 blocks the columnwise copy is
        rebuilt from them, with 1x32 blocks it is gathered too (it differs from the rowwise
        bytes)."""
        refusal = swizzled_shard_refusal(q) or row_blocks_refusal("MXFP8", shape, world)
        if refusal:
            return refusal
        names = ("_rowwise_data", "_rowwise_scale_inv")
        if columnwise and not q.with_2d_quantization:
            return ShardPlan(q.with_usage(True, True),
                             names + ("_columnwise_data", "_columnwise_scale_inv"), (), False,
                             rows_independent=False)
        return ShardPlan(q.replace(rowwise_usage=True, columnwise_usage=False), names, (), False,
                         rows_independent=False)

    @classmethod
    def columnwise_from_rowwise(cls, s, q) -> dict[str, torch.Tensor]:
        """With 2D 32x32 blocks the columnwise bytes are the rowwise ones, and each block's
        scale serves its 32 columns."""
        if not q.with_2d_quantization or s._with_gemm_swizzled_scales:
            return super().columnwise_from_rowwise(s, q)
        m, k = m_k(s.shape)
        per_block = s._rowwise_scale_inv[:m:MXFP8_BLOCK, :k // MXFP8_BLOCK]
        cs = per_block.repeat_interleave(MXFP8_BLOCK, dim=1)
        return {**present_buffers(cls, s), "_columnwise_data": s._rowwise_data,
                "_columnwise_scale_inv": zero_pad(cs, *mxfp8_columnwise_scale_shape(m, k))}


class MXFP8Tensor(QuantizedTensor, MXFP8TensorStorage):
    """MXFP8 as a tensor."""

    _storage_type = MXFP8TensorStorage
    _row_block = 32

    def _layout(self):
        return {"_rowwise_data": ("rows", 0, 1, 1), "_rowwise_scale_inv": ("2d", 0, 1, 128),
                "_columnwise_data": ("rows", 0, 1, 1),
                "_columnwise_scale_inv": ("2d", 0, 32, 4)}

    def _split_refusal(self):
        return split_refusal(self)


@value_quantizer
class MXFP8Quantizer(Quantizer):
    """MXFP8 block scaling; K must be a multiple of 32, any M."""

    _storage_class = MXFP8TensorStorage

    dtype: DType = DType.E4M3
    with_2d_quantization: bool = False

    def __init__(self, dtype: DType = DType.E4M3, **fields) -> None:
        check_fp8(dtype)
        super().__init__(dtype=dtype, **fields)

    def shape_rule(self) -> tuple[str, int]:
        return "MXFP8", MXFP8_BLOCK

    def row_alignment(self) -> int:
        """The 32-row columnwise blocks."""
        return MXFP8_BLOCK

    def quantize(self, x, *, amax_reduction_group=None, backend=None):
        x2d = as_2d(x, *self.shape_rule())
        be = backends.get(backend, x.device)
        rd, rs, cd, cs = be.mxfp8_quantize(
            x2d, fp8_dtype=self.dtype, rowwise=self.rowwise_usage,
            columnwise=self.columnwise_usage, with_2d_quantization=self.with_2d_quantization,
            swizzle=self.optimize_for_gemm,
        )
        return self._make_storage(x.shape, x.dtype, {
            "_rowwise_data": rd, "_rowwise_scale_inv": rs,
            "_columnwise_data": cd, "_columnwise_scale_inv": cs,
        })

    def quantize_decoded(self, x, *, rowwise, columnwise, dtype, rows=None, backend=None):
        """The backend's one-pass ``mxfp8_quantize_decoded``."""
        x2d = as_2d(x, *self.shape_rule())
        return backends.get(backend, x.device).mxfp8_quantize_decoded(
            x2d, fp8_dtype=self.dtype, rowwise=rowwise, columnwise=columnwise,
            with_2d_quantization=self.with_2d_quantization, dtype=dtype, rows=rows)

    def inner_tensor_specs(self, shape):
        m, k = m_k(shape)
        specs = {}
        if self.rowwise_usage:
            specs["_rowwise_data"] = (tuple(shape), torch.uint8)
            specs["_rowwise_scale_inv"] = (mxfp8_rowwise_scale_shape(m, k), torch.uint8)
        if self.columnwise_usage:
            specs["_columnwise_data"] = (tuple(shape), torch.uint8)
            specs["_columnwise_scale_inv"] = (mxfp8_columnwise_scale_shape(m, k), torch.uint8)
        return specs

    def _storage_tags(self):
        return {"_fp8_dtype": self.dtype, "_with_gemm_swizzled_scales": self.optimize_for_gemm}

    def decodes_exactly_to_bf16(self) -> bool:
        """``fp8 * 2^e`` has at most 4 significant bits: a bf16 value, except below 2^-133
        (bf16's smallest subnormal), which only a block whose amax is under 2^-100 can hold."""
        return True

    def rows_quantize_apart(self) -> bool:
        """1x32 blocks lie in one row; 32x32 blocks span 32 rows."""
        return not self.with_2d_quantization

    def is_requantization_safe(self) -> bool:
        return True

    def lowerings(self) -> tuple[str, ...]:
        """The backend's kernels, recorded into the graph."""
        return ("kernels",)
