"""The five quantizers."""

from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from .float8_block import Float8BlockQuantizer
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import DEFAULT_RHT_SIGN_MASK, NVFP4Quantizer

__all__ = [
    "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer",
    "Float8BlockQuantizer", "NVFP4Quantizer", "DEFAULT_RHT_SIGN_MASK",
]
