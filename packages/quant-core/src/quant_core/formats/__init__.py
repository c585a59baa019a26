"""The formats: each module holds one format's storage, its quantized tensor and its
quantizer(s). Importing a module registers its storage (``quant_core.storage.storage_class``) and
its tensor class.

A pickle (a checkpoint) records a class by its module path. The classes of quant-core 0.1 lived
in ``quant_core.quantizers.*`` (quantizers) and ``quant_core.tensor`` (tensors): those paths are
resolved here, once, for ``torch.load`` with its default ``weights_only=True``
(:func:`pickled_names`), and the old quantizer modules for any unpickler
(:data:`MOVED_MODULES`). A 0.1 pickle of a quantized tensor that needs ``weights_only=False``
(delayed scaling's, whose quantizer holds live tensors) does not load.
"""

import sys

from . import fp8, fp8_block, mxfp8, nvfp4
from .fp8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor, Float8TensorStorage
from .fp8_block import Float8BlockQuantizer, Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage
from .mxfp8 import MXFP8Quantizer, MXFP8Tensor, MXFP8TensorStorage
from .nvfp4 import NVFP4Quantizer, NVFP4Tensor, NVFP4TensorStorage

#: Module paths of quant-core 0.1 -> the module holding their classes now.
MOVED_MODULES = {
    "quant_core.quantizers": sys.modules[__name__],
    "quant_core.quantizers.fp8_tensor": fp8,
    "quant_core.quantizers.float8": fp8,
    "quant_core.quantizers.fp8_block": fp8_block,
    "quant_core.quantizers.float8_block": fp8_block,
    "quant_core.quantizers.mxfp8": mxfp8,
    "quant_core.quantizers.nvfp4": nvfp4,
}
for _old, _module in MOVED_MODULES.items():
    sys.modules.setdefault(_old, _module)

_QUANTIZERS = (Float8Quantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer,
               Float8BlockQuantizer, NVFP4Quantizer)
_TENSORS = (Float8Tensor, MXFP8Tensor, Float8BlockwiseQTensor, NVFP4Tensor)


def pickled_names() -> list[tuple[type, str]]:
    """``(class, 0.1 path)`` of every class a 0.1 checkpoint may name, for
    ``torch.serialization.add_safe_globals``."""
    names = [(t, f"quant_core.tensor.{t.__qualname__}") for t in _TENSORS]
    for old, module in MOVED_MODULES.items():
        names += [(q, f"{old}.{q.__qualname__}") for q in _QUANTIZERS
                  if q.__module__ == module.__name__]
    return names


__all__ = [
    "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8TensorStorage", "Float8Tensor",
    "MXFP8Quantizer", "MXFP8TensorStorage", "MXFP8Tensor", "Float8BlockQuantizer",
    "Float8BlockwiseQTensorStorage", "Float8BlockwiseQTensor", "NVFP4Quantizer",
    "NVFP4TensorStorage", "NVFP4Tensor", "MOVED_MODULES", "pickled_names",
]
