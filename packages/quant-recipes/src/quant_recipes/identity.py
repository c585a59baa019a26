"""``IdentityQuantizer``: a high-precision passthrough for slots that must not be quantized."""

from __future__ import annotations

import torch
from quant_core import QuantizedStorage, Quantizer, value_quantizer


class HighPrecisionStorage(QuantizedStorage):
    """What :class:`IdentityQuantizer` returns: the input itself, under ``_data``."""

    buffer_names = ("_data",)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._data.to(dtype or self._dtype)


@value_quantizer
class IdentityQuantizer(Quantizer):
    """Keeps the tensor in high precision (a CustomRecipe factory returns it instead of None).

    ``quantize(x)`` wraps ``x`` unchanged; ``dequantize`` returns it (cast to the requested dtype).
    """

    storage_format = "high_precision"

    def quantize(self, x, *, amax_reduction_group=None, backend=None):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"IdentityQuantizer: expected a torch.Tensor, got {type(x).__name__}")
        return HighPrecisionStorage(shape=x.shape, dtype=x.dtype, quantizer=self, _data=x)

    def decodes_exactly_to_bf16(self) -> bool:
        """The operand itself: a bf16 value where the layer's operands are bf16 (the grouped
        GEMMs that ask require bf16 operands)."""
        return True

    def rows_quantize_apart(self) -> bool:
        """Each row is kept as it is."""
        return True

    def is_requantization_safe(self) -> bool:
        return True
