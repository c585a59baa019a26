"""FP8 block scaling: 1x128 or 128x128 blocks with fp32 scales (`numerics.md` §6)."""

from __future__ import annotations

from .. import backends
from ..dtypes import DType, check_fp8
from ..inputs import as_2d, transposed_shape
from ..quantizer import Quantizer, value_quantizer
from ..shapes import FP8_BLOCK
from ..storage import Float8BlockwiseQTensorStorage


@value_quantizer
class Float8BlockQuantizer(Quantizer):
    """FP8 blocks of ``block_len`` (always 128): 1D (1x128) or 2D (128x128); any shape."""

    storage_format = "fp8_block"

    dtype: DType = DType.E4M3
    block_len: int = FP8_BLOCK
    amax_epsilon: float = 0.0
    force_pow_2_scales: bool = True
    block_scaling_dim: int = 2

    def __init__(self, dtype: DType = DType.E4M3, **fields) -> None:
        check_fp8(dtype)
        super().__init__(dtype=dtype, **fields)
        if self.block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim must be 1 or 2, got {self.block_scaling_dim}")
        if self.block_len != FP8_BLOCK:
            raise ValueError(f"block_len must be {FP8_BLOCK}, got {self.block_len}")
        if self.amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {self.amax_epsilon}")

    def quantize(self, x, *, amax_reduction_group=None, backend=None):
        x2d = as_2d(x, "FP8 block")
        be = backends.get(backend, x.device)
        rd, rs, cd, cs = be.fp8_block_quantize(
            x2d, fp8_dtype=self.dtype, block_scaling_dim=self.block_scaling_dim,
            force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon,
            rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
        )
        return Float8BlockwiseQTensorStorage(
            shape=x.shape, dtype=x.dtype, quantizer=self, _fp8_dtype=self.dtype,
            _is_2D_scaled=self.block_scaling_dim == 2,
            _rowwise_data=None if rd is None else rd.view(x.shape), _rowwise_scale_inv=rs,
            _columnwise_data=None if cd is None else cd.view(transposed_shape(x.shape)),
            _columnwise_scale_inv=cs,
        )

    def is_requantization_safe(self) -> bool:
        return True
