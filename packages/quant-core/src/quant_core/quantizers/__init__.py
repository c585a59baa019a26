"""The five quantizers."""

import sys

from . import fp8_block, fp8_tensor
from .fp8_block import Float8BlockQuantizer
from .fp8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import DEFAULT_RHT_SIGN_MASK, NVFP4Quantizer

# The modules' names before they took the kernels' and the reference's file stems: a pickle
# records a class by its module path, so quantizers pickled then (checkpoints) still load.
sys.modules.setdefault(f"{__name__}.float8", fp8_tensor)
sys.modules.setdefault(f"{__name__}.float8_block", fp8_block)

__all__ = [
    "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer",
    "Float8BlockQuantizer", "NVFP4Quantizer", "DEFAULT_RHT_SIGN_MASK",
]
