"""quant-core: value-identity quantizers with exact pure-torch reference numerics.

``pip install ./packages/quant-core`` (from a clone) is a complete reference implementation:
every format quantizes and dequantizes on any device through :mod:`quant_core.reference`; kernel
packages register faster backends through the ``quant_core.backends`` entry-point group.
"""

from . import backends, formats, reference, shapes, tensor
from . import tensor_ops as _tensor_ops  # noqa: F401  (fills the quantized tensors' op table)
from .constants import DEFAULT_RHT_SIGN_MASK
from .dtypes import DType
from .formats import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
    Float8BlockwiseQTensorStorage,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
    MXFP8Quantizer,
    MXFP8Tensor,
    MXFP8TensorStorage,
    NVFP4Quantizer,
    NVFP4Tensor,
    NVFP4TensorStorage,
    pickled_names,
)
from .operand import GemmOperand
from .quantizer import (
    Quantizer,
    add_value_class_hook,
    is_value_quantizer,
    value_classes,
    value_quantizer,
)
from .storage import QuantizedStorage, storage_class, storage_formats
from .tensor import QuantizedTensor

tensor.allow_weights_only_load(
    (Float8CurrentScalingQuantizer, MXFP8Quantizer, Float8BlockQuantizer, NVFP4Quantizer),
    (DType,), pickled_names(),
)

__version__ = "0.1.0"

__all__ = [
    "DType", "Quantizer", "value_quantizer", "is_value_quantizer", "add_value_class_hook",
    "value_classes", "Float8Quantizer", "Float8CurrentScalingQuantizer", "MXFP8Quantizer",
    "Float8BlockQuantizer", "NVFP4Quantizer", "DEFAULT_RHT_SIGN_MASK", "QuantizedStorage",
    "Float8TensorStorage", "MXFP8TensorStorage", "Float8BlockwiseQTensorStorage",
    "NVFP4TensorStorage", "storage_class", "storage_formats", "GemmOperand", "QuantizedTensor",
    "Float8Tensor", "MXFP8Tensor",
    "Float8BlockwiseQTensor", "NVFP4Tensor", "backends", "formats", "reference", "shapes", "tensor",
]
