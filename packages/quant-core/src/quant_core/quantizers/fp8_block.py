"""FP8 block scaling: 1x128 or 128x128 blocks with fp32 scales (`numerics.md` §6)."""

from __future__ import annotations

import torch

from .. import backends
from ..dtypes import DType, check_fp8
from ..inputs import as_2d, check_amax_epsilon, check_block_scaling_dim, transposed_shape
from ..quantizer import Quantizer, value_quantizer
from ..shapes import (
    FP8_BLOCK,
    fp8_block_columnwise_scale_shape,
    fp8_block_rowwise_scale_shape,
    m_k,
)
from ..storage import Float8BlockwiseQTensorStorage


@value_quantizer
class Float8BlockQuantizer(Quantizer):
    """FP8 blocks of ``block_len`` (always 128): 1D (1x128) or 2D (128x128); any shape."""

    storage_format = "fp8_block"
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

    def is_requantization_safe(self) -> bool:
        return True

    def lowerings(self) -> tuple[str, ...]:
        """The backend's kernels, recorded into the graph."""
        return ("kernels",)
