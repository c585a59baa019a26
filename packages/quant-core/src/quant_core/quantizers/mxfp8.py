"""MXFP8: 1x32 blocks with E8M0 scales, or 32x32 in 2D mode (`numerics.md` §5)."""

from __future__ import annotations

import torch

from .. import backends
from ..dtypes import DType, check_fp8
from ..inputs import as_2d
from ..quantizer import Quantizer, value_quantizer
from ..shapes import (
    MXFP8_BLOCK,
    m_k,
    mxfp8_columnwise_scale_shape,
    mxfp8_rowwise_scale_shape,
)
from ..storage import MXFP8TensorStorage


@value_quantizer
class MXFP8Quantizer(Quantizer):
    """MXFP8 block scaling; K must be a multiple of 32, any M."""

    storage_format = "mxfp8"
    _storage_class = MXFP8TensorStorage

    dtype: DType = DType.E4M3
    with_2d_quantization: bool = False

    def __init__(self, dtype: DType = DType.E4M3, **fields) -> None:
        check_fp8(dtype)
        super().__init__(dtype=dtype, **fields)

    def shape_rule(self) -> tuple[str, int]:
        return "MXFP8", MXFP8_BLOCK

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

    def is_requantization_safe(self) -> bool:
        return True

    def lowerings(self) -> tuple[str, ...]:
        """The backend's kernels, recorded into the graph."""
        return ("kernels",)
